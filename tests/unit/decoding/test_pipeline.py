"""Pipelined rounds (crossdraft.decoding.pipeline): the next block is drafted while this one is verified.

Tiny random models in process (the round loop is the gateway's; the ports are the model workers,
wrapped where a test counts or orders their calls). The drafter of the same-vocabulary pair is the
target plus noise, so most blocks are accepted whole (the pipelined path) and some are not (the
dropped path). Block sizes are fixed (no adaptive policy), so a run's rounds do not depend on timing.
"""

from __future__ import annotations

import threading

import pytest

from crossdraft.decoding import pipeline as P
from crossdraft.decoding.costmodel import CostModel
from crossdraft.decoding.pipeline import pipeline_on
from crossdraft.decoding.sampling import SamplingParams
from crossdraft.engine import DraftConfig, Engine
from crossdraft.errors import FailedPrecondition
from crossdraft.runtime import sessions as SS
from tests import exact
from tests.tiny_models import noisy_copy, tiny_lm

PROMPTS = ["def add(a, b):\n    return", "The quick brown fox", "import numpy as np\n\nclass Model:"]
FIXED = DraftConfig(num_draft_tokens=3, adaptive=False)


@pytest.fixture(scope="module")
def close_pair(tok_t):
    """A target without EOS (every run generates its whole budget) and a drafter = target + noise."""
    target = tiny_lm(tok_t, seed=1, arch="qwen2", extra_vocab=7, head_scale=8.0, with_eos=False)
    drafter = noisy_copy(target, 0.25, seed=5)
    return target, drafter


@pytest.fixture()
def close(close_pair, tmp_path_factory):
    return Engine(*close_pair, vocab_cache_dir=tmp_path_factory.mktemp("vocab"), pipeline="on")


@pytest.fixture(scope="module")
def cross(target, tok_d, tmp_path_factory):
    """Two vocabularies (TLI and text mode)."""
    return Engine(target, tiny_lm(tok_d, seed=2), vocab_cache_dir=tmp_path_factory.mktemp("vocab"), pipeline="on")


