"""Token healing in text drafting (crossdraft.vocab.healing): the drafter may re-choose its last id.

Tiny random models (fp32). The byte table is the drafter tokenizer's own except where a test
rewrites a few entries to force the case it checks (the drafter's choice at the last id's
position is computed first, then the table is made to agree or not).
"""

from __future__ import annotations

import pytest
import torch

from crossdraft.decoding.sampling import SamplingParams
from crossdraft.engine import DraftConfig, Engine
from crossdraft.runtime.sessions import AllowedSet, DrafterSession
from crossdraft.vocab.healing import TokenBytes
from crossdraft.vocab.tokenbytes import token_bytes
from tests.tiny_models import tiny_lm
from tests.unit.runtime.test_work_counting import FeedLog

PROMPT = "import numpy as np\n\nclass Model:\n    def __init__(self):"


def test_agreeing_ids_start_with_the_bytes_or_are_a_prefix_of_whitespace():
    t = TokenBytes([b"a", b"ab", b"abc", b"b", None, b"   ", b" ", b"  ", b" return", b"\xff", b"\xff\x01", b""])
    assert t.agreeing(b"ab").tolist() == [1, 2]  # a word is not split: "a" (then "b") is not offered
    assert t.agreeing(b"    ").tolist() == [5, 6, 7]  # 3, 1 and 2 spaces: the rest follows; " return" does not
    assert t.agreeing(b"\xff").tolist() == [9, 10]
    assert t.agreeing(b"zz").tolist() == []
    assert t.rest(b"    ", 5) == b" " and t.rest(b"    ", 6) == b"   " and t.rest(b"ab", 2) == b""
    assert t.rest(b"ab", 3) == b""  # "b" does not agree: nothing more is asked of later proposals


@pytest.fixture(scope="module")
def drafter(tok_d):
    return tiny_lm(tok_d, seed=2)


def _session(drafter, ids):
    return DrafterSession(drafter.model, ids, drafter.device)


def _allowed(drafter) -> AllowedSet:
    import numpy as np

    return AllowedSet(drafter.model, np.ones(drafter.vocab_size, dtype=bool), drafter.device)


def _choice_at_last(drafter, ids, allowed) -> list[int]:
    """Drafter ids ordered by the drafter's preference at the position of ids[-1]."""
    s = _session(drafter, ids[:-1])
    row = s.forward([], keep=1)[0].float()
    return [int(allowed.ids[j]) for j in torch.argsort(row[allowed.ids], descending=True)[:8]]


def _disagreeing_table(drafter, tok_d) -> list:
    """The drafter's byte table with every byte-bearing id rewritten to bytes no other id agrees
    with (a test then sets the few entries its case needs)."""
    table = list(token_bytes(tok_d)) + [None] * (drafter.vocab_size - len(tok_d))
    return [b"\x01" + bytes([i % 251]) + b"\x02" if b else b for i, b in enumerate(table)]


def _ids(drafter, tok_d):
    ids = tok_d(PROMPT, add_special_tokens=False)["input_ids"]
    return list(ids)


def test_the_drafter_replaces_its_last_id_with_the_token_it_prefers_for_those_bytes(drafter, tok_d):
    allowed = _allowed(drafter)
    ids = _ids(drafter, tok_d)
    p = ids[-1]
    best = next(x for x in _choice_at_last(drafter, ids, allowed) if x != p)
    table = _disagreeing_table(drafter, tok_d)  # all disagree...
    table[p] = b"\x10\x11"
    table[best] = b"\x10\x11\x12"  # ...but `best` spells P's bytes and one more
    heal = TokenBytes(table)

    sess = _session(drafter, ids)
    sess.prefill()  # all but the last id cached, as after a round
    log = FeedLog(drafter.model)
    try:
        toks = list(sess.draft_iter(3, 0, SamplingParams(), 0, allowed, heal=heal))
    finally:
        log.close()
    assert toks[0].id == best and toks[0].heals and not any(t.heals for t in toks[1:])
    assert sess.ids == ids[:-1]  # P left the committed ids
    # the first forward fed the last two ids (rows for P's position and the next); then one token per step
    assert log.calls[0] == (ids[-2:], [len(ids) - 2, len(ids) - 1])
    assert [c[0] for c in log.calls[1:]] == [[t.id] for t in toks[:-1]]
    assert log.calls[1][1] == [len(ids) - 1]  # the healed token sits where P sat
    # the cache is the one a fresh session builds on the new history (next-token logits agree)
    new = ids[:-1] + [t.id for t in toks]
    got = sess.forward([t.id for t in toks], keep=1)  # feeds only the last proposal
    ref = _session(drafter, new).forward([], keep=1)
    assert torch.allclose(got, ref, atol=1e-5)
    assert sess.cache_repairs == 0


