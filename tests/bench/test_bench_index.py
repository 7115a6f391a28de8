"""`specrl bench index` on the tiny model's tokenizer: the three scenarios, their bounds, the report
and the chart; bad flags get one line."""

import json
import subprocess
import sys

import matplotlib.image

from specrl.apps.bench.index import run_index_bench
from specrl.config import Settings

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_bench_index_tiny(tmp_path, capsys):
    capacity = 40 * 61  # room for every document of the mixed scenario
    settings = Settings.load(model="tiny-random", suffix_capacity=capacity)
    result = run_index_bench(settings, documents=40, doc_tokens=60, requests=24, out_dir=str(tmp_path))

    report = json.loads((tmp_path / "bench-index.json").read_text())
    assert report["capacity_tokens"] == capacity and report["machine"]["read_gb_s"] > 0
    mixed, repeated, long = (report["scenarios"][name] for name in ("mixed", "repeated", "long"))
    assert mixed["documents_kept"] == 40 and mixed["tokens_kept"] == 40 * 60 and mixed["evicted"] == 0
    assert repeated["documents_kept"] == 40  # different keys: no dedupe
    assert long["documents_kept"] == 1 and long["tokens_kept"] == capacity - 1  # its tail, one separator
    for row in report["scenarios"].values():
        for timing in ("add_us", "propose_us", "step_of_8_us"):
            assert 0 < row[timing]["p50"] <= row[timing]["p99"] <= row[timing]["max"]
        assert row["propose_us"]["n"] == 24 and row["step_of_8_us"]["n"] == 3
        assert 0 <= row["drafted_tokens_mean"] <= 16 and row["reserved_bytes"] > 0
    assert repeated["drafted_tokens_mean"] > 1  # the contexts are partway through what the index holds
    assert result["scenarios"]["mixed"]["propose_us"] == mixed["propose_us"]
    png = tmp_path / "bench-index.png"
    assert png.read_bytes()[:8] == PNG_SIGNATURE and min(matplotlib.image.imread(png).shape[:2]) > 100
    out = capsys.readouterr().out
    assert "propose p50" in out and "repeated" in out and str(tmp_path / "bench-index.json") in out


def test_bench_index_bad_flags_get_one_line(tmp_path):
    for flags, message in ((["--documents", "0"], "--documents must be at least 1"),
                           (["--suffix-capacity", "0"], "--suffix-capacity must be at least 1")):
        done = subprocess.run([sys.executable, "-m", "specrl.apps.cli", "bench", "index", "--model", "tiny-random",
                               "--out", str(tmp_path), *flags], capture_output=True, text=True)
        assert done.returncode != 0 and message in done.stderr and "Traceback" not in done.stderr
