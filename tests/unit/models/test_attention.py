"""crossdraft.models.attention: GQA on a CPU without per-head copies of K/V gives transformers' numbers
bit for bit, and the batched forward takes that path (work counting)."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from crossdraft.models import attention
from crossdraft.runtime.kvpool import KVPool, Row, batched_forward


class _Layer(torch.nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def _mask(B, T, L, dtype, g, window=None):
    """An additive [B, 1, T, L] mask as crossdraft.runtime.kvpool builds it: each row's queries at their own
    positions (rows of different history lengths), optionally sliding-window limited."""
    ends = torch.randint(T, L + 1, (B,), generator=g)
    qpos = (ends.view(B, 1) - T + torch.arange(T).view(1, T)).view(B, 1, T, 1)
    kpos = torch.arange(L).view(1, 1, 1, L)
    visible = kpos <= qpos
    if window is not None:
        visible = visible & (kpos > qpos - window)
    return torch.where(visible, torch.zeros((), dtype=dtype), torch.full((), torch.finfo(dtype).min, dtype=dtype))


# (query heads, kv heads, head dim): qwen2.5-coder-1.5b-like (6 per group), gemma3-270m-like (4 on 1,
# head dim 256), llama-3-like (4 per group)
SHAPES = [(12, 2, 128), (4, 1, 256), (8, 2, 64)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads", SHAPES)
@pytest.mark.parametrize("B,T,L,window", [(16, 5, 300, None), (3, 9, 77, None), (1, 2, 40, None),
                                          (4, 6, 120, 32), (2, 64, 64, None)])
def test_gqa_path_equals_transformers_bit_for_bit(dtype, heads, B, T, L, window):
    attention.install()
    H, Hkv, D = heads
    g = torch.Generator().manual_seed(B * 1000 + T * 10 + H)
    q = torch.randn(B, H, T, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, L, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, L, D, generator=g).to(dtype)
    mask = _mask(B, T, L, dtype, g, window)
    layer = _Layer(H // Hkv)
    before = attention.gqa_calls
    with torch.inference_mode():
        got, _ = attention.sdpa_forward(layer, q, k, v, mask, scaling=D ** -0.5)
        want, _ = sdpa_attention_forward(layer, q, k, v, mask, scaling=D ** -0.5)
    assert attention.gqa_calls == before + 1  # it took the in-place path...
    assert got.shape == want.shape == (B, T, H, D)
    assert torch.equal(got, want)  # ...and gave the same bits


@pytest.mark.parametrize("case", ["one-query", "no-mask", "no-groups", "softcap"])
def test_other_calls_go_to_transformers_unchanged(case):
    attention.install()
    g = torch.Generator().manual_seed(7)
    B, H, Hkv, T, L, D = 2, 8, 2, 4, 50, 32
    if case == "one-query":
        T = 1
    if case == "no-groups":
        Hkv = H
    q = torch.randn(B, H, T, D, generator=g)
    k = torch.randn(B, Hkv, L, D, generator=g)
    v = torch.randn(B, Hkv, L, D, generator=g)
    mask = None if case == "no-mask" else _mask(B, T, L, torch.float32, g)
    layer = _Layer(H // Hkv)
    kw = {"softcap": 30.0} if case == "softcap" else {}
    before = attention.gqa_calls
    with torch.inference_mode():
        if case == "softcap":  # transformers' sdpa refuses softcapping; so must the wrapper
            with pytest.raises(ValueError):
                attention.sdpa_forward(layer, q, k, v, mask, **kw)
        else:
            got, _ = attention.sdpa_forward(layer, q, k, v, mask)
            want, _ = sdpa_attention_forward(layer, q, k, v, mask)
            assert torch.equal(got, want)
    assert attention.gqa_calls == before


def _tiny_gqa_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=200, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, num_hidden_layers=3, max_position_embeddings=256,
                      attn_implementation="sdpa")
    return Qwen2ForCausalLM(cfg).eval()


def test_a_batched_verification_reads_the_shared_heads_in_place():
    model = _tiny_gqa_model()
    pool = KVPool(model, max_tokens=512, block_size=16)
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is attention.sdpa_forward  # a pool installs it
    g = torch.Generator().manual_seed(1)
    hs = [pool.alloc() for _ in range(3)]
    lens = [20, 45, 9]
    batched_forward(model, pool, [Row(h, 0, torch.randint(0, 200, (n,), generator=g).tolist())
                                  for h, n in zip(hs, lens, strict=True)])
    layers = model.config.num_hidden_layers
    before = attention.gqa_calls
    # one batched forward of 3 drafted blocks: every layer's attention on the in-place GQA path
    rows = [Row(h, n, torch.randint(0, 200, (5,), generator=g).tolist(), keep=5) for h, n in zip(hs, lens, strict=True)]
    batched = batched_forward(model, pool, rows)
    assert attention.gqa_calls == before + layers
    # one-token steps: transformers packs the group's queries itself (no copies); not this path
    for h, n in zip(hs, lens, strict=True):
        pool.truncate(h, n)
    before = attention.gqa_calls
    batched_forward(model, pool, [Row(h, n, [3]) for h, n in zip(hs, lens, strict=True)])
    assert attention.gqa_calls == before
    # and each block verified alone gives the batched logits
    for h, n in zip(hs, lens, strict=True):
        pool.truncate(h, n)
    for r, out in zip(rows, batched, strict=True):
        alone = batched_forward(model, pool, [Row(r.handle, r.start, r.tokens, keep=5)])[0]
        torch.testing.assert_close(out, alone, atol=1e-5, rtol=0)
        pool.truncate(r.handle, r.start)
