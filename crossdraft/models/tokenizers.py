"""Tokenizers: loading a model's tokenizer, and the token ids that end a completion.

:func:`load_tokenizer` takes the same specs as the model loader and downloads no weights for it
(of a Hub repo only the tokenizer and config files, of a GGUF repo the one GGUF, which holds the
tokenizer). The gateway loads its tokenizers through here, so this module imports neither torch
nor the model loader; transformers only when a tokenizer is loaded.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from crossdraft.errors import ModelError
from crossdraft.models.resolve import ModelRef, ensure_available, resolve_model

__all__ = ["EOS_TOKEN_STRINGS", "collect_eos_token_ids", "load_tokenizer", "tokenizer_from"]

# Token strings that end a completion when the vocabulary has them as special tokens.
EOS_TOKEN_STRINGS: tuple[str, ...] = ("<|endoftext|>", "<|im_end|>", "<end_of_turn>", "<eos>", "</s>")


def _special_tokens(tokenizer: Any) -> set[str]:
    """The tokenizer's special tokens: the named ones and the added tokens marked special."""
    out: set[str] = set()
    with contextlib.suppress(Exception):
        out.update(str(t) for t in tokenizer.all_special_tokens)
    with contextlib.suppress(Exception):
        out.update(t.content for t in tokenizer.added_tokens_decoder.values() if getattr(t, "special", False))
    return out


def collect_eos_token_ids(
    tokenizer: Any,
    *,
    generation_config: Any = None,
    config: Any = None,
    vocab_size: int | None = None,
) -> frozenset[int]:
    """Token ids that end a completion.

    The union of ``generation_config.eos_token_id`` and ``config.eos_token_id`` (int or list),
    ``tokenizer.eos_token_id``, and the ids of :data:`EOS_TOKEN_STRINGS` that the vocabulary holds
    *as special tokens* (looked up in the vocab, never via ``convert_tokens_to_ids``, which maps
    unknown strings to the unk id). Ids outside ``[0, vocab_size)`` are dropped when ``vocab_size``
    is given (the model can never emit them).
    """
    import torch  # deferred: loading a tokenizer alone needs no torch

    ids: set[int] = set()

    def add(value: Any) -> None:
        if value is None:
            return
        if isinstance(value, (list, tuple, set, frozenset)):
            for v in value:
                add(v)
        elif isinstance(value, int) and not isinstance(value, bool):
            ids.add(int(value))
        elif isinstance(value, torch.Tensor):
            add(value.flatten().tolist())

    add(getattr(generation_config, "eos_token_id", None))
    add(getattr(config, "eos_token_id", None))
    add(getattr(tokenizer, "eos_token_id", None))
    vocab = tokenizer.get_vocab()
    special = _special_tokens(tokenizer)
    for s in EOS_TOKEN_STRINGS:
        if s in vocab and s in special:
            add(vocab[s])
    if vocab_size is not None:
        ids = {i for i in ids if 0 <= i < vocab_size}
    return frozenset(ids)


def tokenizer_from(ref: ModelRef, trust_remote_code: bool = False) -> Any:
    """The tokenizer of an available ``ref`` (of its GGUF when it loads one); :class:`ModelError` if it fails."""
    from transformers import AutoTokenizer

    try:
        if (gguf := ref.gguf_path) is not None:
            return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        extra = {"trust_remote_code": True} if trust_remote_code else {}
        return AutoTokenizer.from_pretrained(str(ref.path), **extra)
    except Exception as e:
        raise ModelError(f"could not load the tokenizer of {ref.spec!r} from {ref.path}: "
                         f"{type(e).__name__}: {e}") from e


def load_tokenizer(spec: str | os.PathLike[str], *, pull_missing: bool = True, progress: bool = True,
                   revision: str | None = None, trust_remote_code: bool = False, model_file: str | None = None) -> Any:
    """The tokenizer of a catalog name (pulled if missing), HF directory, ``.gguf`` file or Hub id
    (only its tokenizer and config files are downloaded, never the weights; of a GGUF repo, the one
    GGUF, which holds the tokenizer)."""
    ref = ensure_available(resolve_model(spec, revision=revision, model_file=model_file), pull_missing=pull_missing,
                           progress=progress, weights=False, trust_remote_code=trust_remote_code)
    return tokenizer_from(ref, trust_remote_code)
