"""Which rows share a batched forward: the padding a long row would add, and where a mixed batch is cut.

A batched forward pads every row to the longest (crossdraft.runtime.kvpool.batched_forward), so the
scheduler (crossdraft.runtime.batching) keeps long rows apart from short ones (:func:`_mixes`) and,
with the model's cost table, cuts a batch by length where two forwards cost less than one padded
(:func:`_split`). :func:`take_rows` takes the queued rows that join a batch.
"""

from __future__ import annotations

from crossdraft.decoding.costmodel import interpolate_cost

# rows up to this many tokens batch together whatever their lengths (verification blocks, drafting
# steps, short syncs): padding them to the longest costs little
SHORT_ROW = 32


def _mixes(rows: int, longest: int, n: int, max_tokens: int) -> bool:
    """Whether a row of ``n`` tokens joins a batch of ``rows`` rows (the longest ``longest``). The
    forward pads every row to the longest: it computes rows x longest tokens. A long row (a
    prefill chunk) among one-token steps would make each of them cost its length --
    seen on a CPU: 16 sessions starting at once, each new prompt's 150-token chunk padded the 15
    others' decoding steps to 150 tokens, a 2,400-token forward for 165 real ones. So a batch
    stays within ``max_tokens`` padded, and a row longer than SHORT_ROW joins (or is joined) only
    where that adds at most SHORT_ROW tokens of padding to the forward (about what a forward of its
    own costs beyond its tokens: two chunks of about one length batch, a chunk and a one-token step
    do not); the row set aside runs in the next forward."""
    t = max(longest, n)
    padded = (rows + 1) * t
    if padded > max_tokens:
        return False
    return t <= SHORT_ROW or padded - rows * longest - n <= SHORT_ROW


def take_rows(q, batch: list, max_rows: int, max_tokens: int) -> list:
    """Take off the queue ``q`` (a deque of jobs, oldest first) the rows that join ``batch``: in order,
    one per session, within ``max_rows`` and the token cap, where they mix (:func:`_mixes`). A row set
    aside stays at the queue's front for the next forward; one past the token cap ends the taking
    (nothing overtakes it). Returns the rows taken."""
    slots = {id(j.slot) for j in batch}
    tokens = sum(len(j.tokens) for j in batch)
    longest = max((len(j.tokens) for j in batch), default=0)
    taken: list = []
    aside: list = []
    while q and len(batch) + len(taken) < max_rows:
        job = q.popleft()
        n = len(job.tokens)
        if tokens + n > max_tokens:
            aside.append(job)
            break
        if id(job.slot) in slots or not _mixes(len(batch) + len(taken), longest, n, max_tokens):
            aside.append(job)
            continue
        taken.append(job)
        slots.add(id(job.slot))
        tokens += n
        longest = max(longest, n)
    q.extendleft(reversed(aside))
    return taken


def _split(batch: list, cost_ms: list[float] | None) -> tuple[list, list]:
    """(rows to run now, rows for the next forward). Every row is padded to the longest, and on a
    CPU a forward's cost grows with its tokens: one session's 11-token block among 15 one-token
    steps makes a forward of 176 tokens (~7 decoding steps of a 1.5B model on 2 cores, against
    ~2.5 for the steps and the block apart). With the model's cost table (``cost_ms``) the batch
    is cut by length where that is cheaper: the rows up to some length or the rows from some length
    on run now -- always with the oldest row (``batch[0]``: no row waits more than one extra
    forward) -- the rest in the next forward, whichever costs least for both forwards together.
    On a GPU the table is flat and the batch stays whole; without a table it does too (rows longer
    than SHORT_ROW were already kept apart by :func:`_mixes`)."""
    if not cost_ms or len(batch) < 2:
        return batch, []
    lens = sorted({len(j.tokens) for j in batch})
    if len(lens) < 2:
        return batch, []
    first = len(batch[0].tokens)

    def total(now: list[int], rest: list[int]) -> float:
        c = interpolate_cost(cost_ms, len(now) * max(now), 0.0)
        return c + (interpolate_cost(cost_ms, len(rest) * max(rest), 0.0) if rest else 0.0)

    sizes = [len(j.tokens) for j in batch]
    best = total(sizes, [])  # (whole: the cut must be clearly cheaper to win)
    keep = None
    # the cuts that keep the oldest row and leave rows for later: rows <= L (first <= L < longest),
    # or rows >= L (shortest < L <= first)
    cuts = [(L, True) for L in lens if first <= L < lens[-1]] + [(L, False) for L in lens if lens[0] < L <= first]
    for L, short in sorted(cuts, key=lambda c: (c[0], not c[1])):  # (by length; at a tie the first wins)
        inside = [(n <= L) if short else (n >= L) for n in sizes]
        pairs = list(zip(sizes, inside, strict=True))
        c = total([n for n, x in pairs if x], [n for n, x in pairs if not x])
        if c < 0.9 * best:
            best, keep = c, inside
    if keep is None:
        return batch, []
    return [j for j, x in zip(batch, keep, strict=True) if x], [j for j, x in zip(batch, keep, strict=True) if not x]
