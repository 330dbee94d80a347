"""Vocabulary mapping between the catalog's real tokenizers (pulled by `make models`).

Run with ``pytest -m real_models tests/integration/test_vocab_real.py -s`` to see the numbers.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

from crossdraft.vocab import mapping as V
from crossdraft.vocab.report import vocab_report
from crossdraft.vocab.tokenbytes import byte_table, token_bytes
from tests.unit.vocab.checks import in_context_mismatches

pytestmark = pytest.mark.real_models

NAMES = ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]
_LOADED: dict = {}


def tok(name):
    if name not in _LOADED:
        from crossdraft.models.tokenizers import load_tokenizer

        _LOADED[name] = load_tokenizer(name)
    return _LOADED[name]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    V.clear_memory_cache()
    yield tmp_path_factory.mktemp("vocab")
    V.clear_memory_cache()


def test_gemma_qwen_beats_hf_style_and_maps_whitespace(cache_dir):
    gemma, qwen = tok("gemma3-270m"), tok("qwen2.5-coder-0.5b")
    for target, drafter in ((qwen, gemma), (gemma, qwen)):
        m = V.build_mapping(target, drafter, cache_dir=cache_dir)
        rep = vocab_report(target, drafter, cache_dir=cache_dir)
        print({k: v for k, v in rep.items() if k != "key"})
        # HF-style finds 63,608; decoded-bytes matching ~96k (see crossdraft.vocab.report's docstring)
        assert rep["intersection_size"] > rep["hf_style_intersection"] + 25_000
        assert rep["intersection_size"] > 90_000
        assert rep["intersection_size"] >= rep["hf_style_correct_pairs"]
        t_index, d_index = byte_table(target).index, byte_table(drafter).index
        for text in (b"\n", b"    ", b"\n    ", b"\n\n", b"\t", b"  ", b" the", b"def", b"\n\n\n"):
            if text in t_index and text in d_index:
                t = t_index[text]
                assert m.t2d[t] >= 0, text
                assert m.d2t[d_index[text]] == t, text
            elif text in (b"\n", b"    "):
                pytest.fail(f"{text!r} missing from a vocabulary")
        # newline and 4-space indentation are in both and mapped (HF-style misses them)
        assert m.t2d[t_index[b"\n"]] >= 0 and m.t2d[t_index[b"    "]] >= 0


# every ordered pair of the distinct tokenizers, and the two Qwen2.5-Coder sizes both ways (they share one
# tokenizer: pairing the 1.5B's with the others again would repeat the 0.5B's pairs, ~7 s each)
PAIRS = list(itertools.permutations(NAMES[:3], 2)) + [("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"),
                                                      ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")]


@pytest.mark.parametrize("t_name, d_name", PAIRS)
def test_all_pairs_numbers(t_name, d_name, cache_dir):
    target, drafter = tok(t_name), tok(d_name)
    t0 = time.perf_counter()
    m = V.build_mapping(target, drafter, cache_dir=cache_dir)
    built = time.perf_counter() - t0
    rep = vocab_report(target, drafter, cache_dir=cache_dir)
    print(
        f"\ntarget={t_name:<20} drafter={d_name:<20} ours={rep['intersection_size']:>7} "
        f"hf_style={rep['hf_style_intersection']:>7} (wrong text {rep['hf_style_wrong_text_pairs']}, "
        f"special {rep['hf_style_special_pairs']}) only_ours={rep['only_ours']} "
        f"many_to_one={rep['many_to_one']} build={built:.2f}s examples={rep['examples_only_ours'][:6]}"
    )
    assert 0 < m.intersection_size() <= min(len(target), len(drafter))
    assert rep["intersection_size"] >= rep["hf_style_correct_pairs"]
    d = np.flatnonzero(m.d2t >= 0)
    tb, db = token_bytes(target), token_bytes(drafter)
    assert all(db[i] == tb[m.d2t[i]] for i in d[:: max(1, len(d) // 5000)])
    if tb == db:  # e.g. the two Qwen2.5-Coder sizes share one tokenizer
        ok = np.array([b is not None for b in tb])
        assert (m.d2t[ok] == np.flatnonzero(ok)).all()


@pytest.mark.parametrize("a_name, b_name", [
    ("gemma3-270m", "qwen2.5-coder-0.5b"),
    ("smollm2-135m", "qwen2.5-coder-0.5b"),
    ("smollm2-135m", "gemma3-270m"),
])
def test_sampled_pairs_decode_identically(a_name, b_name, cache_dir):
    a, b = tok(a_name), tok(b_name)
    m = V.build_mapping(b, a, cache_dir=cache_dir)  # drafter a -> target b
    mapped = np.flatnonzero(m.d2t >= 0)
    rng = np.random.default_rng(0)
    sample = rng.choice(mapped, size=min(2000, len(mapped)), replace=False)
    # always include the whitespace-heavy tokens HF-style misses
    extra = [i for i, x in enumerate(token_bytes(a)) if x is not None and m.d2t[i] >= 0
             and (b"\n" in x or b"\t" in x or x.startswith(b"  "))][:500]
    pairs = [(int(d), int(m.d2t[d])) for d in {*sample.tolist(), *extra}]
    bad = in_context_mismatches(a, b, pairs)
    assert bad == [], bad[:10]


def test_a_mapping_in_the_disk_cache_is_read_not_rebuilt(cache_dir, monkeypatch):
    """A gateway restarting on a pair it mapped before reads the mapping from the disk cache: the
    second build computes nothing (the tokenizers' bytes tables are memoized per object; the
    mapping, forgotten in memory, is loaded from its file) and gives the same mapping."""
    from tests.unit.vocab.checks import count_vocab_work

    gemma, qwen = tok("gemma3-270m"), tok("qwen2.5-coder-0.5b")
    first = V.build_mapping(qwen, gemma, cache_dir=cache_dir)
    V._MEMORY.clear()  # per-tokenizer byte tables stay memoized
    counts = count_vocab_work(monkeypatch)
    m = V.build_mapping(qwen, gemma, cache_dir=cache_dir)
    assert counts == {"table": 0, "compute": 0, "load": 1, "save": 0}
    assert m is not first and m.key == first.key
    assert (m.d2t == first.d2t).all() and (m.t2d == first.t2d).all()
    assert m.intersection_size() > 90_000
