"""The drafter's catch-up off the critical path (crossdraft.decoding.pipeline.CatchUp): while drafting
does not pay, the drafter is fed nothing; in the round before a probe it is synced with everything it
missed while the verifier checks that round, so the probe's first forward feeds only the round's own
token.

Tiny random models in process: a target and a much smaller drafter that does not agree with it
(acceptance near 0), static costs (the rounds and probes do not depend on timing). Work is counted
and ordered, never timed.
"""

from __future__ import annotations

import threading

import pytest

from crossdraft.decoding import pipeline as P
from crossdraft.decoding.sampling import SamplingParams
from crossdraft.engine import DraftConfig, Engine
from tests.tiny_models import tiny_lm

PROMPT = "def add(a, b):\n    return"
STATIC = DraftConfig(cost_model="static")


@pytest.fixture(scope="module")
def hopeless(tok_t, tmp_path_factory):
    target = tiny_lm(tok_t, seed=1, hidden=64, arch="qwen2", with_eos=False)
    drafter = tiny_lm(tok_t, seed=9, hidden=16, layers=1, arch="qwen2")
    return Engine(target, drafter, vocab_cache_dir=tmp_path_factory.mktemp("vocab"), pipeline="on")


class Recording:
    """The drafter port, recording each Draft's edit (what it feeds before drafting) and each sync."""

    def __init__(self, inner):
        self.inner = inner
        self.events: list[tuple] = []

    def sync(self, sid, ids, prefill=False):
        self.events.append(("sync", len(ids), prefill))
        return self.inner.sync(sid, ids, prefill)

    def draft(self, sid, edit, *a, **kw):
        self.events.append(("draft", len(edit[1]) if edit else 0))
        return self.inner.draft(sid, edit, *a, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _probe_feeds(events) -> list[int]:
    """Tokens each Draft after the first fed the drafter."""
    return [e[1] for e in events if e[0] == "draft"][1:]


def test_a_probe_after_skipped_rounds_finds_the_drafter_caught_up(hopeless):
    dec = hopeless.decoder
    ref = hopeless.generate(PROMPT, max_new_tokens=80, use_drafter=False)
    inner = dec.drafter
    try:
        dec.drafter = serial_port = Recording(inner)
        dec.pipeline = False
        serial = hopeless.generate(PROMPT, max_new_tokens=80, draft=STATIC)
        dec.drafter = piped_port = Recording(inner)
        dec.pipeline = True
        piped = hopeless.generate(PROMPT, max_new_tokens=80, draft=STATIC)
    finally:
        dec.drafter, dec.pipeline = inner, False
    assert serial.token_ids == piped.token_ids == ref.token_ids
    # the drafter stopped paying, rounds were skipped, and probes came back
    assert piped.stats.skipped_rounds > 5
    # serial: each probe after a stretch of skipped rounds feeds the stretch itself, on its path
    assert serial.stats.caught_up == 0
    stretches = [n for n in _probe_feeds(serial_port.events) if n > 2]
    assert len(stretches) >= 2
    # pipelined: those probes were each preceded by a catch-up sync, and every Draft feeds one or two tokens
    catch_ups = [e for e in piped_port.events if e[0] == "sync" and e[2]]
    assert piped.stats.caught_up == len(catch_ups) == len(stretches)
    assert max(_probe_feeds(piped_port.events)) <= 2
    # and the probes (and the rounds) are the same: the catch-up moved work, it did not change choices
    assert piped.stats.rounds == serial.stats.rounds and piped.stats.drafted == serial.stats.drafted


def test_the_catch_up_runs_while_the_round_is_verified(hopeless, monkeypatch):
    """Work ordering, not clocks: each Verify of a round with a catch-up waits until the drafter's sync
    has finished -- which only a sync running during the Verify can do."""
    made: list[threading.Event] = []

    class Recorded(P.CatchUp):
        def __init__(self, drafter, sid, ids):
            done = threading.Event()
            made.append(done)

            class Signal:
                def sync(self, *a):
                    try:
                        return drafter.sync(*a)
                    finally:
                        done.set()
            super().__init__(Signal(), sid, ids)

    monkeypatch.setattr(P, "CatchUp", Recorded)
    dec = hopeless.decoder
    verifier = dec.verifier
    overlapped: list[bool] = []
    seen = [0]

    class Ordering:
        def verify(self, *a, **kw):
            if len(made) > seen[0]:  # this round started a catch-up: it must finish before this Verify does
                seen[0] = len(made)
                overlapped.append(made[-1].wait(timeout=60))
            return verifier.verify(*a, **kw)

        def __getattr__(self, name):
            return getattr(verifier, name)

    try:
        dec.verifier, dec.pipeline = Ordering(), True
        out = hopeless.generate(PROMPT, max_new_tokens=80, draft=STATIC)
    finally:
        dec.verifier, dec.pipeline = verifier, False
    assert overlapped and all(overlapped)
    assert len(overlapped) == out.stats.caught_up


def test_a_catch_up_that_outlasts_the_verification_is_not_counted_as_verifier_time(hopeless, tmp_path):
    """A drafter that catches up more slowly than the target verifies (a long history on a slow core): the
    round waits for it, and that wait is the drafter's -- not the verification's wall time, whose ratio to
    the cost table corrects the target's price (scale_v: counted there, a probe's catch-up would make the
    target look slow and drafting cheap), and not overhead. The catch-up here takes 0.5 s more than it
    would; the tiny target verifies in milliseconds."""
    import json
    import time

    from crossdraft.decoding.roundlog import RoundLog

    dec = hopeless.decoder
    inner = dec.drafter

    class Slow(Recording):
        def sync(self, sid, ids, prefill=False):
            if prefill:
                time.sleep(0.5)
            return super().sync(sid, ids, prefill)

    log = tmp_path / "rounds.jsonl"
    try:
        dec.drafter, dec.pipeline, dec.log = Slow(inner), True, RoundLog(str(log))
        events = list(dec.run("slow-catch-up", list(hopeless.target.tokenizer(PROMPT)["input_ids"]),
                              list(hopeless.drafter.tokenizer(PROMPT)["input_ids"]), max_new_tokens=80,
                              params=SamplingParams(), seed=0, draft=STATIC))
        dec.log.flush()
    finally:
        dec.drafter, dec.pipeline, dec.log = inner, False, RoundLog(None)
    recs = [json.loads(line) for line in log.read_text().splitlines() if '"round"' in line]
    assert len(recs) == len(events)
    slow = [i for i, ev in enumerate(events) if ev.wall_s > 0.45]
    assert slow, "no round waited for a catch-up"
    for i in slow:
        assert recs[i]["verify_s"] < 0.25 and events[i].overhead_s < 0.25, (recs[i], events[i])


def test_a_catch_up_runs_only_where_the_drafter_takes_the_history_in_within_a_target_step():
    """Measured costs: the drafter takes in a few missed tokens within a target step (the catch-up hides in
    the verification), but a long history on a drafter whose feed costs half a step and more per 10 tokens
    would be waited for; there the catch-up is left to the probe, which prices that feed. Static costs
    cannot tell, and catch up."""
    from crossdraft.decoding.costmodel import CostModel

    table = [1.0 + 0.1 * i for i in range(8)]  # the drafter's forward of n tokens, in its own steps
    m = CostModel(cost_ratio=0.5, measured=True, verify_costs=[1.0 + 0.1 * i for i in range(8)], drafter_costs=table)
    assert m.feed_fits(1) and m.feed_fits(8)
    assert not m.feed_fits(40) and not m.feed_fits(200)
    m.scale_v = 3.0  # (a slower target than its table says: more time to hide the feed in)
    assert m.feed_fits(40)
    assert CostModel(cost_ratio=0.5, drafter_costs=table).feed_fits(200)