class Counting:
    """A port that counts the calls the round loop makes (and their arguments)."""

    def __init__(self, inner):
        self.inner = inner
        self.syncs = 0
        self.calls: list[dict] = []

    def sync(self, sid, ids, *a, **kw):
        self.syncs += 1
        return self.inner.sync(sid, ids, *a, **kw)

    def verify(self, *a, **kw):
        self.calls.append(dict(kw, round_index=a[4]))
        return self.inner.verify(*a, **kw)

    def draft(self, *a, **kw):
        self.calls.append(dict(kw, thread=threading.current_thread().name))
        return self.inner.draft(*a, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _gen(eng, prompt, pipeline: bool, **kw):
    eng.decoder.pipeline = pipeline
    kw.setdefault("draft", FIXED)
    return eng.generate(prompt, max_new_tokens=kw.pop("max_new_tokens", 40), **kw)


def _rounds(eng, prompt):
    """The RoundEvents of a pipelined greedy run through the round loop itself."""
    eng.decoder.pipeline = True
    ids = list(eng.target.tokenizer(prompt)["input_ids"])
    d_ids = list(eng.drafter.tokenizer(prompt)["input_ids"])
    return eng.decoder.run("rounds", ids, d_ids, max_new_tokens=40, params=SamplingParams(), seed=0, draft=FIXED)


def test_pipeline_setting():
    assert pipeline_on("on", colocated=True) and not pipeline_on("off", colocated=False)
    assert pipeline_on("auto", colocated=False) and not pipeline_on("auto", colocated=True)
    with pytest.raises(ValueError, match="pipeline"):
        pipeline_on("yes", colocated=False)


def test_greedy_is_token_identical_pipelined_same_vocabulary(close):
    """Pipelined, serial and target-only give the same tokens; both pipelined paths ran."""
    pipelined = dropped = 0
    for prompt in PROMPTS:
        ref = close.generate(prompt, max_new_tokens=40, use_drafter=False)
        serial = _gen(close, prompt, False)
        piped = _gen(close, prompt, True)
        assert serial.token_ids == ref.token_ids
        assert piped.token_ids == ref.token_ids
        assert serial.stats.pipelined_blocks == serial.stats.dropped_blocks == 0
        pipelined += piped.stats.pipelined_blocks
        dropped += piped.stats.dropped_blocks
        # a block accepted whole takes no token of its own: fewer rounds than blocks' tokens + 1 each
        assert piped.stats.new_tokens == piped.stats.accepted + piped.stats.rounds - piped.stats.pipelined_blocks
        # each round says whether its block was drafted ahead, and what became of the one it drafted ahead
        events = list(_rounds(close, prompt))
        assert [e.ahead for e in events].count("used") == sum(e.drafted_ahead for e in events) > 0
        assert all(b.drafted_ahead == (a.ahead == "used") for a, b in zip(events, events[1:], strict=False))
    assert pipelined > 0 and dropped > 0


@pytest.mark.parametrize("mode", ["tli", "text"])
def test_greedy_is_token_identical_pipelined_across_vocabularies(cross, mode):
    ahead = 0
    for prompt in PROMPTS:
        ref = cross.generate(prompt, max_new_tokens=32, use_drafter=False)
        out = _gen(cross, prompt, True, max_new_tokens=32, draft=DraftConfig(num_draft_tokens=2, adaptive=False,
                                                                             mode=mode))
        assert out.token_ids == ref.token_ids
        assert out.stats.draft_mode == mode
        ahead += out.stats.pipelined_blocks + out.stats.dropped_blocks
    assert ahead > 0  # blocks were drafted ahead in this mode


def test_the_next_block_is_drafted_while_this_one_is_verified(close, monkeypatch):
    """Work ordering, not clocks: each Verify with a block drafted ahead of it waits until that
    drafter call has finished -- which only a drafter call running during the Verify can do."""
    made: dict[int, threading.Event] = {}  # round index -> set when the block drafted ahead for it is done

    class Recorded(P.Ahead):
        def __init__(self, call, proposals, position, round_index, cancel=None):
            done = made.setdefault(round_index, threading.Event())

            def run():
                try:
                    return call()
                finally:
                    done.set()
            super().__init__(run, proposals, position, round_index, cancel)

    monkeypatch.setattr(P, "Ahead", Recorded)
    verifier = close.decoder.verifier
    overlapped: list[bool] = []

    class Ordering(Counting):
        def verify(self, *a, **kw):
            ev = made.get(a[4] + 1)
            if ev is not None:  # this round drafted its successor: it must finish before this Verify does
                overlapped.append(ev.wait(timeout=60))
            return super().verify(*a, **kw)

    close.decoder.verifier = Ordering(verifier)
    out = _gen(close, PROMPTS[0], True)
    assert overlapped and all(overlapped)
    assert len(overlapped) == out.stats.pipelined_blocks + out.stats.dropped_blocks


def test_the_targets_prefill_runs_while_the_first_block_is_drafted(close):
    """A drafter on hardware of its own (not colocated): the verifier computes the prompt's keys and values
    (a sync with prefill) while the first block is drafted, not after it arrives -- work ordering, not
    clocks: the prefill waits until the first draft call has begun and that call until the prefill has,
    which only the two running at once allows. The text is the target-only text, pipelined or serial.
    Colocated (the models share the cores), the first Verify prefills as before."""
    drafting, prefilling = threading.Event(), threading.Event()
    prefills: list[bool] = []
    drafts: list[bool] = []

    class Verifier(Counting):
        def sync(self, sid, ids, *a, **kw):
            if kw.get("prefill") or (a and a[0]):
                prefilling.set()
                prefills.append(drafting.wait(timeout=30))
            return super().sync(sid, ids, *a, **kw)

    class Drafter(Counting):
        def draft(self, *a, **kw):
            if not drafting.is_set() and not close.decoder.colocated:
                drafting.set()
                drafts.append(prefilling.wait(timeout=30))
            return super().draft(*a, **kw)

    ref = close.generate(PROMPTS[1], max_new_tokens=40, use_drafter=False)
    close.decoder.verifier = Verifier(close.decoder.verifier)
    close.decoder.drafter = Drafter(close.decoder.drafter)
    for colocated, pipelined in ((False, False), (False, True), (True, False)):
        close.decoder.colocated = colocated
        for x in (drafting, prefilling, prefills, drafts):
            x.clear()
        out = _gen(close, PROMPTS[1], pipelined)
        assert out.token_ids == ref.token_ids
        assert prefills == drafts == ([] if colocated else [True])


def test_dropped_blocks_roll_back_without_a_resync(close, monkeypatch):
    """A block drafted ahead of a block that is not accepted whole is cut from the drafter's cache by
    the next edit: no re-sync of either server, no cache repair, the verifier drops its own token of
    each pipelined round through Verify alone."""
    close.decoder.check = True  # each call states the history it expects (as the gateway does)
    repairs: list[int] = []  # per session closed: forwards that found its cache out of step with its ids
    close_session = SS._ModelSession.close
    monkeypatch.setattr(SS._ModelSession, "close", lambda s: (repairs.append(s.cache_repairs), close_session(s)))
    d, v = Counting(close.drafter_worker), Counting(close.verifier)
    close.decoder.drafter, close.decoder.verifier = d, v
    out = _gen(close, PROMPTS[2], True, max_new_tokens=48)
    assert out.stats.dropped_blocks > 0 and out.stats.pipelined_blocks > 0
    assert d.syncs == 1 and v.syncs == 1
    verifies = [c for c in v.calls if "round_index" in c and "k" not in c]
    assert sum(1 for c in verifies if c.get("drop_last")) == out.stats.pipelined_blocks
    ahead = [c for c in d.calls if c["thread"].startswith("draft-ahead")]
    assert len(ahead) == out.stats.pipelined_blocks + out.stats.dropped_blocks
    assert repairs == [0, 0]  # the request's session on each server


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.0)], ids=["greedy", "rejection"])
def test_a_rejected_blocks_successor_stops_drafting(close, monkeypatch, params):
    """Work counting: the drafter call for the block after a rejected one is cancelled (it stops after
    the token in progress); the block after one accepted whole keeps its planned length. Each call
    drafting ahead is held after its first token until the round loop has the verification's outcome
    (and has cancelled it or not): a cancelled call then returns at most 2 tokens (1 if the cancel came
    before its first token was drafted), a kept one its whole block."""
    released: dict[int, threading.Event] = {}
    cancelled: dict[int, bool] = {}
    wait = P.Ahead.wait

    def wait_released(self):
        cancelled[self.round_index] = self.cancelled.requested
        released.setdefault(self.round_index, threading.Event()).set()
        return wait(self)

    monkeypatch.setattr(P.Ahead, "wait", wait_released)
    draft_iter = close.drafter_worker.draft_iter

    def held(sid, edit, expect, k, round_index, *a, **kw):
        for i, tok in enumerate(draft_iter(sid, edit, expect, k, round_index, *a, **kw)):
            yield tok
            if i == 0 and threading.current_thread().name.startswith("draft-ahead"):
                assert released.setdefault(round_index, threading.Event()).wait(60)

    monkeypatch.setattr(close.drafter_worker, "draft_iter", held)
    sizes: dict[int, tuple[int, int]] = {}  # round index -> (k asked, tokens returned) of each call drafting ahead
    inner = close.drafter_worker.draft

    def draft(*a, **kw):
        toks = inner(*a, **kw)
        if threading.current_thread().name.startswith("draft-ahead"):
            sizes[kw["round_index"]] = (kw["k"], len(toks))
        return toks

    monkeypatch.setattr(close.drafter_worker, "draft", draft)
    out = _gen(close, PROMPTS[0], True, max_new_tokens=48, params=params,
               draft=DraftConfig(num_draft_tokens=4, adaptive=False, stop_below=0.0))
    assert out.stats.dropped_blocks > 0 and out.stats.pipelined_blocks > 0
    assert set(sizes) == set(cancelled)
    assert sum(cancelled.values()) == out.stats.dropped_blocks
    for r, (k, n) in sizes.items():
        assert (n <= min(2, k)) if cancelled[r] else (n == k), (r, k, n, cancelled[r])
    assert any(cancelled[r] and k == 4 for r, (k, _) in sizes.items())  # blocks of 4 were cut short


