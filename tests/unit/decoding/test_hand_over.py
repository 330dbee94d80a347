"""A request handed over between drafter kinds mid-run (Decoder.hand_over; the gateway's pool of drafters).

Tiny random models in process: one verifier worker shared by two Decoders -- a drafter of another
vocabulary ("far": TLI, or text mode when greedy) and the target plus noise ("close": same vocabulary) --
and a chooser that moves the request between them at fixed rounds. The target decides every token, so
the text must be the target's alone: greedy token for token, and a seeded sampling run with coupled draws
(its tokens are a function of the seed and the position) exactly the target-only run's."""

from __future__ import annotations

import pytest

from crossdraft.decoding.decode import Decoder
from crossdraft.decoding.sampling import SamplingParams
from crossdraft.engine import DraftConfig, Engine
from tests import exact
from tests.tiny_models import noisy_copy, tiny_lm

PROMPTS = ["def add(a, b):\n    return", "The quick brown fox"]
FIXED = DraftConfig(num_draft_tokens=3, adaptive=False)


@pytest.fixture(scope="module")
def kinds(tok_t, tok_d, tmp_path_factory):
    """(far Decoder, close Decoder, target-only engine): both Decoders over the far engine's verifier."""
    target = tiny_lm(tok_t, seed=1, arch="qwen2", extra_vocab=7, head_scale=8.0, with_eos=False)
    far = Engine(target, tiny_lm(tok_d, seed=2), vocab_cache_dir=tmp_path_factory.mktemp("vocab"))
    close = Engine(target, noisy_copy(target, 0.25, seed=5), vocab_cache_dir=tmp_path_factory.mktemp("vocab"))
    d_far = Decoder(far.pair, far.verifier, far.drafter_worker, check_context=False, name="far")
    d_close = Decoder(close.pair, far.verifier, close.drafter_worker, check_context=False, name="close")
    d_far.models, d_close.models = (target, far.drafter), (target, close.drafter)  # (for the exact checks)
    return d_far, d_close, far


def _run(start: Decoder, sid: str, prompt: str, plan: dict, params: SamplingParams, seed: int = 0, n: int = 32):
    """Run through `start`, moving to plan[round] after that round; (result, the kind of each round)."""

    def chooser(req, ev):
        return plan.get(ev.round_index)

    t_ids = start.pair.encode_target(prompt)
    run = start.run(sid, t_ids, start.pair.encode_drafter(prompt), max_new_tokens=n, params=params, seed=seed,
                    draft=FIXED, chooser=chooser)
    events = list(run)
    start.verifier.end(sid)
    for dec in {start, *plan.values()}:
        dec.drafter.end(sid)
    return run.result, events


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_text_is_the_targets_across_hand_overs(kinds, prompt):
    d_far, d_close, far = kinds
    ref = far.generate(prompt, max_new_tokens=32, use_drafter=False)
    res, events = _run(d_far, "ho-greedy", prompt, {0: d_close, 3: d_far, 5: d_close}, SamplingParams())
    assert res.token_ids == ref.token_ids
    assert res.stats.drafter_switches == 3 and res.stats.drafter == "close"
    assert [ev.drafter for ev in events[:7]] == ["far", "close", "close", "close", "far", "far", "close"]
    # each kind drafted right after each move (its session synced from the re-encoded history; the far
    # one greedy in text mode), and the close drafter's proposals were accepted
    assert all(ev.drafted > 0 for ev in events[:7])
    assert sum(ev.accepted for ev in events if ev.drafter == "close") > 0


def test_coupled_sampling_is_the_targets_across_hand_overs(kinds):
    d_far, d_close, far = kinds
    params = SamplingParams(temperature=0.9, coupled=True)
    ref = far.generate(PROMPTS[0], max_new_tokens=32, params=params, seed=77, use_drafter=False)
    res, _ = _run(d_close, "ho-coupled", PROMPTS[0], {1: d_far, 4: d_close}, params, seed=77)
    assert res.token_ids == ref.token_ids
    assert res.stats.drafter_switches == 2


def test_a_hand_over_keeps_stop_strings_and_logprobs(kinds):
    """Output state (stop strings held back, log-probabilities) lives on the target side: a move between
    kinds does not touch it."""
    d_far, d_close, far = kinds
    ref = far.generate(PROMPTS[1], max_new_tokens=32, use_drafter=False, top_logprobs=2)
    cut = ref.text[len(ref.text) // 2:][:3]
    ref_stop = far.generate(PROMPTS[1], max_new_tokens=32, use_drafter=False, stop=[cut], top_logprobs=2)

    def chooser(req, ev):
        return {0: d_far, 2: d_close}.get(ev.round_index)

    t_ids = d_close.pair.encode_target(PROMPTS[1])
    run = d_close.run("ho-stop", t_ids, d_close.pair.encode_drafter(PROMPTS[1]), max_new_tokens=32,
                      params=SamplingParams(), seed=0, draft=FIXED, chooser=chooser, stop=[cut], top_logprobs=2)
    for _ in run:
        pass
    for dec in (d_close, d_far):
        dec.drafter.end("ho-stop")
    d_close.verifier.end("ho-stop")
    res = run.result
    assert res.text == ref_stop.text and res.stats.finish_reason == ref_stop.stats.finish_reason
    assert [lp[0] for lp in res.logprobs] == pytest.approx([lp[0] for lp in ref_stop.logprobs], abs=1e-5)


def test_sampling_rounds_are_exact_on_both_sides_of_a_hand_over(kinds, monkeypatch):
    """Rejection sampling (no coupled draws): every recorded round, whichever kind drafted it, is exact
    (tests/exact.py) -- the verifier's rows are target-only's for the history, each draft a sample of
    the distribution its own drafter shipped (checked against that kind's model and mapping), each
    position's emission distributed as the target's."""
    d_far, d_close, _ = kinds
    cap = exact.Capture(monkeypatch)
    _, events = _run(d_close, "ho-exact", PROMPTS[0], {1: d_far, 3: d_close}, SamplingParams(temperature=1.0),
                     seed=3, n=16)
    by_round = {ev.round_index: {"far": d_far, "close": d_close}[ev.drafter] for ev in events}
    rounds = cap.speculative()
    assert {by_round[vc.round_index].name for vc in rounds} == {"far", "close"}
    report = exact.Report()
    for vc in rounds:
        dec = by_round[vc.round_index]
        exact.check_target_rows(dec.models[0].model, vc)
        exact.check_drafts(cap, vc, dec.pair.d2t, dec.models[1].model)
        exact.check_exact(cap, vc, report)
    assert report.nodes > 0
