"""The floors under a forward's cost (specrl/apps/bench/floors.py): the peak multiply-add rate of each kernel
instruction (a loop of it in C), which instruction a model's weights take, and each curve point against both
floors."""

import pytest
import torch

from specrl.apps.bench.floors import add_floors, forward_work, kernel_instruction, peak_rates
from specrl.models.calibration import cpu_info
from specrl.models.linear import cpu_kernels
from specrl.models.llama import load_llama
from tests.models.test_prepared import AmxPlan, ForcedPlan

needs_kernels = pytest.mark.skipif(cpu_kernels is None, reason="the stream kernel is not built")
FLAGS = cpu_info()[1]
NEEDS = {"avx2_fma": {"avx2", "fma"}, "avx512_fma": {"avx512f"}, "avx2_int8": {"avx2"},
         "avx512_vnni": {"avx512f", "avx512bw", "avx512_vnni"}, "avx512_bf16": {"avx512f", "avx512_bf16"},
         "amx_bf16": {"amx_tile", "amx_bf16"}, "amx_int8": {"amx_tile", "amx_int8"}}


@needs_kernels
@pytest.mark.parametrize("name", sorted(NEEDS))
def test_peak_is_measured_where_the_cpu_runs_the_instruction_and_refused_elsewhere(name):
    rate = cpu_kernels.peak_macs(name, 1, 1)
    if NEEDS[name] <= FLAGS:
        assert rate > 1e9  # any vector unit of this century does a billion multiply-adds a second
    else:
        assert rate == -1


@needs_kernels
def test_unknown_instructions_and_thread_counts_are_refused():
    assert cpu_kernels.peak_macs("avx9000", 1) == -1 and cpu_kernels.peak_macs("avx2_fma", 0) == -1
    assert peak_rates(["avx9000", None], 1) == {}


class _Kernels:
    """cpu_kernels with a peak_macs that reads back given rates in turn (a machine whose neighbour comes and goes)."""

    def __init__(self, rates):
        self.rates, self.calls = list(rates), []

    def peak_macs(self, name, threads):
        self.calls.append((name, threads))
        return self.rates.pop(0)


def test_a_peak_is_the_best_of_samples_apart_in_time(monkeypatch):
    """A rate read while a neighbour held a core is half the machine's: the floor takes the best of the samples,
    per instruction, and an instruction the CPU refuses (-1 in every sample) has no peak."""
    import specrl.apps.bench.floors as floors

    fake = _Kernels([2e11, -1.0, 4.6e11, -1.0, 4.4e11, -1.0])  # two instructions, three samples each, in turn
    monkeypatch.setattr(floors, "cpu_kernels", fake)
    assert peak_rates(["avx512_vnni", "amx_int8", None, "avx512_vnni"], 2, samples=3, pause_s=0) == {"avx512_vnni": 4.6e11}
    assert fake.calls == [("avx512_vnni", 2), ("amx_int8", 2)] * 3 and fake.rates == []


@needs_kernels
def test_the_instruction_follows_the_weights_format_and_the_cpu(tiny_dir):
    vnni = NEEDS["avx512_vnni"] <= FLAGS
    int8 = load_llama(tiny_dir, plan=ForcedPlan("blocked", torch.float32, torch.int8))
    assert kernel_instruction(int8) == ("avx512_vnni" if vnni else "avx2_int8" if "avx2" in FLAGS else None)
    assert kernel_instruction(load_llama(tiny_dir)) is None  # plain weights: torch's matmuls, no peak of ours
    blocked = load_llama(tiny_dir, plan=ForcedPlan("blocked", torch.float32))
    assert kernel_instruction(blocked) in {"avx2_fma", "avx512_fma", None}
    rates = peak_rates([kernel_instruction(int8)], 1)
    assert set(rates) == ({kernel_instruction(int8)} - {None})
    amx = load_llama(tiny_dir, plan=AmxPlan("blocked", torch.float32, torch.int8))  # "stream amx" at every row count
    assert kernel_instruction(amx, 5) == ("amx_int8" if NEEDS["amx_int8"] <= FLAGS else kernel_instruction(int8))
    work = forward_work(amx, "int8", (1, 5))
    assert work["instruction_by_rows"] == {1: kernel_instruction(amx, 1), 5: kernel_instruction(amx, 5)}


def test_forward_work_counts_every_streamed_weight_once_per_row(tiny_dir):
    model = load_llama(tiny_dir)
    work = forward_work(model, "float32")
    cfg = model.cfg
    assert work["macs_per_row"] == sum(w.numel() for w in model.streamed_weights())
    assert work["weight_bytes"] == model.streamed_weight_bytes()
    assert work["kv_bytes_per_position"] == cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4


def test_each_point_reads_against_the_larger_floor():
    work = {"q4": {"weight_bytes": 80e6, "kv_bytes_per_position": 1000, "macs_per_row": 100e6,
                   "instruction": "avx2_int8"},
            "bfloat16": {"weight_bytes": 200e6, "kv_bytes_per_position": 1000, "macs_per_row": 100e6,
                         "instruction": None}}
    points = [{"dtype": "q4", "batch": 1, "tokens": 1, "rows": 1, "context": 100, "median_ms": 6.0},
              {"dtype": "q4", "batch": 1, "tokens": 16, "rows": 16, "context": 100, "median_ms": 20.0},
              {"dtype": "bfloat16", "batch": 2, "tokens": 8, "rows": 16, "context": 100, "median_ms": 30.0}]
    one, sixteen, no_peak = add_floors(points, work, read_gb_s=40.0, peaks={"avx2_int8": 200e9})
    work["q4"]["instruction_by_rows"] = {16: "amx_int8"}  # a call of its own from 16 rows: its own peak there
    one_again, tiles = add_floors(points[:2], work, read_gb_s=40.0, peaks={"avx2_int8": 200e9, "amx_int8": 1600e9})[:2]
    assert one_again == one and tiles["instruction"] == "amx_int8"
    assert tiles["compute_floor_ms"] == pytest.approx(1.0) and tiles["floor_ms"] == tiles["bytes_floor_ms"]
    assert one["bytes_floor_ms"] == pytest.approx((80e6 + 100 * 1000) / 40e9 * 1e3)  # 2.0025 ms
    assert one["compute_floor_ms"] == pytest.approx(0.5) and one["floor_ms"] == one["bytes_floor_ms"]
    assert sixteen["compute_floor_ms"] == pytest.approx(8.0) and sixteen["floor_ms"] == pytest.approx(8.0)
    assert sixteen["of_floor"] == pytest.approx(20.0 / 8.0) and one["of_floor"] == pytest.approx(6.0 / 2.0025)
    assert no_peak["compute_floor_ms"] is None  # no peak for its instruction: the bytes floor alone
    assert no_peak["floor_ms"] == pytest.approx((200e6 + 2 * 100 * 1000) / 40e9 * 1e3)
