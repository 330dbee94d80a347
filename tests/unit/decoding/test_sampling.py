"""Acceptance math and logits processing: hand-built cases and exact distribution checks."""

import math

import pytest
import torch

from crossdraft.decoding import sampling as S
from crossdraft.decoding.sampling import SamplingParams
from crossdraft.errors import InvalidArgument


def t(xs):
    return torch.tensor(xs, dtype=torch.float64)


# ---- hand-built accept / reject cases -------------------------------------------------------

def test_accept_when_target_likes_draft_more():
    p, q = t([0.1, 0.6, 0.3]), t([0.5, 0.4, 0.1])
    # p(1)/q(1) = 1.5 -> always accepted, whatever the uniform
    assert S.accept_or_resample(p, q, 1, 0.999999, 0.5) == (True, 1)


def test_accept_probability_is_ratio():
    assert S.acceptance_probability(0.1, 0.5) == pytest.approx(0.2)
    p, q = t([0.1, 0.6, 0.3]), t([0.5, 0.4, 0.1])
    assert S.accept_or_resample(p, q, 0, 0.19, 0.0) == (True, 0)
    ok, tok = S.accept_or_resample(p, q, 0, 0.21, 0.0)
    assert not ok
    # residual = max(0, p - q) = [0, 0.2, 0.2] / 0.4 -> token 0 impossible
    assert tok == 1
    assert S.accept_or_resample(p, q, 0, 0.21, 0.99)[1] == 2


def test_residual_never_returns_rejected_draft_when_q_dominates():
    p, q = t([0.2, 0.8]), t([0.9, 0.1])
    r = S.residual_distribution(p, q)
    assert r.tolist() == pytest.approx([0.0, 1.0])
    for u in [0.0, 0.3, 0.999999]:
        assert S.accept_or_resample(p, q, 0, 0.99, u) == (False, 1)


def test_residual_when_p_equals_q_falls_back_to_p():
    p = t([0.25, 0.75])
    assert S.residual_distribution(p, p).tolist() == pytest.approx([0.25, 0.75])


def test_greedy_verification():
    out = S.verify_greedy([5, 7, 9, 11], [5, 7, 8])
    assert (out.num_accepted, out.next_token, out.accepted) == (2, 9, [True, True, False])
    out = S.verify_greedy([5, 7, 9, 11], [5, 7, 9])
    assert (out.num_accepted, out.next_token) == (3, 11)
    out = S.verify_greedy([4], [])
    assert (out.num_accepted, out.next_token) == (0, 4)


def test_verify_sampling_bonus_and_rejection_positions():
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    q = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]], dtype=torch.float64)
    out = S.verify_sampling(p, q, [1, 2], seed=3, round_index=0)
    assert (out.num_accepted, out.next_token) == (2, 0)  # bonus from p_3
    q2 = torch.tensor([[0.0, 1.0, 0.0], [0.0, 1.0, 0.0]], dtype=torch.float64)
    out = S.verify_sampling(p, q2, [1, 1], seed=3, round_index=0)
    assert (out.num_accepted, out.next_token) == (1, 2)  # p_2(1) = 0 -> rejected, residual = p_2


# ---- exact marginal: one accept-or-resample step has distribution p -------------------------

def _exact_marginal(p, q):
    """P(emit y) = sum_x q(x) [a(x) 1{y=x} + (1 - a(x)) r(y)], using the library's own pieces."""
    r = S.residual_distribution(p, q)
    out = torch.zeros_like(p)
    for x in range(p.numel()):
        if q[x] == 0:
            continue
        a = S.acceptance_probability(float(p[x]), float(q[x]))
        out[x] += q[x] * a
        out += q[x] * (1 - a) * r
    return out


@pytest.mark.parametrize("trial", range(30))
def test_one_step_marginal_is_exactly_p(trial):
    g = torch.Generator().manual_seed(trial)
    v = 50
    p = torch.softmax(torch.randn(v, generator=g, dtype=torch.float64) * 2, 0)
    q = torch.softmax(torch.randn(v, generator=g, dtype=torch.float64) * 2, 0)
    if trial % 2:
        # q lives only on an "intersection": zero outside a random subset of the target vocab
        keep = torch.rand(v, generator=g) < 0.4
        keep[0] = True
        q = torch.where(keep, q, torch.zeros_like(q))
        q = q / q.sum()
    if trial % 3 == 0:
        # sparse p too (after top-k/top-p), overlapping q only partly
        p = torch.where(torch.rand(v, generator=g) < 0.5, p, torch.zeros_like(p))
        p[1] += 1e-3
        p = p / p.sum()
    assert float((_exact_marginal(p, q) - p).abs().max()) < 1e-6


