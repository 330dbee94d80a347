"""gateway/memtrace.py: CROSSDRAFT_TRACEMALLOC's reports name the allocation site that grew."""

import re
import tracemalloc

from gateway.memtrace import MemTrace, from_env

_KEEP: list = []


class _Blob:
    def __init__(self):
        self.payload = bytearray(1000)


def _grow(n: int) -> None:
    _KEEP.extend(_Blob() for _ in range(n))


def test_off_without_the_variable():
    assert from_env({}) is None
    assert from_env({"CROSSDRAFT_TRACEMALLOC": " "}) is None


def test_from_env_reads_the_settings(tmp_path):
    m = from_env({"CROSSDRAFT_TRACEMALLOC": str(tmp_path / "m.txt"), "CROSSDRAFT_TRACEMALLOC_INTERVAL_S": "5",
                  "CROSSDRAFT_TRACEMALLOC_TOP": "3", "CROSSDRAFT_TRACEMALLOC_FRAMES": "4",
                  "CROSSDRAFT_TRACEMALLOC_BASELINE_S": "7"})
    assert (m.path, m.interval_s, m.top, m.frames, m.baseline_s) == (str(tmp_path / "m.txt"), 5.0, 3, 4, 7.0)
    assert not m.started  # started once the gateway is ready


def test_a_report_names_what_grew_since_the_baseline(tmp_path):
    path = tmp_path / "memtrace.txt"
    was_tracing = tracemalloc.is_tracing()
    m = MemTrace(str(path), interval_s=3600, top=5, frames=4).start()
    try:
        _grow(2000)  # ~2 MB kept alive after the baseline
        text = m.report()
        m.stop()  # a last report
    finally:
        _KEEP.clear()
        if not was_tracing:
            tracemalloc.stop()
    assert path.read_text().count("==== memtrace report") == 2
    first = text.split("\n")
    assert first[0].startswith("==== memtrace report 1")
    assert first[1].startswith("rss ") and "traced python heap" in first[1]
    top = text.split("top 5 by growth:\n", 1)[1]
    site = re.split(r"\n\s+[+-][0-9.]+ KiB", top)[0]  # the site that grew most, with its traceback
    assert "test_gateway_memtrace.py" in site and "self.payload = bytearray(1000)" in site
    assert "_Blob +2000" in text.split("object types by growth in count:", 1)[1]
