"""Grouped-query attention on a CPU without copying the keys and values for every query head.

Qwen2.5, Llama 3 and Gemma 3 share each key/value head among several query heads (GQA). With a
mask and more than one query token, transformers' ``sdpa`` attention (5.x) copies the keys and
values once per query head of the group (``repeat_kv``) before calling
``torch.nn.functional.scaled_dot_product_attention``: a batched verification of 16 sessions x 5
tokens over ~575 history columns copies 2 x 16 x 12 x 575 x 128 values per layer. On a 2-vCPU
Xeon (AMX, bf16) with qwen2.5-coder-1.5b those copies are 42% of that forward's CPU time and make
it cost 1.75x a single session's forward of the same 80 tokens, a cost the cost tables (timed on
one session) do not see, so the draft policy would overprice drafting under load.

torch's own ``enable_gqa=True`` reads the shared heads in place, and on a CPU its kernel gives the
bitwise-same output as the copied heads (tests/unit/models/test_attention.py checks that, bf16 and fp32,
with the masks crossdraft builds). :func:`install` puts :func:`sdpa_forward` in transformers'
attention registry under ``"sdpa"``: on a CPU, for a GQA layer with a mask and more than one query
token, it calls torch with ``enable_gqa=True``; every other call (one query token: transformers
packs the group's queries instead of copying; CUDA, where a masked GQA call falls back to the
math kernel; softcapping, dropout, position biases) goes to transformers' own function unchanged.
So the outputs stay the same and only the copies go.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

_lock = threading.Lock()
_original = None  # transformers' sdpa attention function, once install() ran
gqa_calls = 0  # work counting (tests): calls that took the in-place GQA path


def _takes_gqa_path(module, query, key, value, attention_mask, dropout, kwargs) -> bool:
    groups = getattr(module, "num_key_value_groups", 1) or 1
    return (groups > 1 and query.device.type == "cpu" and query.dim() == 4 and query.shape[2] > 1
            and attention_mask is not None and attention_mask.dim() == 4 and not dropout
            and kwargs.get("softcap") is None and kwargs.get("position_bias") is None
            and not kwargs.get("output_attentions", False)
            and key.shape[-1] == value.shape[-1] and query.shape[1] == key.shape[1] * groups)


def sdpa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 is_causal: bool | None = None, **kwargs):
    """transformers' attention-function signature; ``(output [B, T, H, D], None)``."""
    global gqa_calls
    if _takes_gqa_path(module, query, key, value, attention_mask, dropout, kwargs):
        gqa_calls += 1
        # with a mask transformers passes is_causal=False to torch as well: the mask says it all
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                             enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    return _original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                     is_causal=is_causal, **kwargs)


def installed() -> bool:
    """Whether :func:`install` routed transformers' ``"sdpa"`` here (keys the cost tables' cache)."""
    return _original is not None


def install() -> bool:
    """Route transformers' ``"sdpa"`` attention through :func:`sdpa_forward` (once per process;
    idempotent). Returns whether it is installed (False where transformers has no such registry)."""
    global _original
    with _lock:
        if _original is not None:
            return True
        try:
            from transformers.integrations.sdpa_attention import sdpa_attention_forward
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        except ImportError:  # another transformers layout: leave attention as it is
            return False
        _original = sdpa_attention_forward
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa_forward
        return True
