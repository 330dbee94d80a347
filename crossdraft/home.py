"""Where crossdraft keeps what it downloads and builds: models, tokenizers, vocabulary mappings."""

from __future__ import annotations

import os
from pathlib import Path

HOME_ENV = "CROSSDRAFT_HOME"


def crossdraft_home() -> Path:
    """``$CROSSDRAFT_HOME`` (read on every call), default ``~/.cache/crossdraft``."""
    env = os.environ.get(HOME_ENV)
    return Path(env).expanduser() if env else Path("~/.cache/crossdraft").expanduser()
