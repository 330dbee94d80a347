"""The whole engine with tiny random-init models and two different small tokenizers.

Real transformers models and real tokenizers; only the weights are random (so the tests run in
seconds on a CPU). The drafter's vocabulary (SentencePiece-like with byte fallback) differs from
the target's (byte-level BPE), so these runs exercise TLI: masking to the intersection, mapping
q into target ids, rejection into tokens outside the intersection and drafter re-sync.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats as sst

from crossdraft import sampling as S
from crossdraft.engine import DraftConfig, Engine
from crossdraft.errors import InvalidArgument
from crossdraft.sampling import SamplingParams
from tests.tiny_models import tiny_lm

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


# ---- the distribution of sampled output equals target-only sampling --------------------------

N_RUNS = 20_000


def _exact_two_token_distribution(engine, prompt_ids, params):
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


def _chi_square(counts: dict, expected_p: dict, n: int):
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
    # no EOS so that every run yields exactly two tokens; peaked heads so that 20,000 samples
    # populate a few hundred cells of the joint distribution
    target = tiny_lm(tok_t, seed=1, arch="qwen2", extra_vocab=7, head_scale=25.0, with_eos=False)
    drafter = tiny_lm(tok_d, seed=2, head_scale=25.0)
    return target, drafter


@pytest.fixture(scope="module")
def tli_no_eos(peaked_pair, tmp_path_factory):
    return Engine(*peaked_pair, vocab_cache_dir=tmp_path_factory.mktemp("vocab"))


@pytest.fixture(scope="module")
def same_vocab_close(peaked_pair, tok_t, tmp_path_factory):
    """Same vocabulary, drafter = target + noise: most drafts are accepted (the other branch)."""
    import copy

    target = peaked_pair[0]
    drafter = copy.deepcopy(target)
    torch.manual_seed(9)
    with torch.no_grad():
        for prm in drafter.model.parameters():
            prm.add_(0.3 * prm.std() * torch.randn_like(prm))
    return Engine(target, drafter, vocab_cache_dir=tmp_path_factory.mktemp("vocab"))


def _check_distribution(engine, params, n=N_RUNS):
    prompt = "def add(a, b):\n"
    prompt_ids = list(engine.target.tokenizer(prompt)["input_ids"])
    expected = _exact_two_token_distribution(engine, prompt_ids, params)
    counts, drafted, accepted = _sample_counts(engine, prompt, params, n)
    (chi2, pvalue), cells = _chi_square(counts, expected, n)
    assert cells >= 50, "distribution too concentrated to test anything"
    assert pvalue > 1e-3, f"chi2={chi2:.1f} over {cells} cells, p={pvalue:.2e}"
    # both branches of the acceptance rule were exercised
    assert 0 < accepted < drafted
    return accepted / drafted


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, top_k=100, top_p=0.95, repetition_penalty=1.3),
    ],
    ids=["temperature", "topk-topp-penalty"],
)
def test_tli_sampling_matches_target_only_distribution(tli_no_eos, params):
    _check_distribution(tli_no_eos, params)


def test_same_vocab_high_acceptance_matches_target_only_distribution(same_vocab_close):
    rate = _check_distribution(same_vocab_close, SamplingParams(temperature=1.0))
    assert rate > 0.3


def test_stats_name_the_draws(tli):
    """Stats.draws tells a caller how the tokens were chosen; unseeded-style rejection sampling here."""
    out = tli.generate(PROMPTS[0], max_new_tokens=4, params=SamplingParams(temperature=1.0), seed=1)
    assert out.stats.draws == "rejection" and out.stats.to_dict()["draws"] == "rejection"


def test_chi_square_detects_a_lossy_sampler(tli_no_eos, monkeypatch):
    """Negative control: accept every draft (the HF 5.24 failure mode) and the check must fail."""
    params = SamplingParams(temperature=1.0)
    prompt = "def add(a, b):\n"
    prompt_ids = list(tli_no_eos.target.tokenizer(prompt)["input_ids"])
    expected = _exact_two_token_distribution(tli_no_eos, prompt_ids, params)

    def accept_all(p, q, drafts, seed, round_index):
        k = len(drafts)
        return S.VerifyOutcome(k, S.sample_from(p[k], S.uniform(seed, round_index, k, S.STREAM_EMIT)), [True] * k)

    monkeypatch.setattr(S, "verify_sampling", accept_all)
    counts, _, _ = _sample_counts(tli_no_eos, prompt, params, 3000)
    try:
        (_, pvalue), _ = _chi_square(counts, expected, 3000)
    except AssertionError:
        return  # produced pairs target-only sampling never would: detected
    assert pvalue < 1e-6


def test_tli_sampling_in_shared_batches_matches_target_only_distribution(tli_no_eos, peaked_pair):
    """Losslessness with batching: many sessions at once (8 threads) over batched drafter and
    verifier workers, so drafting steps and verification blocks share forwards; the sampled pairs
    still follow target-only sampling's exact distribution."""
    import threading

    from crossdraft.batching import BatchConfig
    from crossdraft.decode import Decoder
    from crossdraft.workers import DrafterWorker, VerifierWorker, WorkerConfig

    params = SamplingParams(temperature=1.0)
    engine = tli_no_eos
    prompt = "def add(a, b):\n"
    t_ids = list(engine.target.tokenizer(prompt)["input_ids"])
    d_ids = engine.pair.encode_drafter(prompt)
    expected = _exact_two_token_distribution(engine, t_ids, params)
    target, drafter = peaked_pair
    cfg = WorkerConfig(max_sessions=64)
    vb = VerifierWorker(target, cfg, batch=BatchConfig(max_wait_ms=20))
    db = DrafterWorker(drafter, cfg, batch=BatchConfig(max_wait_ms=20))
    dec = Decoder(engine.pair, vb, db, eos_ids=target.eos_token_ids, max_context=vb.max_context)
    n, threads = 8000, 8
    counts: dict = {}
    lock = threading.Lock()
    errors = []

    def worker(w):
        try:
            for seed in range(w, n, threads):
                sid = f"chi-{seed}"
                run = dec.run(sid, t_ids, d_ids, max_new_tokens=2, params=params, seed=seed,
                              draft=DraftConfig(num_draft_tokens=3, adaptive=False))
                for _ in run:
                    pass
                vb.end(sid)
                db.end(sid)
                key = tuple(run.result.token_ids[:2])
                with lock:
                    counts[key] = counts.get(key, 0) + 1
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
    (chi2, pvalue), cells = _chi_square(counts, expected, n)
    assert cells >= 30
    assert pvalue > 1e-3, f"chi2={chi2:.1f} over {cells} cells, p={pvalue:.2e}"
    # the forwards really were shared
    assert vb.scheduler.stats.rows > 1.5 * vb.scheduler.stats.batches
    assert db.scheduler.stats.rows > 1.5 * db.scheduler.stats.batches


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


# ---- coupled draws (crossdraft.coupled) ------------------------------------------------------


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


def test_coupled_sampling_matches_target_only_distribution(tli_no_eos):
    """The chi-square check of the rejection rule, with coupled draws: the two-token joint over
    6,000 seeds follows the target's exact distribution (the positions draw independently; the
    texts equal target-only's, tested above, so this checks the target's own draws)."""
    _check_distribution(tli_no_eos, SamplingParams(temperature=1.0, coupled=True), n=6000)


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


def test_a_smaller_draft_vocabulary_matches_target_only_distribution(peaked_pair, tmp_path_factory):
    """Sampling stays lossless when the drafter drafts from a subset of the intersection (the
    target's tokens outside it come from the residual)."""
    eng = Engine(*peaked_pair, vocab_cache_dir=tmp_path_factory.mktemp("vocab"), draft_vocab=200)
    assert int(eng.pair.masks["tli"].sum()) < int(eng.pair.allowed.sum())
    _check_distribution(eng, SamplingParams(temperature=1.0))