def test_when_the_last_id_is_the_drafters_choice_nothing_changes_and_no_forward_is_added(drafter, tok_d):
    allowed = _allowed(drafter)
    ids = _ids(drafter, tok_d)
    table = _disagreeing_table(drafter, tok_d)
    table[ids[-1]] = b"\x10\x11"  # no other id agrees with P's bytes
    heal = TokenBytes(table)
    plain = list(_session(drafter, ids).draft_iter(4, 0, SamplingParams(), 0, allowed))
    sess = _session(drafter, ids)
    log = FeedLog(drafter.model)
    try:
        healed = list(sess.draft_iter(4, 0, SamplingParams(), 0, allowed, heal=heal))
    finally:
        log.close()
    assert [t.id for t in healed] == [t.id for t in plain] and not any(t.heals for t in healed)
    assert sess.ids == ids and len(log.calls) == 4  # 4 proposals, 4 forwards


def test_a_healed_token_that_spells_only_part_of_the_bytes_makes_the_next_proposals_spell_the_rest(drafter, tok_d):
    allowed = _allowed(drafter)
    ids = _ids(drafter, tok_d)
    p = ids[-1]
    best = next(x for x in _choice_at_last(drafter, ids, allowed) if x != p)
    table = _disagreeing_table(drafter, tok_d)
    table[p] = b" \t\t"  # whitespace
    table[best] = b" "  # a prefix: the next proposal must start with the two tabs
    only = next(x for x in range(drafter.vocab_size) if x not in (p, best) and table[x])
    table[only] = b"\t\treturn"
    toks = list(_session(drafter, ids).draft_iter(3, 0, SamplingParams(), 0, allowed, heal=TokenBytes(table)))
    assert [t.id for t in toks[:2]] == [best, only] and toks[0].heals


def test_healing_is_for_greedy_drafting_only(drafter, tok_d):
    from crossdraft.errors import InvalidArgument
    from crossdraft.runtime.workers import DrafterWorker

    w = DrafterWorker(drafter)
    w.sync("s", _ids(drafter, tok_d))
    with pytest.raises(InvalidArgument) as e:
        w.draft("s", None, None, 2, 0, SamplingParams(temperature=1.0), 0, 0.0, "", heal=True)
    assert e.value.field == "heal"


def test_text_drafting_with_healing_keeps_the_output_and_the_drafters_text_exact(target, drafter, tmp_path):
    """Greedy text drafting with healing gives the target's tokens, and after every round the
    drafter's generated ids spell exactly the target's generated bytes."""
    eng = Engine(target, drafter, vocab_cache_dir=tmp_path)
    healed = 0
    for n, prompt in enumerate([PROMPT, "def add(a, b):\n    return", "The quick brown fox"]):
        ref = eng.generate(prompt, max_new_tokens=40, use_drafter=False)
        d_bytes, t_ids = eng.pair.d_bytes, eng.pair.encode_target(prompt)
        d_ids = eng.pair.encode_drafter(prompt)
        run = eng.decoder.run(f"h{n}", t_ids, d_ids, max_new_tokens=40, params=SamplingParams(), seed=0,
                              draft=DraftConfig(num_draft_tokens=3, mode="text", adaptive=False))
        gen: list[int] = []
        for ev in run:
            gen += ev.emitted
            if not ev.done:
                spelled = b"".join(d_bytes[x] for x in ev.drafter_ids[len(d_ids):])
                assert spelled == eng.pair.target_text_bytes(gen)
        st = run.result.stats
        assert run.result.token_ids == ref.token_ids
        assert st.draft_mode == "text" and st.drafted > 0
        healed += st.healed
        eng.verifier.end(f"h{n}")
        eng.drafter_worker.end(f"h{n}")
    assert healed > 0  # the random drafter often prefers another spelling than the re-encoding's


def test_a_split_no_token_can_finish_ends_the_block_instead_of_proposing_other_text(drafter, tok_d):
    allowed = _allowed(drafter)
    ids = _ids(drafter, tok_d)
    p = ids[-1]
    best = next(x for x in _choice_at_last(drafter, ids, allowed) if x != p)
    table = _disagreeing_table(drafter, tok_d)
    table[p] = b" \t"
    table[best] = b" "  # a prefix, and no id starts with the tab that must follow
    toks = list(_session(drafter, ids).draft_iter(4, 0, SamplingParams(), 0, allowed, heal=TokenBytes(table)))
    assert [t.id for t in toks] == [best] and toks[0].heals