def test_under_load_rounds_run_serially(close_pair, tmp_path, monkeypatch):
    """A verifier that reports 16 sessions sharing its forwards: once the round loop has seen it (its
    second round), no block is drafted ahead -- the other sessions' verifications fill the time this
    one drafts, and drafting ahead would only give up each block's own token."""
    import dataclasses

    # measured costs (the load is priced with them; the e2e tests' session turns them off process-wide)
    monkeypatch.setenv("CROSSDRAFT_COST_PROFILE", "measure")
    close = Engine(*close_pair, vocab_cache_dir=tmp_path, pipeline="on")

    class Loaded(Counting):
        def verify(self, *a, **kw):
            return dataclasses.replace(super().verify(*a, **kw), active_sessions=16, batch_size=16)

    close.decoder.verifier = Loaded(close.verifier)
    out = _gen(close, PROMPTS[0], True)
    assert out.stats.cost_model == "measured" and out.stats.rounds > 5
    assert out.stats.pipelined_blocks + out.stats.dropped_blocks <= 2  # rounds 0 and 1 started before it was seen


def test_drafted_blocks_verified_apart_from_the_load_are_learnt_and_carried(close_pair, tmp_path, monkeypatch):
    """A verifier that reports 4 sessions sharing its forwards but verifies each drafted block in a forward
    of its own (1 row): the round loop learns that drafted verifications share their forwards with a
    quarter of the load (CostModel.sharing, priced in everyone-drafting rounds), and the decoder carries
    it to the next request of the mode at that load."""
    import dataclasses

    monkeypatch.setenv("CROSSDRAFT_COST_PROFILE", "measure")
    eng = Engine(*close_pair, vocab_cache_dir=tmp_path)

    class Apart(Counting):
        def verify(self, *a, **kw):
            return dataclasses.replace(super().verify(*a, **kw), active_sessions=4, batch_size=1)

    eng.decoder.verifier = Apart(eng.verifier)
    out = _gen(eng, PROMPTS[0], False)
    assert out.stats.cost_model == "measured" and out.stats.drafted > 0
    busy = eng.decoder._scales.get(out.stats.draft_mode, 4.0)
    assert busy is not None and busy[4] < 0.4
    # carried per load band: a request alone afterwards records its own corrections beside them
    eng.decoder.verifier = Counting(eng.verifier)
    alone = _gen(eng, PROMPTS[0], False)
    assert alone.stats.draft_mode == out.stats.draft_mode
    assert eng.decoder._scales.get(out.stats.draft_mode, 4.0) is busy
    assert eng.decoder._scales.get(out.stats.draft_mode, 1.0) is not busy


