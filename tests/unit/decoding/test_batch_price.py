"""The chooser of draft lengths priced by the verifier's published price of a batched forward
(rows AND tokens, crossdraft.runtime.price) and why it drafts nothing when it does not
(DraftPolicy.reason). Properties of the choice, with cost tables and prices given as numbers."""

from __future__ import annotations

import pytest

from crossdraft.decoding.acceptance import expected_tokens
from crossdraft.decoding.policy import SKIP_REASONS, DraftConfig, DraftPolicy
from crossdraft.runtime.price import Price

# one-row tables of a GPU (memory-bound: 17 tokens in one row cost about one) and its drafter, ms
GPU_V = [30.0 + 0.02 * i for i in range(17)]
GPU_D = [5.0 + 0.01 * i for i in range(17)]
# what the verifier measures of its batches: flat in rows and tokens (a GPU), or growing with every
# token (compute-bound: a CPU, or a GPU batch past its memory-bound range)
FLAT = Price(base_ms=29.0, row_ms=0.05, token_ms=0.02, forwards=100)
PER_TOKEN = Price(base_ms=5.0, row_ms=1.0, token_ms=10.0, forwards=100)
PER_ROW = Price(base_ms=5.0, row_ms=12.0, token_ms=0.02, forwards=100)


def _policy(rows: float, alpha: float, price: Price | None, *, others: float | None = None,
            peer: float | None = None, colocated: bool = False, measured: bool = True) -> DraftPolicy:
    p = DraftPolicy(DraftConfig(), 0.15, verify_costs=GPU_V if measured else None, drafter_costs=GPU_D,
                    measured=measured)
    p.expect_load(float(rows))
    p.see_peers(others if others is not None else rows - 1.0, peer if peer is not None else alpha, colocated)
    p.acceptance.succ, p.acceptance.trials = alpha, 1.0
    p.see_price(price)
    return p


def _best_k(p: DraftPolicy) -> int:
    return max(range(1, 11), key=p.rate) if p.pays() else 0


def test_a_price_flat_in_rows_and_tokens_has_every_session_draft_under_load():
    """16 sessions, all drafting at 80%: where a batch costs about one forward whatever its rows and
    tokens, blocks are nearly free to verify and everyone drafts long ones."""
    p = _policy(16, 0.8, FLAT)
    assert p.costs.price is FLAT
    assert p.pays() and _best_k(p) >= 3


def test_a_price_that_grows_with_tokens_stops_drafting_under_load_but_not_alone():
    """The one-row table says blocks are free (flat); the verifier's batches say every token costs.
    At 16 sessions its price rules: no block size pays even at 90% acceptance. The table alone would
    have had all 16 draft. Alone (one row) the table prices the block, and the session drafts."""
    loaded = _policy(16, 0.9, PER_TOKEN)
    assert not loaded.pays()
    # (each token of a block costs what a token of a target-only round costs: at best break-even)
    assert max(loaded.rate(k) for k in range(1, 11)) < 1.01
    assert _policy(16, 0.9, None).pays()  # (no price: the table's view)
    alone = _policy(1, 0.9, PER_TOKEN)
    assert alone.pays() and _best_k(alone) >= 3


def test_a_cost_per_row_alone_does_not_stop_drafting():
    """Rows that cost much but tokens that do not: a block adds tokens to a row the batch pays for
    anyway, so drafting keeps paying under load."""
    p = _policy(16, 0.8, PER_ROW)
    assert p.pays() and _best_k(p) >= 3


def test_the_price_takes_over_gradually_with_the_load():
    """The best rate falls as the sessions sharing a compute-bound verifier grow: never rising
    with the load."""
    best = [max(_policy(b, 0.85, PER_TOKEN).rate(k) for k in range(1, 11)) for b in (1, 2, 4, 8, 16, 32)]
    assert best == sorted(best, reverse=True)
    assert best[0] > 1.5 and best[-1] < 1.0


def test_static_costs_and_an_unproven_price_are_not_used():
    """Static costs never read a price (a seeded run replays anywhere); a price fitted from fewer
    than a handful of forwards waits."""
    static = _policy(16, 0.9, PER_TOKEN, measured=False)
    assert static.costs.price is None
    young = _policy(16, 0.9, Price(5.0, 1.0, 10.0, forwards=2))
    assert young.costs.price is None
    assert young.pays()  # priced by the table, as without a price


