"""The vLLM backend refuses any vLLM but the pinned release, with one line naming it."""

import pytest

from specrl.errors import SpecrlError
from specrl.serving.vllm import SUPPORTED_VERSION, check_version


@pytest.mark.parametrize("installed", ["0.31.1", "0.33.0+cpu", "1.0.0"])
def test_other_versions_are_refused_naming_the_supported_one(installed):
    with pytest.raises(SpecrlError) as err:
        check_version(installed)
    assert SUPPORTED_VERSION in err.value.message and installed in err.value.message and "\n" not in err.value.message


def test_the_pinned_version_passes_with_or_without_a_local_tag():
    assert check_version(f"{SUPPORTED_VERSION}+cpu") == f"{SUPPORTED_VERSION}+cpu"
    assert check_version(SUPPORTED_VERSION) == SUPPORTED_VERSION
