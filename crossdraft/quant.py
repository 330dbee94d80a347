"""Weight-only int8 quantization for drafters (CPU): the drafter's decoding step reads half the bytes.

Why only the drafter: speculative decoding stays lossless whatever the drafter computes, as long as
the probabilities it reports are those it sampled from; the target's weights must stay exact (its
greedy output must equal the target alone). On a CPU a one-token decoding step is bound by memory
bandwidth: measured on a 2-vCPU AMX Xeon, torch 2.13, qwen2.5-coder-0.5b in bf16, ~75% of a step
is the matmuls reading weights from DRAM. ``torch.ops.aten._weight_int8pack_mm`` (int8 weights, one
scale per output row, activations in the model's dtype) reads half of bf16's bytes and ran a
4864x896 projection in 0.35 ms instead of 0.61 ms with a working set larger than the caches.

It does not batch: its time grows with the number of rows (200 rows: 10.6 ms vs 1.0 ms for bf16
with AMX). So each quantized linear keeps the float weight too and picks per call: up to
``max_rows`` rows (the drafter's one-token steps, a few sessions drafting together) take the int8
kernel, more rows (prefills, syncs, wide batches) the float one. Memory: +50% over bf16 weights.

Limits found: in bf16 the kernel needs ``in_features % 16 == 0`` (other widths crashed or returned
NaN in torch 2.13); such layers keep the float path, and every quantized layer is checked against
its dequantized weight on a random input before it is used.
"""

from __future__ import annotations

import torch
from torch import nn

MODES = ("auto", "none", "int8")
DEFAULT_MAX_ROWS = 4  # the int8 kernel's time grows with rows; measured break-even ~4-8 rows (bf16, AMX)


def available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


def parse_mode(x: str | None) -> str:
    from .errors import InvalidArgument

    m = "auto" if x in (None, "") else str(x).strip().lower()
    if m not in MODES:
        raise InvalidArgument("quantize", f"must be one of {', '.join(MODES)}, got {x!r}")
    return m


def resolve_mode(mode: str, device: torch.device, dtype: torch.dtype) -> str:
    """``auto`` -> ``int8`` for a CPU drafter computing in bf16/fp16, else ``none``. fp32 stays exact
    float unless asked for: it is the mode whose numbers tests compare bit for bit."""
    mode = parse_mode(mode)
    if mode == "auto":
        ok = available() and torch.device(device).type == "cpu" and dtype in (torch.bfloat16, torch.float16)
        return "int8" if ok else "none"
    if mode == "int8":
        from .errors import InvalidArgument

        if not available():
            raise InvalidArgument("quantize", "int8 needs torch.ops.aten._weight_int8pack_mm (not in this torch)")
        if torch.device(device).type != "cpu":
            raise InvalidArgument("quantize", f"int8 weights are a CPU path; this model is on {device}")
    return mode


def _quantize_rows(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: w ~ q * scale[:, None]."""
    wf = w.detach().float()
    scale = (wf.abs().amax(dim=1) / 127.0).clamp(min=1e-12).to(dtype)  # rounded to the compute dtype first,
    q = torch.round(wf / scale.float()[:, None]).clamp(-127, 127)      # so q fits the scale the kernel uses
    return q.to(torch.int8).contiguous(), scale.contiguous()


class Int8Linear(nn.Module):
    """A linear layer with an int8 copy of its weight, used for calls of at most ``max_rows`` rows.

    ``weight`` (and ``bias``) stay the original parameters, so code that reads ``.weight`` (a tied
    embedding, a pruned head's rows, cost estimates) sees the float model.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, max_rows: int = DEFAULT_MAX_ROWS):
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.bias = bias
        self.in_features = int(weight.shape[1])
        self.out_features = int(weight.shape[0])
        self.max_rows = int(max_rows)
        q, s = _quantize_rows(weight, weight.dtype)
        self.register_buffer("qweight", q, persistent=False)
        self.register_buffer("scales", s, persistent=False)
        self.int8_calls = 0  # work counting for tests: how many calls took the int8 kernel

    @classmethod
    def from_linear(cls, lin: nn.Linear, max_rows: int = DEFAULT_MAX_ROWS) -> "Int8Linear":
        return cls(lin.weight, lin.bias, max_rows)

    def rows(self, idx: torch.Tensor) -> "Int8Linear":
        """The layer restricted to some output rows (a pruned LM head). Quantization is per row, so
        the rows' int8 copy equals the full layer's rows."""
        idx = idx.to(self.weight.device)
        w = self.weight.detach().index_select(0, idx).contiguous()
        bias = None if self.bias is None else self.bias.detach().index_select(0, idx)
        return Int8Linear(w, bias, self.max_rows)

    def dequantized(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(1, x.shape[-1])
        if 0 < rows <= self.max_rows and x.dtype == self.scales.dtype and x.device.type == "cpu":
            self.int8_calls += 1
            y = torch.ops.aten._weight_int8pack_mm(x.reshape(rows, self.in_features).contiguous(), self.qweight,
                                                   self.scales)
            y = y.reshape(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias
        return nn.functional.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 up to {self.max_rows} rows"


def _supported(lin: nn.Linear) -> bool:
    w = lin.weight
    if w.dim() != 2 or w.device.type != "cpu":
        return False
    if w.dtype != torch.float32 and w.shape[1] % 16:
        return False  # the bf16/fp16 kernel needs in_features % 16 == 0
    return True


@torch.inference_mode()
def _check(layer: Int8Linear) -> bool:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, layer.in_features, generator=g).to(layer.weight.dtype)
    got = torch.ops.aten._weight_int8pack_mm(x, layer.qweight, layer.scales).float()
    want = x.float() @ layer.dequantized().T
    tol = 1e-2 * (want.abs().max().item() + 1.0)
    return bool(torch.isfinite(got).all()) and float((got - want).abs().max()) <= tol


def quantize_int8(model: nn.Module, max_rows: int = DEFAULT_MAX_ROWS) -> int:
    """Swap the decoder's linear layers and the LM head for :class:`Int8Linear` in place.
    Returns how many layers were swapped (layers the kernel cannot take keep their float path)."""
    if not available():
        raise RuntimeError("torch.ops.aten._weight_int8pack_mm is not available in this torch")
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or not _supported(child):
                continue
            q = Int8Linear.from_linear(child, max_rows)
            if not _check(q):
                continue
            setattr(parent, name, q)
            swapped += 1
    return swapped


def int8_calls(model: nn.Module) -> int:
    return sum(m.int8_calls for m in model.modules() if isinstance(m, Int8Linear))


def set_max_rows(model: nn.Module, max_rows: int) -> None:
    for m in model.modules():
        if isinstance(m, Int8Linear):
            m.max_rows = int(max_rows)
