"""Exact losslessness checks of speculative sampling, on the rows real decoding produces.

A :class:`Capture` spies on a real run (``Engine.generate`` or a :class:`crossdraft.decoding.decode.Decoder`
over real workers) and records, per verification round, what the code computed: the target's
context, the drafts, the p rows and q rows handed to :func:`crossdraft.decoding.sampling.verify_sampling`
(or the processed rows handed to :func:`crossdraft.decoding.coupled.verify_coupled`), and, per drafter
block, the distribution each proposal was sampled from and the uniform it was sampled with.

:func:`check_rounds` then checks, for every recorded round:

* the p rows are target-only's processed probabilities for the same context (a fresh forward of
  the target over context + drafts, through the same logits processing target-only decoding uses);
* each draft is an inverse-CDF sample of the distribution the drafter shipped with it, taken with
  its own seeded uniform, and that distribution, mapped into target ids, is the verifier's q row;
* the emission at every position of the block -- the first, the later ones conditioned on the
  accepted prefix, and the bonus token after a fully accepted block -- is distributed exactly as
  the target's p row (within 1e-9). That distribution is computed by running the verification
  function the pipeline called, with its uniforms replaced by chosen values: for every draft in
  q's support, one uniform on each side of the acceptance threshold, and, when it rejects, the
  distribution it hands :func:`crossdraft.decoding.sampling.sample_from` for the emitted token (itself
  checked to be an exact inverse-CDF sampler on that distribution).

Coupled draws have no acceptance rule to integrate: for them the check is that every position
emits the target's own draw at (seed, position) whatever is drafted there, so the output is the
target-only output token for token.
"""

from __future__ import annotations

import math
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
from scipy import stats as sst

from crossdraft.decoding import coupled as CP
from crossdraft.decoding import sampling as S
from crossdraft.runtime import sessions as SS

# fp32 model outputs computed two ways (a KV-cached block forward, possibly batched with other
# sessions' rows, against one uncached forward over the whole context) differ by float32 rounding
# of the matmuls: a few 1e-7 relative in the logits, times logits of magnitude ~10-50 here, moves
# probabilities by at most ~1e-6. A wrong row (another context, a missing penalty, the wrong
# position) moves them by far more than 1e-5.
ROW_TOL = 1e-5
EXACT_TOL = 1e-9  # the emission distribution against p: float64 arithmetic only
_EMIT_U = 0.6180339887498949  # the uniform handed to the emission draw of the position under test


@dataclass
class Draw:
    probs: torch.Tensor  # what sample_from was given
    u: float
    result: int


@dataclass
class DraftCall:
    thread: int
    ctx: list[int]  # the drafter's ids when the block started
    k: int
    round_index: int
    params: S.SamplingParams
    seed: int
    allowed: SS.AllowedSet
    tokens: list = field(default_factory=list)  # DraftTokens yielded
    draws: list[Draw] = field(default_factory=list)  # the drafter's sample_from calls, in order


@dataclass
class VerifyCall:
    thread: int
    ctx: list[int]  # the target's ids before the block
    drafts: list[int]
    params: S.SamplingParams
    seed: int
    round_index: int
    draft: DraftCall | None = None
    fn: object = None  # the verification function the pipeline called
    p: torch.Tensor | None = None  # [k+1, V] float64 (rejection sampling)
    q: torch.Tensor | None = None  # [k, V] float64
    processed: torch.Tensor | None = None  # [k+1, V] (coupled draws)
    position: int = -1  # coupled: the target position of the block's first row
    outcome: S.VerifyOutcome | None = None


