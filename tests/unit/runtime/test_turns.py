"""Model servers on the same CPU cores take turns at forwards (crossdraft.runtime.turns).

Two Turns objects on one lock file behave as two processes would: ``flock`` locks belong to an open
file, and each Turns opens its own. Schedulers run with a stand-in forward that sleeps (batched_forward
patched; no model): the tests are about which forwards run when, counted, not timed."""

import fcntl
import os
import subprocess
import sys
import threading
import time

import pytest

from crossdraft.argtypes import format_cpu_list
from crossdraft.errors import InvalidArgument
from crossdraft.runtime import batching
from crossdraft.runtime.batching import BatchConfig, BatchScheduler, KVSlot
from crossdraft.runtime.turns import Turns, lock_path
from tests.unit.runtime.threads import cpu_pool, run_threads


def test_the_lock_file_of_each_setting(tmp_path):
    assert lock_path("off") is None and lock_path("") is None and lock_path(None) is None
    auto = lock_path("auto")
    cpus = format_cpu_list(os.sched_getaffinity(0))
    assert os.path.dirname(auto) and auto.endswith(f"crossdraft-turns-cpus-{cpus}.lock")
    assert lock_path(str(tmp_path / "x.lock")) == str(tmp_path / "x.lock")


def test_the_model_servers_flag(monkeypatch):
    import argparse

    from crossdraft.serving import modelserver

    def cfg(*extra):
        p = argparse.ArgumentParser()
        modelserver.add_arguments(p, 0)
        return modelserver.config_from_args(p.parse_args(["--model", "x", *extra]))

    assert cfg().cpu_turns == "auto"
    assert cfg("--cpu-turns", "OFF").cpu_turns == "off"
    c = cfg("--cpu-turns", "/shared/turns.lock")
    assert modelserver.batch_config(c, "drafter") == BatchConfig(cpu_turns="/shared/turns.lock", name="drafter")
    monkeypatch.setenv("CROSSDRAFT_CPU_TURNS", "off")
    assert cfg().cpu_turns == "off"
    with pytest.raises(InvalidArgument, match="cpu_turns"):
        cfg("--cpu-turns", " ")


def _forwards(monkeypatch, events: list, seconds: float = 0.02) -> None:
    """batched_forward -> a stand-in that records (model, start/end) and sleeps ``seconds``."""
    lock = threading.Lock()

    def forward(model, pool, rows, head=None, graphs=None):
        with lock:
            events.append((model, "start", len(rows)))
        time.sleep(seconds)
        with lock:
            events.append((model, "end", len(rows)))
        return [None] * len(rows)

    monkeypatch.setattr(batching, "batched_forward", forward)


def _scheduler(name: str, turns: str | None) -> BatchScheduler:
    sched = BatchScheduler(name, cpu_pool(), BatchConfig(max_wait_ms=0, cpu_turns=turns, name=name), threads=1)
    sched._reserve = lambda batch: batch
    return sched


def _clients(sched: BatchScheduler, n: int, rounds: int) -> list:
    def client():
        slot = KVSlot()
        for _ in range(rounds):
            sched.forward(slot, 0, [1], 1)
        sched.release(slot)

    return [client] * n


def test_two_servers_forwards_never_overlap_and_alternate(monkeypatch, tmp_path):
    """A verifier and a drafter on one lock file, each kept busy by its own clients: no forward of one
    runs during a forward of the other, and while both have rows waiting, neither runs more than two
    forwards in a row (an ending turn lets the waiting server go first -- a plain lock would let the
    server that just ended take it again at once, its rows already queued)."""
    events: list = []
    _forwards(monkeypatch, events)
    path = str(tmp_path / "turns.lock")
    v, d = _scheduler("verifier", path), _scheduler("drafter", path)
    try:
        run_threads(_clients(v, 3, 12) + _clients(d, 3, 12), 60)
    finally:
        v.close()
        d.close()
    assert sum(n for _, what, n in events if what == "end") == 6 * 12
    running = None
    for model, what, _ in events:  # strictly start/end pairs of one model at a time
        assert (what == "start") == (running is None), events
        running = model if what == "start" else None
    order = [m for m, what, _ in events if what == "start"]
    both = min(max(i for i, m in enumerate(order) if m == name) for name in ("verifier", "drafter"))
    runs, longest = 1, 1
    for i in range(1, both + 1):  # (until one server's clients are done)
        runs = runs + 1 if order[i] == order[i - 1] else 1
        longest = max(longest, runs)
    assert longest <= 2, order
    assert v.turns.turns >= 1 and d.turns.turns >= 1 and v.turns.forced == d.turns.forced == 0


