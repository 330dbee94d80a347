"""crossdraft.runtime.memory: resident memory from /proc, and malloc_trim handing freed heap pages back."""

from __future__ import annotations

import ctypes

import pytest

from crossdraft.runtime import memory


def test_resident_reads_this_process():
    res = memory.resident()
    assert res is not None and res["rss"] > 10 * 2**20  # a Python process with torch importable
    assert 0 < res["anon"] <= res["rss"]


def test_trim_returns_free_pages_that_free_alone_keeps():
    libc = memory._libc()
    if libc is None:
        pytest.skip("not glibc: malloc_trim does not exist here")
    malloc, free = libc.malloc, libc.free
    malloc.restype, malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    free.argtypes = [ctypes.c_void_p]
    # 400 heap buffers of 100 kB (below the mmap threshold), each followed by a live 40 kB one, so
    # that the freed ones are holes in the middle of the heap, not at its top: what a model load
    # leaves behind
    size, chunks, pins = 100_000, [], []
    for _ in range(400):
        p = malloc(size)
        ctypes.memset(p, 1, size)
        chunks.append(p)
        pins.append(malloc(40_000))
    try:
        for p in chunks:
            free(p)
        before = memory.resident()["anon"]
        freed = memory.trim()
        after = memory.resident()["anon"]
    finally:
        for p in pins:
            free(p)
    assert freed is not None and freed >= 20 * 2**20  # most of the 40 MB of holes
    assert before - after >= 20 * 2**20
