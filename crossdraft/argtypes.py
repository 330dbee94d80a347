"""argparse types that check a flag's value and name the flag in the error.

argparse also runs a type on a string default, so a default read from the environment
(``default=os.environ.get("CROSSDRAFT_PORT", "50052")``) is checked the same way and a bad value
ends in ``error: argument --port: ... (env CROSSDRAFT_PORT)`` instead of a traceback.
"""

from __future__ import annotations

import argparse
import os
import re
from typing import Callable

from crossdraft.errors import InvalidArgument

INT63 = 2**63 - 1  # seeds and round indices hash as signed 64-bit integers


def _number_arg(name: str, env: str | None, convert: Callable[[str], int | float], kind: str,
                check: Callable[[int | float, str], str | None]):
    """The part every parser shares: strip the text, convert it, and refuse it naming the flag.

    `kind` completes "must be ..." when `convert` raises ValueError; `check(value, text)` returns
    what completes "must be ..." for a value out of range, or None for a good one. A value from the
    environment (`env`) names the variable after the message.
    """
    where = f" (the flag or env {env})" if env else ""

    def parse(s):
        try:
            v = convert(str(s).strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be {kind}, got {s!r}{where}") from None
        problem = check(v, s)
        if problem is not None:
            raise argparse.ArgumentTypeError(f"{name} must be {problem}{where}")
        return v

    return parse


def _bounds(v, minimum, maximum, above: bool = False) -> str | None:
    """Why `v` is outside [minimum, maximum] ((minimum, maximum] with above=True), or None."""
    if minimum is not None and (v <= minimum if above else v < minimum):
        return f"{'>' if above else '>='} {minimum}, got {v}"
    if maximum is not None and v > maximum:
        return f"<= {maximum}, got {v}"
    return None


def int_arg(name: str, minimum: int | None = None, maximum: int | None = None, env: str | None = None):
    """A type for flag `name` that parses an integer in [minimum, maximum] (either bound optional)."""
    return _number_arg(name, env, int, "an integer", lambda v, s: _bounds(v, minimum, maximum))


def port_arg(name: str, env: str | None = None, zero: str = "off"):
    """A TCP port in [0, 65535]; what 0 means (`zero`) goes into the message."""
    def check(v, s):
        return None if 0 <= v <= 65535 else f"in [0, 65535] (0 = {zero}), got {v}"

    return _number_arg(name, env, int, "a port number", check)


def float_arg(name: str, minimum: float | None = None, maximum: float | None = None, *, above: bool = False,
              env: str | None = None):
    """A finite float >= minimum (> minimum with above=True) and <= maximum."""
    def check(v, s):
        if v != v or v in (float("inf"), float("-inf")):
            return f"a finite number, got {s!r}"
        return _bounds(v, minimum, maximum, above)

    return _number_arg(name, env, float, "a number", check)


def available_cpus() -> frozenset[int]:
    """The CPUs this process may run on (its affinity set; every online CPU where that is unknown)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity API on this platform
        return frozenset(range(os.cpu_count() or 1))


def parse_cpu_list(text, field: str = "cpus", available=None) -> tuple[int, ...]:
    """CPU numbers from a list like "0", "0-3" or "0,2,4-5" (sorted, each once).

    Every CPU must be one of `available` (default: :func:`available_cpus`), so a list names only
    CPUs a process started from here can pin itself to. InvalidArgument naming `field` otherwise.
    """
    s = str(text if text is not None else "").strip()
    if not s:
        raise InvalidArgument(field, "must name at least one CPU (a list like 0, 0-3 or 0,2,4-5), got ''")
    have = available_cpus() if available is None else frozenset(available)
    top = max(have, default=-1)
    cpus: set[int] = set()
    beyond: list[str] = []
    for part in s.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?", part, re.ASCII)
        if m is None:
            if re.fullmatch(r"-\s*\d+|\d+\s*-\s*-\s*\d+", part, re.ASCII):
                raise InvalidArgument(field, f"CPU numbers must be >= 0, got {s!r}")
            raise InvalidArgument(field, f"must be a list of CPU numbers and ranges like 0, 0-3 or 0,2,4-5, "
                                         f"got {s!r}")
        a = int(m.group(1))
        b = int(m.group(2)) if m.group(2) is not None else a
        if a > b:
            raise InvalidArgument(field, f"a range must run from low to high, got {part!r} in {s!r}")
        cpus.update(range(a, min(b, top) + 1))
        if b > top:  # the part past the last CPU here is named, never spelled out (a typo like 0-99999999)
            far = str(b) if max(a, top + 1) == b else f"{max(a, top + 1)}-{b}"
            beyond += [far] if far not in beyond else []
    missing = [format_cpu_list(cpus - have)] if cpus - have else []
    missing += beyond
    if missing:
        n = len(cpus - have) + sum(1 + ("-" in x) for x in beyond)
        what = f"CPU {missing[0]} is" if n == 1 else f"CPUs {','.join(missing)} are"
        raise InvalidArgument(field, f"{what} not available here: this process may use CPUs "
                                     f"{format_cpu_list(have) or 'none'}, got {s!r}")
    return tuple(sorted(cpus))


def format_cpu_list(cpus) -> str:
    """The shortest list form of a set of CPU numbers: {0, 1, 2, 5} -> "0-2,5"."""
    out: list[str] = []
    run: list[int] = []
    for c in sorted(set(cpus)):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def cpu_list_arg(name: str, env: str | None = None, available=None):
    """A type for flag `name` that parses a CPU list (:func:`parse_cpu_list`), naming the flag when refused."""
    where = f" (the flag or env {env})" if env else ""

    def parse(s):
        try:
            return parse_cpu_list(s, name, available)
        except InvalidArgument as e:
            raise argparse.ArgumentTypeError(f"{e}{where}") from None

    return parse
