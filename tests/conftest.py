"""The whole test session runs under its own temporary $CROSSDRAFT_HOME.

crossdraft caches vocabulary mappings, tokenizers fetched from model servers, cost tables and
pulled models under $CROSSDRAFT_HOME (crossdraft.home.crossdraft_home). The tests set it in
pytest_configure, before collection, to a fresh directory, so that in-process engines and every
service process a fixture starts (they inherit os.environ) write there and not into the user's
cache. The pulled catalog models (`make models`) and their downloaded wheels are symlinked into it
from the user's cache, so the real-model tests find them without copying gigabytes; nothing writes
through those links (a forced re-pull replaces a link, not its target).

The user's cache is listed before the session and again after its last test; a file that appeared,
changed or went away there fails that last teardown and names the files (a process outside the
tests that writes the cache during the session, `crossdraft models pull` say, fails it too).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

_ENV = "CROSSDRAFT_HOME"
_state: dict = {}


def _listing(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and symlink under ``root`` (not following links): relative path -> (size, mtime_ns)."""
    out = {}
    if not root.is_dir():
        return out
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            out[os.path.relpath(path, root)] = (st.st_size, st.st_mtime_ns)
    return out


def _link_pulled(real: Path, home: Path) -> None:
    """Symlink the complete models (their completion marker is there) and the wheels of ``real``
    into ``home``; unfinished work (``.tmp-*``, ``.trash-*``) stays out."""
    from crossdraft.models.catalog import MARKER_FILE

    for sub, keep in (("models", lambda p: p.is_dir() and (p / MARKER_FILE).is_file()),
                      ("downloads", lambda p: p.is_file() and p.suffix == ".whl")):
        src = real / sub
        if not src.is_dir():
            continue
        dst = home / sub
        dst.mkdir(parents=True, exist_ok=True)
        for p in src.iterdir():
            if not p.name.startswith(".") and keep(p):
                os.symlink(p, dst / p.name)


def pytest_configure(config):
    from crossdraft.home import crossdraft_home

    real = crossdraft_home()
    home = Path(tempfile.mkdtemp(prefix="crossdraft-home-"))
    _link_pulled(real, home)
    _state.update(real=real, home=home, before=_listing(real), old=os.environ.get(_ENV))
    os.environ[_ENV] = str(home)


def pytest_unconfigure(config):
    if "home" not in _state:
        return
    if _state["old"] is None:
        os.environ.pop(_ENV, None)
    else:
        os.environ[_ENV] = _state["old"]
    shutil.rmtree(_state.pop("home"), ignore_errors=True)  # removes the links, never what they point to


@pytest.fixture(scope="session", autouse=True)
def users_crossdraft_home_is_untouched():
    """Tears down after the session's last test: the user's $CROSSDRAFT_HOME is as it was."""
    yield
    real, before = _state["real"], _state["before"]
    after = _listing(real)
    changed = sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))
    assert not changed, (f"{len(changed)} files changed in the user's crossdraft cache {real} during the test "
                         f"session (tests write under the temporary $CROSSDRAFT_HOME; or another process "
                         f"wrote there meanwhile): {changed[:20]}")
