"""`--backend native,vllm` of the benches: parsing, the one-line errors, the shared thread count."""

import pytest

from specrl.apps.bench import backends
from specrl.apps.bench.backends import bench_threads, parse_backends, ratio, vllm_env
from specrl.apps.cli import main
from specrl.errors import InvalidRequestError, SpecrlError
from specrl.serving.vllm import SUPPORTED_VERSION


def test_parse_backends_keeps_order_and_drops_duplicates():
    assert parse_backends("native") == ["native"]
    assert parse_backends(" vllm, native,vllm ", installed=SUPPORTED_VERSION) == ["vllm", "native"]


def test_default_is_both_when_vllm_is_installed(monkeypatch):
    assert parse_backends(None, installed=SUPPORTED_VERSION) == ["native", "vllm"]
    monkeypatch.setattr(backends, "vllm_version", lambda: None)
    assert parse_backends("") == ["native"]


@pytest.mark.parametrize("text", ["gpu", "native,foo", ","])
def test_unknown_backend_is_one_actionable_line(text):
    with pytest.raises(InvalidRequestError) as err:
        parse_backends(text)
    assert "\n" not in err.value.message and "native, vllm" in err.value.message


def test_vllm_missing_or_unpinned(monkeypatch):
    monkeypatch.setattr(backends, "vllm_version", lambda: None)
    with pytest.raises(InvalidRequestError, match=r"pip install 'specrl\[vllm\]'"):
        parse_backends("native,vllm")
    with pytest.raises(SpecrlError, match="supports vLLM"):
        parse_backends("vllm", installed="0.1.0")


def test_cli_unknown_backend_exits_1_with_one_line(capsys):
    for bench in ("engine", "serve"):
        assert main(["bench", bench, "--backend", "native,tgi"]) == 1
        err = capsys.readouterr().err
        assert err.startswith("specrl: error: unknown backend tgi") and err.count("\n") == 1


def test_threads_default_leaves_one_core_like_vllm():
    assert bench_threads(3, cpus=8) == 3
    assert bench_threads(0, cpus=8) == 7
    assert bench_threads(0, cpus=1) == 1
    assert vllm_env(2) == {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "2"}


def test_ratio_of_missing_values_is_none():
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(None, 2.0) is None and ratio(1.0, None) is None and ratio(1.0, 0.0) is None