class Capture:
    """Record what a real run computes. Install it after any replacement of
    ``crossdraft.decoding.sampling.verify_sampling`` (a negative control's): the spy wraps, and the exact
    check later integrates, whatever function is installed then."""

    def __init__(self, monkeypatch, keep: int | None = None):
        self.keep = keep  # record the first ``keep`` rounds (None: all); later ones only run
        self.rounds: list[VerifyCall] = []
        self.drafts: list[DraftCall] = []
        self._local = threading.local()
        self._lock = threading.Lock()
        # blocks drafted and not verified yet, oldest first: a round's block is the latest one drafted for
        # its round index, on its own thread (serial rounds) or on any (pipelined rounds: drafted on a
        # worker thread during the previous verification)
        self._pending: list[DraftCall] = []
        cap = self

        verify_sampling = S.verify_sampling
        verify_coupled = SS.verify_coupled
        sample_from = S.sample_from
        target_verify = SS.TargetSession.verify
        draft_iter = SS.DrafterSession.draft_iter

        def spy_verify(sess, drafts, q_rows, round_index, params, seed, top_logprobs=-1):
            if cap.full():
                return target_verify(sess, drafts, q_rows, round_index, params, seed, top_logprobs)
            tid = threading.get_ident()
            vc = VerifyCall(tid, list(sess.ids), list(drafts), params, seed, round_index)
            with cap._lock:
                if drafts:
                    mine = [dc for dc in cap._pending if dc.round_index == round_index and dc.thread == tid]
                    vc.draft = (mine or [dc for dc in cap._pending if dc.round_index == round_index] or [None])[-1]
                # this thread's blocks up to this round are spent (verified, or dropped)
                cap._pending = [dc for dc in cap._pending if not (dc.thread == tid and dc.round_index <= round_index)
                                and dc is not vc.draft][-64:]
            cap._local.verify = vc
            try:
                res = target_verify(sess, drafts, q_rows, round_index, params, seed, top_logprobs)
            finally:
                cap._local.verify = None
            vc.outcome = res.outcome
            with cap._lock:
                cap.rounds.append(vc)
            return res

        def spy_verify_sampling(p, q, drafts, seed, round_index):
            vc = getattr(cap._local, "verify", None)
            if vc is not None:
                vc.fn, vc.p, vc.q = verify_sampling, p.detach().clone(), q.detach().clone()
            return verify_sampling(p, q, drafts, seed, round_index)

        def spy_verify_coupled(processed, drafts, seed, position):
            vc = getattr(cap._local, "verify", None)
            if vc is not None:
                vc.fn, vc.processed, vc.position = verify_coupled, processed.detach().clone(), position
            return verify_coupled(processed, drafts, seed, position)

        def spy_sample_from(probs, u):
            out = sample_from(probs, u)
            draws = getattr(cap._local, "draws", None)
            if draws is not None:
                draws.append(Draw(probs.detach().clone(), u, out))
            return out

        def spy_draft_iter(sess, k, round_index, params, seed, allowed, *args, **kwargs):
            if cap.full():
                yield from draft_iter(sess, k, round_index, params, seed, allowed, *args, **kwargs)
                return
            tid = threading.get_ident()
            dc = DraftCall(tid, list(sess.ids), k, round_index, params, seed, allowed)
            it = draft_iter(sess, k, round_index, params, seed, allowed, *args, **kwargs)
            with cap._lock:
                cap.drafts.append(dc)
                cap._pending.append(dc)
            while True:
                cap._local.draws = dc.draws
                try:
                    tok = next(it, None)
                finally:
                    cap._local.draws = None
                if tok is None:
                    return
                dc.tokens.append(tok)
                yield tok

        monkeypatch.setattr(S, "verify_sampling", spy_verify_sampling)
        monkeypatch.setattr(S, "sample_from", spy_sample_from)
        monkeypatch.setattr(SS, "verify_coupled", spy_verify_coupled)
        monkeypatch.setattr(SS.TargetSession, "verify", spy_verify)
        monkeypatch.setattr(SS.DrafterSession, "draft_iter", spy_draft_iter)
        self._sample_from = sample_from  # the real one, for the checks

    def full(self) -> bool:
        with self._lock:
            return self.keep is not None and len(self.rounds) >= self.keep

    def speculative(self) -> list[VerifyCall]:
        """Rounds that verified drafts."""
        return [vc for vc in self.rounds if vc.drafts]


# --------------------------------------------------------------------------------------------
# Reference rows.


def _reference_processed(model, ctx: list[int], extra: list[int], params: S.SamplingParams,
                         columns: torch.Tensor | None = None) -> torch.Tensor:
    """Processed logits [len(extra)+1, n] of the tokens after ctx, ctx+extra[:1], ...: one uncached
    forward over the whole sequence, the repetition penalty's presence rows and the processing that
    target-only decoding (a verification of no drafts) applies. columns: keep only these ids (a
    drafter's allowed set), processed as the drafter does."""
    seq = list(ctx) + list(extra)
    rows = len(extra) + 1
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([seq])).logits[0, -rows:].float()
    vocab = logits.shape[-1]
    presence = None
    if params.repetition_penalty != 1.0:
        ext = torch.tensor(extra, dtype=torch.long) if extra else None
        presence = S.presence_rows(torch.tensor(ctx, dtype=torch.long), ext, vocab, rows)
    if columns is not None:
        logits = logits[:, columns]
        presence = None if presence is None else presence[:, columns]
    return S.process_logits(logits, params, presence)