@pytest.mark.parametrize("case", ["acceptance", "load", "drafter busy"])
def test_a_round_that_drafts_nothing_says_why(case):
    """The reason the chooser gives for k = 0 is the one that holds: hopeless text even alone
    (acceptance), a session that would draft alone but not among 16 on a compute-bound verifier
    (load), a drafter whose steps take 30x its table now (drafter busy)."""
    if case == "acceptance":
        p = _policy(1, 0.02, FLAT)
    elif case == "load":
        p = _policy(16, 0.9, PER_TOKEN)
    else:
        p = _policy(1, 0.9, FLAT)
        p.costs.scale_d = 30.0
    assert p.reason == ""
    ks = [p.next_k(remaining=1000) for _ in range(3)]
    assert ks == [0, 0, 0]
    assert p.reason == case and case in SKIP_REASONS
    # and the reason is gone once the cause is: the same session alone, on drafter-friendly text, with
    # its drafter back at speed
    p.costs.batch, p.costs.others, p.costs.scale_d = 1.0, None, 1.0
    p.acceptance.succ, p.acceptance.trials = 0.9, 1.0
    assert p.next_k(remaining=1000) > 0 and p.reason == ""


def test_the_prediction_of_a_round_is_the_chooser_s_own_pricing():
    """What the chooser expects of a round (the gateway's goodput metrics compare it with what the
    round gives): one token at one target step's (batched) cost without drafts; with d drafts the
    expected tokens of d at its acceptance, at a cost that grows with d."""
    p = _policy(16, 0.8, PER_TOKEN)
    tok0, cost0 = p.predict(0, 0)
    assert tok0 == 1.0 and cost0 == pytest.approx(p.costs.scale_v * p.costs.fwd(16, 1))
    preds = [p.predict(d, d) for d in range(1, 8)]
    assert [t for t, _ in preds] == pytest.approx([expected_tokens(p.acceptance.alpha(), d) for d in range(1, 8)])
    costs = [c for _, c in preds]
    assert costs == sorted(costs) and costs[0] > cost0


def test_a_drafter_whose_batched_steps_cost_per_row_has_fewer_sessions_draft():
    """The drafter's capacity counts: its one-row table says a step of 16 sessions costs about one
    (flat, like the GPU's), its published price says each row costs (a drafter that is the
    bottleneck). Then 16 sessions drafting together do not pay where its table said they would;
    a drafter whose batched steps are flat (its price agrees with the table) keeps them drafting,
    and one session alone is priced by its own step whatever the price."""
    def drafting(dprice):
        p = _policy(16, 0.8, FLAT, colocated=True)
        p.costs.see_price(FLAT, dprice)
        return p

    per_row = Price(base_ms=1.0, row_ms=4.0, token_ms=0.0, forwards=100)
    flat = Price(base_ms=5.0, row_ms=0.01, token_ms=0.01, forwards=100)
    assert drafting(None).pays() and drafting(flat).pays()
    assert not drafting(per_row).pays()
    assert drafting(per_row).costs.dcost(16) == pytest.approx(per_row.ms(16, 16) / per_row.ms(1, 1))
    alone = _policy(1, 0.8, FLAT, colocated=True)
    before = [alone.rate(k) for k in range(1, 11)]
    alone.costs.see_price(FLAT, per_row)
    assert [alone.rate(k) for k in range(1, 11)] == pytest.approx(before)


def test_drafted_verifications_measured_out_of_step_price_everyone_drafting_at_their_forwards():
    """A GPU-like price at 8 sessions, all drafting at 80%: priced as one forward of every session's
    block, drafting pays. The drafted blocks' verifications were measured to run in forwards of 2 rows
    (the sessions fell out of step): the 8 blocks then take 4 forwards, and drafting stops paying --
    the sessions' own share of the forwards is what they get, not what one batch of all would. A
    session alone says nothing about it; a block verified with all of them restores it."""
    p = _policy(8, 0.8, FLAT, colocated=True)
    assert p.pays() and p.costs.sharing == 1.0
    for _ in range(10):
        p.costs.observe_sharing(2)
    assert p.costs.sharing == pytest.approx(0.25, abs=0.03)
    assert not p.pays()
    alone = _policy(1, 0.8, FLAT)
    alone.costs.observe_sharing(1)
    assert alone.costs.sharing == 1.0
    for _ in range(10):
        p.costs.observe_sharing(8)
    assert p.costs.sharing == pytest.approx(1.0, abs=0.03) and p.pays()
    # and the request that follows starts from what the drafted rounds measured (the decoder carries it)
    nxt = _policy(8, 0.8, FLAT, colocated=True)
    for _ in range(10):
        p.costs.observe_sharing(2)
    nxt.resume(p.scales())
    assert nxt.costs.sharing == p.costs.sharing < 0.3 and not nxt.pays()


