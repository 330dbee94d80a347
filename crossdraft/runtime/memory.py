"""This process's memory: what is resident, and handing freed heap pages back to the system.

Loading a model on a CPU makes many large short-lived buffers (float copies while quantizing,
layers timed and thrown away, the cost tables' forwards). A freed heap page goes back to the
system only when the top of the heap is free, so pages nothing uses can stay counted in the
process's resident memory (and in a pod's memory limit). ``malloc_trim(0)`` returns every whole
free page; :func:`trim` calls it once a server has loaded, and the server prints what is resident
(measured on a 2-vCPU CPU: 43-89 MiB returned for the catalog models; the rest is the weights,
their packed / int8 copies and the KV pool, docs/services.md "Memory"). Elsewhere than Linux with
glibc both functions report ``None`` and do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_LIBC = None


def _libc():
    global _LIBC
    if _LIBC is None:
        _LIBC = False
        if sys.platform.startswith("linux"):
            try:
                lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                lib.malloc_trim.argtypes = [ctypes.c_size_t]
                lib.malloc_trim.restype = ctypes.c_int
                _LIBC = lib
            except (OSError, AttributeError):  # musl and others: no malloc_trim
                _LIBC = False
    return _LIBC or None


def resident() -> dict[str, int] | None:
    """{"rss": bytes, "anon": bytes, "file": bytes} of this process (Linux), else None."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    fields = {}
    for line in lines:  # "Rss:  123 kB" (the first line is the mapping's address range)
        name, sep, value = line.partition(":")
        if sep and name.replace("_", "").isalpha():
            fields[name] = value
    out = {}
    for key, name in (("rss", "Rss"), ("anon", "Anonymous"), ("file", "Pss_File")):
        value = fields.get(name, "").split()
        if value and value[0].isdigit():
            out[key] = int(value[0]) * 1024
    return out if "rss" in out else None


def trim() -> int | None:
    """Give the heap's whole free pages back to the system (glibc ``malloc_trim(0)``).
    Returns the drop of resident anonymous bytes it measured (>= 0), or None where not available."""
    lib = _libc()
    if lib is None:
        return None
    before = resident()
    lib.malloc_trim(0)
    after = resident()
    if not before or not after or "anon" not in before or "anon" not in after:
        return 0
    return max(0, before["anon"] - after["anon"])