def check_target_rows(model, vc: VerifyCall, tol: float = ROW_TOL) -> None:
    ref = S.probabilities(_reference_processed(model, vc.ctx, vc.drafts, vc.params)).double()
    got = vc.p if vc.p is not None else S.probabilities(vc.processed.float()).double()
    assert got.shape == ref.shape, (got.shape, ref.shape)
    err = float((got - ref).abs().max())
    assert err <= tol, f"round {vc.round_index}: p rows differ from target-only's by {err:.2e}"


# --------------------------------------------------------------------------------------------
# The drafter's side.


_checked_samplers: dict = {}  # (sampler, probs' bytes) -> the distribution, once checked


def check_inverse_cdf(sample_from, probs: torch.Tensor) -> torch.Tensor:
    """Check that ``sample_from(probs, u)`` for u uniform on [0, 1) returns id j with probability
    probs[j] / sum(probs), exactly: the id it returns at two points inside each cell of probs'
    cumulative sums is that cell's. Cells narrower than 1e-13 (their total mass is below V * 1e-13)
    hold no point that rounding cannot move across a boundary, and are not probed. Returns the
    distribution, float64."""
    pr = probs.detach().to(torch.float64).flatten()
    key = (id(sample_from), pr.numpy().tobytes())
    dist = _checked_samplers.get(key)
    if dist is not None:
        return dist
    total = float(pr.sum())
    dist = pr / total
    cdf = torch.cumsum(pr, 0).numpy() / total
    lo = np.concatenate([[0.0], cdf[:-1]])
    for j in np.nonzero(cdf - lo > 1e-13)[0]:
        for frac in (0.25, 0.75):
            u = lo[j] + frac * (cdf[j] - lo[j])
            got = sample_from(probs, u)
            assert got == j, f"sample_from returned {got} at u={u!r}, inside the cell of id {j}"
    if len(_checked_samplers) > 1000:
        _checked_samplers.clear()
    _checked_samplers[key] = dist
    return dist


def check_drafts(cap: Capture, vc: VerifyCall, d2t: np.ndarray, drafter_model=None, tol: float = ROW_TOL) -> None:
    """The block's drafts against what the drafter shipped (see the module's docstring).
    drafter_model: also check the shipped rows against the drafter's own processed distribution
    over its allowed ids for the same context (None: skip)."""
    dc = vc.draft
    assert dc is not None, "a verified block without a drafter call"
    k = len(vc.drafts)
    assert len(dc.tokens) == k and len(dc.draws) == k, (len(dc.tokens), len(dc.draws), k)
    assert (dc.seed, dc.round_index) == (vc.seed, vc.round_index)
    allowed = dc.allowed.ids.numpy()
    vocab = vc.q.shape[-1]
    for i, (tok, draw) in enumerate(zip(dc.tokens, dc.draws, strict=True)):
        # an inverse-CDF draw of the shipped distribution, with this position's own uniform
        assert draw.u == S.uniform(vc.seed, vc.round_index, i, S.STREAM_DRAFT)
        assert np.array_equal(np.asarray(tok.q_probs), draw.probs.numpy()), "shipped q is not what was sampled"
        assert tok.id == int(tok.q_ids[draw.result])
        check_inverse_cdf(cap._sample_from, draw.probs)
        # proposals only from the allowed ids (the vocabulary intersection, or its smaller draft vocabulary)
        assert np.isin(tok.q_ids, allowed).all() and (d2t[tok.q_ids] >= 0).all()
        # the verifier's q row is that distribution in target ids; the draft, its target id
        assert vc.drafts[i] == int(d2t[tok.id])
        want = np.zeros(vocab)
        np.add.at(want, d2t[tok.q_ids], np.asarray(tok.q_probs, dtype=np.float64))
        want /= want.sum()
        err = float(np.abs(vc.q[i].numpy() - want).max())
        assert err <= 1e-12, f"q row {i} differs from the shipped distribution by {err:.2e}"
    if drafter_model is None:
        return
    props = [t.id for t in dc.tokens]
    ref = torch.softmax(_reference_processed(drafter_model, dc.ctx, props[:-1], dc.params, dc.allowed.ids),
                        dim=-1).double()
    for i, tok in enumerate(dc.tokens):
        j = torch.as_tensor(np.searchsorted(allowed, tok.q_ids))
        shipped = torch.as_tensor(np.asarray(tok.q_probs, dtype=np.float64))
        kept = ref[i, j]
        err = float((shipped / shipped.sum() - kept / kept.sum()).abs().max())
        assert err <= tol, f"q row {i} differs from the drafter's own distribution by {err:.2e}"
        # the shipped ids are the drafter's most likely ones, holding all but ~Q_TAIL of its mass
        rest = torch.ones(ref.shape[1], dtype=torch.bool)
        rest[j] = False
        if bool(rest.any()):
            assert float(kept.min()) >= float(ref[i, rest].max()) - tol
        assert float(kept.sum()) >= 1 - SS.Q_TAIL - tol


