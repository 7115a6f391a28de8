"""Start-up calibration of the linear calls: which storage and call each weight uses here.

For every weight shape an inference model holds, every call of `linear.CALLS` is timed at every
row bucket, from every storage this torch can build (oneDNN bf16 packing, for one, needs
AVX-512 or AVX-NE-CONVERT). A weight then gets ONE storage, the one whose best calls minimise
the expected slowdown over the buckets (per bucket: its fastest call's time / the fastest call
from any storage, weighted by the bucket's share of forwards), and per bucket that storage's
fastest call. A slowdown, not raw ms: a 512-row prefill costs 50x a decode row, so raw ms let a
1% share of prefill forwards (compute-bound, where every storage is within ~10%) outweigh the
decode buckets, and let one preempted sample there flip the choice.

Bucket weights (the expected share of forwards at each row count M = B*T): B uniform over
1..8; T=1 (plain decode, and every drafter step) 40%, T=2..5 (verify at k<=4) 50%, T=6..17 9%;
prefill chunks (bucket 512) 1%. Heads never run over prefill rows: they are timed up to 48 rows
(B*T for B<=8, k<=4; a head over more rows is compute-bound and keeps its 48-row call) and
weighted without the prefill share.

Timing: weights are cycled through a ring of copies larger than the L3 (`ring_copies`), so each
call streams its weight from memory as a real forward does (30 layers of SmolLM2 are 478 MB:
nothing stays cached between two uses of one weight). The fastest of a few calls: other processes
only ever add time.

Measurements are cached in `<directory>/linears-<dtype>-<threads>t.json` under a key (CPU
model, the flags that matter, torch version, torch threads, dtype, the stream kernel's build (a digest of
its shared library: a changed kernel is measured again), this module's schema): a
restart reads them back; a file with another key (another machine or torch) is measured again
and overwritten. One file per thread count, so processes calibrated with different thread
counts (a 1-thread benchmark beside a 2-thread server) do not overwrite each other's.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specrl.errors import InvalidRequestError
from specrl.models.linear import CALLS, STORAGES, PackedLinear, calls_for, cpu_kernels
from specrl.models.quantize import QUANTIZED, Int8Weight, Q4Weight, bytes_per_weight

SCHEMA = 4  # 2: two passes per measurement; 3: the stream kernel's 12 x 2 tiles for 7-12 rows; 4: integer dot products for int8 and q4
BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64, 96, 136, 512)
HEAD_BUCKETS = tuple(b for b in BUCKETS if b <= 48)
# the weights' formats (activations are float32 in every one)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8,
          "q4": torch.quint4x2}
STREAM_FLAGS = ("avx2", "fma", "f16c")  # the stream kernel's vector path (AVX-512F is a superset here)
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
AMX_FLAGS = ("amx_tile", "amx_bf16")
KEY_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
             "avx512_bf16", "avx512_fp16", "avx_ne_convert", "amx_tile", "amx_bf16", "amx_int8")
DEFAULT_L3 = 32 << 20
RING_BYTES = 512 << 20  # the ring's size where twice the L3 is more (`ring_copies`)
MAX_RING_COPIES = 64


@functools.cache
def stream_kernel_digest() -> str | None:
    """The built stream kernel's identity: the first 16 hex digits of its shared library's sha256 (None: not
    built), read once a process. Calibrations measured with another build are measured again."""
    if cpu_kernels is None:
        return None
    return hashlib.sha256(Path(cpu_kernels.__file__).read_bytes()).hexdigest()[:16]


def cpu_info() -> tuple[str, frozenset[str]]:
    """-> (CPU model name, its flags) from /proc/cpuinfo; ("unknown", {}) where there is none."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown", frozenset()
    fields = dict(line.split(":", 1) for line in text.splitlines()[:64] if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    return fields.get("model name", "unknown"), frozenset(fields.get("flags", "").split())


def resolve_dtype(requested: str, flags: frozenset[str] | set[str]) -> tuple[torch.dtype, str]:
    """"auto" | "float32" | "float16" | "bfloat16" | "int8" | "q4" -> (the weights' dtype, a one-line reason).

    Half-precision weights halve the bytes a decode step streams; activations, norms, KV cache and
    sums stay float32 either way (`Calibration.dtype`). float16 weights keep 10 mantissa bits and are
    converted in registers by the stream kernel (linear.py); bfloat16 weights keep 7 and multiply x
    rounded to bfloat16 on the CPU's own bf16 units (AMX tiles, else AVX512-BF16).

    auto: bfloat16 where the CPU has native bf16 dot products (AMX-BF16 or AVX512-BF16). With AMX one
    tile multiplies 16 rows for the price of one, so a verify or a batch costs what a decode step does
    (measured on an AMX Xeon, 2 threads, all the layers' and head's matmuls: 11.3 / 11.6 / 17.6 ms at
    1 / 16 / 40 rows, float16 weights 10.1 / 23.9 / 51.5). With AVX512-BF16 alone one `vdpbf16ps`
    multiplies 32 weights a row where float16 weights take a conversion and an FMA per 16 (measured on
    an AVX-512 EPYC with avx512_bf16, 44.6 GB/s, 2 threads, `specrl bench engine`, SmolLM2 plain
    decoding: bfloat16 133 / 680 tok/s at B=1 / 8, float16 98 / 553, float32 66 / 465). Else float16
    where the CPU has the stream kernel's vector path (AVX2 + FMA + F16C): half the bytes, converted
    in registers, measured faster than float32. Else float32.

    int8 and q4 (`specrl.models.quantize`) are never auto's pick: they change the model's outputs
    (measured by `specrl bench quality`), so they are asked for. They need the stream kernel
    (InvalidRequestError where it is not built)."""
    if requested not in ("auto", *DTYPES):
        raise InvalidRequestError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {requested!r}")
    if requested in ("int8", "q4") and cpu_kernels is None:
        raise InvalidRequestError(f"dtype={requested} needs the stream kernel (specrl.models._cpu_kernels), which is "
                                  "not built here: pip install -e . builds it")
    if requested == "int8":
        return torch.int8, ("dtype=int8 (requested: int8 weights, a float32 scale per output and group of 32 inputs, "
                            "float32 activations)")
    if requested == "q4":
        return torch.quint4x2, ("dtype=q4 (requested: 4-bit weights in Q4_1's format, a float16 scale and minimum per "
                                "output and group of 32 inputs, float32 activations)")
    if requested == "auto":
        if all(f in flags for f in AMX_FLAGS):
            return torch.bfloat16, "dtype=bfloat16 (auto: bfloat16 weights on AMX tiles, float32 activations; " \
                                   "the CPU has amx_tile+amx_bf16)"
        if "avx512_bf16" in flags:
            return torch.bfloat16, "dtype=bfloat16 (auto: bfloat16 weights on AVX512-BF16 dot products, float32 " \
                                   "activations; the CPU has avx512_bf16)"
        missing = [f for f in STREAM_FLAGS if f not in flags]
        if not missing:
            return torch.float16, "dtype=float16 (auto: float16 weights, float32 compute; the CPU has avx2+fma+f16c)"
        return torch.float32, f"dtype=float32 (auto: the CPU lacks {'+'.join(missing)} for float16 weights)"
    return DTYPES[requested], f"dtype={requested} (requested)"


def bucket_weights(buckets: tuple[int, ...], max_batch: int = 8, prefill_share: float = 0.01) -> dict[int, float]:
    """The expected share of forwards per row bucket (module docstring), summing to 1."""
    t_share = {1: 0.40, **{t: 0.50 / 4 for t in range(2, 6)}, **{t: 0.09 / 12 for t in range(6, 18)}}
    weights = dict.fromkeys(buckets, 0.0)
    for b in range(1, max_batch + 1):
        for t, share in t_share.items():
            weights[bucket_of(b * t, buckets)] += share / max_batch
    if buckets[-1] >= 512:
        weights[buckets[-1]] += prefill_share
    total = sum(weights.values())
    return {k: v / total for k, v in weights.items()}


def bucket_of(rows: int, buckets: tuple[int, ...]) -> int:
    return next((b for b in buckets if b >= rows), buckets[-1])


@dataclass
class Choice:
    """One shape's pick: the storage, its call per bucket, and per storage the expected slowdown
    (over the bucket weights, against the fastest call at each bucket from any allowed storage)
    and the expected ms per call."""

    storage: str
    buckets: tuple[int, ...]
    calls: tuple[str, ...]
    slowdown: dict[str, float]
    expected_ms: dict[str, float]


@dataclass
class Calibration:
    """Measured calls for one (machine, torch, threads, dtype); packs weights for inference.

    `note` is the one-line dtype reason the caller logs, with a measured slowdown warning when
    bfloat16 was asked for on a CPU without native bf16."""

    path: Path
    dtype: torch.dtype  # what models prepared with this plan compute in (activations, norms, KV cache)
    note: str
    key: dict
    shapes: dict = field(default_factory=dict)  # "OUTxIN" -> storage -> call -> [ms per bucket | None]
    progress: bool = False
    measure_s: float = 0.0  # seconds spent measuring in this process
    _reference: "Calibration | None" = None  # float32 twin, to measure a bf16 slowdown against
    _cost: list = field(default_factory=lambda: [0.0, 0.0])  # expected ms of what was packed: [this, fp32]
    weight_dtype: torch.dtype | None = None  # the packed weights' dtype (None: dtype)

    def __post_init__(self) -> None:
        if self.weight_dtype is None:
            self.weight_dtype = self.dtype

    @classmethod
    def open(cls, directory: Path, dtype: str = "auto", *, progress: bool = False,
             flags: frozenset[str] | None = None) -> "Calibration":
        """Read `<directory>/linears-<dtype>.json` if it was measured on this machine, torch and
        thread count; else start empty (shapes are measured when first packed, then saved). Open
        it after setting torch's thread count: the key records it. flags: for tests (fake CPUs)."""
        model, cpu_flags = cpu_info()
        flags = cpu_flags if flags is None else frozenset(flags)
        torch_dtype, reason = resolve_dtype(dtype, flags)
        name = next(k for k, v in DTYPES.items() if v == torch_dtype)
        key = {"schema": SCHEMA, "cpu": model, "flags": sorted(flags & set(KEY_FLAGS)), "torch": torch.__version__,
               "threads": torch.get_num_threads(), "dtype": name, "buckets": list(BUCKETS), "calls": sorted(CALLS),
               "stream_kernel": stream_kernel_digest()}
        path = Path(directory) / f"linears-{name}-{torch.get_num_threads()}t.json"
        shapes = {}
        if path.is_file():
            try:
                saved = json.loads(path.read_text())
                shapes = saved["shapes"] if saved.get("key") == key else {}
            except (ValueError, KeyError, TypeError):
                shapes = {}
        # float32 activations, norms and KV cache whatever the weights: the weights are what a decode step streams
        calib = cls(path, torch.float32, reason, key, shapes, progress, weight_dtype=torch_dtype)
        if torch_dtype == torch.bfloat16 and not any(f in flags for f in NATIVE_BF16_FLAGS):
            calib._reference = cls.open(directory, "float32", progress=progress, flags=flags)
        return calib

    # ---- packing ---------------------------------------------------------------------------
    def pack(self, weight: torch.Tensor, *, head: bool = False, tied: bool = False) -> PackedLinear:
        """weight [OUT, IN] (any float dtype, or quantized blocks) -> a PackedLinear in this calibration's
        dtype, its one copy in the chosen storage. head: timed and weighted up to 48 rows; tied: the weight is also
        an embedding, so only storages with row access qualify."""
        choice = self.choose(tuple(weight.shape), head=head, tied=tied)
        self._cost[0] += choice.expected_ms[choice.storage]
        if self._reference is not None:
            ref = self._reference.choose(tuple(weight.shape), head=head, tied=tied)
            self._cost[1] += ref.expected_ms[ref.storage]
        return PackedLinear(convert(weight, self.format_of(head)), choice.storage, choice.buckets, choice.calls)

    def format_of(self, head: bool) -> torch.dtype:
        """The weights' format for a layer's linear or a head. q4 keeps heads (and so the tied embeddings)
        in int8: SmolLM2's GGUF holds its embedding as Q8_0 (int8 with a scale per 32, what int8 is here),
        which 4 bits would round again; its layers' Q4_1 values q4 takes as they are."""
        return torch.int8 if head and self.weight_dtype == torch.quint4x2 else self.weight_dtype

    def choose(self, shape: tuple[int, int], *, head: bool = False, tied: bool = False) -> Choice:
        buckets = HEAD_BUCKETS if head else BUCKETS
        measured = {s: calls for s, calls in self._measured(shape, buckets, tied, self.format_of(head)).items()
                    if not tied or STORAGES[s].rows is not None}
        weights = bucket_weights(buckets, prefill_share=0.0 if head else 0.01)
        best = {}  # storage -> per bucket (ms, call) of its fastest call
        for storage, calls in measured.items():
            per_bucket = [min(((ms[i], name) for name, ms in calls.items() if ms[i] is not None), default=None)
                          for i in range(len(buckets))]
            if all(per_bucket):
                best[storage] = per_bucket
        if not best:
            raise RuntimeError(f"no linear call works for a {self.key['dtype']} weight {list(shape)} here")
        fastest = [min(per_bucket[i][0] for per_bucket in best.values()) for i in range(len(buckets))]
        slowdown = {s: sum(weights[b] * pb[i][0] / fastest[i] for i, b in enumerate(buckets)) for s, pb in best.items()}
        expected = {s: sum(weights[b] * pb[i][0] for i, b in enumerate(buckets)) for s, pb in best.items()}
        storage = min(slowdown, key=slowdown.get)
        return Choice(storage, buckets, tuple(call for _, call in best[storage]), slowdown, expected)

    def slowdown(self) -> float | None:
        """bf16 without native support: expected matmul time of what was packed / the same in fp32."""
        return self._cost[0] / self._cost[1] if self._reference is not None and self._cost[1] > 0 else None

    def packed_note(self) -> str:
        """`note`, plus the measured slowdown warning where bf16 is emulated (after packing)."""
        ratio = self.slowdown()
        if ratio is None:
            return self.note
        return (f"{self.note}: WARNING this CPU has no native bf16 dot products (no avx512_bf16/amx_bf16); "
                f"its linears measured {ratio:.1f}x the float32 time (expected over the engine's row counts), "
                f"use dtype=float32 or auto")

    # ---- measuring -------------------------------------------------------------------------
    def _measured(self, shape: tuple[int, int], buckets: tuple[int, ...], tied: bool, dtype: torch.dtype) -> dict:
        """storage -> call -> [ms per bucket | None] for `buckets` and weights of `dtype`, measuring what is
        missing (a tied weight needs only the storages with row access)."""
        name = f"{shape[0]}x{shape[1]}" + ("" if dtype == self.weight_dtype else f"-{str(dtype).removeprefix('torch.')}")
        have = self.shapes.setdefault(name, {})
        wanted = [s for s, st in STORAGES.items() if not tied or st.rows is not None]
        missing = [s for s in wanted if s not in have or have[s] and any(len(ms) < len(buckets) for ms in have[s].values())]
        if missing:
            started = time.perf_counter()
            have.update(measure_shape(shape, dtype, buckets, missing, progress=self.progress,
                                      x_dtype=self.dtype))
            for storage in missing:
                have.setdefault(storage, None)  # None: this torch cannot build it for this dtype
            self.measure_s += time.perf_counter() - started
            return_freed_memory()
            self._save()
        return {s: {c: ms[: len(buckets)] for c, ms in have[s].items()} for s in wanted if have.get(s)}

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"key": self.key, "shapes": self.shapes}, indent=1))
        tmp.replace(self.path)


