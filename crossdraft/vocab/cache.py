"""The mappings' disk cache: one ``<key>.npz`` per tokenizer pair (d2t, t2d and the key).

A gateway or engine pairing two models it paired before reads the mapping instead of computing
it. A file that is unreadable, belongs to another key, has the wrong shapes or ids out of range is
ignored (and rewritten by :func:`crossdraft.vocab.mapping.build_mapping`); a file is written to a
temporary name and renamed, so readers never see half of one; a cache that cannot be written only
costs the next process a recomputation.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

__all__ = ["default_cache_dir", "load_mapping", "save_mapping"]


def default_cache_dir() -> Path:
    """``$CROSSDRAFT_HOME/vocab`` (``CROSSDRAFT_HOME`` defaults to ``~/.cache/crossdraft``)."""
    from crossdraft.home import crossdraft_home

    return crossdraft_home() / "vocab"


def load_mapping(path: Path, key: str, nt: int, nd: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(d2t [nd], t2d [nt]) int64 read-only from ``path`` if it holds the mapping ``key``, else None."""
    try:
        with np.load(path, allow_pickle=False) as z:
            stored_key = str(z["key"])
            d2t = np.asarray(z["d2t"], dtype=np.int64)
            t2d = np.asarray(z["t2d"], dtype=np.int64)
    except FileNotFoundError:
        return None
    except Exception as exc:  # corrupt, truncated, not an npz ...
        log.warning("vocab: ignoring unreadable cache file %s (%s)", path, exc)
        return None
    if stored_key != key or d2t.shape != (nd,) or t2d.shape != (nt,):
        log.warning("vocab: ignoring inconsistent cache file %s", path)
        return None
    if (d2t >= nt).any() or (t2d >= nd).any() or (d2t < -1).any() or (t2d < -1).any():
        log.warning("vocab: ignoring cache file %s with out-of-range ids", path)
        return None
    d2t.setflags(write=False)
    t2d.setflags(write=False)
    return d2t, t2d


def save_mapping(path: Path, key: str, d2t: np.ndarray, t2d: np.ndarray) -> None:
    """Write the mapping ``key`` to ``path`` atomically; a failure is logged, not raised."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{key[:16]}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, d2t=d2t, t2d=t2d, key=np.array(key))
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)  # mkstemp creates 0600; the cache may be shared
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
    except OSError as exc:
        log.warning("vocab: could not write cache file %s (%s)", path, exc)
