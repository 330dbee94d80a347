"""The draft-length policy: it drafts where drafting pays and stops (probing rarely) where it cannot.

Pure policy arithmetic, no models: acceptance outcomes are fed in as a drafter that never / always
matches would produce them.
"""

from __future__ import annotations

import itertools
import math

import pytest

from crossdraft.decoding.acceptance import expected_tokens
from crossdraft.decoding.policy import DraftConfig, DraftPolicy
from crossdraft.errors import InvalidArgument

# a CPU-like table: 1..3 tokens cost one step, 5 tokens twice that (measured shape, fp32 BLAS)
CPU_TABLE = [324, 334, 334, 500, 644, 700, 760, 820, 893, 910, 930]
FLAT_TABLE = [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110]  # GPU-like: memory-bound


def _run(policy: DraftPolicy, rounds: int, accept) -> list[int]:
    ks = []
    k = policy.cfg.num_draft_tokens
    for _ in range(rounds):
        ks.append(k)
        n = accept(k)
        policy.observe(k, n)
        k = policy.next_k()
    return ks


def test_zero_acceptance_stops_within_a_few_rounds_and_probes_rarely():
    p = DraftPolicy(DraftConfig(), 0.14, verify_costs=CPU_TABLE, measured=True)
    ks = _run(p, 200, lambda k: 0)
    first_skip = ks.index(0)
    assert first_skip <= 4
    drafted = sum(ks)
    assert drafted <= sum(ks[:first_skip]) + 20  # probes of 2 tokens, backing off to every 48 rounds
    probes = [i for i, k in enumerate(ks) if i > first_skip and k]
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert gaps == sorted(gaps) and gaps[-1] == DraftPolicy.max_probe_every