def test_drafter_steps_measured_unbatched_price_everyone_drafting_at_one_forward_each():
    """A GPU-like verifier and drafter at 8 sessions, all drafting at 80%: priced as every session's
    drafter step in one forward, drafting pays. The drafted blocks' steps were measured to run in
    forwards of 1 row (the sessions' Draft calls did not meet): each step of the 8 sessions then costs
    the drafter 8 forwards -- on the verifier's hardware a stall of them all -- and drafting stops
    paying. Steps that report no rows (an older drafter) say nothing; steps of 8 rows restore it; the
    next request starts from what was measured."""
    p = _policy(8, 0.8, FLAT, colocated=True)
    assert p.pays() and p.costs.dsharing == 1.0
    p.costs.observe_sharing(8, 0)
    assert p.costs.dsharing == 1.0 and p.costs.sharing == 1.0
    for _ in range(10):
        p.costs.observe_sharing(8, 1)
    assert p.costs.dsharing == pytest.approx(1 / 8, abs=0.03) and p.costs.sharing == 1.0
    assert not p.pays()
    nxt = _policy(8, 0.8, FLAT, colocated=True)
    nxt.resume(p.scales())
    assert nxt.costs.dsharing == p.costs.dsharing and not nxt.pays()
    for _ in range(10):
        p.costs.observe_sharing(8, 8)
    assert p.costs.dsharing == pytest.approx(1.0, abs=0.03) and p.pays()
    alone = _policy(1, 0.8, FLAT, colocated=True)
    alone.costs.observe_sharing(1, 1)
    assert alone.costs.dsharing == 1.0 and alone.pays()


def test_a_drafter_on_its_own_hardware_measured_unbatched_is_the_rounds_bottleneck():
    """The same drafter on its own hardware: the rounds cannot come faster than it drafts all 8 sessions'
    blocks one row at a time (8 x 5 ms a step against a 30 ms verification), so long blocks stop paying and
    the best block shrinks; short ones still pay (the drafter keeps up with the verifier)."""
    p = _policy(8, 0.8, FLAT, colocated=False)
    k0, r0 = _best_k(p), max(p.rate(k) for k in range(1, 11))
    for _ in range(10):
        p.costs.observe_sharing(8, 1)
    k1, r1 = _best_k(p), max(p.rate(k) for k in range(1, 11))
    assert 1 <= k1 < k0 and r1 < r0
    # the drafter busy for the 8 blocks bounds the round: its time, not the verification's, prices them
    c = p.costs
    for k in range(1, 11):
        drafter = c.c * c.scale_d * c.dstep(8) * k
        assert p.rate(k) <= expected_tokens(0.8, k) * c.fwd(8, 1) / drafter + 1e-9


def test_a_session_the_drafter_follows_well_does_not_draft_beside_others_it_follows_badly():
    """4 sessions on shared cores priced as a CPU measures its batches (every token costs), 2 others
    drafting: where they draft at this session's 85%, the group of 3 gains and it drafts with them; where
    they draft at 30%, the group's blocks stall the fourth session for little and lose as a whole, so
    this session -- though its own blocks would pay for itself -- does not join them (priced with
    everyone's acceptance at its own, it did)."""
    cpu = Price(base_ms=307.0, row_ms=11.0, token_ms=15.7, forwards=100)
    drafter = Price(base_ms=78.0, row_ms=0.0, token_ms=6.8, forwards=100)

    def session(peer):
        p = _policy(4, 0.85, cpu, others=2.0, peer=peer, colocated=True)
        p.costs.see_price(cpu, drafter)
        p.costs.c = 0.25  # (a drafter step a quarter of a target step: a 0.5B drafter for a 1.5B target)
        return p

    assert session(0.85).pays()
    assert not session(0.3).pays()


# a CPU drafter's one-row table (ms for 1..17 tokens; past it, each token costs the last step): a prefill
# grows with its tokens
CPU_D = [50.0 + 8.0 * i for i in range(17)]