def test_step_with_explicit_uniforms_matches_marginal_on_a_grid():
    # Drive accept_or_resample itself over a fine grid of (draft, u_accept, u_emit) and check the
    # emitted-token frequencies equal p up to the grid resolution.
    p = t([0.05, 0.5, 0.0, 0.3, 0.15])
    q = t([0.4, 0.1, 0.0, 0.0, 0.5])  # zero on tokens 2, 3: outside the intersection
    n = 400
    freq = torch.zeros(5, dtype=torch.float64)
    for x in range(5):
        if q[x] == 0:
            continue
        for i in range(n):
            ua = (i + 0.5) / n
            for j in range(n // 4):
                ue = (j + 0.5) / (n // 4)
                _, y = S.accept_or_resample(p, q, x, ua, ue)
                freq[y] += q[x] / (n * (n // 4))
    assert float((freq - p).abs().max()) < 5e-3


# ---- seeded uniforms and inverse-CDF sampling ----------------------------------------------

def test_uniform_is_deterministic_and_stream_separated():
    a = S.uniform(7, 3, 1, S.STREAM_ACCEPT)
    assert a == S.uniform(7, 3, 1, S.STREAM_ACCEPT)
    others = {S.uniform(7, 3, 1, S.STREAM_EMIT), S.uniform(7, 3, 2, S.STREAM_ACCEPT),
              S.uniform(7, 4, 1, S.STREAM_ACCEPT), S.uniform(8, 3, 1, S.STREAM_ACCEPT)}
    assert a not in others
    us = [S.uniform(1, r, 0, 1) for r in range(20000)]
    assert all(0.0 <= u < 1.0 for u in us)
    assert abs(sum(us) / len(us) - 0.5) < 0.01


def test_sample_from_never_picks_zero_probability():
    probs = t([0.0, 0.5, 0.0, 0.5, 0.0])
    for u in [0.0, 1e-12, 0.25, 0.5, 0.75, 1 - 1e-16]:
        assert S.sample_from(probs, u) in (1, 3)
    with pytest.raises(ValueError):
        S.sample_from(t([0.0, 0.0]), 0.3)


# ---- logits processing ------------------------------------------------------------------------

def test_processing_order_penalty_temperature_topk_topp():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 3.0]])
    presence = torch.tensor([[False, False, False, True, True]])
    params = SamplingParams(temperature=0.5, top_k=3, top_p=0.9, repetition_penalty=2.0)
    out = S.process_logits(logits, params, presence)
    # penalty: 3.0 -> 1.5, -1.0 -> -2.0; temperature 0.5: [4, 2, 1, -4, 3]; top-3 keeps 4, 3, 2
    probs = torch.softmax(torch.tensor([4.0, 2.0, 3.0]), 0)  # ids 0, 1, 4
    # top-p 0.9: sorted masses [0.665, 0.245, 0.090]; before-mass of id 1 is 0.91 >= 0.9 -> dropped
    assert probs[0] < 0.9 <= probs[0] + probs[2]  # ids 0 and 4 are needed to reach 0.9
    assert torch.isinf(out[0, [1, 2, 3]]).all()
    # (sampling rows come shifted to max 0: 4 -> 0, 3 -> -1)
    assert out[0, 0].item() == pytest.approx(0.0) and out[0, 4].item() == pytest.approx(-1.0)


def test_greedy_applies_penalty_only():
    logits = torch.tensor([[2.0, 1.9]])
    params = SamplingParams(repetition_penalty=1.2)
    out = S.process_logits(logits, params, torch.tensor([[True, False]]))
    assert int(out.argmax()) == 1


def test_presence_rows_track_block_tokens():
    pres = S.presence_rows(torch.tensor([1, 2]), torch.tensor([3, 4]), 6, 3)
    assert pres.tolist() == [
        [False, True, True, False, False, False],
        [False, True, True, True, False, False],
        [False, True, True, True, True, False],
    ]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(InvalidArgument) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field and field in str(e.value)


def test_top_p_keeps_at_least_one_token():
    out = S.process_logits(torch.tensor([[10.0, 0.0, 0.0]]), SamplingParams(temperature=1.0, top_p=0.01))
    assert math.isfinite(out[0, 0].item()) and torch.isinf(out[0, 1:]).all()


@pytest.mark.parametrize("temperature, top_p", [(5e-324, 5e-324), (1e-30, 1.0), (1e-30, 0.5), (1e300, 1.0)])
def test_extreme_temperatures_give_a_distribution_not_nan(temperature, top_p):
    """Found by fuzzing the REST API: temperature 5e-324 overflowed the logits to +inf and the
    softmax to NaN (a 5xx). Tiny temperatures now tend to the argmax, huge ones to uniform."""
    import torch

    from crossdraft.decoding.sampling import SamplingParams, probabilities, process_logits

    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0], [0.5, 0.5, 0.1, 0.0]])
    p = probabilities(process_logits(logits, SamplingParams(temperature=temperature, top_p=top_p)))
    assert torch.isfinite(p).all() and torch.allclose(p.sum(-1), torch.ones(2))
    if temperature < 1e-20:
        assert p[0].argmax() == 1 and p[0, 1] == 1.0
    if temperature > 1e200:
        assert torch.allclose(p[0], torch.full((4,), 0.25))
