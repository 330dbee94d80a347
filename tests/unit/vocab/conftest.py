"""The vocab tests' shared fixture: an empty mapping cache directory, memory caches cleared around it."""

from __future__ import annotations

import pytest

from crossdraft.vocab.mapping import clear_memory_cache


@pytest.fixture
def cache_dir(tmp_path):
    clear_memory_cache()
    yield tmp_path / "vocab"
    clear_memory_cache()
