"""argparse types that check a flag's value and name the flag in the error.

argparse also runs a type on a string default, so a default read from the environment
(``default=os.environ.get("CROSSDRAFT_PORT", "50052")``) is checked the same way and a bad value
ends in ``error: argument --port: ... (env CROSSDRAFT_PORT)`` instead of a traceback.
"""

from __future__ import annotations

import argparse
from typing import Callable

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