# --------------------------------------------------------------------------------------------
# The emission distribution, integrated over the drafts and the uniforms.


@contextmanager
def _uniforms(values: dict):
    """Replace crossdraft.decoding.sampling.uniform: (position, stream) -> the value (0.5 when unlisted);
    record every sample_from call meanwhile."""
    real_u, real_s = S.uniform, S.sample_from
    calls: list[Draw] = []

    def fake_uniform(seed, round_index, position, stream):
        return values.get((position, stream), 0.5)

    def recording_sample_from(probs, u):
        out = real_s(probs, u)
        calls.append(Draw(probs.detach().clone(), u, out))
        return out

    S.uniform, S.sample_from = fake_uniform, recording_sample_from
    try:
        yield calls
    finally:
        S.uniform, S.sample_from = real_u, real_s


def _outcome(fn, p, q, drafts, values):
    with _uniforms(values) as calls:
        out = fn(p, q, drafts, 0, 0)
    return out, calls


def _emitted_given(fn, sampler, p, q, drafts, i, values) -> tuple[int | None, torch.Tensor | None]:
    """Run the verification with these uniforms: (the draft, None) when position i emits an
    accepted draft, (None, the emission's distribution) when it emits a sample, AssertionError when
    the block ends before position i."""
    values = dict(values)
    values[(i, S.STREAM_EMIT)] = _EMIT_U
    out, calls = _outcome(fn, p, q, drafts, values)
    assert out.num_accepted >= i, f"position {i} was not reached with its prefix accepted"
    if out.num_accepted > i:
        return drafts[i], None
    mine = [c for c in calls if c.u == _EMIT_U]
    assert mine and mine[-1].result == out.next_token, "the emitted token is not a draw of the emission uniform"
    return None, check_inverse_cdf(sampler, mine[-1].probs)


def emission_distribution(vc: VerifyCall, i: int, p: torch.Tensor, sampler) -> torch.Tensor | None:
    """P(the token emitted at position i = x | drafts[:i] accepted), float64 [V], from the
    verification function the round used; None when that prefix cannot be accepted (a draft the
    target gives probability 0)."""
    fn, q, k = vc.fn, vc.q, len(vc.drafts)
    prefix = {(j, S.STREAM_ACCEPT): 0.0 for j in range(i)}  # u = 0 accepts any draft that can be accepted
    probe, _ = _outcome(fn, p, q, vc.drafts, prefix)
    if probe.num_accepted < i:
        return None
    vocab = p.shape[-1]
    dist = torch.zeros(vocab, dtype=torch.float64)
    if i == k:  # the bonus token
        _, emit = _emitted_given(fn, sampler, p, q, vc.drafts, i, prefix)
        assert emit is not None, "a fully accepted block emitted no bonus token"
        return emit
    for d in torch.nonzero(q[i] > 0).flatten().tolist():
        drafts = list(vc.drafts)
        drafts[i] = d
        a = S.acceptance_probability(float(p[i, d]), float(q[i, d]))
        # the threshold splits [0, 1) in two cells; the function is probed once in each
        cells = []
        if a > 0:
            cells.append((a, math.nextafter(a, 0.0)))
        if a < 1:
            cells.append((1.0 - a, a))
        for width, u in cells:
            tok, emit = _emitted_given(fn, sampler, p, q, drafts, i, {**prefix, (i, S.STREAM_ACCEPT): u})
            w = float(q[i, d]) * width
            if tok is not None:
                dist[tok] += w
            else:
                dist += w * emit
    return dist


@dataclass
class Report:
    nodes: int = 0  # positions whose emission distribution was integrated
    unreachable: int = 0  # positions behind a prefix the target cannot accept
    accept_mass: list[float] = field(default_factory=list)  # P(accept) at each draft position
    by_position: dict = field(default_factory=dict)  # position in the block -> positions checked there


def check_exact(cap: Capture, vc: VerifyCall, report: Report | None = None) -> Report:
    """Every position of the block emits exactly the target's distribution (rejection sampling)."""
    report = report or Report()
    # the target's law is p / sum(p) (sample_from normalises); its float32 softmax leaves the sum a
    # few 1e-8 from 1, which the check removes first so that it compares the algorithm's float64 math
    sums = vc.p.sum(dim=-1, keepdim=True)
    assert float((sums - 1).abs().max()) < 1e-6
    p = vc.p / sums
    for i in range(len(vc.drafts) + 1):
        dist = emission_distribution(vc, i, p, cap._sample_from)
        if dist is None:
            report.unreachable += 1
            continue
        err = float((dist - p[i]).abs().max())
        assert err <= EXACT_TOL, (f"round {vc.round_index} position {i} emits a distribution {err:.2e} away "
                                  f"from the target's")
        report.nodes += 1
        report.by_position[i] = report.by_position.get(i, 0) + 1
        if i < len(vc.drafts):
            report.accept_mass.append(float(torch.minimum(p[i], vc.q[i]).sum()))
    return report