def test_a_prompt_fed_to_the_drafter_costs_its_prefill_for_every_session_that_waits():
    """A first block feeds the drafter the request's prompt in a forward of its own: a prefill does not
    batch with the other sessions' steps like a one-token row (it is compute-bound). On hardware shared
    with the verifier every session waits for it, so its cost grows with the sessions sharing the
    forwards, however many draft beside it; on its own hardware only this session waits. (A burst of 16
    new requests once priced their 16 prompt feeds as one step of 16 rows, all started drafting at
    once, and ran at 0.63x of target-only.)"""
    def fed(rows: float, others: float, colocated: bool) -> float:
        p = DraftPolicy(DraftConfig(), 0.15, verify_costs=GPU_V, drafter_costs=CPU_D, measured=True)
        p.expect_load(rows)
        p.see_peers(others, 0.7, colocated)
        p.see_price(FLAT)
        # what 150 prompt tokens add to a probe, in target time (a target step at this load is fwd(b, 1))
        return (p.probe_cost(150) - p.probe_cost(1)) * p.costs.fwd(p.costs.load()[0], 1)

    alone = fed(1.0, 0.0, True)
    assert alone > 0
    assert fed(4.0, 3.0, True) == pytest.approx(4 * alone)
    assert fed(16.0, 15.0, True) == pytest.approx(16 * alone)
    assert fed(16.0, 0.0, True) == pytest.approx(16 * alone)  # (the others' drafting does not share it)
    assert fed(16.0, 15.0, False) == pytest.approx(alone)  # the drafter on its own hardware


def _count_rates(p: DraftPolicy) -> list[int]:
    """Count the policy's block rates priced (one entry per next_k call, appended by the caller)."""
    calls = [0]
    rate = p.costs.rate

    def counted(k, a):
        calls[0] += 1
        return rate(k, a)

    p.costs.rate = counted
    return calls


def test_a_session_the_load_rules_out_is_priced_again_now_and_then_and_when_the_load_falls():
    """Work counting: 16 sessions on a compute-bound verifier draft nothing; a session does not price
    every block size every round to find that out again -- it re-prices every ``recheck_every`` rounds,
    and at once when the load falls by half a session (then, alone, it drafts) or when the load gate
    lets go."""
    p = _policy(16, 0.9, PER_TOKEN)
    calls = _count_rates(p)
    priced = []
    for _ in range(4 * p.recheck_every - 1):
        before = calls[0]
        assert p.next_k(remaining=1000) == 0 and p.reason == "load"
        priced.append(calls[0] > before)
    assert sum(priced) == 4 and priced[0]  # (the first call priced; then one in every recheck_every)
    before = calls[0]
    p.costs.batch = 15.7  # (less than half a session fewer: nothing that could make drafting pay)
    assert p.next_k(remaining=1000) == 0 and calls[0] == before
    p.costs.batch, p.costs.others = 1.0, None
    assert p.next_k(remaining=1000) > 0 and calls[0] > before and p.reason == ""
    # the load gate holds drafting that would pay: the session waits without pricing, until the gate lets go
    g = _policy(16, 0.8, FLAT)
    g.held = True
    assert g.next_k(remaining=1000) == 0 and g.reason == "load"
    calls = _count_rates(g)
    assert g.next_k(remaining=1000) == 0 and calls[0] == 0
    g.held = False
    assert g.next_k(remaining=1000) > 0 and calls[0] > 0


@pytest.mark.parametrize("price", [FLAT, Price(base_ms=29.0, row_ms=0.05, token_ms=1.0, forwards=100)])
def test_a_confident_block_under_load_stops_at_the_size_it_was_priced_at(price):
    """Confident blocks (the drafter's doubt ends them) run up to the upper bound for a session alone; among
    16 sessions a batched forward pads every row to its longest, so the block's bound is the best-rated
    size: a block that ran on would cost every session in the forward more than its pricing said."""
    def confident(rows):
        p = DraftPolicy(DraftConfig(), 0.15, verify_costs=GPU_V, drafter_costs=GPU_D, measured=True, confident=True)
        p.expect_load(float(rows))
        p.see_peers(rows - 1.0, 0.8, False)
        p.acceptance.succ, p.acceptance.trials = 0.8, 1.0
        p.see_price(price)
        return p

    alone, loaded = confident(1), confident(16)
    assert alone.next_k(remaining=1000) == alone.hi
    best = loaded.best_k()
    assert loaded.next_k(remaining=1000) == best < loaded.hi
    assert all(loaded.rate(best) >= loaded.rate(k) for k in range(1, loaded.hi + 1))