def convert(weight: "torch.Tensor | Int8Weight | Q4Weight", dtype: torch.dtype) -> "torch.Tensor | Int8Weight | Q4Weight":
    """weight [OUT, IN] (any float dtype, or already quantized) -> in the weights' format `dtype` (int8, q4:
    quantized; a quantized weight of that format as it is, of another one dequantized first)."""
    if isinstance(weight, QUANTIZED):
        if weight.dtype == dtype:
            return weight
        weight = weight.dequantize()
    if dtype == torch.int8:
        return Int8Weight.from_float(weight)
    if dtype == torch.quint4x2:
        return Q4Weight.from_float(weight)
    return weight.to(dtype)


def return_freed_memory() -> bool:
    """Hand the heap's free pages back to the system (glibc's `malloc_trim`; elsewhere nothing):
    -> whether it could. Why: glibc's mmap threshold rises to 32 MB as large blocks are freed, so
    the timing ring's copies, once freed, stay in the heap and in the RSS under everything loaded
    after them (145 MiB kept on an AMX Xeon, which put a first calibration's engine 3% over its
    memory limit in `bench engine`)."""
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True


def l3_bytes() -> int:
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        return int(text[:-1]) << {"K": 10, "M": 20}[text[-1]] if text[-1] in "KM" else int(text)
    except (OSError, ValueError, KeyError):
        return DEFAULT_L3