def test_a_verifier_without_drop_last_is_resynced(close):
    """An older verifier ignores drop_last_token and finds the history one token longer than the
    caller states: FAILED_PRECONDITION, a re-sync, the same tokens."""
    close.decoder.check = True
    inner = close.verifier

    class Old(Counting):
        def verify(self, *a, **kw):
            kw.pop("drop_last", None)
            return super().verify(*a, **kw)

    old = Old(inner)
    close.decoder.verifier = old
    ref = close.generate(PROMPTS[1], max_new_tokens=40, use_drafter=False)
    out = _gen(close, PROMPTS[1], True)
    assert out.token_ids == ref.token_ids
    assert out.stats.pipelined_blocks > 0
    assert old.syncs == 2 + out.stats.pipelined_blocks  # the two requests' starts, one per dropped token


def test_drop_last_checks_the_history(close):
    w = close.verifier
    ids = list(close.target.tokenizer(PROMPTS[0])["input_ids"])
    w.sync("s", ids)
    r = w.verify("s", None, [], None, 0, SamplingParams(), 0)
    from crossdraft.decoding.messages import Expect

    with pytest.raises(FailedPrecondition, match="drop_last_token"):
        w.verify("s", Expect.of(ids[:-1]), [5], None, 1, SamplingParams(), 0, drop_last=True)
    assert w.sync("s", ids + [r.next_token])[1] == Expect.of(ids + [r.next_token])  # unchanged
    again = w.verify("s", Expect.of(ids), [r.next_token], None, 1, SamplingParams(), 0, drop_last=True)
    assert again.num_accepted == 1  # the dropped token is checked again at its position


