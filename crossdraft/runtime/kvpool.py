"""A paged KV store for running many sessions through ONE forward of a Hugging Face causal LM.

Why this exists
---------------
The reference engine keeps one ``DynamicCache`` per session and runs one forward per session. A
batching scheduler (verify the draft blocks of many sessions at once) needs the opposite: every
session's history lives in one shared store, and a single forward feeds a few new tokens for each
of B sessions, each at its own position and on top of its own history.

Design
------
* **Paged storage, fixed budget.** :class:`KVPool` preallocates, per decoder layer, one K and one V
  tensor of shape ``[num_blocks * block_size + block_size, kv_heads, head_dim]`` (token-major).
  ``num_blocks = ceil(max_tokens / block_size)``: ``max_tokens`` is the memory budget, summed over
  all sessions. The trailing extra block is a *scratch* area: padding positions of a ragged batch
  write there and short rows read from there, so no write is ever masked out or branched on.
* **Sessions are integer handles** with a block table (physical block ids, in order) and a length.
  Token ``i`` of a handle lives at physical row ``table[i // block_size] * block_size + i %
  block_size``. Blocks are taken from a free list on demand (:meth:`KVPool.ensure`), and
  :class:`PoolFull` is raised -- with nothing changed -- when the free list cannot cover a request.
* **Forks share blocks.** :meth:`KVPool.fork` gives a new handle the same blocks as an existing
  one (reference counts, no copy): n completions of one prompt share the prompt's keys and values.
  A block is written only by a handle that owns it alone: before a forward writes into a shared
  block, the writer gets a private copy of it (copy on write; only the block a fork point falls
  into is ever copied, since a fork writes from its own length on).
* **Rollback is a length change.** Rejected drafts are dropped by :meth:`KVPool.truncate`, which
  moves the length back and returns the whole blocks past it to the free list; stale K/V behind
  the length is simply overwritten by the next forward. Sliding-window layers (Gemma-3) keep the
  *full* history too, so a rollback past the window is exact; the window is applied by the mask.
* **Attention through one gather per layer.** Plain PyTorch attention (sdpa / eager) has no kernel
  that reads K/V through a slot table, so :func:`batched_forward` hands the model a small cache
  object whose ``update()`` (called by every attention layer) scatters the new K/V of all rows into
  the pool with one ``index_copy_`` and then gathers each row's whole history (``0 .. start+len-1``)
  through its block table with one ``index_select`` into a dense ``[B, kv_heads, Lmax, head_dim]``
  tensor. The index tensors are built once per forward and reused by all layers. The cost is one
  copy of the batch's history per layer -- memory traffic proportional to the context, which is
  acceptable for verification steps (few query tokens, history read once anyway by attention).
* **Ragged batch.** Rows are left-padded to the longest row ``T``; ``position_ids`` carry every
  row's own positions, and additive float masks ``[B, 1, T, Lmax]`` (0 = visible, dtype min =
  hidden) make a query at position ``p`` see its own row's keys ``0..p`` (and, for sliding layers,
  only those ``> p - sliding_window``). Pad queries sit at position 0 and see key 0, so nothing
  turns into NaN. Models with sliding layers get a ``{"full_attention": .., "sliding_attention": ..}``
  dict, which the Qwen2 / Gemma-3 forwards take as-is; others get the 4-D tensor, which
  ``create_causal_mask`` returns unchanged.
* **Only kept positions reach the head.** Hidden states come from ``model.model``; the LM head (or
  a caller-supplied pruned head) and ``final_logit_softcapping`` are applied only to each row's
  last ``keep`` positions, never to padding.

Only the ``sdpa`` and ``eager`` attention implementations are supported (they take a dense float
mask); flash / flex attention would need their own (varlen / block-mask) inputs.
"""

from __future__ import annotations

import inspect
import math
import os
from dataclasses import dataclass

import torch

from crossdraft.models import attention

__all__ = ["PoolFull", "KVPool", "Row", "available_memory", "batched_forward", "forward_hidden", "kv_bytes_per_token",
           "new_pool_for", "plan_indices"]

