"""The runtime pair: both tokenizers and the mapping between the two models' ids, as the round
loop uses them (:class:`TokenPair`), and a conversation's ids in a tokenizer's chat template.
"""

from __future__ import annotations

import numpy as np

from crossdraft.errors import InvalidArgument
from crossdraft.vocab.codec import encode_bytes
from crossdraft.vocab.frequency import frequency_order
from crossdraft.vocab.mapping import build_mapping
from crossdraft.vocab.tokenbytes import byte_table

__all__ = ["TokenPair", "chat_ids", "chat_text", "has_chat_template"]


def has_chat_template(tok) -> bool:
    """Whether the tokenizer carries a chat template."""
    return bool(getattr(tok, "chat_template", None))


def chat_text(tok, messages: list[dict], model: str = "the model") -> str:
    """`messages` rendered with the tokenizer's chat template (+ generation prompt).

    ``model`` names the model in the error (never the tokenizer's path: that is a server detail)."""
    if not has_chat_template(tok):
        raise InvalidArgument("messages", f"{model} has no chat template: send the conversation as text (a "
                                          "prompt to /v1/completions, or GenerateRequest.prompt)")
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def chat_ids(tok, messages: list[dict], model: str = "the model") -> list[int]:
    """Token ids of `messages` rendered with the tokenizer's chat template (+ generation prompt)."""
    return list(tok(chat_text(tok, messages, model), add_special_tokens=False)["input_ids"])


