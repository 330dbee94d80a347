"""Real catalog models with different vocabularies: greedy identity, sampling, CLI errors.

smollm2-135m (49,152-token byte-level BPE) drafts for gemma3-270m (262,144-token SentencePiece)
and for qwen2.5-coder-0.5b (151,936-token byte-level BPE). The models are pulled by `make models`
(or on first use) into $CROSSDRAFT_HOME.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from crossdraft.decoding.sampling import SamplingParams
from crossdraft.engine import DraftConfig, Engine
from crossdraft.models import loading as M

pytestmark = pytest.mark.real_models

PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The three primary colors are",
    # Chinese output: most of its target tokens are outside SmolLM2's vocabulary, so the target
    # emits tokens the drafter can never propose and the drafter must re-sync from text.
    "请用中文回答：天空为什么是蓝色的？",
]
N_TOKENS = 24  # as tests/integration/test_services_real.py: the target-only references are shared


@pytest.fixture(scope="module")
def smol(catalog_model):
    return catalog_model("smollm2-135m", dtype=M.DEFAULT_DTYPES["drafter"])


@pytest.fixture(scope="module", params=["gemma3-270m", "qwen2.5-coder-0.5b"])
def engine(request, smol, catalog_model):
    # fp32 target: verification and target-only decoding then agree to the last bit that matters
    return Engine(catalog_model(request.param, dtype=torch.float32), smol)


def test_greedy_identical_to_target_only(engine, target_only):
    outside_total = 0
    for prompt in PROMPTS:
        ref = target_only(engine, prompt, N_TOKENS)
        # TLI drafting (the intersection) and text drafting (greedy: drafted text re-encoded)
        for mode in ("tli", "text"):
            # static costs: with measured ones this pair near its break-even (a smollm2 step ~0.7 of
            # a gemma3 one) rightly drafts nothing in 24 tokens, and drafting is what is tested here
            out = engine.generate(prompt, max_new_tokens=N_TOKENS,
                                  draft=DraftConfig(num_draft_tokens=4, mode=mode, cost_model="static"))
            assert out.token_ids == ref.token_ids, f"{mode} diverged on {prompt!r}"
            assert out.text == ref.text
            assert out.stats.drafted > 0 and out.stats.draft_mode == mode
            if mode == "tli":
                outside = [t for t in ref.token_ids if engine.t2d[t] < 0 and t not in engine.target.eos_token_ids]
                outside_total += len(outside)
                if outside:
                    assert out.stats.resyncs > 0
    assert outside_total > 0, "no prompt needed a target token outside the intersection"


def test_greedy_fixed_k_and_penalty(engine):
    params = SamplingParams(repetition_penalty=1.2)
    ref = engine.generate(PROMPTS[0], max_new_tokens=N_TOKENS, params=params, use_drafter=False)
    out = engine.generate(PROMPTS[0], max_new_tokens=N_TOKENS, params=params,
                          draft=DraftConfig(num_draft_tokens=6, adaptive=False))
    assert out.token_ids == ref.token_ids


def test_sampling_runs_and_reports_acceptance(engine):
    params = SamplingParams(temperature=0.7, top_p=0.95)
    out = engine.generate(PROMPTS[0], max_new_tokens=N_TOKENS, params=params, seed=3)
    s = out.stats.to_dict()
    assert s["drafted"] > 0 and 0 < s["accepted"] <= s["drafted"]
    assert 0 < s["acceptance_rate"] <= 1
    assert len(s["acceptance_by_position"]) >= 1
    again = engine.generate(PROMPTS[0], max_new_tokens=N_TOKENS, params=params, seed=3)
    assert again.token_ids == out.token_ids  # seeded


def test_coupled_sampling_identical_to_target_only(engine):
    """Coupled draws with real models (fp32 target, cross-vocabulary drafter): a seed's sampled text
    is target-only's, token for token, and drafts are still accepted."""
    params = SamplingParams(temperature=0.7, top_p=0.95, coupled=True)
    accepted = 0
    for prompt, seed in ((PROMPTS[0], 3), (PROMPTS[1], 4)):  # many seeds: tests/unit/test_engine_tiny.py
        ref = engine.generate(prompt, max_new_tokens=N_TOKENS, params=params, seed=seed, use_drafter=False)
        out = engine.generate(prompt, max_new_tokens=N_TOKENS, params=params, seed=seed,
                              draft=DraftConfig(num_draft_tokens=4, cost_model="static"))
        assert out.token_ids == ref.token_ids, (prompt, seed)
        assert out.stats.drafted > 0
        accepted += out.stats.accepted
    assert accepted > 0


