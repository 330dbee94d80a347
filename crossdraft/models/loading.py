"""Loading a model for inference: dtypes and devices, ``load_model`` and what it returns.

:func:`load_model` takes a catalog name (pulled on first use), a local Hugging Face model directory,
a local ``.gguf`` file or a Hugging Face Hub id (:mod:`crossdraft.models.resolve`), loads the
weights with a dtype and device (a GGUF dequantised at load time), applies what a model gets on
this machine (grouped-query attention on a CPU, int8 drafter weights, packed fp32 CPU linears) and
returns a :class:`LoadedModel` with its tokenizer and the token ids that end a completion.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from crossdraft.errors import InvalidArgument, ModelError
from crossdraft.models import attention
from crossdraft.models.gguf import detach_gguf_quantizer, quiet_transformers, text_config
from crossdraft.models.resolve import ModelRef, ensure_available, resolve_model
from crossdraft.models.tokenizers import collect_eos_token_ids, tokenizer_from

log = logging.getLogger("crossdraft.models.loading")

__all__ = [
    "DEFAULT_DTYPES",
    "LoadedModel",
    "cpu_has_native_bf16",
    "fast_dtype",
    "load_model",
    "parse_device",
    "parse_dtype",
]


def cpu_has_native_bf16() -> bool:
    """True when the CPU has bf16 dot-product instructions (AVX512-BF16 or AMX)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool({"avx512_bf16", "amx_bf16"} & flags)
    except OSError:
        pass
    return False


def fast_dtype(device: str | torch.device = "cpu") -> torch.dtype:
    """The dtype that decodes AND verifies fastest on `device`.

    On CUDA and on CPUs with native bf16 (AVX512-BF16 or AMX) bf16 wins for every forward shape:
    Qwen2.5-Coder-1.5B on an AMD EPYC with AVX512-BF16 (torch 2.13) takes 221 ms per 1-token decode
    step in bf16 against 666 ms in fp32, and 236 against 923 ms per 8-token verification. Without
    native bf16 the multi-token forwards of verification are several times slower in bf16 than in
    fp32, so fp32.
    """
    if torch.device(device).type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


# Per-role default dtypes: both roles take the fastest dtype of this machine. Strict bitwise greedy
# identity between a k-token verification forward and 1-token decoding needs fp32 (bf16 rounds
# every matmul output, so a different kernel blocking for M=k+1 rows can flip an argmax at a
# near-tie); pass dtype=float32 for the target when that matters.
DEFAULT_DTYPES: dict[str, torch.dtype] = {"target": fast_dtype(), "drafter": fast_dtype()}

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32, "f32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "f16": torch.float16, "half": torch.float16,
    "float64": torch.float64, "fp64": torch.float64, "f64": torch.float64, "double": torch.float64,
}  # fmt: skip
_DTYPES = frozenset(_DTYPE_NAMES.values())


def parse_dtype(x: str | torch.dtype) -> torch.dtype | Literal["auto"]:
    """``"float32"``/``"fp32"``, ``"bfloat16"``/``"bf16"``, ``"float16"``/``"fp16"``,
    ``"float64"``/``"fp64"`` (also with a ``torch.`` prefix) or a floating ``torch.dtype`` → that
    dtype; ``"auto"`` → the string ``"auto"`` (the checkpoint's own dtype, settled at load time).
    Anything else raises ``InvalidArgument("dtype", ...)``.
    """
    if isinstance(x, torch.dtype):
        if x in _DTYPES:
            return x
        raise InvalidArgument("dtype", f"unsupported dtype {x}; use float32, bfloat16, float16 or float64")
    if isinstance(x, str):
        key = x.strip().lower().removeprefix("torch.")
        if key == "auto":
            return "auto"
        if key in _DTYPE_NAMES:
            return _DTYPE_NAMES[key]
        raise InvalidArgument(
            "dtype", f"unknown dtype {x!r}; use float32/fp32, bfloat16/bf16, float16/fp16, float64/fp64 or auto"
        )
    raise InvalidArgument("dtype", f"expected a dtype name or torch.dtype, got {type(x).__name__}")


def parse_device(x: str | torch.device) -> torch.device:
    """``"cpu"``, ``"cuda"``, ``"cuda:N"`` (or ``"mps"``) → ``torch.device``, checked to exist."""
    try:
        dev = x if isinstance(x, torch.device) else torch.device(str(x).strip().lower())
    except (RuntimeError, TypeError, ValueError) as e:
        raise InvalidArgument("device", f"invalid device {x!r}; use cpu, cuda or cuda:N ({e})") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidArgument(
                "device",
                f"{str(x)!r} requested but CUDA is not available (torch {torch.__version__} "
                f"{'has no CUDA support' if torch.version.cuda is None else 'sees no GPU'}); use device='cpu'",
            )
        count = torch.cuda.device_count()
        index = 0 if dev.index is None else dev.index
        if index >= count:
            raise InvalidArgument("device", f"{str(x)!r} requested but only {count} CUDA device(s) are visible")
        return torch.device("cuda", index)
    if dev.type == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise InvalidArgument("device", f"{str(x)!r} requested but MPS is not available")
        return dev
    raise InvalidArgument("device", f"unsupported device {str(x)!r}; use cpu, cuda or cuda:N")