def test_sampling_pipelined_is_exactly_lossless(close, monkeypatch):
    """Every recorded round (drafted serially or ahead) is exact (tests/exact.py): the verifier's p rows
    are target-only's for the history, each draft a sample of the distribution it shipped, each
    position's emission distributed as the target's."""
    cap = exact.Capture(monkeypatch)
    params = SamplingParams(temperature=1.0)
    piped = 0
    for seed in range(3):
        out = _gen(close, PROMPTS[0], True, max_new_tokens=16, params=params, seed=seed)
        piped += out.stats.pipelined_blocks
    assert piped > 0
    report = exact.check_rounds(cap, close.target.model, close.pair.d2t, close.drafter.model, limit=24)
    assert any(0 < a < 1 for a in report.accept_mass)


def test_coupled_draws_give_the_same_text_pipelined(close):
    params = SamplingParams(temperature=0.8, coupled=True)
    ref = close.generate(PROMPTS[0], max_new_tokens=40, params=params, seed=11, use_drafter=False)
    serial = _gen(close, PROMPTS[0], False, params=params, seed=11)
    piped = _gen(close, PROMPTS[0], True, params=params, seed=11)
    assert serial.token_ids == ref.token_ids == piped.token_ids
    assert piped.stats.pipelined_blocks > 0


def test_stop_strings_and_logprobs_pipelined(close):
    ref = close.generate(PROMPTS[0], max_new_tokens=40, use_drafter=False, top_logprobs=2)
    text = ref.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    piped = _gen(close, PROMPTS[0], True, top_logprobs=2)
    assert piped.token_ids == ref.token_ids
    assert [lp[0] for lp in piped.logprobs] == pytest.approx([lp[0] for lp in ref.logprobs], abs=1e-4)
    cut_ref = close.generate(PROMPTS[0], max_new_tokens=40, use_drafter=False, stop=[stop])
    cut = _gen(close, PROMPTS[0], True, stop=[stop])
    assert cut.text == cut_ref.text and cut.stats.finish_reason == "stop"


def test_pipelined_rounds_price_drafting_off_the_critical_path():
    """The cost model's rate for a pipelined round: a block accepted whole hides its successor's
    drafting behind its verification (so a likely-accepted block costs about its verification alone)
    and yields no token of its own (so a hopeless block gains nothing from pipelining)."""
    serial = CostModel(cost_ratio=0.5)
    piped = CostModel(cost_ratio=0.5)
    piped.pipelined = True
    assert piped.rate(4, 0.95) > serial.rate(4, 0.95)
    assert piped.rate(4, 0.05) <= serial.rate(4, 0.05) + 1e-9
    # other sessions share the verifier's forwards: their verifications fill this session's drafting
    # time, and the round is priced (and run) serially
    piped.measured = True
    for _ in range(20):
        piped.observe_batch(16)
    assert not piped.pipelines()
    assert piped.rate(4, 0.95) == pytest.approx(_serial_rate_at(piped, 4, 0.95))
    # a drafter slower than the whole verification: pipelined, a round at full acceptance would cost the
    # drafting and yield k tokens (2 for 2 drafter steps of 5 target steps); serially it yields k + 1 for
    # the drafting plus the verification, which is more -- such rounds run serially, and are priced so
    slow = CostModel(cost_ratio=5.0)
    slow.pipelined = True
    assert not slow.ahead_pays(2, 0.999) and piped.ahead_pays(4, 0.95) is False  # (piped: loaded, serial)
    assert slow.rate(2, 0.999) == pytest.approx(_serial_rate_at(slow, 2, 0.999))
    assert slow.rate(2, 0.999) > 2 * slow.vcost(1) / (2 * 5.0)


