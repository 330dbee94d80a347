"""crossdraft.vocab.mapping's memory cache and crossdraft.vocab.cache's disk cache."""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest

from crossdraft.vocab import mapping
from crossdraft.vocab.cache import default_cache_dir
from crossdraft.vocab.mapping import build_mapping, clear_memory_cache
from tests.tokenizers_fixtures import bytelevel_bpe_tokenizer, sentencepiece_like_tokenizer
from tests.unit.vocab.checks import count_vocab_work

BL = bytelevel_bpe_tokenizer
SP = sentencepiece_like_tokenizer


def test_memory_and_disk_cache(cache_dir, monkeypatch):
    m1 = build_mapping(BL(), SP(), cache_dir=cache_dir)
    path = cache_dir / f"{m1.key}.npz"
    assert path.is_file()
    assert [p.name for p in cache_dir.iterdir()] == [path.name]  # no temp files left behind
    assert build_mapping(BL(), SP(), cache_dir=cache_dir) is m1  # memory hit

    mapping._MEMORY.clear()

    def boom(*a, **k):
        raise AssertionError("should have been loaded from disk")

    monkeypatch.setattr(mapping, "_compute", boom)
    m2 = build_mapping(BL(), SP(), cache_dir=cache_dir)
    assert m2 is not m1 and m2.key == m1.key
    assert (m2.d2t == m1.d2t).all() and (m2.t2d == m1.t2d).all()
    # the key depends on the direction
    monkeypatch.undo()
    assert build_mapping(SP(), BL(), cache_dir=cache_dir).key != m1.key


@pytest.mark.parametrize("garbage", [b"not a zip", b"", "wrong-shape"])
def test_corrupt_cache_file_ignored_and_rewritten(cache_dir, garbage):
    m1 = build_mapping(BL(), SP(), cache_dir=cache_dir)
    path = cache_dir / f"{m1.key}.npz"
    if garbage == "wrong-shape":
        np.savez(path, d2t=np.zeros(3, np.int64), t2d=np.zeros(3, np.int64), key=np.array(m1.key))
    else:
        path.write_bytes(garbage)
    mapping._MEMORY.clear()
    m2 = build_mapping(BL(), SP(), cache_dir=cache_dir)
    assert (m2.d2t == m1.d2t).all() and (m2.t2d == m1.t2d).all()
    with np.load(path) as z:  # rewritten, valid
        assert (z["d2t"] == m1.d2t).all() and str(z["key"]) == m1.key


def test_default_cache_dir_uses_crossdraft_home(tmp_path, monkeypatch):
    monkeypatch.setenv("CROSSDRAFT_HOME", str(tmp_path / "home"))
    clear_memory_cache()
    assert default_cache_dir() == tmp_path / "home" / "vocab"
    m = build_mapping(SP(), BL())
    assert (tmp_path / "home" / "vocab" / f"{m.key}.npz").is_file()
    clear_memory_cache()


def test_unwritable_cache_dir_still_works(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    clear_memory_cache()
    m = build_mapping(BL(), SP(), cache_dir=blocker / "sub")  # cannot mkdir under a file
    assert m.intersection_size() > 0
    clear_memory_cache()


def test_a_mapping_built_again_is_a_cache_hit_that_redoes_no_work(cache_dir, monkeypatch):
    """build_mapping runs every time a gateway pairs two models: the mapping is computed once, and
    building it again does none of that work -- with the same tokenizer objects not even their
    bytes tables; with new objects of the same tokenizers only the tables (kept per object), the
    mapping itself coming from memory."""
    counts = count_vocab_work(monkeypatch)
    bl, sp = BL(), SP()
    first = build_mapping(bl, sp, cache_dir=cache_dir)
    assert counts == {"table": 2, "compute": 1, "load": 1, "save": 1}  # (the disk had nothing yet)
    for _ in range(20):
        assert build_mapping(bl, sp, cache_dir=cache_dir) is first
    assert counts == {"table": 2, "compute": 1, "load": 1, "save": 1}
    for _ in range(3):  # equal tokenizers, other objects (the fixtures are cached: copies)
        assert build_mapping(copy.deepcopy(bl), copy.deepcopy(sp), cache_dir=cache_dir) is first
    assert counts == {"table": 2 + 2 * 3, "compute": 1, "load": 1, "save": 1}
    assert os.path.isdir(cache_dir)
