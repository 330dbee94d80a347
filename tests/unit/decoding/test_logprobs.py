"""Log-probabilities of generated tokens: the TARGET's, after the request's logits processing,
exact whether a token was an accepted draft, a resample or the bonus token -- checked against a
from-scratch forward of the target over the whole text (tiny random-init fp32 models)."""

from __future__ import annotations

import pytest
import torch

from crossdraft.decoding.decode import Decoder
from crossdraft.decoding.policy import DraftConfig
from crossdraft.decoding.sampling import SamplingParams, process_logits
from crossdraft.errors import InvalidArgument
from crossdraft.runtime.batching import BatchConfig
from crossdraft.runtime.workers import DrafterWorker, VerifierWorker, WorkerConfig
from crossdraft.vocab.pair import TokenPair
from tests.tiny_models import tiny_lm

WCFG = WorkerConfig(max_sessions=16)
PROMPT = "the cat sat on"


@pytest.fixture(scope="module")
def drafter(tok_d):
    return tiny_lm(tok_d, seed=2, arch="llama")


def _decoder(target, drafter, tok_t, tok_d, batched=False):
    pair = TokenPair(tok_t, tok_d, target.vocab_size, drafter.vocab_size)
    b = BatchConfig() if batched else None
    return Decoder(pair, VerifierWorker(target, WCFG, batch=b), DrafterWorker(drafter, WCFG, batch=b), eos_ids=())


def _generate(dec, params, top, use_drafter=True, n=24):
    pair = dec.pair
    prompt = pair.encode_target(PROMPT)
    r = dec.run("s", prompt, pair.encode_drafter(PROMPT), max_new_tokens=n, params=params, seed=5,
                draft=DraftConfig(num_draft_tokens=3, adaptive=False, mode="tli"), use_drafter=use_drafter,
                top_logprobs=top)
    evs = list(r)
    return prompt, r.result, evs


@torch.inference_mode()
def _reference(target, prompt, gen, params):
    """log_softmax of the processed logits at every generated position, one plain forward."""
    ids = torch.tensor([prompt + gen])
    logits = target.model(ids).logits[0, len(prompt) - 1: len(prompt) + len(gen) - 1].float()
    presence = None
    if params.repetition_penalty != 1.0:
        from crossdraft.decoding import sampling as S

        ctx = torch.tensor(prompt)
        presence = S.presence_rows(ctx, torch.tensor(gen[:-1]) if len(gen) > 1 else None, logits.shape[-1], len(gen))
    return torch.log_softmax(process_logits(logits, params, presence).double(), dim=-1)


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, top_k=20)],
                         ids=["greedy", "sampling-topk"])
def test_logprobs_are_the_targets_at_every_position(target, drafter, tok_t, tok_d, params, batched):
    dec = _decoder(target, drafter, tok_t, tok_d, batched)
    prompt, res, evs = _generate(dec, params, top=4)
    assert res.stats.drafted > 0  # drafts were verified: accepted ones, resamples and bonus tokens
    gen = res.token_ids
    assert len(res.logprobs) == len(gen)
    # the rounds' pieces line up with their tokens and add up to the whole
    assert [len(e.logprobs) for e in evs] == [len(e.emitted) for e in evs]
    assert [x for e in evs for x in e.logprobs] == res.logprobs
    ref = _reference(target, prompt, gen, params)
    for i, (tok, (lp, ids, vals)) in enumerate(zip(gen, res.logprobs, strict=True)):
        assert lp == pytest.approx(float(ref[i, tok]), abs=1e-4)
        want_vals, want_ids = torch.topk(ref[i], 4)
        keep = torch.isfinite(want_vals)
        assert ids == want_ids[keep].tolist()
        assert vals == pytest.approx(want_vals[keep].tolist(), abs=1e-4)
        assert all(v <= 0 for v in vals) and vals == sorted(vals, reverse=True)
        if params.greedy:
            assert ids[0] == tok and lp == pytest.approx(vals[0])
        if params.top_k:
            assert len(ids) <= params.top_k


def test_logprobs_do_not_change_the_tokens_and_zero_means_no_alternatives(target, drafter, tok_t, tok_d):
    dec = _decoder(target, drafter, tok_t, tok_d)
    _, plain, _ = _generate(dec, SamplingParams(temperature=0.7), top=-1)
    _, with0, _ = _generate(dec, SamplingParams(temperature=0.7), top=0)
    assert plain.logprobs is None and with0.token_ids == plain.token_ids and with0.text == plain.text
    assert len(with0.logprobs) == len(with0.token_ids) and all(ids == [] for _, ids, _ in with0.logprobs)


def test_target_only_logprobs_too(target, drafter, tok_t, tok_d):
    dec = _decoder(target, drafter, tok_t, tok_d)
    prompt, res, _ = _generate(dec, SamplingParams(), top=1, use_drafter=False)
    ref = _reference(target, prompt, res.token_ids, SamplingParams())
    assert [lp for lp, _, _ in res.logprobs] == pytest.approx(
        [float(ref[i, t]) for i, t in enumerate(res.token_ids)], abs=1e-4)


@pytest.mark.parametrize("bad", [21, -2, 1.5, True])
def test_bad_top_logprobs_is_refused(target, drafter, tok_t, tok_d, bad):
    dec = _decoder(target, drafter, tok_t, tok_d)
    with pytest.raises(InvalidArgument) as e:
        _generate(dec, SamplingParams(), top=bad)
    assert e.value.field == "top_logprobs"


def test_openai_shapes_of_logprobs(target, drafter, tok_t, tok_d):
    """The REST shapes: completions {tokens, token_logprobs, top_logprobs, text_offset}; chat
    {content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""
    from gateway.rest_json import logprobs_json as _logprobs_json

    pair = TokenPair(tok_t, tok_d, target.vocab_size, drafter.vocab_size)
    ids = pair.encode_target("hello world")
    lps = [(-0.5 * (i + 1), [t, 7], [-0.5 * (i + 1), -3.0]) for i, t in enumerate(ids)]
    comp = _logprobs_json(pair, ids, lps, chat=False, offset=10)
    texts = [pair.target_text_bytes([t]).decode() for t in ids]
    assert comp["tokens"] == texts and "".join(texts) == "hello world"
    assert comp["token_logprobs"] == [x[0] for x in lps]
    assert comp["text_offset"][0] == 10 and comp["text_offset"][-1] == 10 + len("hello world") - len(texts[-1])
    assert all(len(d) <= 2 for d in comp["top_logprobs"])
    chat = _logprobs_json(pair, ids, lps, chat=True)
    c0 = chat["content"][0]
    assert c0["token"] == texts[0] and c0["bytes"] == list(texts[0].encode()) and c0["logprob"] == -0.5
    assert [t["logprob"] for t in c0["top_logprobs"]] == [-0.5, -3.0]
    assert _logprobs_json(pair, ids, None, chat=True) is None