def ring_copies(weight_bytes: int, l3: int) -> int:
    """How many copies of a weight the timing ring cycles through: enough for twice the L3, but
    where that is more than RING_BYTES, only as many as pass the L3 by one weight (or reach
    RING_BYTES): cycling a ring larger than an LRU cache misses on every access all the same. Why
    bounded: the ring is the process's peak memory, and a VM can report its host's whole L3
    (measured: 480 MB on a 2-core AMX Xeon, where twice the L3 held nine copies of SmolLM2's
    float32 head, 1 GB, and `bench engine` read a peak RSS 420 MB above its limit)."""
    ring = min(2 * l3, max(l3 + weight_bytes, RING_BYTES))
    return max(1, min(MAX_RING_COPIES, math.ceil(ring / weight_bytes)))


def measure_shape(shape: tuple[int, int], dtype: torch.dtype, buckets: tuple[int, ...],
                  storages: list[str], progress: bool = False, passes: int = 2,
                  x_dtype: torch.dtype | None = None) -> dict:
    """Time every call from every storage at every bucket for a weight [OUT, IN] of `dtype` and
    inputs of `x_dtype` (None: dtype; float32 with half-precision weights takes the "mixed" calls only).

    -> storage -> call -> [ms | None]; None: a single-row call above one row, or a call dropped
    in every pass after it measured > 3x the fastest call so far at a smaller bucket (no call was
    seen to come back from that; emulated bf16 `x @ Wt` at 512 rows would take 0.7 s a sample).
    A storage this torch cannot build for `dtype` is left out.

    `passes` whole passes, each entry the fastest over them: one disturbed moment (measured on an
    AVX-512 EPYC: oneDNN bf16 [3072, 576] read 27 ms at 6 rows in one pass, 0.16 in the next) then
    costs one pass's sample instead of dropping the fastest storage, which had made bf16 decode
    slower than fp32 there."""
    from tqdm import tqdm

    out_features, in_features = shape
    nbytes = int(out_features * in_features * bytes_per_weight(dtype))
    copies = ring_copies(nbytes, l3_bytes())
    gen = torch.Generator().manual_seed(0)
    if dtype in (torch.int8, torch.quint4x2):
        base = convert(torch.randn(shape, generator=gen).mul_(0.02), dtype)
    else:
        base = torch.randn(shape, generator=gen, dtype=dtype).mul_(0.02)  # one tensor of the dtype, no fp32 temporary
    x_dtype = dtype if x_dtype is None else x_dtype
    inputs = [torch.randn(rows, in_features, generator=gen).to(x_dtype) for rows in buckets]
    result: dict[str, dict[str, list]] = {}
    bar = tqdm(total=passes * len(storages) * len(buckets),
               desc=f"calibrating {list(shape)} {dtype}".replace("torch.", ""), disable=not progress, leave=False)
    with torch.inference_mode():
        for _ in range(passes):
            best = [math.inf] * len(buckets)  # seconds, over every storage measured so far in this pass
            for storage in (STORAGES[name] for name in storages):
                if not calls_for(storage.name, 1, dtype, x_dtype):  # e.g. oneDNN's layout for float16 weights
                    bar.update(len(buckets))
                    continue
                try:
                    ring = [storage.pack(base.clone()) for _ in range(copies)]
                except RuntimeError:  # e.g. oneDNN bf16 packing without AVX-512 / AVX-NE-CONVERT
                    bar.update(len(buckets))
                    continue
                calls = result.setdefault(storage.name, {c.name: [None] * len(buckets)
                                                          for c in calls_for(storage.name, 1, dtype, x_dtype)})
                dropped: set[str] = set()
                cursor = 0
                for i, x2 in enumerate(inputs):
                    for call in calls_for(storage.name, len(x2), dtype, x_dtype):
                        if call.name in dropped:
                            continue
                        seconds, cursor = _time_call(call.fn, x2, ring, cursor, best[i])
                        before = calls[call.name][i]
                        calls[call.name][i] = 1000 * seconds if before is None else min(before, 1000 * seconds)
                        best[i] = min(best[i], seconds)
                        if seconds > 3 * best[i]:
                            dropped.add(call.name)
                    bar.update()
                del ring
    bar.close()
    return result


