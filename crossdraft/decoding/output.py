"""A request's output: the tokens it generated, the text that has gone out, stop strings, logprobs.

:class:`Output` appends each round's target tokens (cut after an end-of-sequence token or a stop
string, or at the token budget) and hands out the new text as complete UTF-8 characters, holding
back a tail that could still become a stop string until it cannot. :func:`check_stop` validates a
request's ``stop`` (the gateway checks it before a request starts).
"""

from __future__ import annotations

import codecs
from collections.abc import Callable
from dataclasses import dataclass, field

from crossdraft.decoding.stats import GenerationResult, Stats
from crossdraft.errors import InvalidArgument

MAX_STOP = 4  # stop strings per request (as the OpenAI API)
MAX_STOP_CHARS = 256


def check_stop(stop) -> list[str]:
    """A request's ``stop``: None, a string, or a list of up to 4 non-empty strings -> list."""
    if stop is None or stop == "":
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)):
        raise InvalidArgument("stop", "must be a string or a list of strings")
    if len(stop) > MAX_STOP:
        raise InvalidArgument("stop", f"at most {MAX_STOP} stop strings, got {len(stop)}")
    out = []
    for i, x in enumerate(stop):
        if not isinstance(x, str) or not x:
            raise InvalidArgument(f"stop[{i}]", "must be a non-empty string")
        if len(x) > MAX_STOP_CHARS:
            raise InvalidArgument(f"stop[{i}]", f"is longer than {MAX_STOP_CHARS} characters")
        try:
            x.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidArgument(f"stop[{i}]", "is not valid UTF-8 (unpaired surrogate)") from None
        out.append(x)
    return out


def safe_end(buf: bytearray, stops: tuple[bytes, ...]) -> int:
    """How much of ``buf`` can go out: all but its longest tail that begins some stop string."""
    n = len(buf)
    for k in range(min(n, max((len(x) for x in stops), default=1) - 1), 0, -1):
        tail = bytes(buf[n - k:])
        if any(x.startswith(tail) for x in stops):
            return n - k
    return n


def _utf8_decoder():
    return codecs.getincrementaldecoder("utf-8")(errors="replace")


@dataclass
class Output:
    """One request's generated target tokens and the text that has gone out of them."""

    stop: tuple[bytes, ...] = ()  # stop strings (UTF-8)
    top_logprobs: int = -1  # -1: no log-probabilities; n: each token's and the n best
    gen: list[int] = field(default_factory=list)  # the generated target ids
    gen_bytes: bytearray = field(default_factory=bytearray)  # their text (up to the token completing a stop string)
    fed: int = 0  # gen_bytes[:fed] went out as text (the rest may still turn into a stop string)
    cut: int | None = None  # a stop string starts at gen_bytes[cut]
    stopped: bool = False  # an end-of-sequence token or a stop string ended the output
    logprobs: list = field(default_factory=list)
    utf8: codecs.IncrementalDecoder = field(default_factory=_utf8_decoder)

    def emit(self, tokens: list[int], eos: set[int], spell: Callable[[list[int]], bytes],
             limit: int) -> tuple[list[int], str, bool]:
        """Append a round's target tokens (cut after an EOS or the token completing a stop string);
        ``spell`` gives target ids' text bytes, ``limit`` is the token budget.
        Returns (the tokens appended, the complete new text, whether the output is done)."""
        out = tokens
        for j, tok in enumerate(out):
            if tok in eos:
                out = out[: j + 1]
                self.stopped = True
                break
        if self.stop:
            out = self._find_stop(out, spell)
        self.gen.extend(out)
        if self.cut is None:
            self.gen_bytes += spell(out)
        done = self.stopped or len(self.gen) >= limit
        # text goes out up to a stop string, else up to what could still become one (all of it at the end)
        end = self.cut if self.cut is not None else len(self.gen_bytes) if done else safe_end(self.gen_bytes, self.stop)
        piece = bytes(self.gen_bytes[self.fed:end])
        self.fed = max(self.fed, end)
        return out, self.utf8.decode(piece, final=done), done

    def _find_stop(self, out: list[int], spell: Callable[[list[int]], bytes]) -> list[int]:
        """Look for a stop string in the text so far plus ``out``; if one is there, cut ``out`` after
        the token that completes it, set ``cut`` and ``stopped``."""
        base = len(self.gen_bytes)
        pieces = [spell([t]) for t in out]
        buf = bytes(self.gen_bytes) + b"".join(pieces)
        longest = max(len(x) for x in self.stop)
        start = max(0, base - longest + 1)
        hits = [(i, i + len(x)) for x in self.stop if (i := buf.find(x, start)) >= 0]
        if not hits:
            return out
        cut, end = min(hits)
        n, pos = 0, base
        while pos < end and n < len(out):
            pos += len(pieces[n])
            n += 1
        self.gen_bytes += b"".join(pieces[:n])
        self.cut = cut
        self.stopped = True
        return out[:n]

    def keep_logprobs(self, reply_logprobs, n: int) -> list | None:
        """The verifier's log-probabilities of the n tokens just appended, kept when the request asked
        for them (None otherwise)."""
        if self.top_logprobs < 0:
            return None
        lps = list(reply_logprobs or [])[:n]
        self.logprobs.extend(lps)
        return lps

    def result(self, stats: Stats) -> GenerationResult:
        """The finished output: its text up to a stop string, and what followed it in the same token."""
        cut = len(self.gen_bytes) if self.cut is None else self.cut
        text = bytes(self.gen_bytes[:cut]).decode("utf-8", errors="replace")
        tail = bytes(self.gen_bytes[cut:]).decode("utf-8", errors="replace")
        return GenerationResult(text, self.gen, stats, stop_tail=tail,
                                logprobs=self.logprobs if self.top_logprobs >= 0 else None)