def test_pipelined_rounds_are_priced_at_the_verifications_speed_beside_the_drafter():
    """Measured costs, one session, pipelining on: the verifications run while the drafter drafts the next
    block beside them (on cores or memory the two share) take 1.6x their time alone. The rounds measure that
    (scale_o) apart from the verification's own scale, and a block worth pipelining at the first prices is
    then worth more serially: the rounds run serially (ahead_pays) -- not drafted ahead at a loss, as where
    the overlap was priced free. A dropped block's wait for its step in progress costs too; serial rounds
    that draft let what the pipelined ones measured relax, so a contention that passes is found out."""
    table = [1.0 + 0.3 * i for i in range(12)]  # a CPU in fp32: each verified token costs 0.3 of a step
    step_s = 0.05
    c = 0.5
    model = CostModel(cost_ratio=c, measured=True, verify_costs=table)
    model.pipelined = True
    k, a = 3, 0.95
    assert model.ahead_pays(k, a) and model.rate(k, a) > _serial_rate_at(model, k, a) > 1.0
    free = model.rate(k, a)
    for _ in range(30):  # overlapped verifications of k + 1 tokens at 1.6x their time alone
        model.observe_time(0, 0.0, k + 1, 1.6 * model.vcost(k + 1) * step_s, step_s, overlapped=True)
    assert model.scale_o == pytest.approx(1.6, rel=0.01) and model.scale_v == 1.0
    assert not model.ahead_pays(k, a)
    assert model.rate(k, a) == pytest.approx(_serial_rate_at(model, k, a)) and model.rate(k, a) < free
    # a little contention: still pipelined, priced lower, lower still with a dropped block's wait
    little = CostModel(cost_ratio=c, measured=True, verify_costs=table)
    little.pipelined = True
    little.scale_o = 1.1
    assert little.ahead_pays(k, a) and little.rate(k, a) < free
    before = little.rate(k, a)
    for _ in range(30):
        little.observe_time(0, 0.0, k + 1, 1.1 * little.vcost(k + 1) * step_s, step_s, overlapped=True,
                            drop_s=0.5 * step_s)
    assert little.drop_wait == pytest.approx(0.5, rel=0.01) and little.rate(k, a) < before
    # serial drafting rounds relax what the pipelined ones measured: pipelining is tried again
    for _ in range(200):
        model.observe_time(k, k * c * step_s, k + 1, model.vcost(k + 1) * step_s, step_s)
    assert model.scale_o == pytest.approx(1.0, abs=0.01) and model.ahead_pays(k, a)


def _serial_rate_at(model: CostModel, k: int, a: float) -> float:
    model.pipelined = False
    try:
        return model.rate(k, a)
    finally:
        model.pipelined = True


class Branching(Counting):
    """A drafter port that records each draft's session and thread, and each fork and end."""

    def __init__(self, inner):
        super().__init__(inner)
        self.forks: list[tuple[str, str]] = []
        self.ends: list[str] = []

    def draft(self, sid, *a, **kw):
        self.calls.append(dict(kw, sid=sid, thread=threading.current_thread().name))
        return self.inner.draft(sid, *a, **kw)

    def fork(self, src, dst):
        self.forks.append((src, dst))
        return self.inner.fork(src, dst)

    def end(self, sid):
        self.ends.append(sid)
        return self.inner.end(sid)