def _time_call(fn, x2: torch.Tensor, ring: list[torch.Tensor], cursor: int, best: float) -> tuple[float, int]:
    """-> (seconds: the fastest of a few calls after one warm-up, the ring cursor after them).
    A call slower than 10x `best` and 20 ms twice in a row stops there (one slow sample alone
    can be a preempted one).

    Each call takes the ring's next weight (none is cache-resident). The warm-up also builds
    oneDNN's primitive for this row count. ~12 ms of samples, 1 to 5: a head call takes 3-60 ms.
    The minimum, as other processes only ever add time (a preempted sample reads 10-20x)."""
    started = time.perf_counter()
    fn(x2, ring[cursor % len(ring)])
    warm = time.perf_counter() - started
    cursor += 1
    times = []
    if warm > 10 * best and warm > 0.02:  # hopeless and slow if a second call says so too: no more samples
        started = time.perf_counter()
        fn(x2, ring[cursor % len(ring)])
        times.append(time.perf_counter() - started)
        cursor += 1
        if times[0] > 10 * best:
            return times[0], cursor
    for _ in range(max(1, min(5, math.ceil(0.012 / warm)))):
        started = time.perf_counter()
        fn(x2, ring[cursor % len(ring)])
        times.append(time.perf_counter() - started)
        cursor += 1
    return min(times), cursor
