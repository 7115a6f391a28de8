"""The layering of pyproject.toml's import contracts, checked by import-linter on the installed layout.

serving/, trainer/, kernels/ and loadtest/ stand at the top of the repository but install as
specrl.serving etc. (setuptools package-dir); import-linter reads packages from the file system,
so the test copies the tree into that layout first and lints the copy.
"""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAPPED = {"serving": "serving", "trainer": "trainer", "kernels": "kernels", "loadtest": "loadtest"}
IGNORE = shutil.ignore_patterns("__pycache__", "*.so", "*.pyc")


def installed_layout(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "specrl", tmp_path / "specrl", ignore=IGNORE)
    for source, name in MAPPED.items():
        shutil.copytree(ROOT / source, tmp_path / "specrl" / name, ignore=IGNORE)
    return tmp_path


def lint(root: Path) -> subprocess.CompletedProcess:
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", code, str(ROOT / "pyproject.toml"), "--no-cache"], cwd=root,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                          timeout=300)


def test_the_import_contracts_hold(tmp_path):
    result = lint(installed_layout(tmp_path))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "Contracts: 4 kept, 0 broken" in result.stdout


def test_a_core_module_that_imports_serving_breaks_a_contract(tmp_path):
    root = installed_layout(tmp_path)
    (root / "specrl" / "engine" / "_leak.py").write_text("from specrl.serving import app\n")
    result = lint(root)
    assert result.returncode != 0
    assert "BROKEN" in result.stdout and "specrl.engine._leak -> specrl.serving.app" in result.stdout, result.stdout