def _runs(order: list, name: str) -> list[int]:
    """Lengths of the runs of ``name``'s forwards in the order they started."""
    runs: list[int] = []
    for i, m in enumerate(order):
        if m == name:
            runs[-1:] = [runs[-1] + 1] if i and order[i - 1] == name else [*runs[-1:], 1]
    return runs


@pytest.mark.parametrize("run_on_s", [1.0, 0.05])
def test_a_drafters_block_runs_in_one_turn_bounded(monkeypatch, tmp_path, run_on_s):
    """A drafter's block sends each step's row as soon as it has the last answer (``more``): its steps
    run one after another in one turn, never each behind a forward of the verifier, which stays busy
    with rows of its own throughout -- for at most ``run_on_s`` (0.05 s: at most 3 forwards of 0.02 s)."""
    events: list = []
    _forwards(monkeypatch, events)
    monkeypatch.setattr(Turns, "run_on_s", run_on_s)
    path = str(tmp_path / "turns.lock")
    v, d = _scheduler("verifier", path), _scheduler("drafter", path)

    def blocks():
        slot = KVSlot()
        for _ in range(3):
            for i in range(5):
                d.forward(slot, 0, [1], 1, more=i < 4)
            time.sleep(0.05)  # (the block's verification, elsewhere)
        d.release(slot)

    try:
        run_threads([blocks] + _clients(v, 2, 40), 60)
    finally:
        v.close()
        d.close()
    order = [m for m, what, _ in events if what == "start"]
    last_v = max(i for i, m in enumerate(order) if m == "verifier")
    assert order.index("drafter") < last_v and order.count("drafter") == 15
    runs = _runs(order[:last_v], "drafter")
    if run_on_s >= 1.0:
        assert runs == [5, 5, 5], order
    else:
        assert max(runs) <= 3 and len(runs) >= 6, order
    assert _runs(order[:last_v], "verifier")  # (the verifier's rows went on in between)


def test_a_scheduler_without_turns_runs_whenever_it_likes(monkeypatch, tmp_path):
    """(off, or a GPU's pool: no lock file is opened)"""
    events: list = []
    _forwards(monkeypatch, events, 0.0)
    sched = _scheduler("verifier", "off")
    try:
        sched.forward(KVSlot(), 0, [1], 1)
    finally:
        sched.close()
    assert sched.turns is None and len(events) == 2


