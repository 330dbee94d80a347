"""The whole engine with tiny random-init models and two different small tokenizers.

Real transformers models and real tokenizers; only the weights are random (so the tests run in
seconds on a CPU). The drafter's vocabulary (SentencePiece-like with byte fallback) differs from
the target's (byte-level BPE), so these runs exercise TLI: masking to the intersection, mapping
q into target ids, rejection into tokens outside the intersection and drafter re-sync.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from crossdraft.decoding import sampling as S
from crossdraft.decoding.sampling import SamplingParams
from crossdraft.engine import DraftConfig, Engine
from crossdraft.errors import InvalidArgument, ResourceExhausted
from tests import exact
from tests.tiny_models import noisy_copy, tiny_lm

PROMPTS = [
    "def add(a, b):\n    return",
    "The quick brown fox",
    "for i in range(10):\n",
    "import numpy as np\n\nclass Model:\n    def __init__(self):",
]


@pytest.fixture(scope="module")
def drafter(tok_d):
    return tiny_lm(tok_d, seed=2)


@pytest.fixture(scope="module")
def tli(target, drafter, tmp_path_factory):
    return Engine(target, drafter, vocab_cache_dir=tmp_path_factory.mktemp("vocab"))


@pytest.fixture(scope="module")
def same_vocab(target, tok_t, tmp_path_factory):
    return Engine(target, tiny_lm(tok_t, seed=3), vocab_cache_dir=tmp_path_factory.mktemp("vocab"))


def test_tli_mapping_is_partial(tli):
    st = tli.mapping.stats()
    assert 0 < st["intersection_size"] < min(st["drafter_vocab_size"], st["target_vocab_size"])


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("k, adaptive", [(1, False), (3, True), (6, False)])
@pytest.mark.parametrize("mode", ["tli", "text"])
def test_greedy_is_token_identical(tli, prompt, k, adaptive, mode):
    ref = tli.generate(prompt, max_new_tokens=40, use_drafter=False)
    # static costs for the adaptive case: measured, these two equal-size random models tell the
    # policy that no acceptance could pay, and it would (rightly) not draft at all
    draft = DraftConfig(num_draft_tokens=k, adaptive=adaptive, mode=mode, cost_model="static" if adaptive else "auto")
    out = tli.generate(prompt, max_new_tokens=40, draft=draft)
    assert out.token_ids == ref.token_ids
    assert out.text == ref.text
    assert out.stats.mode == "speculative" and out.stats.drafted > 0
    assert out.stats.draft_mode == mode
    assert out.stats.draws == ref.stats.draws == "greedy"


def test_text_drafting_refuses_sampling(tli):
    with pytest.raises(InvalidArgument) as e:
        tli.generate("hi", max_new_tokens=3, params=SamplingParams(temperature=1.0), draft=DraftConfig(mode="text"))
    assert e.value.field == "mode"


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_greedy_same_vocab_and_penalty_identical(same_vocab, prompt):
    params = SamplingParams(repetition_penalty=1.3)
    ref = same_vocab.generate(prompt, max_new_tokens=32, params=params, use_drafter=False)
    out = same_vocab.generate(prompt, max_new_tokens=32, params=params, draft=DraftConfig(num_draft_tokens=4))
    assert out.token_ids == ref.token_ids


def test_greedy_run_hits_tokens_outside_intersection_and_resyncs(tli):
    outside = 0
    resyncs = 0
    for prompt in PROMPTS:
        ref = tli.generate(prompt, max_new_tokens=40, use_drafter=False)
        out = tli.generate(prompt, max_new_tokens=40, draft=DraftConfig(mode="tli"))
        assert out.token_ids == ref.token_ids
        outside += sum(1 for t in ref.token_ids if t >= len(tli.t2d) or tli.t2d[t] < 0)
        resyncs += out.stats.resyncs
    # the random target does emit tokens the drafter cannot propose; each one forces a re-sync
    assert outside > 0 and resyncs > 0


def test_kv_cache_is_reused_not_recomputed(tli, monkeypatch):
    fed = []
    model = tli.target.model
    orig = model.forward

    def spy(*args, **kwargs):
        fed.append(kwargs["input_ids"].shape[1])
        return orig(*args, **kwargs)

    monkeypatch.setattr(model, "forward", spy)
    out = tli.generate(PROMPTS[3], max_new_tokens=30, draft=DraftConfig(num_draft_tokens=3, adaptive=False))
    prompt_len = out.stats.prompt_tokens
    # round 0 feeds the prompt + k drafts; every later round feeds exactly 1 pending token + its drafts
    ks = out.stats.draft_lengths
    assert len(fed) == out.stats.rounds
    assert fed[0] == prompt_len + (ks[0] if ks else 0)
    assert sum(fed) == prompt_len + out.stats.drafted + out.stats.rounds - 1


def test_stats_are_consistent(tli):
    out = tli.generate(PROMPTS[0], max_new_tokens=25, params=SamplingParams(temperature=0.8), seed=5)
    s = out.stats.to_dict()
    assert s["new_tokens"] == len(out.token_ids) <= 25
    assert 0 <= s["accepted"] <= s["drafted"]
    assert sum(s["accepted_by_position"]) == s["accepted"] and sum(s["drafted_by_position"]) == s["drafted"]
    assert s["rounds"] >= 1 and s["total_s"] >= s["draft_s"] + s["verify_s"]
    assert 0.0 <= s["acceptance_rate"] <= 1.0


def test_sampling_is_seeded(tli):
    p = SamplingParams(temperature=1.0, top_p=0.95)
    a = tli.generate(PROMPTS[1], max_new_tokens=20, params=p, seed=11)
    b = tli.generate(PROMPTS[1], max_new_tokens=20, params=p, seed=11)
    c = tli.generate(PROMPTS[1], max_new_tokens=20, params=p, seed=12)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": -3}, "max_new_tokens"),
        ({"prompt": ""}, "prompt"),
        ({"max_new_tokens": 10_000}, "max_new_tokens"),
    ],
)
def test_bad_generate_arguments(tli, kwargs, field):
    args = {"prompt": "hello", "max_new_tokens": 5} | kwargs
    with pytest.raises(InvalidArgument) as e:
        tli.generate(args.pop("prompt"), **args)
    assert e.value.field == field


@pytest.mark.parametrize("k", [0, -1])
def test_bad_num_draft_tokens(k):
    with pytest.raises(InvalidArgument) as e:
        DraftConfig(num_draft_tokens=k)
    assert e.value.field == "num_draft_tokens"


# ---- sampled output is distributed as target-only sampling's ----------------------------------
#
# Exact checks (tests/exact.py): real runs are recorded round by round -- the p rows, the q rows,
# the drafts and the drafter's own draws -- and each round's emission distribution, at every
# position of its block, is integrated over the drafts and the uniforms through the verification
# function the run called, then compared with the target's row within 1e-9. Seeded chi-square runs
# of a few thousand samples stay as end-to-end guards, one per path.

PROMPT = "def add(a, b):\n"
FIXED = DraftConfig(num_draft_tokens=3, adaptive=False)
FULL_BLOCKS = DraftConfig(num_draft_tokens=3, adaptive=False, stop_below=0.0)  # every block drafts 3 tokens
GUARD_RUNS = 2_000  # samples of an end-to-end chi-square guard
# the batched test's hold on its schedulers' first batches: a liveness bound (the rows of threads
# released by one barrier arrive within milliseconds), never a batching window
HOLD_S = 3.0


def _sample_counts(engine, prompt, params, n, *, k=3):
    counts: dict = {}
    drafted = accepted = 0
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threading overhead dominates
    try:
        for seed in range(n):
            out = engine.generate(prompt, max_new_tokens=2, params=params, seed=seed,
                                  draft=DraftConfig(num_draft_tokens=k, adaptive=False))
            key = tuple(out.token_ids[:2])
            counts[key] = counts.get(key, 0) + 1
            drafted += out.stats.drafted
            accepted += out.stats.accepted
    finally:
        torch.set_num_threads(torch_threads)
    return counts, drafted, accepted


@pytest.fixture(scope="module")
def peaked_pair(tok_t, tok_d):
    # no EOS so that every run yields exactly two tokens; peaked heads so that a few thousand
    # samples fill the joint distribution's likely cells
    target = tiny_lm(tok_t, seed=1, arch="qwen2", extra_vocab=7, head_scale=25.0, with_eos=False)
    drafter = tiny_lm(tok_d, seed=2, head_scale=25.0)
    return target, drafter


@pytest.fixture(scope="module")
def tli_no_eos(peaked_pair, tmp_path_factory):
    return Engine(*peaked_pair, vocab_cache_dir=tmp_path_factory.mktemp("vocab"))


@pytest.fixture(scope="module")
def same_vocab_close(peaked_pair, tok_t, tmp_path_factory):
    """Same vocabulary, drafter = target + noise: most drafts are accepted (the other branch)."""

    target = peaked_pair[0]
    drafter = noisy_copy(target, 0.3, seed=9)
    return Engine(target, drafter, vocab_cache_dir=tmp_path_factory.mktemp("vocab"))


def _check_distribution(engine, params, n=GUARD_RUNS):
    """End-to-end guard: n seeded runs' first two tokens against target-only's exact joint."""
    prompt_ids = list(engine.target.tokenizer(PROMPT)["input_ids"])
    expected = exact.exact_two_token_distribution(engine, prompt_ids, params)
    counts, drafted, accepted = _sample_counts(engine, PROMPT, params, n)
    (chi2, pvalue), cells = exact.chi_square(counts, expected, n)
    assert cells >= 10, "distribution too concentrated to test anything"
    assert pvalue > 1e-3, f"chi2={chi2:.1f} over {cells} cells, p={pvalue:.2e}"
    # both branches of the acceptance rule were exercised
    assert 0 < accepted < drafted
    return accepted / drafted


def _capture_runs(engine, params, monkeypatch, seeds=(0, 1, 2, 3), max_new_tokens=8) -> exact.Capture:
    """Record seeded runs of full blocks (tests/exact.py)."""
    cap = exact.Capture(monkeypatch)
    for seed in seeds:
        engine.generate(PROMPT, max_new_tokens=max_new_tokens, params=params, seed=seed, draft=FULL_BLOCKS)
    return cap


def _check_exact(engine, params, monkeypatch, positions=(0, 1, 2, 3), limit=8,
                 **kw) -> tuple[exact.Capture, exact.Report]:
    """Record real runs and check their first ``limit`` speculative rounds exactly (tests/exact.py)."""
    cap = _capture_runs(engine, params, monkeypatch, **kw)
    report = exact.check_rounds(cap, engine.target.model, engine.pair.d2t, engine.drafter.model, limit=limit)
    # both branches: draft positions where acceptance and rejection both have probability
    assert any(0 < a < 1 for a in report.accept_mass)
    # positions after the first, conditioned on an accepted prefix, and the bonus token
    assert set(positions) <= set(report.by_position), report.by_position
    return cap, report


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, top_k=100, top_p=0.95, repetition_penalty=1.3),
    ],
    ids=["temperature", "topk-topp-penalty"],
)
def test_tli_sampling_is_exactly_lossless(tli_no_eos, params, monkeypatch):
    """TLI: q masked to the vocabulary intersection and mapped into target ids; the target's
    tokens outside the intersection (q = 0 there) come only from the residual."""
    if params.top_k == 0:
        cap, report = _check_exact(tli_no_eos, params, monkeypatch)
    else:  # the filtered target gives many drafts probability 0: fewer prefixes reach the later positions
        cap, report = _check_exact(tli_no_eos, params, monkeypatch, positions=(0, 1, 2), limit=None, seeds=range(8))
    assert report.nodes >= 20
    # rows where the target puts mass on tokens the drafter cannot propose were among those checked
    vocab = int(tli_no_eos.target.vocab_size)
    outside = torch.ones(vocab, dtype=torch.bool)
    outside[: len(tli_no_eos.t2d)] = torch.as_tensor(tli_no_eos.t2d < 0)
    assert max(float(vc.p[:, outside].sum(-1).max()) for vc in cap.speculative()) > 1e-3


def test_tli_sampling_matches_target_only_distribution(tli_no_eos):
    _check_distribution(tli_no_eos, SamplingParams(temperature=1.0))


def test_same_vocab_sampling_is_exactly_lossless(same_vocab_close, monkeypatch):
    _, report = _check_exact(same_vocab_close, SamplingParams(temperature=1.0), monkeypatch)
    assert float(np.mean(report.accept_mass)) > 0.3  # a close drafter: the accept branch carries most mass


def test_same_vocab_high_acceptance_matches_target_only_distribution(same_vocab_close):
    rate = _check_distribution(same_vocab_close, SamplingParams(temperature=1.0))
    assert rate > 0.3


def test_stats_name_the_draws(tli):
    """Stats.draws tells a caller how the tokens were chosen; unseeded-style rejection sampling here."""
    out = tli.generate(PROMPTS[0], max_new_tokens=4, params=SamplingParams(temperature=1.0), seed=1)
    assert out.stats.draws == "rejection" and out.stats.to_dict()["draws"] == "rejection"


def _accept_all(p, q, drafts, seed, round_index):
    """A lossy verification: every draft accepted."""
    k = len(drafts)
    return S.VerifyOutcome(k, S.sample_from(p[k], S.uniform(seed, round_index, k, S.STREAM_EMIT)), [True] * k)


def test_the_exact_check_fails_for_a_lossy_sampler(tli_no_eos, monkeypatch):
    """Negative control: accept every draft and the exact check must fail -- on the emission
    distribution, with every other check passing."""
    monkeypatch.setattr(S, "verify_sampling", _accept_all)
    cap = _capture_runs(tli_no_eos, SamplingParams(temperature=1.0), monkeypatch, seeds=(0,))
    vc = cap.speculative()[0]
    assert vc.fn is _accept_all
    exact.check_target_rows(tli_no_eos.target.model, vc)
    exact.check_drafts(cap, vc, tli_no_eos.pair.d2t, tli_no_eos.drafter.model)
    with pytest.raises(AssertionError, match="emits a distribution"):
        exact.check_exact(cap, vc)


def _hold_first_batch(sched, rows: int) -> list[int]:
    """Hold the scheduler's first batch until it has ``rows`` rows (it is told that many callers are
    inside the worker, and waits up to HOLD_S for them), then batch as usual. Returns the rows of
    each batch, as they run."""
    sizes: list[int] = []
    busy = sched.busy
    sched.busy = lambda: rows
    sched._max_wait_s = lambda: HOLD_S

    def observe(n, tokens, waits):  # on the scheduler's thread, after each batch
        sizes.append(n)
        if len(sizes) == 1:
            sched.busy = busy
            del sched._max_wait_s

    sched.stats.observers.append(observe)
    return sizes


def test_tli_sampling_in_shared_batches_is_lossless(tli_no_eos, peaked_pair, monkeypatch):
    """Losslessness with batching: sessions in 8 threads over batched drafter and verifier workers.
    The first drafting step and the first verification of the first 8 sessions are held into one
    forward of 8 rows each; the rounds recorded (those 8 included) are checked exactly, and all
    sampled pairs against target-only's joint distribution. How later forwards are shared depends
    on the threads' timing, and nothing asserted depends on it."""
    import threading

    from crossdraft.decoding.decode import Decoder
    from crossdraft.runtime.batching import BatchConfig
    from crossdraft.runtime.workers import DrafterWorker, VerifierWorker, WorkerConfig

    params = SamplingParams(temperature=1.0)
    engine = tli_no_eos
    t_ids = list(engine.target.tokenizer(PROMPT)["input_ids"])
    d_ids = engine.pair.encode_drafter(PROMPT)
    expected = exact.exact_two_token_distribution(engine, t_ids, params)
    target, drafter = peaked_pair
    cfg = WorkerConfig(max_sessions=64)
    vb = VerifierWorker(target, cfg, batch=BatchConfig(max_wait_ms=20))
    db = DrafterWorker(drafter, cfg, batch=BatchConfig(max_wait_ms=20))
    dec = Decoder(engine.pair, vb, db, eos_ids=target.eos_token_ids, max_context=vb.max_context)
    n, threads = 2_000, 8
    v_sizes = _hold_first_batch(vb.scheduler, threads)
    d_sizes = _hold_first_batch(db.scheduler, threads)
    cap = exact.Capture(monkeypatch, keep=48)
    counts: dict = {}
    drafted = accepted = 0
    lock = threading.Lock()
    start = threading.Barrier(threads)
    errors = []

    def worker(w):
        nonlocal drafted, accepted
        try:
            start.wait(60)
            for seed in range(w, n, threads):
                sid = f"chi-{seed}"
                run = dec.run(sid, t_ids, d_ids, max_new_tokens=2, params=params, seed=seed, draft=FIXED)
                for _ in run:
                    pass
                vb.end(sid)
                db.end(sid)
                key = tuple(run.result.token_ids[:2])
                with lock:
                    counts[key] = counts.get(key, 0) + 1
                    drafted += run.result.stats.drafted
                    accepted += run.result.stats.accepted
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ts = [threading.Thread(target=worker, args=(w,)) for w in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(600)
    finally:
        torch.set_num_threads(torch_threads)
        vb.scheduler.close()
        db.scheduler.close()
    assert not errors, errors[0]
    assert sum(counts.values()) == n
    # the first sessions' first drafting step and first verification each ran as one forward of 8 rows
    assert d_sizes[0] == threads and v_sizes[0] == threads
    report = exact.check_rounds(cap, target.model, engine.pair.d2t, drafter.model)
    assert report.nodes >= 24
    (chi2, pvalue), cells = exact.chi_square(counts, expected, n)
    assert cells >= 10
    assert pvalue > 1e-3, f"chi2={chi2:.1f} over {cells} cells, p={pvalue:.2e}"
    assert 0 < accepted < drafted


@pytest.mark.parametrize("where", ["at the start", "mid-request"])
def test_a_drafter_whose_context_runs_out_falls_back_instead_of_failing(target, drafter, tmp_path_factory, where):
    """The drafter's context can be shorter than the target's, and its tokenizer may spell the same
    text in more tokens: a request that fits the target's context must not fail because the drafter
    cannot hold it. The drafter is dropped -- when the prompt is already too long for it, or when its
    history outgrows it mid-request -- and the output is the target-only one. Found by
    benchmarks/soak.py: chat sessions on the tiny models, whose drafter spells a conversation in
    ~30% more tokens, failed with "token_ids: N tokens exceed the model's context"."""
    eng = Engine(target, drafter, vocab_cache_dir=tmp_path_factory.mktemp("vocab"))
    prompt = PROMPTS[3]
    n_d = len(eng.pair.encode_drafter(prompt))
    # mid-request: room for the first block (greedy blocks may run to max_draft_tokens) and a few more
    eng.drafter_worker.max_context = n_d - 1 if where == "at the start" else n_d + DraftConfig().max_draft_tokens + 4
    ref = eng.generate(prompt, max_new_tokens=40, use_drafter=False)
    for temperature in (0.0, 0.8):
        params = SamplingParams(temperature=temperature)
        # fixed blocks: the drafter keeps drafting (an adaptive policy may pause it for this random pair)
        out = eng.generate(prompt, max_new_tokens=40, params=params, seed=5,
                           draft=DraftConfig(num_draft_tokens=4, adaptive=False))
        assert len(out.token_ids) == 40
        if temperature == 0:
            assert out.token_ids == ref.token_ids
        assert out.stats.drafter_fallback
        assert "drafter refused" in out.stats.fallback_reason and "context" in out.stats.fallback_reason
        assert (out.stats.drafted > 0) == (where == "mid-request")


# ---- coupled draws (crossdraft.decoding.coupled) ------------------------------------------------------


_FILTERED = SamplingParams(temperature=0.7, top_k=50, top_p=0.9, repetition_penalty=1.2, coupled=True)


@pytest.mark.parametrize("engine_name, params, accepts", [
    ("tli_no_eos", SamplingParams(temperature=1.0, coupled=True), True),
    ("tli_no_eos", _FILTERED, False),  # this random drafter's filtered picks never hit the target's
    ("same_vocab_close", SamplingParams(temperature=1.0, coupled=True), True),
    ("same_vocab_close", _FILTERED, True),
], ids=["tli-temperature", "tli-topk-topp-penalty", "same-vocab-temperature", "same-vocab-topk-topp-penalty"])
def test_coupled_sampling_gives_the_target_only_text_whatever_is_drafted(request, engine_name, params, accepts):
    """A seed's text is a function of (seed, prompt): target-only, fixed blocks of 1, 3 or 6, and the
    adaptive policy all give the same tokens, drafts accepted or not."""
    engine = request.getfixturevalue(engine_name)
    drafted = accepted = 0
    for seed in range(4):
        for prompt in PROMPTS[:2]:
            ref = engine.generate(prompt, max_new_tokens=24, params=params, seed=seed, use_drafter=False)
            for k, adaptive in [(1, False), (3, False), (6, False), (4, True)]:
                draft = DraftConfig(num_draft_tokens=k, adaptive=adaptive, cost_model="static")
                out = engine.generate(prompt, max_new_tokens=24, params=params, seed=seed, draft=draft)
                assert out.token_ids == ref.token_ids, (seed, prompt, k, adaptive)
                assert out.stats.draws == ref.stats.draws == "coupled"
                drafted += out.stats.drafted
                accepted += out.stats.accepted
    assert accepted < drafted  # rejections happened
    assert (accepted > 0) == accepts  # and, where the pair can, acceptances
    other = engine.generate(PROMPTS[0], max_new_tokens=24, params=params, seed=99, use_drafter=False)
    assert other.token_ids != engine.generate(PROMPTS[0], max_new_tokens=24, params=params, seed=0,
                                              use_drafter=False).token_ids


@pytest.mark.parametrize("engine_name, params", [
    ("tli_no_eos", SamplingParams(temperature=1.0, coupled=True)),
    ("tli_no_eos", _FILTERED),
    ("same_vocab_close", SamplingParams(temperature=1.0, coupled=True)),
], ids=["tli-temperature", "tli-topk-topp-penalty", "same-vocab-temperature"])
def test_coupled_sampling_emits_the_targets_own_draws_whatever_is_drafted(request, engine_name, params, monkeypatch):
    """Exact check of coupled draws on recorded rounds: the processed rows are target-only's, and at
    every position the block reaches, the verification emits the argmax of the row plus the full
    noise field of (seed, position) -- target-only's draw there -- for the target's own token and
    other ids drafted in its place. The output is then the target-only output token for token;
    that those draws follow softmax of the row is the noise field's property (tests/unit/decoding/test_coupled.py)."""
    engine = request.getfixturevalue(engine_name)
    cap = _capture_runs(engine, params, monkeypatch)
    report = exact.check_rounds(cap, engine.target.model)
    assert report.nodes >= 20
    assert all(vc.fn is not None and vc.processed is not None for vc in cap.speculative())


def test_coupled_sampling_matches_target_only_distribution(tli_no_eos):
    """End-to-end guard with coupled draws: the two-token joint over seeded runs follows the
    target's exact distribution (the positions draw independently)."""
    _check_distribution(tli_no_eos, SamplingParams(temperature=1.0, coupled=True), n=2_000)


def test_coupled_drafting_ships_no_distribution_and_reads_the_targets_noise(tli_no_eos, monkeypatch):
    """The drafter's proposals under coupled draws carry no q rows (the verifier's test uses none);
    the drafter knows the target id of each allowed id (sent with the mask) and the target position
    of each block."""
    engine = tli_no_eos
    w = engine.drafter_worker
    seen = []
    orig = w.draft

    def spy(*args, **kwargs):
        toks = orig(*args, **kwargs)
        seen.append((kwargs.get("position"), toks))
        return toks

    monkeypatch.setattr(w, "draft", spy)
    params = SamplingParams(temperature=1.0, coupled=True)
    out = engine.generate(PROMPTS[0], max_new_tokens=8, params=params, seed=3,
                          draft=DraftConfig(num_draft_tokens=3, adaptive=False))
    assert out.stats.drafted > 0 and seen
    assert all(t.q_ids is None and t.q_probs is None for _, toks in seen for t in toks)
    n_prompt = out.stats.prompt_tokens
    assert seen[0][0] == n_prompt  # the first block's first proposal stands at the prompt's end
    assert all(n_prompt <= pos < n_prompt + 8 for pos, _ in seen)
    allowed = w.allowed(engine.pair.keys["tli"])
    assert allowed.target_ids is not None
    assert np.array_equal(allowed.target_ids, engine.pair.d2t[allowed.ids.numpy()])


# ---- a smaller draft vocabulary (the drafter's most frequent tokens) --------------------------


@pytest.mark.parametrize("mode", ["tli", "text"])
def test_a_smaller_draft_vocabulary_keeps_greedy_identical_and_prunes_the_head(target, drafter, tmp_path_factory,
                                                                                mode):
    full = Engine(target, drafter, vocab_cache_dir=tmp_path_factory.mktemp("vocab"))
    eng = Engine(target, drafter, vocab_cache_dir=tmp_path_factory.mktemp("vocab"), draft_vocab=160)
    draft = DraftConfig(num_draft_tokens=3, adaptive=False, mode=mode)
    for prompt in PROMPTS[:3]:
        ref = eng.generate(prompt, max_new_tokens=32, use_drafter=False)
        out = eng.generate(prompt, max_new_tokens=32, draft=draft)
        assert out.token_ids == ref.token_ids and out.stats.drafted > 0
    n = int(eng.pair.masks[mode].sum())
    assert 0 < n < int(full.pair.masks[mode].sum())
    # the drafter computes logits for those rows only: its mask's LM head is pruned to them
    allowed = eng.drafter_worker.masks[eng.pair.keys[mode]]
    assert allowed.count == n and allowed.head is not None and allowed.head.shape[0] == n


def test_a_smaller_draft_vocabulary_is_exactly_lossless(peaked_pair, tmp_path_factory, monkeypatch):
    """Sampling stays lossless when the drafter drafts from a subset of the intersection (the
    target's tokens outside it come from the residual): exact check on recorded rounds."""
    eng = Engine(*peaked_pair, vocab_cache_dir=tmp_path_factory.mktemp("vocab"), draft_vocab=200)
    small = int(eng.pair.masks["tli"].sum())
    assert small < int(eng.pair.allowed.sum())
    cap, _ = _check_exact(eng, SamplingParams(temperature=1.0), monkeypatch)
    # the drafts and q rows checked came from the smaller set (exact.check_drafts: q within the drafter's set)
    assert all(vc.draft.allowed.count == small for vc in cap.speculative())


@pytest.mark.parametrize("lose", ["verifier", "drafter", "both"])
def test_a_model_server_that_loses_the_session_mid_request_is_resynced_with_the_same_output(tli, monkeypatch, lose):
    """A model server may drop a session between rounds (a restart, an LRU eviction): its next
    verify or draft answers NotFound, and the round loop syncs the session's history again and
    retries that call. The output is the uninterrupted run's, token for token (greedy)."""
    draft = DraftConfig(num_draft_tokens=3, adaptive=False)
    ref = tli.generate(PROMPTS[0], max_new_tokens=24, draft=draft)
    workers = {"verifier": [tli.verifier], "drafter": [tli.drafter_worker],
               "both": [tli.verifier, tli.drafter_worker]}[lose]
    syncs = {id(w): 0 for w in workers}
    for w in workers:
        orig_sync = w.sync

        def sync(sid, ids, *a, _w=w, _orig=orig_sync, **kw):
            syncs[id(_w)] += 1
            return _orig(sid, ids, *a, **kw)

        monkeypatch.setattr(w, "sync", sync)
    tli._n += 1
    sid = f"engine-{tli._n}"
    run = tli.decoder.run(sid, tli.pair.encode_target(PROMPTS[0]), tli.pair.encode_drafter(PROMPTS[0]),
                          max_new_tokens=24, params=SamplingParams(), seed=0, draft=draft)
    dropped = 0
    try:
        for i, _ in enumerate(run):
            if i in (1, 3):  # between rounds, twice: the worker forgets the session
                for w in workers:
                    assert w.end(sid)
                dropped += 1
    finally:
        tli.verifier.end(sid)
        tli.drafter_worker.end(sid)
    assert dropped == 2
    assert run.result.token_ids == ref.token_ids
    # each loss costs exactly one extra sync of that worker, beyond the one at the start
    assert all(n == 1 + dropped for n in syncs.values()), syncs


@pytest.mark.parametrize("evictions", [1, 99])
def test_a_session_evicted_again_between_its_resync_and_its_verification(tli, monkeypatch, evictions):
    """A full KV pool may evict a session again between the loop's re-sync and its verification: the loop
    syncs once more (the same output, token for token), and a session evicted at every try ends the request
    with ResourceExhausted (HTTP 429, retry later) after a few tries -- not NotFound, not a loop without end."""
    draft = DraftConfig(num_draft_tokens=3, adaptive=False)
    ref = tli.generate(PROMPTS[0], max_new_tokens=16, draft=draft)
    v = tli.verifier
    orig_sync, state = v.sync, {"armed": False, "evicted": 0, "syncs": 0}

    def sync(sid, ids, *a, **kw):
        out = orig_sync(sid, ids, *a, **kw)
        state["syncs"] += 1
        if state["armed"] and state["evicted"] < evictions:  # another session's prefill takes its blocks
            state["evicted"] += 1
            assert v.end(sid)
        return out

    monkeypatch.setattr(v, "sync", sync)
    tli._n += 1
    sid = f"engine-{tli._n}"
    run = tli.decoder.run(sid, tli.pair.encode_target(PROMPTS[0]), tli.pair.encode_drafter(PROMPTS[0]),
                          max_new_tokens=16, params=SamplingParams(), seed=0, draft=draft)
    try:
        with contextlib.ExitStack() as raises:
            if evictions > 3:
                raises.enter_context(pytest.raises(ResourceExhausted, match="evicted"))
            for i, _ in enumerate(run):
                if i == 1:  # between rounds the verifier forgets the session, and the re-sync is evicted too
                    assert v.end(sid)
                    state["armed"] = True
    finally:
        v.end(sid)
        tli.drafter_worker.end(sid)
    if evictions == 1:
        assert run.result.token_ids == ref.token_ids
        assert state["syncs"] == 3  # the start, the re-sync that was evicted, the one that held
    else:
        assert state["evicted"] == state["syncs"] - 1 <= 4  # a bounded number of tries