def test_a_branch_on_the_likeliest_correction_becomes_the_next_block_when_it_comes_true(close, monkeypatch):
    """--branch: beside each block ahead the drafter drafts, on a fork of its session, the block after the
    block's likeliest miss (the drafter's second choice where it most likely disagrees). Where the
    verification makes exactly that correction the branch is the next block: no Draft call in that round,
    the branch's session forked back into the request's. Greedy output stays the target's; the branch's
    session is dropped at the end. (BRANCH_MIN_HIT 0: the tiny models' flat distributions would rarely
    reach it; which branches come true depends only on the models, not on timing.)"""
    monkeypatch.setattr(P, "BRANCH_MIN_HIT", 0.0)
    close.decoder.check = True
    close.decoder.branch = True
    taken = 0
    for prompt in PROMPTS:
        ref = close.generate(prompt, max_new_tokens=40, use_drafter=False)
        d = Branching(close.drafter_worker)
        close.decoder.drafter = d
        events = list(_rounds(close, prompt))
        sid, bsid = "rounds", P.branch_sid("rounds")
        assert [t for e in events for t in e.emitted] == ref.token_ids[:len([t for e in events for t in e.emitted])]
        branched = [e for e in events if e.ahead == "branch"]
        taken += len(branched)
        # a branch comes true only where the block was not accepted whole; the next round verifies it at once
        assert all(e.accepted < e.drafted for e in branched)
        following = {e.round_index + 1 for e in branched}
        assert all(e.drafted_ahead for e in events if e.round_index in following)
        # every block was drafted by exactly one call: in its own round, ahead of it, or beside that (a
        # round's own call asked again after a re-sync -- the drafter refused the edit, FailedPrecondition,
        # when its session had moved under a block ahead being dropped; seen under CPU contention -- is
        # that round's one call: the same block, and the same tokens below)
        in_round = {c["round_index"] for c in d.calls if c["sid"] == sid and not c["thread"].startswith("draft-ahead")}
        used_ahead = sum(e.ahead == "used" for e in events)
        assert len(in_round) + used_ahead + len(branched) == sum(e.drafted > 0 for e in events)
        # each branch drafted on its own session, forked from the request's; each that came true forked back
        beside = [c for c in d.calls if c["sid"] == bsid]
        assert len(beside) == sum(1 for f in d.forks if f == (sid, bsid)) > 0
        assert all(c["runner_up"] for c in d.calls)
        assert [f for f in d.forks if f[1] == sid] == [(bsid, sid)] * len(branched)
        assert d.ends == [bsid] and close.drafter_worker.sessions.get(bsid) is None
        out = _gen(close, prompt, True)  # (and through generate: the whole output is the target's)
        assert out.token_ids == ref.token_ids and out.stats.branch_blocks <= out.stats.branches
    assert taken > 0


def test_no_branch_without_second_choices_sampling_or_text_mode(cross, close):
    """A branch needs the drafter's second choices (greedy) and one target id per drafter id (TLI)."""
    close.decoder.branch = cross.decoder.branch = True
    toks = [SS.DraftToken(5, None, None, 0.0)]
    assert P.likeliest_miss(toks) == (-1, 0.0)
    toks = [SS.DraftToken(5, None, None, 0.0, prob=0.9, alt=6, alt_prob=0.05),
            SS.DraftToken(7, None, None, 0.0, prob=0.5, alt=8, alt_prob=0.4)]
    j, chance = P.likeliest_miss(toks)
    assert j == 1 and chance == pytest.approx(0.9 * 0.4)
    for eng, kw in ((close, {"params": SamplingParams(temperature=0.8)}),
                    (cross, {"draft": DraftConfig(num_draft_tokens=2, adaptive=False, mode="text")})):
        out = _gen(eng, PROMPTS[0], True, max_new_tokens=24, **kw)
        assert out.stats.branches == 0 and out.stats.pipelined_blocks + out.stats.dropped_blocks > 0