class TokenPair:
    """Both tokenizers and the mapping between the two models' ids (drafter optional).

    What the round loop needs at run time, built from :class:`crossdraft.vocab.mapping.VocabMapping`
    resized to the models' logit rows: ``d2t`` / ``t2d`` (ids, -1 outside the intersection), the drafter masks
    (``"tli"``: the intersection; ``"text"``: every drafter token that stands for bytes, for text
    drafting), ``map_q`` (a drafter distribution as target ids), and the bytes of each id.
    """

    def __init__(self, target_tok, drafter_tok=None, target_vocab: int = 0, drafter_vocab: int = 0, *, mapping=None,
                 vocab_cache_dir=None, draft_vocab: int = 0):
        # draft_vocab: the drafter drafts only from its this many most frequent tokens (frequency_order):
        # its LM head is then pruned to those rows, which a drafter with a large vocabulary reads on every
        # step (Gemma-3: 168M of its 268M parameters). Lossless whatever the set: the target verifies,
        # and its own tokens outside the set come from the residual. 0 = every token.
        if isinstance(draft_vocab, bool) or not isinstance(draft_vocab, (int, np.integer)) or draft_vocab < 0:
            raise InvalidArgument("draft_vocab", f"must be an integer >= 0 (0 = no limit), got {draft_vocab!r}")
        self.draft_vocab = int(draft_vocab)

        self.target_tok = target_tok
        self.drafter_tok = drafter_tok
        self.vt = int(target_vocab or len(target_tok))
        # the tables once, here: the round loop spells and re-encodes bytes several times per round,
        # and checking a table for staleness costs 0.2 ms per call for Gemma-3's tokenizer
        self._t_table = byte_table(target_tok)
        self._d_table = None
        # encode_*_bytes of short byte strings, remembered: the round loop re-encodes each round's new
        # text (mostly one token's bytes, the same few hundred strings again and again) into drafter
        # ids, and the tokenizer's Python wrapper costs ~0.2 ms a call -- per round, per session, on
        # the gateway's one interpreter
        self._memo: dict[tuple[bool, bytes], tuple[int, ...]] = {}
        self.t_bytes = [b if b is not None else b"" for b in self._t_table.bytes]
        self.mapping = None
        self.same_vocab = False
        if drafter_tok is None:
            return
        self.mapping = mapping or build_mapping(target_tok, drafter_tok, cache_dir=vocab_cache_dir)
        vt, vd = self.vt, int(drafter_vocab or len(drafter_tok))
        self.vd = vd
        self.rows = self.mapping.resized(vd, vt)  # the mapping over the models' logit rows
        self.d2t, self.t2d = self.rows.d2t, self.rows.t2d
        self.allowed = self.rows.allowed_drafter_mask()  # [vd] bool: drafter ids in the intersection
        self._d_table = byte_table(drafter_tok)
        self.d_bytes = [b if b is not None else b"" for b in self._d_table.bytes]
        has_bytes = np.zeros(vd, dtype=bool)
        nb = min(vd, len(self.d_bytes))
        has_bytes[:nb] = [len(b) > 0 for b in self.d_bytes[:nb]]
        self.allowed_text = has_bytes  # text drafting may use every drafter token that stands for bytes
        # the same vocabulary: every drafter token that stands for bytes is allowed and is its own target
        # id (greedy then drafts in TLI, no text re-encoding). The row counts may differ (Qwen2.5's small
        # models have 151,936 logit rows, the 7B+ ones 152,064; Llama variants with extra reserved ids):
        # ids past either tokenizer or past the other model's rows are padding, never allowed (resized).
        src = np.nonzero(self.allowed)[0]
        self.same_vocab = bool(np.array_equal(self.d2t[src], src)) and bool(np.array_equal(self.allowed, has_bytes))
        if not self.allowed.any():
            raise InvalidArgument("drafter", "shares no token with the target's vocabulary")
        base = f"{self.mapping.key}-{vt}-{vd}"
        self.keys = {"tli": f"{base}-tli", "text": f"{base}-text"}
        self.masks = {"tli": self.allowed, "text": self.allowed_text}
        if 0 < self.draft_vocab < vd:
            top = frequency_order(drafter_tok, vd) < self.draft_vocab
            for mode, mask in list(self.masks.items()):
                capped = mask & top
                if capped.any() and int(capped.sum()) < int(mask.sum()):  # (never an empty set)
                    self.masks[mode] = capped
                    self.keys[mode] += f"-top{self.draft_vocab}"

    # ---- text <-> ids ----------------------------------------------------------------------
    def encode_target(self, text: str) -> list[int]:
        return list(self.target_tok(text, add_special_tokens=True)["input_ids"])

    def encode_drafter(self, text: str) -> list[int]:
        return list(self.drafter_tok(text, add_special_tokens=True)["input_ids"])

    def chat_ids(self, messages: list[dict],
                 target_name: str = "the target model") -> tuple[list[int], list[int] | None]:
        """Both models' ids of a conversation, each in its own chat template. A drafter without a
        template drafts over the target's rendering (the text the target sees)."""
        text = chat_text(self.target_tok, messages, target_name)
        t = list(self.target_tok(text, add_special_tokens=False)["input_ids"])
        if self.drafter_tok is None:
            return t, None
        if has_chat_template(self.drafter_tok):
            return t, chat_ids(self.drafter_tok, messages)
        return t, self.encode_drafter(text)

    def target_text_bytes(self, ids) -> bytes:
        """The bytes of target ids (special tokens and ids past the tokenizer stand for none), as
        :func:`crossdraft.vocab.codec.decode_bytes`."""
        tb, n = self.t_bytes, len(self.t_bytes)
        return b"".join(tb[i] for i in map(int, ids) if 0 <= i < n)

    MEMO_BYTES = 48  # strings up to this long are remembered
    MEMO_SIZE = 16384  # entries; past it the memo starts over

    def _encode_memo(self, drafter: bool, data: bytes) -> list[int]:
        """encode_bytes with the drafter's or the target's tokenizer (a pure function of ``data``),
        remembered for short strings. A string the vocabulary cannot spell raises every time."""
        tok, table = (self.drafter_tok, self._d_table) if drafter else (self.target_tok, self._t_table)
        if len(data) > self.MEMO_BYTES:
            return encode_bytes(tok, data, table=table)
        key = (drafter, bytes(data))
        ids = self._memo.get(key)
        if ids is None:
            ids = tuple(encode_bytes(tok, data, table=table))
            if len(self._memo) >= self.MEMO_SIZE:
                self._memo = {}
            self._memo[key] = ids
        return list(ids)

    def encode_target_bytes(self, data: bytes) -> list[int]:
        """:func:`encode_bytes` with the target's tokenizer."""
        return self._encode_memo(False, data)

    def encode_drafter_bytes(self, data: bytes) -> list[int]:
        """:func:`encode_bytes` with the drafter's tokenizer."""
        return self._encode_memo(True, data)

    def map_q(self, q_ids: np.ndarray, q_probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A drafter distribution as target ids: :meth:`crossdraft.vocab.mapping.VocabMapping.map_distribution`."""
        return self.rows.map_distribution(q_ids, q_probs)
