"""Captured forwards: one CUDA graph per shape bucket of the batched forward.

A verification round or a drafting step feeds a few tokens per session; on a GPU such a forward
is short enough that launching its hundreds of kernels one by one from Python costs as much as
running them. A CUDA graph records the kernels of one forward once and replays them with one
launch -- but only for fixed shapes and fixed memory addresses. So:

* **Shape buckets.** A batch of B rows of up to T tokens over L key columns is padded up to the
  next bucket of each (rows 1, 2, 4, 8, 16, 32; tokens per row 1, 2, 4, 8, 16; context 256, 512,
  ... 32768). Padding rows and tokens write to the pool's scratch block and read only it; the mask
  hides every padded key from real queries, so a real row's logits are those of the unpadded
  forward (fp32: equal within float rounding of the larger matmuls). Longer feeds (prefill
  chunks) and larger batches run eagerly.
* **Static inputs.** Each captured bucket owns its input tensors (token ids, positions, the pool
  rows written and read); a replay copies the batch's values into them. The KV pool is
  preallocated (crossdraft.runtime.kvpool), so its K/V tensors keep their addresses. The masks are
  computed inside the graph from the positions. Only the decoder body is captured: the LM head
  (full, or a session's pruned drafter head) runs eagerly on the kept positions.
* **Lazily, and checked.** A bucket is captured the first time a batch needs it (warm-up runs
  write to the scratch block only), at most ``max_graphs`` of them (least recently used dropped);
  all share one memory pool. The first replay of every graph is checked against the eager forward
  of the same inputs; a capture that fails or a replay that differs turns graphs off for this
  model server (logged, counted in ``stats``) and the forward runs eagerly -- slower, never wrong.

On CPU there is nothing to capture and padding only costs: model servers use graphs on CUDA only
(``BatchConfig.cuda_graphs``, on by default there). ``backend="emulate"`` runs the same bucketing
and static-buffer path with the "graph" being the eager call on those buffers -- what the CPU
tests use to check the padding, since no GPU runs here.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from crossdraft.runtime.kvpool import KVPool, forward_hidden

log = logging.getLogger("crossdraft.runtime.graphs")

ROW_BUCKETS = (1, 2, 4, 8, 16, 32)
TOKEN_BUCKETS = (1, 2, 4, 8, 16)
CONTEXT_BUCKETS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


@dataclass
class GraphStats:
    captures: int = 0
    replays: int = 0
    eager: int = 0  # batches that fit no bucket (or came after graphs were turned off)
    dropped: int = 0  # captured graphs dropped to stay within max_graphs
    disabled: str = ""  # why graphs were turned off ("" while on)
    buckets: dict = field(default_factory=dict)  # (rows, tokens, context) -> replays


class _Captured:
    __slots__ = ("ids", "pos", "w", "r", "out", "graph", "checked")

    def __init__(self, ids, pos, w, r):
        self.ids, self.pos, self.w, self.r = ids, pos, w, r
        self.out = None
        self.graph = None
        self.checked = False


class ForwardGraphs:
    """Captured decoder forwards of one model over one KV pool, one per shape bucket."""

    def __init__(self, model, pool: KVPool, *, backend: str = "cuda", rows=ROW_BUCKETS, tokens=TOKEN_BUCKETS,
                 contexts=CONTEXT_BUCKETS, max_graphs: int = 48, check_atol: float | None = None):
        if backend not in ("cuda", "emulate"):
            raise ValueError(f"backend must be 'cuda' or 'emulate', got {backend!r}")
        if backend == "cuda" and pool.device.type != "cuda":
            raise ValueError("CUDA graphs need the model and its KV pool on a CUDA device")
        self.model = model
        self.pool = pool
        self.backend = backend
        self.rows, self.tokens, self.contexts = tuple(sorted(rows)), tuple(sorted(tokens)), tuple(sorted(contexts))
        self.max_graphs = max(1, int(max_graphs))
        # the replay-vs-eager check's tolerance on hidden states, relative to their largest value:
        # one graph replays the same kernels as the eager forward, so anything beyond rounding is a
        # capture gone wrong
        if check_atol is None:
            check_atol = 1e-4 if pool.dtype == torch.float32 else 2e-2
        self.check_atol = check_atol
        self.stats = GraphStats()
        self._graphs: OrderedDict[tuple, _Captured] = OrderedDict()
        self._mempool = None
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return not self.stats.disabled

    def bucket(self, rows: int, tokens: int, context: int) -> tuple[int, int, int] | None:
        """The padded (rows, tokens per row, context) a batch runs at, or None: eager."""
        if not self.enabled:
            self.stats.eager += 1
            return None
        b = _up(self.rows, rows)
        t = _up(self.tokens, tokens)
        c = _up(self.contexts, context)
        if b is None or t is None or c is None:
            self.stats.eager += 1
            return None
        return b, t, c

    def hidden(self, shape: tuple[int, int, int], ids, pos, w, r, ends) -> torch.Tensor | None:
        """The decoder's hidden states ``[rows, tokens, hidden]`` of a batch padded to ``shape``
        (host index tensors from crossdraft.runtime.kvpool.plan_indices), from the bucket's graph; None
        where graphs are (or just got) turned off: the caller runs the forward eagerly."""
        with self._lock:
            if not self.enabled:
                return None
            try:
                g = self._graphs.get(shape)
                if g is None:
                    g = self._capture(shape)
                    if g is None:
                        return None
                else:
                    self._graphs.move_to_end(shape)
                g.ids.copy_(ids, non_blocking=True)
                g.pos.copy_(pos, non_blocking=True)
                g.w.copy_(w, non_blocking=True)
                g.r.copy_(r, non_blocking=True)
                self._replay(g)
                out = g.out
                if not g.checked:
                    # the first replay of a graph against the eager forward of the same inputs (which
                    # writes the same keys and values to the same pool rows again)
                    ref = forward_hidden(self.model, self.pool, g.ids, g.pos, g.w, g.r, shape[2])
                    n = len(ends)
                    scale = max(1.0, float(ref[:n].abs().max()))
                    diff = float((out[:n].float() - ref[:n].float()).abs().max())
                    if not diff <= self.check_atol * scale:
                        self._disable(f"replay of bucket {shape} differs from the eager forward by {diff:.3g}")
                        return ref
                    g.checked = True
                self.stats.replays += 1
                self.stats.buckets[shape] = self.stats.buckets.get(shape, 0) + 1
                return out
            except Exception as e:  # a capture or replay that fails: eager from now on
                log.exception("CUDA graph of bucket %s failed", shape)
                self._disable(f"bucket {shape}: {type(e).__name__}: {e}"[:300])
                return None

    # ---- internals -----------------------------------------------------------------------------
    def _disable(self, why: str) -> None:
        log.warning("CUDA graphs turned off for this model server: %s", why)
        self.stats.disabled = why
        self._graphs.clear()

    def _capture(self, shape: tuple[int, int, int]) -> _Captured | None:
        b, t, c = shape
        dev = self.pool.device
        scratch = self.pool.scratch_block * self.pool.block_size
        g = _Captured(torch.zeros(b, t, dtype=torch.long, device=dev), torch.zeros(b, t, dtype=torch.long, device=dev),
                      torch.full((b * t,), scratch, dtype=torch.long, device=dev),
                      torch.full((b * c,), scratch, dtype=torch.long, device=dev))

        def run():
            return forward_hidden(self.model, self.pool, g.ids, g.pos, g.w, g.r, c)

        while len(self._graphs) >= self.max_graphs:
            self._graphs.popitem(last=False)
            self.stats.dropped += 1
        if self.backend == "emulate":
            g.graph = run
        else:
            # warm-up on a side stream (the inputs point at the scratch block: no session is touched),
            # then record one forward into a graph sharing the server's graph memory pool
            if self._mempool is None:
                self._mempool = torch.cuda.graph_pool_handle()
            side = torch.cuda.Stream(device=dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for _ in range(2):
                    run()
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: the server's handler threads keep using the GPU (sampling, acceptance on
            # the logits) while this thread captures
            with torch.cuda.graph(graph, pool=self._mempool, capture_error_mode="thread_local"):
                g.out = run()
            g.graph = graph
        self._graphs[shape] = g
        self.stats.captures += 1
        return g

    def _replay(self, g: _Captured) -> None:
        if self.backend == "emulate":
            g.out = g.graph()
        else:
            g.graph.replay()


def _up(buckets: tuple[int, ...], n: int) -> int | None:
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


__all__ = ["CONTEXT_BUCKETS", "ROW_BUCKETS", "TOKEN_BUCKETS", "ForwardGraphs", "GraphStats"]
