"""Pipelined rounds on the catalog's real models, fp32 targets: greedy output token-identical pipelined and
target-only (serial rounds on real models: tests/integration/test_real_models.py).

Two pairs, in process (the gateway's round loop; ``engine.decoder.pipeline`` switches pipelining
between runs of one engine): qwen2.5-coder-0.5b with int8 weights drafting for its fp32 self (one
vocabulary: blocks drafted ahead are target ids as they are; the int8 copy loads from the package's
models in seconds, where the 1.5b would cost a minute of the suite), and smollm2-135m drafting for gemma3-270m in text
mode (two vocabularies: the block ahead continues from the drafter's own text, re-encoded into
gemma3's tokens). The prompts are tests/integration/test_real_models.py's -- the target-only
references of gemma3-270m are shared with it (`target_only`) -- Chinese among them, whose output
holds gemma3 tokens outside SmolLM2's vocabulary.
"""

from __future__ import annotations

import pytest
import torch

from crossdraft.engine import DraftConfig, Engine
from crossdraft.models import loading as M
from tests.integration.test_real_models import N_TOKENS, PROMPTS

pytestmark = pytest.mark.real_models


@pytest.fixture(scope="module")
def qwen_pair(catalog_model):
    """The package's shared fp32 qwen2.5-coder-0.5b as the target, an int8 copy as the drafter."""
    return Engine(catalog_model("qwen2.5-coder-0.5b"), catalog_model("qwen2.5-coder-0.5b", quantize="int8"),
                  pipeline="on")


@pytest.fixture(scope="module")
def gemma_pair(catalog_model):
    # the models as tests/integration/test_real_models.py loads them (one copy each per package)
    return Engine(catalog_model("gemma3-270m", dtype=torch.float32),
                  catalog_model("smollm2-135m", dtype=M.DEFAULT_DTYPES["drafter"]), pipeline="on")


def _identical(engine, target_only, mode: str, prompts: list[str]) -> dict:
    """Each prompt: pipelined runs give target-only's ids; their counts. (Serial rounds' identity on real
    models is tests/integration/test_real_models.py's; serial runs that pipeline nothing,
    tests/unit/decoding/test_pipeline.py's.)"""
    # fixed blocks, which pipeline whenever they can: an adaptive policy runs a block pipelined only where
    # that beats running it serially, and for a pair near its break-even (or a drafter priced as costly as
    # its target: the int8 copy at static costs) rightly drafts little in 24 tokens
    draft = DraftConfig(num_draft_tokens=4, mode=mode, adaptive=False)
    total = {"pipelined_blocks": 0, "dropped_blocks": 0, "drafted": 0}
    try:
        for prompt in prompts:
            ref = target_only(engine, prompt, N_TOKENS)
            engine.decoder.pipeline = True
            piped = engine.generate(prompt, max_new_tokens=N_TOKENS, draft=draft)
            assert piped.token_ids == ref.token_ids, f"pipelined diverged on {prompt!r}"
            assert piped.text == ref.text
            assert piped.stats.draft_mode == mode
            for k in total:
                total[k] += getattr(piped.stats, k)
    finally:
        engine.decoder.pipeline = True
    return total


def test_greedy_pipelined_is_identical_on_the_qwen_pair(qwen_pair, target_only):
    """One vocabulary: blocks drafted ahead were verified in place of the round's own token -- with the
    target-only ids. (The int8 copy rarely disagrees with its fp32 self: the dropped branch on real
    models is the text-mode pair's below, and the tiny pairs' in tests/unit/decoding/test_pipeline.py.)
    The code and prose prompts: with one vocabulary the Chinese prompt exercises nothing more here (the
    text-mode pair below runs it)."""
    total = _identical(qwen_pair, target_only, "tli", PROMPTS[:2])
    assert total["pipelined_blocks"] > 0, total


def test_greedy_pipelined_is_identical_across_vocabularies_in_text_mode(gemma_pair, target_only):
    """Two vocabularies, text mode: blocks were drafted ahead from the drafter's own text, and the
    Chinese prompt's output holds target tokens outside the drafter's vocabulary (text the drafter
    cannot propose as one of its tokens) -- the same ids as target-only."""
    total = _identical(gemma_pair, target_only, "text", PROMPTS)
    assert total["pipelined_blocks"] > 0 and total["dropped_blocks"] > 0, total
    chinese = target_only(gemma_pair, PROMPTS[2], N_TOKENS)
    eos = gemma_pair.target.eos_token_ids
    assert [t for t in chinese.token_ids if gemma_pair.t2d[t] < 0 and t not in eos], "no token outside the drafter's"