_SUPPORTED_ATTN = ("sdpa", "eager")


class PoolFull(Exception):
    """The pool has not enough free blocks for the request (nothing was changed)."""


def _text_config(model):
    cfg = model.config
    # multimodal wrappers keep the LM's config under text_config
    if not hasattr(cfg, "num_hidden_layers") and hasattr(cfg, "get_text_config"):
        return cfg.get_text_config()
    return cfg


class KVPool:
    """Preallocated paged K/V storage shared by many sessions (integer handles)."""

    def __init__(self, model, *, max_tokens: int, block_size: int = 16, device=None, dtype=None):
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        attention.install()  # GQA on a CPU without per-head copies of K/V (same numbers)
        cfg = _text_config(model)
        self.config = cfg
        self.num_layers = int(cfg.num_hidden_layers)
        n_heads = int(cfg.num_attention_heads)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or n_heads)
        head_dim = getattr(cfg, "head_dim", None)
        self.head_dim = int(head_dim) if head_dim else int(cfg.hidden_size) // n_heads
        self.sliding_window = getattr(cfg, "sliding_window", None)
        layer_types = getattr(cfg, "layer_types", None)
        # with layer_types the model takes a {layer type: mask} dict; without (Mistral-style configs)
        # a sliding_window applies to every layer and the model takes one tensor
        self.mask_per_type = layer_types is not None
        if layer_types is None:
            kind = "sliding_attention" if self.sliding_window else "full_attention"
            layer_types = [kind] * self.num_layers
        self.layer_types = list(layer_types)
        self.has_sliding = "sliding_attention" in self.layer_types and bool(self.sliding_window)

        if dtype is None or device is None:
            p = next(model.parameters())
            dtype = p.dtype if dtype is None else dtype
            device = p.device if device is None else device
        self.dtype = dtype
        self.device = torch.device(device)
        self.block_size = int(block_size)
        self.num_blocks = math.ceil(max_tokens / block_size)
        self.scratch_block = self.num_blocks  # physical id of the scratch block
        rows = (self.num_blocks + 1) * self.block_size
        shape = (rows, self.kv_heads, self.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(self.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(self.num_layers)]

        # free list as a stack; low ids handed out first
        self._free: list[int] = list(range(self.num_blocks - 1, -1, -1))
        self._refs: list[int] = [0] * self.num_blocks  # handles whose tables hold each block
        self._tables: dict[int, list[int]] = {}
        self._lengths: dict[int, int] = {}
        self._next_handle = 0

    # ---- handles -------------------------------------------------------------------------------
    def alloc(self) -> int:
        h = self._next_handle
        self._next_handle += 1
        self._tables[h] = []
        self._lengths[h] = 0
        return h

    def free(self, h: int) -> None:
        table = self._table(h)
        for b in reversed(table):
            self._release(b)
        del self._tables[h]
        del self._lengths[h]

    def fork(self, h: int, n: int | None = None) -> int:
        """A new handle holding the first ``n`` tokens of ``h`` (all by default) in the SAME blocks:
        no copy and no new block; either handle's next write into a shared block copies that block
        first (:meth:`make_writable`)."""
        table = self._table(h)
        n = self._lengths[h] if n is None else n
        if n < 0 or n > self._lengths[h]:
            raise ValueError(f"fork({h}, {n}): length is {self._lengths[h]}")
        shared = table[:self._blocks_for(n)]
        for b in shared:
            self._refs[b] += 1
        new = self.alloc()
        self._tables[new] = list(shared)
        self._lengths[new] = n
        return new

    def shared_blocks(self, h: int, start: int) -> int:
        """How many of ``h``'s blocks from the one holding token ``start`` on are shared with
        another handle (the blocks a write from ``start`` would have to copy)."""
        table = self._table(h)
        return sum(1 for b in table[start // self.block_size:] if self._refs[b] > 1)

    def make_writable(self, h: int, start: int) -> int:
        """Give ``h`` private copies of its shared blocks from the one holding token ``start`` on
        (copy on write); returns how many were copied. PoolFull (nothing changed) when the free
        list cannot cover them."""
        table = self._table(h)
        first = start // self.block_size
        todo = [i for i in range(first, len(table)) if self._refs[table[i]] > 1]
        if len(todo) > len(self._free):
            raise PoolFull(f"copy on write needs {len(todo)} blocks, {len(self._free)} free of {self.num_blocks}")
        bs = self.block_size
        for i in todo:
            old, new = table[i], self._take()
            src = slice(old * bs, (old + 1) * bs)
            dst = slice(new * bs, (new + 1) * bs)
            for layer in range(self.num_layers):
                self.k[layer][dst].copy_(self.k[layer][src])
                self.v[layer][dst].copy_(self.v[layer][src])
            self._refs[old] -= 1
            table[i] = new
        return len(todo)

    def length(self, h: int) -> int:
        self._table(h)
        return self._lengths[h]

    def block_table(self, h: int) -> list[int]:
        return list(self._table(h))

    def truncate(self, h: int, n: int) -> None:
        """Roll ``h`` back to its first ``n`` tokens; whole blocks past them go back to the pool."""
        table = self._table(h)
        if n < 0 or n > self._lengths[h]:
            raise ValueError(f"truncate({h}, {n}): length is {self._lengths[h]}")
        self._lengths[h] = n
        keep = self._blocks_for(n)
        while len(table) > keep:
            self._release(table.pop())

    def ensure(self, h: int, n_total: int) -> None:
        """Reserve blocks so that ``h`` can hold ``n_total`` tokens (PoolFull leaves state unchanged)."""
        table = self._table(h)
        extra = self._blocks_for(n_total) - len(table)
        if extra <= 0:
            return
        if extra > len(self._free):
            raise PoolFull(f"need {extra} more blocks, {len(self._free)} free of {self.num_blocks}")
        for _ in range(extra):
            table.append(self._take())

    # ---- stats ---------------------------------------------------------------------------------
    @property
    def blocks_total(self) -> int:
        return self.num_blocks

    @property
    def blocks_free(self) -> int:
        return len(self._free)

    @property
    def blocks_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def tokens_capacity(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def occupancy(self) -> float:
        return self.blocks_used / self.num_blocks

    @property
    def handles(self) -> int:
        return len(self._tables)

    def __repr__(self) -> str:
        return (f"KVPool(layers={self.num_layers}, kv_heads={self.kv_heads}, head_dim={self.head_dim}, "
                f"blocks={self.blocks_used}/{self.num_blocks}x{self.block_size}, handles={self.handles}, "
                f"dtype={self.dtype}, device={self.device})")

    # ---- internals -----------------------------------------------------------------------------
    def _table(self, h: int) -> list[int]:
        try:
            return self._tables[h]
        except KeyError:
            raise KeyError(f"unknown KVPool handle {h!r}") from None

    def _blocks_for(self, n: int) -> int:
        return -(-n // self.block_size)

    def _take(self) -> int:
        b = self._free.pop()
        self._refs[b] = 1
        return b

    def _release(self, b: int) -> None:
        self._refs[b] -= 1
        if self._refs[b] == 0:
            self._free.append(b)


def kv_bytes_per_token(model, dtype=None) -> int:
    """Bytes of K and V one token takes in a pool for `model` (all layers)."""
    cfg = _text_config(model)
    n_heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or n_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or int(cfg.hidden_size) // n_heads)
    dtype = dtype or next(model.parameters()).dtype
    return int(cfg.num_hidden_layers) * kv_heads * head_dim * 2 * torch.empty((), dtype=dtype).element_size()


def available_memory(device) -> int:
    """Bytes free for a pool on `device`: the GPU's free memory, or the host's MemAvailable."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def new_pool_for(model, max_tokens: int, block_size: int = 16) -> KVPool:
    """A pool on the model's device and in its parameter dtype."""
    return KVPool(model, max_tokens=max_tokens, block_size=block_size)


@dataclass
class Row:
    """Feed ``tokens`` to ``handle`` at positions ``start .. start+len-1``; return the last ``keep`` logits."""

    handle: int
    start: int
    tokens: list[int]
    keep: int = 1


class _PoolCache:
    """What the attention layers see as ``cache``: scatter new K/V into the pool, gather histories back.

    Not a ``transformers.Cache`` subclass on purpose: with position ids and ready-made masks given,
    the model forwards only call ``update()``; leaving it a plain object also keeps
    ``create_causal_mask`` from asking it for mask sizes.
    """

    is_compileable = False

    def __init__(self, pool: KVPool, write_idx: torch.Tensor, read_idx: torch.Tensor, lmax: int,
                 batch: int, lengths: list[int]):
        self.pool = pool
        self.write_idx = write_idx  # [B*T] physical rows of the fed tokens (pads -> scratch)
        self.read_idx = read_idx  # [B*Lmax] physical rows of each row's history (short rows -> scratch)
        self.lmax = lmax
        self.batch = batch
        self._lengths = lengths
        self.is_sliding = [t == "sliding_attention" for t in pool.layer_types]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k_store, v_store = self.pool.k[layer_idx], self.pool.v[layer_idx]
        b, h, t, d = key_states.shape
        # [B, H, T, D] -> [B*T, H, D] in token-major order
        k_new = key_states.transpose(1, 2).reshape(b * t, h, d).to(k_store.dtype)
        v_new = value_states.transpose(1, 2).reshape(b * t, h, d).to(v_store.dtype)
        k_store.index_copy_(0, self.write_idx, k_new)
        v_store.index_copy_(0, self.write_idx, v_new)
        k = k_store.index_select(0, self.read_idx).view(b, self.lmax, h, d).transpose(1, 2)
        v = v_store.index_select(0, self.read_idx).view(b, self.lmax, h, d).transpose(1, 2)
        return k, v

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self._lengths) if self._lengths else 0

    def __len__(self) -> int:
        return self.pool.num_layers


def _cache_kwarg(base) -> str:
    """transformers 5.24 renamed ``past_key_values`` to ``cache``; older 5.x take the old name."""
    try:
        params = inspect.signature(base.forward).parameters
    except (TypeError, ValueError):
        return "cache"
    return "cache" if "cache" in params else "past_key_values"


def _decoder(model):
    base = getattr(model, "model", None)
    if base is None:
        base = model.get_decoder()
    # multimodal wrappers (e.g. Gemma3ForConditionalGeneration) nest the LM one level deeper
    if hasattr(base, "language_model") and not hasattr(base, "layers"):
        base = base.language_model
    return base


def _check_rows(pool: KVPool, rows: list[Row]) -> None:
    if not rows:
        raise ValueError("batched_forward needs at least one row")
    seen = set()
    for r in rows:
        if r.handle in seen:
            raise ValueError(f"handle {r.handle} appears twice in one batch")
        seen.add(r.handle)
        n = pool.length(r.handle)  # KeyError for unknown handles
        if r.start < 0 or r.start > n:
            raise ValueError(f"row start {r.start} out of range for handle {r.handle} of length {n}")
        if len(r.tokens) < 1:
            raise ValueError(f"row for handle {r.handle} has no tokens")
        if not 1 <= r.keep <= len(r.tokens):
            raise ValueError(f"row keep={r.keep} must be in 1..{len(r.tokens)}")


def _reserve(pool: KVPool, rows: list[Row]) -> None:
    """Truncate rows to their start and reserve their blocks -- all or nothing (PoolFull)."""
    freed = 0
    needed = 0
    for r in rows:
        table = pool._tables[r.handle]
        after = len(table) if r.start == pool._lengths[r.handle] else min(len(table), pool._blocks_for(r.start))
        # blocks dropped by the rollback return to the pool only if no fork holds them too
        freed += sum(1 for b in table[after:] if pool._refs[b] == 1)
        needed += max(0, pool._blocks_for(r.start + len(r.tokens)) - after)
        needed += sum(1 for b in table[r.start // pool.block_size:after] if pool._refs[b] > 1)  # copy on write
    if needed > len(pool._free) + freed:
        raise PoolFull(f"batch needs {needed} more blocks, {len(pool._free) + freed} would be free "
                       f"of {pool.num_blocks}")
    for r in rows:
        if r.start < pool._lengths[r.handle]:
            pool.truncate(r.handle, r.start)
    for r in rows:
        pool.make_writable(r.handle, r.start)
        pool.ensure(r.handle, r.start + len(r.tokens))


def _rows_head(head, n_rows: int) -> list:
    if head is None or isinstance(head, (torch.Tensor, torch.nn.Module)):
        return [head] * n_rows
    head = list(head)
    if len(head) != n_rows:
        raise ValueError(f"head list has {len(head)} entries for {n_rows} rows")
    return head


def batched_forward(model, pool: KVPool, rows: list[Row], *, head=None, graphs=None) -> list[torch.Tensor]:
    """ONE forward of ``model`` over all ``rows``; per row, float32 logits ``[keep, V]`` of its last tokens.

    ``head``: ``None`` (the model's LM head), a ``[A, hidden]`` matrix used for every row, or a list
    with one matrix-or-None per row; a matrix gives ``linear(h, matrix)`` (softcapped like the model's
    logits when the config asks for it) of width ``A`` instead of the full vocabulary.
    ``graphs``: a :class:`crossdraft.runtime.graphs.ForwardGraphs` -- the batch is padded to a shape bucket
    and replayed as a captured CUDA graph where one fits (else, or without it, eager).
    After the call ``pool.length(row.handle) == row.start + len(row.tokens)``.
    """
    _check_rows(pool, rows)
    heads = _rows_head(head, len(rows))
    cfg = pool.config
    attn = getattr(cfg, "_attn_implementation", None) or "eager"
    if attn not in _SUPPORTED_ATTN:
        raise ValueError(f"batched_forward supports attn_implementation {_SUPPORTED_ATTN}, not {attn!r}")
    _reserve(pool, rows)

    B = len(rows)
    T = max(len(r.tokens) for r in rows)
    ends = [r.start + len(r.tokens) for r in rows]
    lmax = max(ends)
    shape = graphs.bucket(B, T, lmax) if graphs is not None else None
    Bp, Tp, Lp = shape or (B, T, lmax)
    ids, pos, w_phys, r_phys = plan_indices(pool, rows, Bp, Tp, Lp)
    try:
        with torch.inference_mode():
            hidden = None
            if shape is not None:
                hidden = graphs.hidden(shape, ids, pos, w_phys, r_phys, ends)
            if hidden is None:
                dev = pool.device
                hidden = forward_hidden(model, pool, ids.to(dev, non_blocking=True), pos.to(dev, non_blocking=True),
                                        w_phys.to(dev, non_blocking=True), r_phys.to(dev, non_blocking=True), Lp,
                                        lmax)
            results = _heads(model, cfg, hidden, rows, heads, Tp)
    except BaseException:
        # the fed tokens may be half-written; every row stays rolled back to its start
        for r in rows:
            pool._lengths[r.handle] = r.start
        raise
    for r, e in zip(rows, ends, strict=True):
        pool._lengths[r.handle] = e
    return results


def plan_indices(pool: KVPool, rows: list[Row], B: int, T: int, lmax: int):
    """Host index tensors of one forward of ``B >= len(rows)`` rows of ``T`` tokens over ``lmax``
    key columns: token ids and positions ``[B, T]`` (rows left-padded), the physical pool rows the
    fed tokens are written to ``[B*T]`` and each row's history is read from ``[B*lmax]``. Padding
    (of a row, or whole rows past ``len(rows)``: a shape bucket) writes to and reads from the
    scratch block at position 0."""
    bs = pool.block_size
    ends = [r.start + len(r.tokens) for r in rows]
    n_pad = [T - len(r.tokens) for r in rows] + [T] * (B - len(rows))
    ids = torch.zeros(B, T, dtype=torch.long)
    pos = torch.zeros(B, T, dtype=torch.long)
    n_tab = max(1, max(pool._blocks_for(e) for e in ends))
    tables = torch.full((B, n_tab), pool.scratch_block, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, n_pad[b]:] = torch.as_tensor(r.tokens, dtype=torch.long)
        pos[b, n_pad[b]:] = torch.arange(r.start, ends[b], dtype=torch.long)
        tab = pool._tables[r.handle]
        tables[b, :len(tab)] = torch.as_tensor(tab, dtype=torch.long)
    real = torch.arange(T).unsqueeze(0) >= torch.as_tensor(n_pad).unsqueeze(1)  # [B, T]
    # writes: real tokens go to their slot; pads to the scratch block
    w_phys = tables.gather(1, pos // bs) * bs + pos % bs
    scratch_row = pool.scratch_block * bs
    w_phys = torch.where(real, w_phys, torch.full_like(w_phys, scratch_row))
    # reads: key column j of row b is the row's token j (j < end_b), else scratch
    j = torch.arange(lmax)
    tab_j = (j // bs).clamp(max=n_tab - 1)
    r_phys = tables[:, tab_j] * bs + j % bs  # [B, Lmax]
    ends_t = torch.as_tensor(ends + [0] * (B - len(rows))).unsqueeze(1)
    r_phys = torch.where(j.unsqueeze(0) < ends_t, r_phys, torch.full_like(r_phys, scratch_row))
    return ids, pos, w_phys.reshape(-1), r_phys.reshape(-1)


def forward_hidden(model, pool: KVPool, ids: torch.Tensor, pos: torch.Tensor, w_idx: torch.Tensor,
                   r_idx: torch.Tensor, lmax: int, seq_len: int | None = None) -> torch.Tensor:
    """The decoder's last hidden states ``[B, T, hidden]`` for device index tensors from
    :func:`plan_indices` (fixed shapes and tensor ops only: what a CUDA graph captures)."""
    B, T = ids.shape
    dev = ids.device
    # ---- masks: [B, 1, T, Lmax] additive -------------------------------------------------------
    mask_dtype = pool.dtype
    neg = torch.finfo(mask_dtype).min
    kpos = torch.arange(lmax, device=dev).view(1, 1, 1, lmax)
    qpos = pos.view(B, 1, T, 1)
    visible = kpos <= qpos  # pads sit at position 0 -> see key 0 (a real key of every row, or scratch)
    zero = torch.zeros((), dtype=mask_dtype, device=dev)
    negt = torch.full((), neg, dtype=mask_dtype, device=dev)
    m_full = torch.where(visible, zero, negt)
    if not pool.has_sliding:
        attention_mask = m_full
    else:
        m_slide = torch.where(visible & (kpos > qpos - pool.sliding_window), zero, negt)
        if pool.mask_per_type:
            attention_mask = {"full_attention": m_full, "sliding_attention": m_slide}
        else:
            attention_mask = m_slide

    cache = _PoolCache(pool, w_idx, r_idx, lmax, B, [seq_len if seq_len is not None else lmax])
    base = _decoder(model)
    kw = {_cache_kwarg(base): cache}
    out = base(input_ids=ids, attention_mask=attention_mask, position_ids=pos, use_cache=True, **kw)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def _softcap(logits: torch.Tensor, cap) -> torch.Tensor:
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap


def _heads(model, cfg, hidden: torch.Tensor, rows: list[Row], heads: list, T: int) -> list[torch.Tensor]:
    cap = getattr(cfg, "final_logit_softcapping", None)
    out: list[torch.Tensor | None] = [None] * len(rows)
    # rows using the full LM head: one matmul over all their kept positions
    full = [b for b, hd in enumerate(heads) if hd is None]
    if full:
        kept = torch.cat([hidden[b, T - rows[b].keep:] for b in full], dim=0)
        logits = _softcap(model.lm_head(kept), cap).float()
        off = 0
        for b in full:
            out[b] = logits[off:off + rows[b].keep]
            off += rows[b].keep
    from crossdraft.runtime.sessions import apply_head

    for b, hd in enumerate(heads):
        if hd is None:
            continue
        out[b] = _softcap(apply_head(hidden[b, T - rows[b].keep:], hd), cap).float()
    return out