def check_coupled(vc: VerifyCall, others: int = 24) -> int:
    """Coupled draws: at every position the prefix reaches, the token emitted is the argmax of the
    row plus the full noise field at (seed, position) -- target-only's draw -- whatever is drafted
    there (the target's own token, and ``others`` other ids). Returns the positions checked."""
    rows = vc.processed.double()
    vocab = rows.shape[-1]
    ids = np.arange(vocab)
    mine = []
    for i in range(rows.shape[0]):
        score = rows[i].numpy() + CP.Draws(vc.seed, vc.position + i).gumbel(ids)
        mine.append(int(np.argmax(score)))
    out = vc.outcome
    assert out.next_token == mine[out.num_accepted] and vc.drafts[: out.num_accepted] == mine[: out.num_accepted]
    rng = np.random.default_rng(vc.seed)
    checked = 0
    for i in range(out.num_accepted + 1):
        candidates = {mine[i]} if i == len(vc.drafts) else {mine[i], *rng.choice(vocab, others, replace=False).tolist()}
        for d in candidates:
            drafts = list(vc.drafts[:i]) + ([d] if i < len(vc.drafts) else []) + list(vc.drafts[i + 1:])
            res = vc.fn(vc.processed, drafts, vc.seed, vc.position)
            assert res.num_accepted >= i
            emitted = drafts[i] if res.num_accepted > i else res.next_token
            assert emitted == mine[i], f"position {i} emits {emitted} after draft {d}, the target draws {mine[i]}"
        checked += 1
    return checked


def check_rounds(cap: Capture, target_model, d2t=None, drafter_model=None, limit: int | None = None) -> Report:
    """All checks on the captured speculative rounds (the first ``limit`` of them)."""
    rounds = cap.speculative()[:limit]
    assert rounds, "no round verified drafts"
    report = Report()
    for vc in rounds:
        check_target_rows(target_model, vc)
        if vc.processed is not None:
            report.nodes += check_coupled(vc)
            continue
        check_drafts(cap, vc, d2t, drafter_model)
        check_exact(cap, vc, report)
    return report


# ---- end-to-end guards: sampled pairs of first tokens against target-only's exact joint -----------


def exact_two_token_distribution(engine, prompt_ids, params):
    """Target-only sampling's exact joint distribution of the first two tokens, {(t1, t2): prob}."""
    model = engine.target.model
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt_ids])).logits[0, -1:]
        vocab = logits.shape[-1]
        pres = S.presence_rows(torch.tensor(prompt_ids), None, vocab, 1)
        p1 = S.probabilities(S.process_logits(logits, params, pres))[0].double()
        firsts = torch.nonzero(p1 > 0).flatten().tolist()
        batch = torch.tensor([prompt_ids + [t] for t in firsts])
        logits2 = model(input_ids=batch).logits[:, -1]
        pres2 = torch.stack([S.presence_rows(torch.tensor(prompt_ids + [t]), None, vocab, 1)[0] for t in firsts])
        p2 = S.probabilities(S.process_logits(logits2, params, pres2)).double()
    joint = {}
    for i, t1 in enumerate(firsts):
        for t2 in torch.nonzero(p2[i] > 0).flatten().tolist():
            joint[(t1, t2)] = float(p1[t1] * p2[i, t2])
    return joint


def chi_square(counts: dict, expected_p: dict, n: int):
    """Pearson chi-square over cells with expected count >= 5, the rest pooled into one cell."""
    obs, exp = [], []
    pool_o, pool_e = 0.0, 0.0
    for cell, p in expected_p.items():
        if p * n >= 5:
            obs.append(counts.get(cell, 0))
            exp.append(p * n)
        else:
            pool_o += counts.get(cell, 0)
            pool_e += p * n
    unexpected = sum(c for cell, c in counts.items() if cell not in expected_p)
    assert unexpected == 0, "sampled a pair that target-only sampling can never produce"
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    obs, exp = np.array(obs, dtype=float), np.array(exp)
    exp *= obs.sum() / exp.sum()
    return sst.chisquare(obs, exp), len(obs)