@pytest.fixture(scope="module", params=["int8", "int4"])
def smol_int8(catalog_model, request):
    return catalog_model("smollm2-135m", dtype=M.DEFAULT_DTYPES["drafter"], quantize=request.param)


def test_an_int8_drafter_changes_speed_only(engine, smol_int8, target_only):
    """smollm2-135m with int8 / int4 weight copies (crossdraft/models/quant.py) drafting for a real fp32
    target: greedy output identical to the target alone, drafts accepted, steps through the low-bit kernel."""
    from crossdraft.models import quant

    assert smol_int8.quantize in ("int8", "int4")
    assert any(type(m) is (quant.Int4Linear if smol_int8.quantize == "int4" else quant.Int8Linear)
               for m in smol_int8.model.modules())
    eng = Engine(engine.target, smol_int8)
    before = quant.int8_calls(smol_int8.model)
    accepted = 0
    for prompt in PROMPTS[:2]:
        ref = target_only(engine, prompt, N_TOKENS)
        out = eng.generate(prompt, max_new_tokens=N_TOKENS, draft=DraftConfig(num_draft_tokens=4, adaptive=False))
        assert out.token_ids == ref.token_ids
        assert out.stats.drafted > 0
        accepted += out.stats.accepted
    assert accepted > 0
    assert quant.int8_calls(smol_int8.model) > before


def _cli(*args, timeout=600):
    env = dict(os.environ)
    return subprocess.run([sys.executable, "-m", "crossdraft.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_cli_generate_json_matches_engine(smol, catalog_model, target_only):
    """`crossdraft generate --json` in a process of its own (it loads both models: ~20 s, so one pair, with
    the int8 drafter flag) gives the engine's target-only tokens. The Qwen target: with measured costs the
    gemma pair sits near its break-even and may rightly draft nothing in 12 tokens."""
    engine = Engine(catalog_model("qwen2.5-coder-0.5b", dtype=torch.float32), smol)
    r = _cli("generate", "--target", "qwen2.5-coder-0.5b", "--drafter", "smollm2-135m", "--prompt", PROMPTS[1],
             "--max-new-tokens", "12", "--target-dtype", "float32", "--json", "--drafter-quantize", "int8")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    ref = target_only(engine, PROMPTS[1], 12)
    assert out["token_ids"] == ref.token_ids
    assert out["text"] == ref.text
    assert out["stats"]["drafted"] > 0 and "acceptance_rate" in out["stats"]


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--num-draft-tokens", "0"], "num_draft_tokens"),
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "0"], "top_p"),
        (["--top-p", "1.5"], "top_p"),
        (["--max-new-tokens", "0"], "max_new_tokens"),
        (["--prompt", ""], "prompt"),
        (["--target", "no-such-model"], "unknown model"),
        (["--drafter", "/nonexistent/model/dir"], "unknown model"),
    ],
)
def test_cli_bad_input_is_a_clear_error(args, needle, capsys):
    """`crossdraft generate` with one bad option: exit status 2 and a message naming it, no traceback. Run
    in process (the CLI's own main(); an unexpected exception would fail the test); the process-level exit
    status is checked once, below."""
    from crossdraft import cli

    base = {"--target": "smollm2-135m", "--prompt": "hi", "--max-new-tokens": "4"}
    for i in range(0, len(args), 2):
        base[args[i]] = args[i + 1]
    argv = ["generate"] + [x for kv in base.items() for x in kv]
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse's refusals
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, (rc, err)
    assert needle in err.lower() or needle in err


def test_cli_bad_input_exits_2_from_the_process():
    r = _cli("generate", "--target", "no-such-model", "--prompt", "hi", timeout=120)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "unknown model" in r.stderr and "Traceback" not in r.stderr
