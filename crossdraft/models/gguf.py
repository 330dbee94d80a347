"""GGUF files: checking a header, and turning a GGUF into a dense float model.

:func:`inspect_gguf` checks that a file is a complete, readable GGUF (a truncated download fails
here, naming the file) with a header reader of its own: ``gguf.GGUFReader`` builds a numpy view per
array item and takes ~10 s on a 262k-token vocabulary, this reader well under a second.
transformers' legacy GGUF loader dequantizes every weight into a dense tensor; the helpers here
drop the GGUF quantizer it leaves attached, quiet its progress bars, and save the result as a plain
Hugging Face directory (:func:`convert_gguf_to_hf`, the conversion step of a catalog pull).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from crossdraft.errors import ModelError

__all__ = [
    "convert_gguf_to_hf",
    "detach_gguf_quantizer",
    "inspect_gguf",
    "quiet_transformers",
    "starts_with_gguf_magic",
    "text_config",
]

_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


class _HeaderReader:
    """Reads GGUF header values from ``buf`` (``size`` bytes, byte order ``end``) at ``pos``, which advances.

    Raises ``ValueError`` / ``struct.error`` on malformed or truncated input.
    """

    def __init__(self, buf: Any, size: int, end: str, pos: int) -> None:
        self.buf, self.size, self.end, self.pos = buf, size, end, pos

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from(self.end + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(self.end + fmt)
        return values

    def string(self) -> bytes:
        (n,) = self.unpack("Q")
        if self.pos + n > self.size:
            raise ValueError("string runs past the end of the file")
        value = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return value

    def skip(self, vtype: int) -> None:
        """Move past one metadata value of type ``vtype`` (scalar, string or array)."""
        if vtype in _GGUF_SCALARS:
            self.pos += struct.calcsize(_GGUF_SCALARS[vtype])
        elif vtype == _GGUF_STRING:
            self.string()
        elif vtype == _GGUF_ARRAY:
            itype, count = self.unpack("IQ")
            if itype in _GGUF_SCALARS:
                self.pos += count * struct.calcsize(_GGUF_SCALARS[itype])
            else:
                for _ in range(count):
                    self.skip(itype)
        else:
            raise ValueError(f"unknown metadata value type {vtype}")

    def metadata(self, n_kv: int) -> dict[str, Any]:
        """The few metadata values this reads (architecture, name, alignment); the rest is skipped."""
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self.string().decode("utf-8", errors="replace")
            (vtype,) = self.unpack("I")
            if vtype == _GGUF_STRING and key in ("general.architecture", "general.name"):
                meta[key] = self.string().decode("utf-8", errors="replace")
            elif vtype in _GGUF_SCALARS and key == "general.alignment":
                (meta[key],) = self.unpack(_GGUF_SCALARS[vtype])
            else:
                self.skip(vtype)
        return meta

    def tensor_data_end(self, n_tensors: int) -> int:
        """Read the tensor infos; return where the last tensor's data ends, relative to the data start."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        data_end = 0
        for _ in range(n_tensors):
            name = self.string()
            (n_dims,) = self.unpack("I")
            dims = self.unpack("Q" * n_dims)
            ttype, offset = self.unpack("IQ")
            try:
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
            except (ValueError, KeyError):
                raise ValueError(f"tensor {name.decode(errors='replace')!r} has unknown type {ttype}") from None
            n_elements = 1
            for d in dims:
                n_elements *= d
            data_end = max(data_end, offset + n_elements // block * type_size)
        return data_end


def _parse_gguf_header(buf: Any, size: int) -> dict[str, Any]:
    """Walk a GGUF header (metadata + tensor infos) in ``buf``; check the tensor data fits in ``size``.

    Raises ``ValueError`` / ``struct.error`` on malformed or truncated input.
    """
    (version,) = struct.unpack_from("<I", buf, 4)
    end = "<"
    if version > 0xFFFF:  # a big-endian file reads as a huge little-endian number
        end, version = ">", struct.unpack_from(">I", buf, 4)[0]
    if version not in (2, 3):
        raise ValueError(f"unsupported GGUF version {version} (this reads versions 2 and 3)")
    reader = _HeaderReader(buf, size, end, 8)
    n_tensors, n_kv = reader.unpack("QQ")
    if n_tensors > 1 << 24 or n_kv > 1 << 24:
        raise ValueError(f"implausible header: {n_tensors} tensors, {n_kv} metadata keys")
    meta = reader.metadata(n_kv)
    data_end = reader.tensor_data_end(n_tensors)
    align = int(meta.get("general.alignment", 32)) or 32
    data_start = -(-reader.pos // align) * align
    if n_tensors and data_start + data_end > size:
        raise ValueError(f"truncated: its tensors need {data_start + data_end} bytes, the file has {size}")
    if "general.architecture" not in meta:
        raise ValueError("no general.architecture in the metadata")
    return {
        "architecture": meta["general.architecture"],
        "name": meta.get("general.name"),
        "version": version,
        "n_tensors": n_tensors,
        "size": size,
    }


def inspect_gguf(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Check that ``path`` is a complete, readable GGUF file; return a few header facts
    (``architecture``, ``name``, ``version``, ``n_tensors``, ``size``).

    Raises :class:`ModelError` for a missing file, a bad magic, a header that does not parse, or
    tensor data that extends past the end of the file (a truncated download).
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            magic = f.read(4)
            if magic != b"GGUF":
                raise ModelError(f"{path} is not a GGUF file (starts with {magic!r}, expected b'GGUF')")
            if size < 24:
                raise ModelError(f"{path} is a truncated GGUF file ({size} bytes, shorter than a GGUF header)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse_gguf_header(buf, size)
    except ModelError:
        raise
    except (ValueError, struct.error, OverflowError, MemoryError) as e:
        raise ModelError(f"{path} is a corrupt or truncated GGUF file ({size} bytes): {e}") from e
    except OSError as e:
        raise ModelError(f"cannot read GGUF file {path}: {e}") from e


def detach_gguf_quantizer(model: Any) -> None:
    """Make a model loaded from GGUF a plain dense model (serializable, ``.to()``-able).

    transformers' legacy GGUF loader dequantizes every weight into a dense tensor but leaves a GGUF
    quantizer attached, which blocks ``save_pretrained``. Only safe when no layer stayed packed.
    """
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None:
        return
    if getattr(quantizer, "packed_modules", None):
        raise ModelError("GGUF weights stayed packed (quantized kernels in use); cannot treat as dense")
    model.hf_quantizer = None
    for cfg in {id(c): c for c in (model.config, text_config(model.config))}.values():
        if hasattr(cfg, "quantization_config"):
            with contextlib.suppress(AttributeError):
                delattr(cfg, "quantization_config")


def text_config(config: Any) -> Any:
    """The text model's config (a multimodal config holds one; a text-only config is its own)."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


@contextlib.contextmanager
def quiet_transformers(progress: bool) -> Iterator[None]:
    """Silence transformers' own progress bars (and the GGUF dequant bar) unless ``progress``."""
    if progress:
        yield
        return
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_mod
    except ImportError:  # pragma: no cover - gguf support missing; from_pretrained will say so
        gguf_mod = None
    old_tqdm = getattr(gguf_mod, "tqdm", None)
    if old_tqdm is not None:
        gguf_mod.tqdm = lambda it, *a, **k: it  # the legacy GGUF loader uses a bare tqdm
    try:
        yield
    finally:
        if old_tqdm is not None:
            gguf_mod.tqdm = old_tqdm
        if was_enabled:
            hf_logging.enable_progress_bar()


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path, *, progress: bool) -> None:
    """Dequantize ``gguf_path`` to float32 and save a Hugging Face directory at ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with quiet_transformers(progress):
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        detach_gguf_quantizer(model)
        out_dir.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
    if not (out_dir / "config.json").is_file() or not any(out_dir.glob("*.safetensors")):
        raise ModelError(f"conversion of {gguf_path.name} wrote no config.json / safetensors into {out_dir}")
    for p in out_dir.iterdir():  # safetensors may be written 0600 via a temp file; make it readable
        if p.is_file():
            p.chmod(0o644)


def starts_with_gguf_magic(path: Path) -> bool:
    """Whether the file at ``path`` begins with the GGUF magic (a GGUF saved without the suffix)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False
