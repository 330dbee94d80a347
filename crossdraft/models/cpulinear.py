"""Prepacked oneDNN linear layers for models computing in float32 on a CPU.

Why: speculative decoding pays only if verifying a block of k tokens costs little more than
decoding one. On a CPU a one-token forward is bound by reading the weights; a k-token forward
should cost about the same plus k times the arithmetic. torch's default fp32 path
(``F.linear`` -> MKL sgemm) does not get there on every CPU: on a 2-vCPU AMD EPYC with AVX2 only
(torch 2.13, MKL 2024.2) a 1536 -> 8960 projection takes 3.6 ms for 1 row, 7.4 ms for 2 and
11-14 ms for 4-8 rows, so a whole Qwen2.5-Coder-1.5B forward of 3-8 tokens costs 2.8x a one-token
one and no drafter can pay. The same layer through oneDNN with its weight reordered once into
oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight`` + ``_linear_pointwise``, what
torch's own CPU compiler uses for frozen weights) takes 2.7 ms for 1 row, 2.6 for 2, 3.4 for 4,
4.1 for 8 and 54 ms instead of 69 for a 256-row prefill chunk.

A second property matters for losslessness tests: with the packed weight, every row of a k-row
call is bitwise equal to the same row computed alone (MKL's k-row and 1-row results differ by
~2e-6), so the linear layers of an fp32 verification block compute exactly what one-token
decoding computes (attention may still round differently).

Which is faster depends on the CPU (and MKL's choices on it), so ``auto`` measures: the model's
largest body layer at 1 and 8 rows, both ways, and packs only where oneDNN wins. Float32 only (bf16
already runs through oneDNN in torch, fp16 is not a CPU path here).

Memory: the packed copy replaces the dense weight, except where another module shares the
weight (a tied embedding) or code reads it (the LM head: pruned drafter heads take its rows);
those keep both.
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn

MODES = ("auto", "packed", "plain")
ENV = "CROSSDRAFT_CPU_LINEAR"
ROWS_HINT = 8  # oneDNN picks its blocking for this many rows; the fastest for 1-16 rows


def available() -> bool:
    ops = getattr(torch.ops, "mkldnn", None)
    return (torch.backends.mkldnn.is_available() and ops is not None
            and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise"))


def parse_mode(x: str | None) -> str:
    from crossdraft.errors import InvalidArgument

    m = (os.environ.get(ENV) or "auto") if x in (None, "") else str(x)
    m = m.strip().lower()
    if m not in MODES:
        raise InvalidArgument("cpu_linear", f"must be one of {', '.join(MODES)}, got {x if x else m!r}")
    return m


class PackedLinear(nn.Module):
    """``nn.Linear`` whose weight lives in oneDNN's blocked layout (``packed``).

    ``weight`` exists only where it is kept dense (``keep_dense``: shared or read elsewhere); the
    bias stays an ordinary parameter.
    """

    def __init__(self, lin: nn.Linear, keep_dense: bool = False):
        super().__init__()
        w = lin.weight.detach()
        self.in_features, self.out_features = int(w.shape[1]), int(w.shape[0])
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), ROWS_HINT)
        self.packed_bytes = w.numel() * w.element_size()
        self.bias = lin.bias
        if keep_dense:
            self.weight = lin.weight
        self.calls = 0  # work counting for tests

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        dense = ", dense copy kept" if "weight" in self._parameters else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN packed{dense}"


def _candidates(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """fp32 CPU ``nn.Linear`` layers, and int8 layers whose wide calls use the fp32 weight (modules
    with a ``qweight`` and an unset ``wide``: crossdraft.models.quant.Int8Linear, which imports this module)."""
    out = []
    for parent in model.modules():
        for name, child in parent.named_children():
            w = getattr(child, "weight", None)
            int8 = hasattr(child, "qweight") and getattr(child, "wide", False) is None
            ok = type(child) is nn.Linear or int8
            if ok and w is not None and w.dim() == 2 and w.device.type == "cpu" and w.dtype == torch.float32:
                out.append((parent, name, child))
    return out


@torch.inference_mode()
def _agrees(lin: nn.Module, packed: PackedLinear) -> bool:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, lin.in_features, generator=g)
    want = nn.functional.linear(x, lin.weight, lin.bias)
    got = packed(x)
    tol = 1e-4 * (float(want.abs().max()) + 1.0)
    return bool(torch.isfinite(got).all()) and float((got - want).abs().max()) <= tol


@torch.inference_mode()
def measure(lin: nn.Linear, rows=(1, 8), repeats: int = 5) -> tuple[float, float]:
    """Seconds of (plain, packed) over calls of each row count in ``rows``: the best of ``repeats``."""
    p = PackedLinear(lin)
    g = torch.Generator().manual_seed(0)
    totals = []
    for fn in (lambda x: nn.functional.linear(x, lin.weight, lin.bias), p):
        total = 0.0
        for m in rows:
            x = torch.randn(m, lin.in_features, generator=g)
            fn(x)
            best = float("inf")
            for _ in range(repeats):
                t = time.perf_counter()
                fn(x)
                best = min(best, time.perf_counter() - t)
            total += best
        totals.append(total)
    return totals[0], totals[1]


def pack_linears(model: nn.Module, mode: str | None = "auto") -> str:
    """Swap the float32 CPU ``nn.Linear`` layers of ``model`` for :class:`PackedLinear` in place.

    ``mode``: ``packed``, ``plain`` (leave as is) or ``auto`` (pack if oneDNN measures faster on
    this machine, see the module doc); ``None`` reads ``CROSSDRAFT_CPU_LINEAR``. Returns the
    mode applied: ``packed`` or ``plain``.
    """
    mode = parse_mode(mode)
    cands = _candidates(model)
    if mode == "plain" or not cands or not available():
        if mode == "packed" and cands and not available():
            from crossdraft.errors import InvalidArgument

            raise InvalidArgument("cpu_linear", "packed needs torch's oneDNN (mkldnn) linear ops")
        return "plain"
    head = getattr(model, "lm_head", None)
    if mode == "auto":
        body = [c for _, _, c in cands if c is not head] or [c for _, _, c in cands]  # (their float weights)
        plain_s, packed_s = measure(max(body, key=lambda c: c.weight.numel()))
        if packed_s >= plain_s:
            return "plain"
    users: dict[int, int] = {}
    for _, prm in model.named_parameters(remove_duplicate=False):
        users[id(prm)] = users.get(id(prm), 0) + 1
    swapped = 0
    for parent, name, lin in cands:
        int8 = type(lin) is not nn.Linear  # an Int8Linear: its wide calls (prefills, syncs) go packed
        keep = int8 or lin is head or users.get(id(lin.weight), 0) > 1
        packed = PackedLinear(lin, keep_dense=keep)
        if not _agrees(lin, packed):
            continue
        if int8:
            lin.wide = packed
        else:
            setattr(parent, name, packed)
        swapped += 1
    return "packed" if swapped else "plain"


def packed_bytes(model: nn.Module) -> int:
    """Bytes of packed weights that no longer appear among the model's parameters."""
    return sum(m.packed_bytes for m in model.modules()
               if isinstance(m, PackedLinear) and "weight" not in m._parameters)


def packed_calls(model: nn.Module) -> int:
    return sum(m.calls for m in model.modules() if isinstance(m, PackedLinear))
