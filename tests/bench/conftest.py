"""Fixtures the bench tests share."""

import shutil

import pytest


@pytest.fixture
def traffic_cache(home):
    """The traffic caches this test records under <home>/bench-learn, removed afterwards."""
    root = home / "bench-learn"
    before = set(root.iterdir()) if root.is_dir() else set()
    yield root
    for path in (set(root.iterdir()) if root.is_dir() else set()) - before:
        shutil.rmtree(path, ignore_errors=True)