@dataclass
class LoadedModel:
    """A model ready for inference (eval mode, no grads) plus what the decoders need about it."""

    model: Any  # transformers PreTrainedModel
    tokenizer: Any  # transformers tokenizer
    name: str
    path: Path
    device: torch.device  # device of the input embeddings
    dtype: torch.dtype
    eos_token_ids: frozenset[int]
    vocab_size: int  # logits width
    kind: str = field(default="hf_dir")  # "catalog" | "hf_dir" | "gguf" | "hub"
    revision: str = ""  # hub: the commit hash served; "" for catalog models and local paths
    quantize: str = "none"  # "int8" / "int4": the linear layers carry low-bit weights for few-row calls (models.quant)
    cpu_linear: str = "plain"  # "packed": fp32 linear layers run on oneDNN-packed weights (crossdraft.models.cpulinear)
    quantize_act: str = ""  # low-bit layers of an fp32 model: the kernel's activation dtype ("float32" / "bfloat16")


def _weights_bytes(model: Any) -> int:
    """Bytes the model's parameters and buffers take (each tensor once: tied weights count once)."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _size(n: int) -> str:
    """Bytes as GiB, MiB or KiB with two decimals (the largest unit the number reaches)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 2**10:.2f} KiB"


def _log_dequantised(ref: ModelRef, gguf: Path, model: Any, progress: bool) -> None:
    """Log what a GGUF became in memory: its quantised weights are now dense tensors, several times
    the file's size (float32: about 8x a 4-bit GGUF). With ``progress`` (the CLI) on stderr too."""
    msg = (f"{ref.spec}: {gguf.name} ({_size(gguf.stat().st_size)}) dequantised to "
           f"{str(model.dtype).replace('torch.', '')}: {_size(_weights_bytes(model))}")
    log.info("%s", msg)
    if progress:
        print(msg, file=sys.stderr, flush=True)


def _logits_width(model: Any) -> int:
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(out, "weight", None)
    if weight is not None and weight.dim() == 2:
        return int(weight.shape[0])
    return int(text_config(model.config).vocab_size)


def _placement(device: str | torch.device, dtype: str | torch.dtype | None, device_map: str | Mapping[str, Any] | None,
               max_memory: Mapping[Any, Any] | None) -> tuple[dict[str, Any], torch.device | None]:
    """``from_pretrained``'s dtype and placement arguments, and the device asked for (None under a device map)."""
    torch_dtype = torch.float32 if dtype is None else parse_dtype(dtype)
    if max_memory is not None and device_map is None:
        raise InvalidArgument("max_memory", "only used together with device_map (e.g. device_map='auto')")
    kwargs: dict[str, Any] = {"dtype": torch_dtype}
    if device_map is not None:
        kwargs["device_map"] = device_map
        if max_memory is not None:
            kwargs["max_memory"] = dict(max_memory)
        return kwargs, None
    target = parse_device(device)
    if target.type != "cpu":
        kwargs["device_map"] = {"": target}  # load straight onto the accelerator
    return kwargs, target


def _load_weights(ref: ModelRef, kwargs: dict[str, Any], progress: bool) -> Any:
    """The model of an available ``ref``, loaded with ``kwargs`` (sdpa attention where the architecture
    has it); a GGUF is dequantised and left a plain dense model."""
    from transformers import AutoModelForCausalLM

    gguf = ref.gguf_path
    if gguf is not None:
        source, kwargs = str(gguf.parent), {**kwargs, "gguf_file": gguf.name}
    else:
        source = str(ref.path)

    def _from_pretrained(**extra: Any) -> Any:
        return AutoModelForCausalLM.from_pretrained(source, **kwargs, **extra)

    # transformers' own bars only for the slow case (dequantizing a GGUF at load time)
    with quiet_transformers(progress and gguf is not None):
        try:
            try:
                model = _from_pretrained(attn_implementation="sdpa")
            except (ValueError, ImportError) as e:
                if "sdpa" not in str(e).lower() and "attn" not in str(e).lower():
                    raise
                model = _from_pretrained()  # architecture without an SDPA path
        except ModelError:
            raise
        except Exception as e:
            raise ModelError(f"could not load model {ref.spec!r} from {ref.path}: {type(e).__name__}: {e}") from e
    if gguf is not None:
        detach_gguf_quantizer(model)
        _log_dequantised(ref, gguf, model, progress)
    return model


