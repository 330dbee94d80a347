"""A batching model server's threads: its forwards run on the scheduler's thread with the server's torch
threads, its gRPC handlers compute on one thread each (crossdraft.serving.modelserver.one_thread). A handler
with an OpenMP team of its own slows every forward: GNU OpenMP, once it manages more threads than there are
CPUs, stops spinning between parallel regions. A real gRPC server on loopback and a real BatchScheduler;
the forward is a stand-in that records the thread count it runs with (no model)."""

from __future__ import annotations

import grpc
import pytest
import torch

from crossdraft.runtime import batching
from crossdraft.runtime.batching import BatchConfig, BatchScheduler, KVSlot
from crossdraft.serving import rpc
from crossdraft.serving.modelserver import one_thread
from tests.unit.runtime.threads import cpu_pool

pytestmark = pytest.mark.timeout(120)


def _serve(thread_init, seen: list):
    """A server whose one method records the torch threads its handler computes with."""
    def go(request, context):
        seen.append(torch.get_num_threads())
        return b"ok"

    handler = grpc.method_handlers_generic_handler("t.T", {"Go": grpc.unary_unary_rpc_method_handler(go)})
    server, port, _ = rpc.build_server([lambda s: s.add_generic_rpc_handlers((handler,))], ["t.T"], "127.0.0.1", 0,
                                       max_workers=2, thread_init=thread_init)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    return server, channel, channel.unary_unary("/t.T/Go")


@pytest.fixture
def restore_threads():
    n = torch.get_num_threads()
    yield n
    torch.set_num_threads(n)  # (the process-wide count that a handler's one_thread set)


def test_handlers_compute_on_one_thread_and_the_forwards_on_the_servers(monkeypatch, restore_threads):
    """The scheduler's thread keeps its threads even where a handler set its own count first (torch gives
    a thread the process-wide count on first use): the handler's one thread does not leak into forwards."""
    forward_threads = []
    monkeypatch.setattr(batching, "batched_forward", lambda model, pool, rows, head=None, graphs=None:
                        forward_threads.append(torch.get_num_threads()) or [None] * len(rows))
    sched = BatchScheduler(None, cpu_pool(), BatchConfig(max_wait_ms=0), threads=2)
    sched._reserve = lambda batch: batch
    seen = []
    server, channel, call = _serve(one_thread, seen)
    try:
        assert call(b"x", timeout=30) == b"ok"
        sched.forward(KVSlot(), 0, [1], 1)
        assert call(b"x", timeout=30) == b"ok"
        sched.forward(KVSlot(), 0, [1], 1)
    finally:
        channel.close()
        server.stop(None).wait(5)
        sched.close()
    assert seen == [1, 1] and forward_threads == [2, 2]


def test_without_batching_the_handlers_keep_the_server_s_threads(restore_threads):
    """Unbatched, each handler runs its session's forwards itself: it computes with the server's threads."""
    seen = []
    server, channel, call = _serve(None, seen)
    try:
        assert call(b"x", timeout=30) == b"ok"
    finally:
        channel.close()
        server.stop(None).wait(5)
    assert seen == [restore_threads]