def test_a_holder_that_never_lets_go_delays_a_turn_but_never_hangs_it(tmp_path):
    path = str(tmp_path / "turns.lock")
    stuck = os.open(path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(stuck, fcntl.LOCK_EX)  # (a stopped server in the middle of its forward)
    t = Turns(path, "verifier")
    t.max_wait_s = 0.2
    try:
        t.acquire()
        t.release()
        assert t.forced == 1 and t.turns == 1
        fcntl.flock(stuck, fcntl.LOCK_UN)
        t.acquire()  # the lock is free again: a real turn
        t.release()
        assert t.forced == 1 and t.turns == 2
    finally:
        t.close()
        os.close(stuck)


def test_a_marked_peer_that_never_takes_its_turn_is_passed_over(tmp_path):
    path = str(tmp_path / "turns.lock")
    mark = os.open(f"{path}.wait.drafter-{os.getpid()}", os.O_RDWR | os.O_CREAT)
    fcntl.flock(mark, fcntl.LOCK_EX)  # (a waiting server stopped before it could take the turn)
    t = Turns(path, "verifier")
    try:
        for _ in range(3):
            t.acquire()
            t.release()  # gives the marked peer its chance, then goes on
        assert t.turns == 3 and t.forced == 0
    finally:
        t.close()
        os.close(mark)


def test_marks_of_servers_that_died_are_swept(tmp_path):
    path = str(tmp_path / "turns.lock")
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    for pid in (gone, str(os.getpid())):
        open(f"{path}.wait.drafter-{pid}", "w").close()
    t = Turns(path, "verifier")
    try:
        left = sorted(os.path.basename(p) for p in t._waiting())
        assert left == [f"turns.lock.wait.drafter-{os.getpid()}"]  # (a live process keeps its mark)
    finally:
        t.close()
    assert not os.path.exists(t._mark)


def test_a_lock_file_that_fails_leaves_the_forwards_running_without_turns(tmp_path):
    t = Turns(str(tmp_path / "turns.lock"), "verifier")
    os.close(t._mark_fd)  # (its mark cannot be locked any more: flock raises)
    try:
        for _ in range(2):
            t.acquire()
            t.release()
        assert t.turns == 2 and t.forced == 2
    finally:
        t._mark_fd = os.open(t._mark, os.O_RDWR)
        t.close()


def test_rows_that_come_while_a_batch_waits_for_its_turn_join_it(monkeypatch, tmp_path):
    """A batch gathered, then held waiting for the turn (another server computing): rows queued meanwhile
    (sessions whose blocks were sent a moment later) run in that forward, not each in a turn of its own."""
    events: list = []
    _forwards(monkeypatch, events, 0.0)
    path = str(tmp_path / "turns.lock")
    peer = os.open(path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(peer, fcntl.LOCK_EX)  # (the drafter in the middle of its forward)
    v = _scheduler("verifier", path)
    try:
        first = threading.Thread(target=lambda: v.forward(KVSlot(), 0, [1], 1))
        first.start()
        for _ in range(20000):  # until the first row was gathered (it then waits for the turn)
            with v._cv:
                if not v._q:
                    break
            time.sleep(0.001)
        time.sleep(0.05)
        later = [threading.Thread(target=lambda: v.forward(KVSlot(), 0, [1], 1)) for _ in range(2)]
        for t in later:
            t.start()
        for _ in range(20000):
            with v._cv:
                if len(v._q) == 2:
                    break
            time.sleep(0.001)
        fcntl.flock(peer, fcntl.LOCK_UN)
        for t in [first, *later]:
            t.join(30)
    finally:
        v.close()
        os.close(peer)
    assert [n for _, what, n in events if what == "start"] == [3]


@pytest.mark.parametrize("hint", [0, 3])
def test_rows_sent_as_a_gang_share_one_forward(monkeypatch, hint):
    """A client says it sends 3 rows at once (BatchScheduler.expect_gang): the first waits for the other two
    (which come a moment later) and the three share one forward; without the hint, the first row runs alone
    (no caller inside the worker, no return history: nothing else to wait for)."""
    events: list = []
    _forwards(monkeypatch, events, 0.0)
    v = _scheduler("verifier", None)
    monkeypatch.setattr(BatchScheduler, "gang_wait_s", 3600.0)
    v._return_wait_s = lambda: 3600.0 if hint else 0.0
    try:
        if hint:
            v.expect_gang(hint)
        first = threading.Thread(target=lambda: v.forward(KVSlot(), 0, [1], 1))
        first.start()
        for _ in range(20000):  # until the first row is in the scheduler's hands (gathered or run)
            with v._cv:
                if not v._q and (events or v._gang_rows or not hint):
                    break
            time.sleep(0.001)
        time.sleep(0.05)
        later = [threading.Thread(target=lambda: v.forward(KVSlot(), 0, [1], 1)) for _ in range(2)]
        for t in [*later]:
            t.start()
        for t in [first, *later]:
            t.join(30)
    finally:
        v.close()
    starts = [n for _, what, n in events if what == "start"]
    assert starts == ([3] if hint else [1, 2]) or (not hint and starts == [1, 1, 1]), starts