def _quantize(model: Any, quantize: str) -> tuple[str, torch.dtype | None]:
    """Give ``model`` low-bit weight copies where ``quantize`` asks for them and they pay
    (:mod:`crossdraft.models.quant`).

    Returns the mode applied (``"int8"``, ``"int4"`` or ``"none"``) and, for an fp32 model, the kernel's
    activation dtype.
    """
    from crossdraft.models import quant

    qdev = model.get_input_embeddings().weight.device
    qmode = quant.resolve_mode(quantize, qdev, model.dtype)
    act = None
    if qmode == "int4":  # its fp32-activation path is ~30x slower than the bf16 one: an fp32 model rounds to bf16
        act = torch.bfloat16 if model.dtype == torch.float32 else None
        if quant.quantize_int8(model, act_dtype=act, bits=4) == 0:
            qmode = "none"
        return qmode, act
    if model.dtype == torch.float32 and qdev.type == "cpu" and quant.parse_mode(quantize) != "none":
        # an fp32 drafter: int8 with fp32 or bf16 activations, whichever is faster, where it pays
        act = quant.choose_fp32(model, required=qmode == "int8")
        qmode = "int8" if act is not None else "none"
        if qmode == "int8" and quant.parse_mode(quantize) == "auto" and quant.int4_pays_fp32(model, act):
            # int4 (bf16 activations) beats int8 by enough on this machine to pay for its drafts
            swapped = quant.quantize_int8(model, act_dtype=torch.bfloat16, bits=4)
            return ("int4", torch.bfloat16) if swapped else ("none", None)
    if qmode == "int8" and quant.quantize_int8(model, act_dtype=act) == 0:
        qmode = "none"  # no layer the kernel can take
    return qmode, act


def load_model(
    spec: str | os.PathLike[str],
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    device_map: str | Mapping[str, Any] | None = None,
    max_memory: Mapping[Any, Any] | None = None,
    pull_missing: bool = True,
    progress: bool = True,
    revision: str | None = None,
    trust_remote_code: bool = False,
    quantize: str = "none",
    cpu_linear: str | None = None,
    model_file: str | None = None,
) -> LoadedModel:
    """Load a causal LM and its tokenizer for inference.

    ``spec``: catalog name (pulled first if missing and ``pull_missing``), local HF directory,
    local ``.gguf`` file (dequantized at load time; slower than a pulled catalog model), or Hub id
    ``org/name[@revision]`` (downloaded into the Hub cache first if missing and ``pull_missing``,
    unless HF_HUB_OFFLINE; ``revision`` is the same as ``@revision``); a Hub repo of GGUFs loads one
    GGUF (``org/name:QUANT`` or ``model_file``, its path in the repo; needed when it holds several),
    dequantized at load time like a local ``.gguf``. ``trust_remote_code`` runs the repo's own
    modelling code; off unless asked for.
    ``dtype``: ``None`` means float32; see :func:`parse_dtype`. ``device``: ``cpu``, ``cuda``,
    ``cuda:N``; ignored when ``device_map`` (e.g. ``"auto"``) is given, in which case it and
    ``max_memory`` go to ``from_pretrained`` and ``LoadedModel.device`` is where the input
    embeddings landed. ``quantize``: ``none`` (default), ``int8``, ``int4`` or ``auto`` -- low-bit weight copies
    for few-row forwards, for *drafters* only (see :mod:`crossdraft.models.quant`; ``auto`` = int4 on a CPU
    in bf16/fp16). ``cpu_linear``: ``auto`` (default; ``None`` reads ``CROSSDRAFT_CPU_LINEAR``),
    ``packed`` or ``plain`` -- float32 CPU linear layers on oneDNN-packed weights where that measures
    faster on this machine (see :mod:`crossdraft.models.cpulinear`).
    """
    from crossdraft.models import cpulinear

    kwargs, target = _placement(device, dtype, device_map, max_memory)
    ref = ensure_available(resolve_model(spec, revision=revision, model_file=model_file), pull_missing=pull_missing,
                           progress=progress, trust_remote_code=trust_remote_code)
    if trust_remote_code:
        kwargs["trust_remote_code"] = True
    model = _load_weights(ref, kwargs, progress)
    attention.install()  # GQA on a CPU without per-head copies of K/V (same numbers)
    model.eval()
    model.requires_grad_(False)
    qmode, act = _quantize(model, quantize)
    lmode = cpulinear.pack_linears(model, cpu_linear)  # fp32 CPU layers only; measured per machine
    tokenizer = tokenizer_from(ref, trust_remote_code)
    emb = model.get_input_embeddings()
    dev = emb.weight.device if emb is not None else (target or torch.device("cpu"))
    width = _logits_width(model)
    eos = collect_eos_token_ids(
        tokenizer,
        generation_config=getattr(model, "generation_config", None),
        config=text_config(model.config),
        vocab_size=width,
    )
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=ref.name,
        path=ref.path,
        device=dev,
        dtype=model.dtype,
        eos_token_ids=eos,
        vocab_size=width,
        kind=ref.kind,
        revision=ref.revision,
        quantize=qmode,
        cpu_linear=lmode,
        quantize_act=str(act).replace("torch.", "") if qmode in ("int8", "int4") and act is not None else "",
    )
