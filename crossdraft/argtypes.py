"""argparse types that check a flag's value and name the flag in the error.

argparse also runs a type on a string default, so a default read from the environment
(``default=os.environ.get("CROSSDRAFT_PORT", "50052")``) is checked the same way and a bad value
ends in ``error: argument --port: ... (env CROSSDRAFT_PORT)`` instead of a traceback.
"""

from __future__ import annotations

import argparse

INT63 = 2**63 - 1  # seeds and round indices hash as signed 64-bit integers


def int_arg(name: str, minimum: int | None = None, maximum: int | None = None, env: str | None = None):
    """A type for flag `name` that parses an integer in [minimum, maximum] (either bound optional)."""
    where = f" (the flag or env {env})" if env else ""

    def parse(s):
        try:
            v = int(str(s).strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {s!r}{where}") from None
        if minimum is not None and v < minimum:
            raise argparse.ArgumentTypeError(f"{name} must be >= {minimum}, got {v}{where}")
        if maximum is not None and v > maximum:
            raise argparse.ArgumentTypeError(f"{name} must be <= {maximum}, got {v}{where}")
        return v

    return parse


def port_arg(name: str, env: str | None = None, zero: str = "off"):
    """A TCP port in [0, 65535]; what 0 means (`zero`) goes into the message."""
    where = f" (the flag or env {env})" if env else ""

    def parse(s):
        try:
            v = int(str(s).strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a port number, got {s!r}{where}") from None
        if not 0 <= v <= 65535:
            raise argparse.ArgumentTypeError(f"{name} must be in [0, 65535] (0 = {zero}), got {v}{where}")
        return v

    return parse


def float_arg(name: str, minimum: float | None = None, maximum: float | None = None, *, above: bool = False,
              env: str | None = None):
    """A finite float >= minimum (> minimum with above=True) and <= maximum."""
    where = f" (the flag or env {env})" if env else ""

    def parse(s):
        try:
            v = float(str(s).strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {s!r}{where}") from None
        if v != v or v in (float("inf"), float("-inf")):
            raise argparse.ArgumentTypeError(f"{name} must be a finite number, got {s!r}{where}")
        if minimum is not None and (v <= minimum if above else v < minimum):
            raise argparse.ArgumentTypeError(f"{name} must be {'>' if above else '>='} {minimum}, got {v}{where}")
        if maximum is not None and v > maximum:
            raise argparse.ArgumentTypeError(f"{name} must be <= {maximum}, got {v}{where}")
        return v

    return parse