def test_high_acceptance_drafts_and_the_table_shapes_k():
    cheap = DraftPolicy(DraftConfig(), 0.14, verify_costs=FLAT_TABLE, measured=True)
    costly = DraftPolicy(DraftConfig(), 0.14, verify_costs=CPU_TABLE, measured=True)
    ks_cheap = _run(cheap, 40, lambda k: (k * 7) // 10)
    ks_costly = _run(costly, 40, lambda k: (k * 7) // 10)
    assert min(ks_cheap[5:]) > max(ks_costly[5:])  # flat verification cost: longer blocks
    assert 0 < min(ks_costly[5:]) and max(ks_costly[5:]) <= 3  # past 3 tokens the target's forward doubles


def test_a_drafter_nearly_as_costly_as_the_target_does_not_draft_at_moderate_acceptance():
    p = DraftPolicy(DraftConfig(), 0.9, verify_costs=CPU_TABLE, measured=True)
    ks = _run(p, 30, lambda k: (k + 1) // 2)
    assert sum(1 for k in ks[3:] if k) <= 3


def test_recovers_after_the_text_turns_draftable():
    p = DraftPolicy(DraftConfig(), 0.14, verify_costs=CPU_TABLE, measured=True)
    _run(p, 30, lambda k: 0)
    ks = _run(p, 80, lambda k: k)
    assert all(k > 0 for k in ks[-20:])


def test_online_correction_sees_a_slow_drafter():
    """Measured costs said the drafter is cheap; the rounds' wall-clock times say it is not."""
    p = DraftPolicy(DraftConfig(), 0.14, verify_costs=CPU_TABLE, measured=True)
    step_s = CPU_TABLE[0] / 1000
    ks = []
    k = 4
    for _ in range(40):
        ks.append(k)
        n = (k * 6) // 10
        p.observe(k, n)
        if k:
            p.observe_time(k, k * 0.9 * step_s, k + 1, CPU_TABLE[k] / 1000, step_s)  # drafter steps cost 0.9 steps
        else:
            p.observe_time(0, 0.0, 1, CPU_TABLE[0] / 1000, step_s)
        k = p.next_k()
    assert p.costs.scale_d > 4
    assert sum(1 for k in ks[10:] if k) <= 3


def test_static_costs_ignore_wall_clock():
    p = DraftPolicy(DraftConfig(), 0.2)
    before = p.rate(3)
    p.observe_time(3, 10.0, 4, 10.0, 0.1)
    assert p.rate(3) == before and not p.costs.measured


def test_bad_cost_model_is_refused():
    with pytest.raises(InvalidArgument) as e:
        DraftConfig(cost_model="fast")
    assert e.value.field == "cost_model"


# measured on this 2-vCPU machine (fp32): gemma3-270m's forwards of 1..17 tokens, smollm2-135m's
GEMMA_CPU = [121, 121, 121, 149, 156, 164, 187, 210, 230, 251, 271, 291, 311, 332, 352, 372, 393]
SMOL_CPU = [65 + 10 * i for i in range(17)]
GPU_V = [30.0 + 0.02 * i for i in range(17)]  # memory-bound: 17 tokens cost about one
GPU_D = [5.0 + 0.01 * i for i in range(17)]


def _run_batched(policy: DraftPolicy, rounds: int, rows: int) -> list[int]:
    ks = []
    k = policy.cfg.num_draft_tokens
    for i in range(rounds):
        ks.append(k)
        policy.observe(k, k if i % 4 else max(0, k - 1))  # high acceptance: every 4th block loses its last draft
        policy.observe_batch(rows)
        k = policy.next_k()
    return ks


def test_batched_sessions_on_a_cpu_stop_drafting_where_one_session_alone_drafts():
    """Forwards that cost in proportion to their tokens: with 16 sessions per batch the verifier
    would rather score 16 single tokens than 16 blocks, so the policy drafts (nearly) nothing;
    alone, the same session drafts."""
    alone = DraftPolicy(DraftConfig(), 0.3, verify_costs=GEMMA_CPU, drafter_costs=SMOL_CPU, measured=True)
    busy = DraftPolicy(DraftConfig(), 0.3, verify_costs=GEMMA_CPU, drafter_costs=SMOL_CPU, measured=True)
    ks_alone = _run_batched(alone, 40, 1)
    ks_busy = _run_batched(busy, 40, 16)
    assert all(k > 0 for k in ks_alone[3:])
    assert sum(1 for k in ks_busy[5:] if k) <= 3  # rare probes only
    assert busy.costs.batch > 12 and alone.costs.batch == 1.0
    # load goes away: the batches shrink back to one row and drafting resumes
    ks_after = _run_batched(busy, 60, 1)
    assert all(k > 0 for k in ks_after[-10:])


def test_a_requests_value_is_priced_alone_whatever_the_load_and_is_one_where_nothing_pays():
    """value() -- what a gateway learns a drafter is worth to a class of prompts -- prices the session
    alone: the same session under a load that rules drafting out (16 rows of a CPU's fp32 forwards) is
    worth what it is alone, and its state is left as it was; at an acceptance where no block pays, 1.0."""
    alone = DraftPolicy(DraftConfig(), 0.3, verify_costs=GEMMA_CPU, drafter_costs=SMOL_CPU, measured=True)
    busy = DraftPolicy(DraftConfig(), 0.3, verify_costs=GEMMA_CPU, drafter_costs=SMOL_CPU, measured=True)
    _run_batched(alone, 40, 1)
    ks = _run_batched(busy, 40, 16)
    assert not busy.pays() and not any(ks[-10:])  # (the load rules drafting out)
    load = busy.costs.batch
    assert busy.value() == pytest.approx(alone.value(busy.acceptance.alpha())) and busy.value() > busy.costs.need()
    assert busy.costs.batch == load and not busy.pays()
    assert alone.value(0.02) == busy.value(0.02) == 1.0
    assert alone.value(0.9) > alone.value(0.6) > 1.0
    # a drafter measured 3x slower than its table (other work on its machine) is worth nothing now, and at
    # its usual speed what it was
    alone.costs.scale_d = 3.0
    assert alone.value(0.6) == 1.0 and alone.value(0.6, usual_speed=True) > 1.0 and alone.costs.scale_d == 3.0


def test_batched_sessions_on_a_gpu_keep_drafting():
    """Forwards flat in their tokens (memory-bound): batching does not change the answer."""
    p = DraftPolicy(DraftConfig(), 0.15, verify_costs=GPU_V, drafter_costs=GPU_D, measured=True)
    ks = _run_batched(p, 40, 16)
    assert all(k >= 3 for k in ks[3:])


def test_static_costs_ignore_the_batch():
    """Static costs are a function of the tokens only (seeded sampling stays reproducible)."""
    a = DraftPolicy(DraftConfig(), 0.3, verify_costs=None, measured=False)
    b = DraftPolicy(DraftConfig(), 0.3, verify_costs=None, measured=False)
    assert _run_batched(a, 30, 1) == _run_batched(b, 30, 32)
    assert b.costs.batch == 1.0


def test_pays_tells_whether_a_new_request_should_start_drafting():
    """A new request starts from the load the last round saw: at 16 sessions on a CPU it starts
    target-only (k = 0) instead of drafting its first blocks for an idle server."""
    p = DraftPolicy(DraftConfig(), 0.3, verify_costs=GEMMA_CPU, drafter_costs=SMOL_CPU, measured=True)
    assert p.pays()
    p.expect_load(16.0)
    assert not p.pays()
    assert p.skipped == 0 and not p.probing  # no state changed
    fixed = DraftPolicy(DraftConfig(adaptive=False), 0.3, verify_costs=GEMMA_CPU, drafter_costs=SMOL_CPU,
                        measured=True)
    fixed.expect_load(16.0)
    assert fixed.pays()  # a fixed block size is the caller's choice


def test_confident_mode_runs_blocks_to_the_bound_and_lets_the_drafter_end_them():
    cfg = DraftConfig(max_draft_tokens=12)
    pol = DraftPolicy(cfg, 0.2, verify_costs=FLAT_TABLE, measured=True)
    pol.confident = True
    rounds = 6
    # (the first block is _run's: the request's configured size)
    assert _run(pol, rounds, lambda k: k)[1:] == [cfg.max_draft_tokens] * (rounds - 1)
    # nothing accepted: drafting stops before a probe would have re-measured the text, and then only
    # probes draft, each a full (confident) block, no more often than the fastest probe pace
    pol = DraftPolicy(cfg, 0.2, verify_costs=FLAT_TABLE, measured=True)
    pol.confident = True
    rounds = 40
    ks = _run(pol, rounds, lambda k: 0)
    first_skip = ks.index(0)
    probes = [k for k in ks[first_skip:] if k]
    assert first_skip < DraftPolicy.probe_every, ks
    assert all(k == cfg.max_draft_tokens for k in ks[1:first_skip] + probes), ks
    assert len(probes) <= (rounds - first_skip) // DraftPolicy.probe_every, ks


def test_the_cumulative_threshold_follows_the_drafters_cost():
    """A costlier drafter must be surer of a block to draft on: the threshold grows with the cost
    (strictly, until its cap) and stays a probability below 1, so a drafter sure of its tokens
    keeps drafting however dear its steps; past some cost it grows no more."""
    costs = (0.01, 0.05, 0.2, 0.45, 0.9, 2.0, 5.0)
    taus = [DraftPolicy(DraftConfig(), c, verify_costs=FLAT_TABLE, measured=True).cumulative_stop() for c in costs]
    assert all(0.0 < t < 1.0 for t in taus), taus
    assert all(b >= a for a, b in itertools.pairwise(taus)), taus
    below_cap = [t for t in taus if t < max(taus)]
    assert len(below_cap) >= 3 and all(b > a for a, b in itertools.pairwise(below_cap)), taus
    assert taus[-2] == taus[-1], taus  # capped
    pol = DraftPolicy(DraftConfig(), 0.45, verify_costs=FLAT_TABLE, measured=True)
    slow = pol.cumulative_stop()
    pol.observe_time(4, 4 * 0.45 * 2.0 * 0.1, 5, 0.1, 0.1)  # the drafter ran twice as slow as its table
    assert pol.cumulative_stop() > slow
    assert DraftPolicy(DraftConfig(stop_cumulative=0.25), 0.45).cumulative_stop() == 0.25


@pytest.mark.parametrize("bad", [1.0, -0.5])
def test_bad_cumulative_threshold_is_refused(bad):
    with pytest.raises(InvalidArgument, match="stop_cumulative"):
        DraftConfig(stop_cumulative=bad)


def test_could_pay_rules_out_a_drafter_as_costly_as_its_target():
    assert DraftPolicy(DraftConfig(), 0.45, verify_costs=FLAT_TABLE, measured=True).could_pay()
    pol = DraftPolicy(DraftConfig(), 1.0, verify_costs=FLAT_TABLE, measured=True)
    before = pol.acceptance.alpha()
    assert not pol.could_pay() and pol.acceptance.alpha() == before
    # its probes slow down to the slowest pace even when they are wholly accepted
    ks = _run(pol, 200, lambda k: k)
    probes = [i for i, k in enumerate(ks) if k > 0]
    assert len(probes) <= 8 and all(b - a >= 24 for a, b in itertools.pairwise(probes[3:])), probes


def test_text_drafting_prices_the_drafter_steps_each_target_token_costs():
    """Text mode: the drafter's text is re-encoded into target tokens, and a drafter spelling a
    Chinese character in 2-3 byte tokens pays 2-3 steps per drafted target token. The policy learns
    that ratio and prices drafting (and the confidence a block needs) with it."""
    pol = DraftPolicy(DraftConfig(), 0.3, verify_costs=FLAT_TABLE, measured=True)
    assert pol.costs.steps_per_token() == 1.0
    rate, tau = pol.rate(3), pol.cumulative_stop()
    for _ in range(6):
        pol.observe_steps(9, 3)  # 3 steps per target token
    assert 2.5 < pol.costs.steps_per_token() <= 3.0
    assert pol.rate(3) < rate and pol.cumulative_stop() > tau
    assert not pol.could_pay()  # 0.9 steps of the target per drafted token: nothing could pay
    learnt = pol.costs.steps_per_token()
    pol.observe_steps(0, 0)  # no block: nothing learnt
    assert pol.costs.steps_per_token() == learnt
    # bounded both ways: a drafter whose tokens are much longer than the target's is never priced as
    # (nearly) free, nor one whose tokens are much shorter as endless; each bound holds however long
    # the evidence goes on
    for steps, tokens in ((1, 100), (100, 1)):
        for _ in range(40):
            pol.observe_steps(steps, tokens)
        bound = pol.costs.steps_per_token()
        for _ in range(40):
            pol.observe_steps(steps, tokens)
        assert pol.costs.steps_per_token() == bound
        assert (bound > 10 * steps / tokens) if steps < tokens else (bound < steps / tokens / 10)
        assert pol.rate(3) > 0 and 0 < pol.cumulative_stop() < 1


def test_a_costlier_verification_of_longer_blocks_asks_for_surer_blocks():
    """The cumulative threshold counts the verification's extra cost per drafted token: flat on a
    GPU or with native bf16, steep on a CPU computing in fp32."""
    flat = DraftPolicy(DraftConfig(), 0.2, verify_costs=FLAT_TABLE, measured=True).cumulative_stop()
    steep = DraftPolicy(DraftConfig(), 0.2, verify_costs=CPU_TABLE, measured=True).cumulative_stop()
    assert steep > flat + 0.1


def test_a_drafter_that_could_not_pay_probes_at_the_slowest_pace_at_once():
    pol = DraftPolicy(DraftConfig(), 0.3, verify_costs=FLAT_TABLE, measured=True)
    for _ in range(6):
        pol.observe_steps(8, 2)  # 4 drafter steps per target token: 1.2 target steps each
    assert not pol.could_pay()
    ks = _run(pol, 120, lambda k: 0)
    probes = [i for i, k in enumerate(ks) if k > 0]
    # the first block, then the longest interval at once (no acceptance could win a probe back)
    assert pol.saving() == 0 and pol.probe_pace() == DraftPolicy.max_probe_every
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert probes[0] == 0 and gaps and all(g == DraftPolicy.max_probe_every for g in gaps), probes


def test_a_wholly_accepted_probe_that_still_does_not_pay_keeps_the_pace():
    """A probe accepted in full leaves the probe interval where it was (not back to the fastest
    pace) while the acceptance estimate still says drafting does not pay."""
    pol = DraftPolicy(DraftConfig(), 0.7, verify_costs=FLAT_TABLE, measured=True)
    assert pol.could_pay()
    pol.interval = pol.wait = 32  # (above this pair's shortest pace, 27 rounds)
    pol.probing = True
    pol.acceptance.restart()  # as a probe starts
    pol.observe(2, 2)
    assert not pol.pays()
    assert pol.probe_pace() < 32 and pol.next_k() == 0 and pol.interval == 32


def test_under_load_where_no_acceptance_could_pay_nothing_is_probed():
    """16 sessions share a CPU's fp32 forwards: even blocks accepted in full could not pay, so the
    session never probes (a probe would feed the drafter everything it missed, for nothing) --
    until the load falls, when the usual probe pace starts over."""
    p = DraftPolicy(DraftConfig(), 0.3, verify_costs=GEMMA_CPU, drafter_costs=SMOL_CPU, measured=True)
    p.expect_load(16.0)
    assert p.loaded_out()
    ks = _run_batched(p, 200, 16)
    assert sum(1 for k in ks[1:] if k) == 0
    ks = _run_batched(p, 40, 1)  # alone again: the batch average decays, probes and drafting resume
    assert not p.loaded_out() and any(ks)
    alone = DraftPolicy(DraftConfig(), 3.0, verify_costs=GEMMA_CPU, drafter_costs=SMOL_CPU, measured=True)
    assert not alone.could_pay() and not alone.loaded_out()  # alone, a costly drafter still gets rare probes


def test_a_cost_table_timed_on_a_busy_machine_is_corrected_by_a_few_probes():
    """The table says a drafter step costs 14 target steps (timed while another process computed
    on the same cores); the drafter's own step times in two probe blocks bring that to the truth."""
    step_s = CPU_TABLE[0] / 1000
    p = DraftPolicy(DraftConfig(), 14.0, verify_costs=FLAT_TABLE, measured=True)
    assert not p.could_pay()
    for _ in range(2):  # two probes of 7 timed steps, each step 0.3 of a target step
        p.observe_time(7, 7 * 0.3 * step_s, 9, FLAT_TABLE[8] / 1000 * step_s / (FLAT_TABLE[0] / 1000), step_s)
    assert 0.3 < 14.0 * p.costs.scale_d < 0.6
    assert p.could_pay()


def _run_left(policy: DraftPolicy, total: int, accept) -> list[int]:
    """Like _run, for a request of `total` tokens: next_k learns how many are left (one per round)."""
    ks = []
    k = policy.cfg.num_draft_tokens
    for i in range(total):
        ks.append(k)
        policy.observe(k, accept(k))
        k = policy.next_k(total - i - 1)
    return ks


def test_a_pair_near_its_break_even_probes_only_where_a_probe_could_pay_back():
    """A drafter step costing 0.72 of a target step (smollm2-135m for gemma3-270m in bf16): drafting
    saves ~9% of the time at 90% acceptance, a probe (two drafted tokens) costs ~1.5 target steps.
    A probe is sent only where the tokens left could save that times the odds against a probe's
    finding text that pays (2 to 1 before any probe is seen), and no sooner than
    that many rounds after the last one."""
    c = 0.72
    near = DraftPolicy(DraftConfig(), c, verify_costs=FLAT_TABLE, measured=True)

    def v(m):  # the target's forward over m tokens, in decoding steps (the table relative to one token)
        return FLAT_TABLE[m - 1] / FLAT_TABLE[0]

    def tokens(k, a=0.9):  # E(k): what a block of k yields at acceptance a
        return (1 - a ** (k + 1)) / (1 - a)

    # the saving at 90% acceptance lies between what a one-token block saves (E(1) tokens for v(2)
    # plus one drafter step) and what the best block would save if verifying it cost no more than
    # one decoding step: the pair pays, but little
    assert near.could_pay()
    floor = 1 - (v(2) + c) / tokens(1)
    ceiling = 1 - 1 / max(tokens(k) / (1 + k * c) for k in range(1, near.hi + 1))
    assert 0 < floor <= near.saving() <= ceiling
    # a failed probe (one token fed, probe_len() drafted) costs its drafter steps and its
    # verification beyond one decoding step, nothing more nor less
    n = int(near.probe_len())
    assert math.isclose(near.probe_cost(), c * n + v(n + 1) - 1)
    need = near.probe_odds() * near.probe_cost() / near.saving()
    assert near.worth_probing(int(need) + 1) and not near.worth_probing(int(need) - 1)
    assert near.probe_pace() == math.ceil(need) > DraftPolicy.probe_every
    ks = _run_left(near, 200, lambda k: 0)
    probes = [i for i, k in enumerate(ks) if k > 0]
    assert probes[0] == 0 and all(b - a >= need for a, b in itertools.pairwise(probes))
    assert probes[-1] <= 200 - need, probes  # none where the rest could not pay it back
    # the same pair without the request's length probes right to the end
    free = _run(DraftPolicy(DraftConfig(), 0.72, verify_costs=FLAT_TABLE, measured=True), 200, lambda k: 0)
    assert max(i for i, k in enumerate(free) if k > 0) > 200 - need


def test_a_pair_that_pays_well_keeps_its_probe_pace_until_the_last_tokens():
    def cheap():
        return DraftPolicy(DraftConfig(), 0.14, verify_costs=FLAT_TABLE, drafter_costs=FLAT_TABLE, measured=True)

    p = cheap()
    assert p.saving() > 0.5 and p.probe_pace() == DraftPolicy.probe_every
    assert p.worth_probing(3) and not p.worth_probing(0)
    ks = _run_left(p, 60, lambda k: 0)
    assert ks == _run(cheap(), 60, lambda k: 0)


def test_the_tokens_a_probe_must_feed_the_drafter_first_count_in_its_cost():
    """A probe's first drafter forward feeds what the drafter missed (the prompt, for a request's
    first block): on a CPU in fp32 that forward grows with its tokens, so a long prompt makes the
    first block costlier -- a request needs more tokens ahead to be worth it."""
    p = DraftPolicy(DraftConfig(), 0.3, verify_costs=FLAT_TABLE, drafter_costs=CPU_TABLE, measured=True)
    assert p.probe_cost(300) > 5 * p.probe_cost(1)
    n1 = next(n for n in range(1, 10_000) if p.worth_probing(n, 1))
    n300 = next(n for n in range(1, 10_000) if p.worth_probing(n, 300))
    assert n300 > 5 * n1


# measured on an AMD EPYC (2 vCPU, fp32): qwen2.5-coder-0.5b verifying 1..11 tokens, smollm2-135m steps
FP32_TARGET = [175.8, 363.5, 498.4, 498.4, 498.4, 498.4, 498.4, 498.4, 498.4, 498.4, 512.2]
FP32_DRAFTER = [58.6, 110.3, 137.6, 137.6, 137.6, 137.6, 137.6, 137.6, 137.6, 137.6, 144.8]


def test_a_confident_probe_is_priced_by_the_block_it_drafts():
    """In confident mode (greedy) a probe's block runs until the drafter doubts -- often 2-4 tokens
    -- and on a CPU in fp32 verifying 3-5 tokens costs ~2.8 decoding steps. A probe is priced by
    the mean block of the recent probes (prior 3 tokens) -- what a probe that fails costs -- not
    one drafted token (~1.4 steps here): for this pair (saving ~10% at best) a 64-token completion
    sends no probe after its first block. Probes the drafter ends after one token cost less, and
    the price follows."""
    def fp32():
        p = DraftPolicy(DraftConfig(), FP32_DRAFTER[0] / FP32_TARGET[0], verify_costs=FP32_TARGET,
                        drafter_costs=FP32_DRAFTER, measured=True)
        p.confident = True
        return p

    p = fp32()
    # before any probe: a prior block of more than one token, within the bound; its price holds the
    # verification of that block beyond a target step and the drafter's steps on top
    assert 1.0 < p.probe_len() <= p.hi
    c = FP32_DRAFTER[0] / FP32_TARGET[0]
    n = p.probe_len()
    assert p.probe_cost() >= p.costs.vcost(n + 1) - 1.0 + c * n - 1e-9
    # ... so more than a probe priced as one drafted token (one drafter step and the verification
    # of two tokens beyond one step)
    assert p.probe_cost() > c + p.costs.vcost(2) - 1.0
    # drafting pays at 90% acceptance, but the verification growing with the block leaves less to
    # save than the same drafter has against a flat (GPU-like) target table
    flat = DraftPolicy(DraftConfig(), c, verify_costs=FLAT_TABLE, drafter_costs=FP32_DRAFTER, measured=True)
    assert p.could_pay() and 0 < p.saving() < flat.saving()
    assert not p.worth_probing(50) and p.probe_pace() == DraftPolicy.max_probe_every
    ks = _run_left(p, 64, lambda k: 0)
    assert ks[0] > 0 and not any(ks[1:]), ks  # (a first block here stands for the request's: not sent, see decode)
    # probes the drafter ends after one token: the price falls toward one token's block
    q = fp32()
    q.first = False
    lens = [q.probe_len()]
    for _ in range(6):
        q.probing = True
        q.observe(1, 0)
        lens.append(q.probe_len())
    assert all(1.0 <= b < a for a, b in itertools.pairwise(lens)), lens
    assert q.probe_cost() < p.probe_cost()
    # a failed first block of ten tokens raises the price; blocks after the first that are not
    # probes do not move it (drafting that pays runs long blocks), nor does a probe accepted in full
    # (it lost nothing)
    first = fp32()
    first.observe(10, 4)
    r = fp32()
    r.observe(10, 4)
    r.probing = False
    r.observe(10, 3)
    r.probing = True
    r.observe(10, 10)
    assert p.probe_len() < first.probe_len() < 10 and p.probe_cost() < first.probe_cost()
    assert (r.probe_len(), r.probe_cost()) == (first.probe_len(), first.probe_cost())
    # a GPU-like target (flat in the block) with a cheap drafter: probes stay cheap
    g = DraftPolicy(DraftConfig(), 0.14, verify_costs=FLAT_TABLE, measured=True)
    g.confident = True
    assert g.probe_cost() < 0.5 and g.probe_pace() == DraftPolicy.probe_every


def test_static_costs_probe_as_before_whatever_is_left():
    """Static costs (seeded sampling) keep their probe schedule: reproducible, and unchanged."""
    a = _run_left(DraftPolicy(DraftConfig(), 0.72), 120, lambda k: 0)
    b = _run(DraftPolicy(DraftConfig(), 0.72), 120, lambda k: 0)
    assert a == b and DraftPolicy(DraftConfig(), 0.72).probe_pace() == DraftPolicy.probe_every


def test_a_later_probe_prices_only_what_the_drafter_missed_since_the_last_one():
    """After a probe the drafter holds the text up to it: the next probe's first forward feeds the
    rounds since then, not every round since drafting last paid. With a CPU-like drafter table
    (that forward grows with its tokens) a long request at zero acceptance keeps probing at its
    pace until the rest could not pay a probe back."""
    p = DraftPolicy(DraftConfig(), 0.5, verify_costs=FLAT_TABLE, drafter_costs=CPU_TABLE, measured=True)
    p.probe_odds = lambda: 3.0  # (held: this test is about the catch-up's price, not the probes' record)
    ks = _run_left(p, 400, lambda k: 0)
    probes = [i for i, k in enumerate(ks) if k > 0]
    assert all(b - a <= DraftPolicy.max_probe_every for a, b in itertools.pairwise(probes)), probes
    last_worth = max(i for i in range(400) if p.worth_probing(400 - i - 1, DraftPolicy.max_probe_every))
    assert probes[-1] > last_worth - DraftPolicy.max_probe_every, (probes, last_worth)
    # (pricing every skipped round, the probes stopped ~100 rounds before: 248 of 400)
    assert probes[-1] > 300


# measured on an AMD EPYC (2 vCPU, bf16) out to 64 tokens: a flat start (1..11 tokens cost about
# one) and then the forward grows with its tokens; the 17-token tables before stopped in the flat part
BF16_DRAFTER = [28.9, 29.0, 29.0, 29.0, 31.0, 33.0, 34.0, 34.6, 36.0, 37.0, 38.0] + [38.0] * 5 + [
    38.0 + (42.7 - 38.0) * (i - 16) / 16 for i in range(17, 33)] + [
    42.7 + (60.3 - 42.7) * (i - 32) / 32 for i in range(33, 65)]
BF16_DRAFTER_128 = 95.2  # the same drafter's forward over 128 tokens, measured (beyond the table)


def test_a_catch_up_is_priced_by_the_drafter_tokens_the_decoder_says_it_feeds():
    """The decoder knows what the drafter's next forward feeds (in text mode a skipped round of a
    Chinese text is 2-3 SmolLM2 tokens); given it, next_k prices a probe's catch-up with it rather
    than one token per skipped round -- and a table that reaches 64 tokens prices a 150-token
    catch-up at ~3.7 steps (128 tokens measured 3.3), where the old 17-token table (flat at its end) said ~1.2x."""
    def near():
        p = DraftPolicy(DraftConfig(), 0.67, verify_costs=FLAT_TABLE, drafter_costs=BF16_DRAFTER, measured=True)
        p.probe_odds = lambda: 2.0
        return p

    p = near()
    # within the table a forward costs what was measured, relative to one token's
    assert math.isclose(p.costs.dcost(17), BF16_DRAFTER[16] / BF16_DRAFTER[0])
    # past its end (64 tokens) the price keeps growing: a 150-token forward costs at least the
    # measured 128-token one, and at most that in proportion to its tokens (a forward's fixed part
    # makes its cost grow no faster than its tokens)
    measured_128 = BF16_DRAFTER_128 / BF16_DRAFTER[0]
    assert measured_128 <= p.costs.dcost(150) <= measured_128 * 150 / 128
    old = DraftPolicy(DraftConfig(), 0.67, verify_costs=FLAT_TABLE, drafter_costs=BF16_DRAFTER[:16], measured=True)
    # the short table ends flat (its last two entries are equal), so past its end it prices every
    # forward at its last entry: below what 128 tokens were measured to cost
    assert BF16_DRAFTER[14] == BF16_DRAFTER[15]
    assert math.isclose(old.costs.dcost(150), BF16_DRAFTER[15] / BF16_DRAFTER[0])
    assert old.costs.dcost(150) < measured_128
    # where both tables hold measurements they agree; past the short one's end only the long one
    # sees the forward grow
    assert [p.costs.dcost(n) for n in range(1, 17)] == [old.costs.dcost(n) for n in range(1, 17)]
    assert p.costs.dcost(150) > old.costs.dcost(150)
    assert p.probe_cost(150) > p.probe_cost(48) + 1.0
    # rounds alone (no feed): a probe comes at its pace; told the drafter would be fed 3 tokens a
    # round, the same request sends fewer probes, none where the catch-up could not pay back
    def run(per_round):
        q, ks, k, missed = near(), [], 0, 1
        q.observe(2, 0)  # the first block missed
        for i in range(300):
            ks.append(k)
            q.observe(k, 0)
            missed = 1 if k else missed + 1  # (after a probe: the target's token)
            k = q.next_k(300 - i - 1, None if per_round is None else per_round * missed)
        return [i for i, x in enumerate(ks) if x]

    by_rounds, by_tokens = run(None), run(3)
    assert set(by_tokens) < set(by_rounds), (by_rounds, by_tokens)
    last = max(set(by_rounds) - set(by_tokens))  # dropped: its catch-up, told in tokens, could not pay
    gap = last - max(i for i in by_rounds if i < last)
    assert p.worth_probing(300 - last, gap) and not p.worth_probing(300 - last, 3 * gap)
    assert run(1) == by_rounds  # one drafter token a round: the same as counting rounds


def test_probes_that_find_nothing_come_rarer_and_probes_that_hit_keep_their_pace():
    """The odds a probe must pay for come from how often recent probes found text that pays (or
    were accepted in full): 2 to 1 before any probe; a drafter whose probes all fail (a pair that
    shares little text on this request: smollm2-135m proposing for a Qwen target on Chinese) ends
    up probing seldom and only with many tokens left, one whose probes hit probes at the pace the
    costs allow."""
    def pol():
        return DraftPolicy(DraftConfig(), 0.3, verify_costs=CPU_TABLE, measured=True)

    fresh = pol()
    assert fresh.probe_odds() == pytest.approx(2.0)
    miss, hit = pol(), pol()
    ks_miss = _run_left(miss, 300, lambda k: 0)
    ks_hit = _run_left(hit, 300, lambda k: k)  # (every probe accepted in full: it drafts on)
    assert miss.probe_odds() > 8 and hit.probe_odds() < 2.0
    n_miss = sum(1 for k in ks_miss if k > 0)
    assert n_miss < sum(1 for k in _run_left(_held(pol(), 2.0), 300, lambda k: 0) if k > 0)
    assert sum(1 for k in ks_hit if k > 0) > 200
    # needing more tokens ahead: a late probe that the first odds allowed is not sent any more
    assert fresh.worth_probing(10) and not miss.worth_probing(10)


def _held(p: DraftPolicy, odds: float) -> DraftPolicy:
    p.probe_odds = lambda: odds
    return p


def test_a_record_of_misses_relaxes_request_by_request_until_a_probe_is_worth_it_again():
    """Only probes change the probes' record, and a record of misses stops the probes of short
    completions: each new request moves it 10% back toward the prior, so a pair whose drafter
    once failed everywhere tries again after a handful of requests (and its odds fall for good
    if that probe hits)."""
    p = DraftPolicy(DraftConfig(), 0.3, verify_costs=CPU_TABLE, measured=True)
    _run_left(p, 300, lambda k: 0)
    assert p.probe_odds() > 8
    need = [p.probe_odds() * p.probe_cost() / p.saving()]
    n = 0
    while p.probe_odds() > 2.5:
        p.relax_record()
        n += 1
        need.append(p.probe_odds() * p.probe_cost() / p.saving())
    assert 5 <= n <= 20 and need == sorted(need, reverse=True), (n, need)


# ---- many sessions: what the others do (DraftPolicy.see_peers) ------------------------------------

def _loaded(v, d, c, rows, others, peer, alpha, colocated=True):
    p = DraftPolicy(DraftConfig(), c, verify_costs=v, drafter_costs=d, measured=True)
    p.expect_load(float(rows))
    p.see_peers(others, peer, colocated)
    p.acceptance.succ, p.acceptance.trials = alpha, 1.0
    return p


# this CPU in bf16 (qwen2.5-coder-1.5b / its 0.5b drafter, int8 weights): flat up to ~16 tokens, then
# in proportion to them (1..64 tokens, ms, rounded from the model servers' timings)
QWEN_BF16 = [131, 131, 133, 135, 136, 137, 138, 139, 141, 143, 150, 155, 158, 161, 165, 169] + \
    [169 + 4.7 * i for i in range(1, 49)]
QWEN05_INT8 = [25.5, 26, 26.5, 27.3] + [27.3 + 4.5 * i for i in range(1, 61)]


def test_one_session_alone_is_priced_as_before_whatever_is_known_of_others():
    """One session: the others' counts change nothing (there are none), nor does the flag."""
    for alpha in (0.2, 0.6, 0.9):
        ref = _loaded(QWEN_BF16, QWEN05_INT8, 0.2, 1, None, None, alpha)
        for others, peer, co in ((0.0, None, True), (0.0, 0.3, False)):
            p = _loaded(QWEN_BF16, QWEN05_INT8, 0.2, 1, others, peer, alpha, co)
            assert [p.rate(k) for k in range(11)] == pytest.approx([ref.rate(k) for k in range(11)])
            assert p.cumulative_stop() == pytest.approx(ref.cumulative_stop())
            assert p.probe_cost(5) == pytest.approx(ref.probe_cost(5))


def test_a_lone_drafter_among_sessions_that_do_not_draft_pays_for_the_whole_extra():
    """16 sessions on this CPU, one of them on text its drafter gets right (86%), the others near
    the prior and not drafting: pricing a 1/16 share of a batch-wide block (the rule before the
    others were counted) drafts; counting what one lone block costs the machine -- a forward of its
    own or padding for all, and drafter steps that stall everyone on shared cores -- does not."""
    old = _loaded(QWEN_BF16, QWEN05_INT8, 0.2, 8, None, None, 0.86)
    new = _loaded(QWEN_BF16, QWEN05_INT8, 0.2, 8, 0.0, 0.3, 0.86)
    assert old.pays() and not new.pays()
    assert all(new.rate(k) < 1.0 for k in range(1, 11))
    # its probes cost the others' time too: dearer than a share of a batch-wide probe
    assert new.probe_cost() > 2 * old.probe_cost()
    # where all the others draft as well, it is the rule before (everyone alike)
    together = _loaded(QWEN_BF16, QWEN05_INT8, 0.2, 8, 7.0, 0.86, 0.86)
    assert [together.rate(k) for k in range(11)] == pytest.approx([old.rate(k) for k in range(11)])
    # and a rate is never below zero: the probes' saving stays a share of a step
    assert all(new.rate(k) > 0 for k in range(11)) and 0.0 <= new.saving() < 1.0


def test_on_a_gpu_a_drafter_on_its_own_hardware_drafts_alone_and_a_shared_one_does_not():
    """Flat tables (a GPU): a lone block's verification is nearly free. With the drafter on its own
    GPU its steps delay only its session, so it drafts among 15 that do not; on the verifier's GPU
    its steps stall all 16 sessions, and alone it does not."""
    own = _loaded(GPU_V, GPU_D, 0.3, 16, 0.0, 0.2, 0.8, colocated=False)
    shared = _loaded(GPU_V, GPU_D, 0.3, 16, 0.0, 0.2, 0.8, colocated=True)
    assert own.pays() and not shared.pays()
    # below its own speedup alone: its block pads the others' forward a little (3% of 15 sessions' steps)
    alone = _loaded(GPU_V, GPU_D, 0.3, 1, 0.0, None, 0.8, colocated=False)
    assert 1.1 < max(own.rate(k) for k in range(1, 11)) < max(alone.rate(k) for k in range(1, 11))


def test_on_a_shared_gpu_sessions_start_drafting_together_where_that_pays_for_all():
    """Shared GPU, nobody drafting yet: a lone drafter would stall 16 sessions, but if the others'
    acceptance says they would draft too, drafting together pays for all -- so they start (else
    none ever would); where the others' acceptance says they would not join, it does not."""
    joined = _loaded(GPU_V, GPU_D, 0.3, 16, 0.0, 0.8, 0.8, colocated=True)
    lonely = _loaded(GPU_V, GPU_D, 0.3, 16, 0.0, 0.05, 0.8, colocated=True)
    assert joined.pays() and not lonely.pays()


def test_a_loaded_cpu_where_sessions_draft_together_at_high_acceptance_keeps_drafting():
    """8 sessions on this CPU's bf16 tables (flat up to 16 tokens), all drafting at 86%: one-token
    blocks for all pay (the forward of 16 tokens costs little more than of 8), whichever view."""
    p = _loaded(QWEN_BF16, QWEN05_INT8, 0.2, 8, 7.0, 0.86, 0.86)
    assert p.pays()
    assert max(range(1, 11), key=p.rate) <= 2


def test_a_few_drafters_that_lose_as_a_group_do_not_keep_each_other_drafting():
    """16 sessions on this CPU, 3 others drafting: once they pay for a forward of their own, one more
    drafter adds little to it -- priced by that margin, 3-4 of 16 kept drafting as a group that lost
    as a whole (0.62x of target-only, traced). Each drafter's share of what the group adds says no."""
    p = _loaded(QWEN_BF16, QWEN05_INT8, 0.2, 16, 3.0, 0.63, 0.85)
    assert not p.pays()
    b, n = p.costs.load()
    c = p.costs.c * p.costs.scale_d * p.costs.steps_per_token()
    e = expected_tokens(p.acceptance.alpha(), 1)
    margin = 1 + b * (p.costs.agg(1, e, n, b, c) - p.costs.agg(1, e, n - 1, b, c))
    assert margin > 1.05 > p.rate(1)  # (the margin would have drafted)


def test_a_lone_doubted_token_accepted_is_not_a_hit_nor_a_reason_to_probe_faster():
    """A confident probe that ends after one proposal (the drafter doubted it) and is accepted says
    little: on text the drafter cannot follow, such lone guesses come true now and then (SmolLM2 for
    a Qwen target on Chinese: 3 of 11). It neither halves the probe interval nor counts as a hit; a
    probe of two or more tokens accepted in full does both."""
    def probing(k_bound: int = 10):
        # (a costly drafter: an estimate of 65% acceptance does not pay, 90% would)
        cfg = DraftConfig(num_draft_tokens=min(4, k_bound), max_draft_tokens=k_bound)
        pol = DraftPolicy(cfg, 0.6, verify_costs=CPU_TABLE, measured=True)
        pol.confident = True
        pol.interval = pol.wait = 32
        pol.probing = True
        pol.acceptance.restart()  # as a probe starts
        return pol

    lone, two = probing(), probing()
    assert lone.could_pay()
    before = lone.interval
    lone.observe(1, 1)
    two.observe(2, 2)
    faster = two.interval
    assert lone.interval == before and DraftPolicy.probe_every <= faster < before
    miss = probing()
    miss.observe(1, 0)
    for pol in (lone, two, miss):
        pol.next_k()  # (scores the probe just observed)
    assert lone.hit_s == miss.hit_s < two.hit_s  # the lone token scores as a missed probe does
    # with blocks bounded at one token, one token is a whole block
    one = probing(k_bound=1)
    one.observe(1, 1)
    assert one.interval == faster


# ---- properties of the choice that hold whatever the tuning ----------------------------------------

# (drafter step cost, verifier table, drafter table, measured): flat and steep tables, both cost models
PAIRS = [
    (0.14, FLAT_TABLE, None, True),
    (0.14, CPU_TABLE, None, True),
    (0.3, GEMMA_CPU, SMOL_CPU, True),
    (0.2, QWEN_BF16, QWEN05_INT8, True),
    (0.15, GPU_V, GPU_D, True),
    (0.2, None, None, False),
    (0.6, None, None, False),
]
ALPHAS = [i / 50 for i in range(1, 50)]


def _chosen(pair, alpha: float, cfg: DraftConfig | None = None) -> int:
    """The block size a session picks at a measured acceptance of `alpha`."""
    c, v, d, measured = pair
    p = DraftPolicy(cfg or DraftConfig(), c, verify_costs=v, drafter_costs=d, measured=measured)
    p.acceptance.succ, p.acceptance.trials = alpha, 1.0
    return p.next_k()


def test_a_block_yields_between_one_token_and_all_its_drafts_plus_one():
    """E(k): the target's own token at least, every draft and the target's next at most; more
    drafts or a higher acceptance never yield less."""
    for a in ALPHAS:
        e = [expected_tokens(a, k) for k in range(0, 12)]
        assert all(1.0 <= x <= k + 1 + 1e-12 for k, x in enumerate(e)), (a, e)
        assert all(y >= x for x, y in itertools.pairwise(e))
    for k in range(12):
        e = [expected_tokens(a, k) for a in ALPHAS]
        assert all(y >= x for x, y in itertools.pairwise(e))


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"c{p[0]}-{'measured' if p[3] else 'static'}-{len(p[1] or [])}")
@pytest.mark.parametrize("bounds", [(1, 10), (2, 6)])
def test_the_chosen_block_never_shrinks_as_acceptance_rises_and_stays_within_its_bounds(pair, bounds):
    cfg = DraftConfig(min_draft_tokens=bounds[0], max_draft_tokens=bounds[1])
    ks = [_chosen(pair, a, cfg) for a in ALPHAS]
    assert all(y >= x for x, y in itertools.pairwise(ks)), ks
    assert all(k == 0 or cfg.min_draft_tokens <= k <= cfg.max_draft_tokens for k in ks), ks
    assert ks[-1] > 0  # (every pair here pays at a high enough acceptance: the sweep is not all zeros)


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"c{p[0]}-{'measured' if p[3] else 'static'}-{len(p[1] or [])}")
@pytest.mark.parametrize("c", [1.0, 2.5])
def test_a_drafter_step_as_dear_as_a_target_step_never_drafts(pair, c):
    """A block of k drafts yields at most k + 1 tokens and costs k drafter steps plus a verification
    of at least one target step: at a drafter step of one target step or more no acceptance
    repays it, so the policy drafts nothing (and knows that no acceptance could pay)."""
    _, v, d, measured = pair
    dear = (c, v, d, measured)
    assert all(_chosen(dear, a) == 0 for a in ALPHAS)
    assert not DraftPolicy(DraftConfig(), c, verify_costs=v, drafter_costs=d, measured=measured).could_pay()


def test_a_fixed_block_size_is_kept_whatever_the_acceptance_or_costs():
    for pair in PAIRS:
        for a in (ALPHAS[0], ALPHAS[-1]):
            assert _chosen(pair, a, DraftConfig(adaptive=False, num_draft_tokens=7)) == 7
            assert _chosen((5.0, *pair[1:]), a, DraftConfig(adaptive=False, num_draft_tokens=7)) == 7
