"""oneDNN-packed fp32 linear layers (crossdraft.models.cpulinear): same numbers, rows independent of the
batch, and the engine stays lossless on packed models (real ops on tiny random models)."""

import pytest
import torch
from torch import nn

from crossdraft.decoding.policy import DraftConfig
from crossdraft.engine import Engine
from crossdraft.errors import InvalidArgument
from crossdraft.models import cpulinear
from crossdraft.runtime.sessions import cost_numbers
from tests.tiny_models import tiny_lm

pytestmark = pytest.mark.skipif(not cpulinear.available(), reason="this torch has no oneDNN linear ops")


@pytest.fixture(scope="module")
def drafter(tok_d):
    return tiny_lm(tok_d, seed=2)


def _lin(i=48, o=80, bias=True, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(i, o, bias=bias).eval()


@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_equals_plain_and_rows_do_not_depend_on_the_batch(bias):
    lin = _lin(bias=bias)
    p = cpulinear.PackedLinear(lin)
    x = torch.randn(9, 48)
    with torch.inference_mode():
        want = lin(x)
        got = p(x)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
        # a k-row call's rows are bitwise the rows computed one at a time (verification == decoding)
        alone = torch.cat([p(x[i:i + 1]) for i in range(9)])
        assert torch.equal(got, alone)
        # 3-D inputs keep their leading shape
        assert torch.equal(p(x.reshape(3, 3, 48)).reshape(9, 80), got)
    assert p.calls == 11
    assert "weight" not in p._parameters and p.packed_bytes == 80 * 48 * 4


def _packed_copy(tl, mode="packed"):
    """A deep copy of a tiny model with its linears packed (the fixture's model stays plain)."""
    import copy

    m = copy.deepcopy(tl.model)
    applied = cpulinear.pack_linears(m, mode)
    return type(tl)(m, tl.tokenizer, tl.name + "-packed", tl.device, tl.dtype, tl.eos_token_ids, tl.vocab_size), applied


def test_pack_linears_swaps_body_layers_keeps_the_head_dense_and_the_same_logits(tok_t):
    tl = tiny_lm(tok_t, seed=5, arch="qwen2")
    before = cost_numbers(tl.model)
    packed, applied = _packed_copy(tl)
    assert applied == "packed"
    kinds = {type(m) for m in packed.model.modules()}
    assert nn.Linear not in kinds and cpulinear.PackedLinear in kinds
    head = packed.model.lm_head
    assert isinstance(head, cpulinear.PackedLinear) and "weight" in head._parameters  # pruned heads read its rows
    q = packed.model.model.layers[0].self_attn.q_proj
    assert "weight" not in q._parameters  # the dense copy was dropped
    # the cost model sees the same bytes (packed weights counted where they left the parameters)
    assert cost_numbers(packed.model) == before
    ids = torch.tensor([[5, 9, 14, 3, 22, 7]])
    with torch.inference_mode():
        want = tl.model(input_ids=ids).logits
        got = packed.model(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    assert cpulinear.packed_calls(packed.model) > 0


def test_tied_weights_stay_shared(tok_t):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)).eval()
    assert m.lm_head.weight is m.model.embed_tokens.weight
    assert cpulinear.pack_linears(m, "packed") == "packed"
    assert m.lm_head.weight is m.model.embed_tokens.weight  # the embedding still reads the dense table


def test_modes(tok_t, monkeypatch):
    tl = tiny_lm(tok_t, seed=6)
    _, applied = _packed_copy(tl, "plain")
    assert applied == "plain"
    monkeypatch.setenv(cpulinear.ENV, "plain")
    assert cpulinear.parse_mode(None) == "plain"
    monkeypatch.setenv(cpulinear.ENV, "PACKED")
    assert cpulinear.parse_mode("") == "packed"
    with pytest.raises(InvalidArgument) as e:
        cpulinear.parse_mode("fast")
    assert e.value.field == "cpu_linear"
    # auto measures: whatever it picks, it is one of the two and the model computes the same
    m, applied = _packed_copy(tl, "auto")
    assert applied in ("packed", "plain")
    # bf16 layers are not packed (torch already runs them on oneDNN)
    bf = tiny_lm(tok_t, seed=6).model.to(torch.bfloat16)
    assert cpulinear.pack_linears(bf, "packed") == "plain"


@pytest.mark.parametrize("k, adaptive", [(1, False), (4, False), (3, True)])
def test_greedy_on_packed_models_is_token_identical_to_the_plain_target(target, drafter, tmp_path_factory, k,
                                                                         adaptive):
    """The lossless contract on packed models: speculative greedy on a packed pair gives the plain
    target's tokens (fp32)."""
    ref_engine = Engine(target, None)
    pt, _ = _packed_copy(target)
    pd, _ = _packed_copy(drafter)
    eng = Engine(pt, pd, vocab_cache_dir=tmp_path_factory.mktemp("vocab"))
    draft = DraftConfig(num_draft_tokens=k, adaptive=adaptive, cost_model="static" if adaptive else "auto")
    drafted = 0
    for prompt in ("def add(a, b):\n", "The quick brown fox", "for i in range(10):"):
        ref = ref_engine.generate(prompt, max_new_tokens=32)
        out = eng.generate(prompt, max_new_tokens=32, draft=draft)
        assert out.token_ids == ref.token_ids, prompt
        drafted += out.stats.drafted
    assert drafted > 0
    assert cpulinear.packed_calls(pt.model) > 0 and cpulinear.packed_calls(pd.model) > 0


def test_servers_refuse_a_bad_cpu_linear_flag_before_loading():
    """A real server process: the flag is checked before any model loads (exit 2, the field named)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "verifier", "--model", "no-such-model", "--port", "0",
                        "--cpu-linear", "fast"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "cpu_linear: must be one of auto, packed, plain" in r.stderr
