"""The drafter servicer counts what session syncs cost it: crossdraft_drafter_synced_tokens_total
adds, per SyncDrafterSession, the history tokens its cache did not hold (the request's ids less
the reply's reused_tokens) -- a session new to this drafter, or moved to it, counts its whole
history. Real DrafterWorkers on a tiny random model, called through the servicer in process."""

from __future__ import annotations

from prometheus_client import REGISTRY

from crossdraft.runtime.workers import DrafterWorker
from crossdraft.serving.modelserver import Loading
from crossdraft.v1 import drafter_pb2
from drafter.service import DrafterServicer
from tests.tiny_models import tiny_lm
from tests.tokenizers_fixtures import sentencepiece_like_tokenizer


def _servicer(lm) -> DrafterServicer:
    state = Loading()
    state.worker = DrafterWorker(lm)
    return DrafterServicer(state)


def _synced() -> float:
    return REGISTRY.get_sample_value("crossdraft_drafter_synced_tokens_total") or 0.0


def _sync(svc: DrafterServicer, sid: str, ids: list[int], prefill: bool = False) -> tuple[int, float]:
    """One SyncDrafterSession: (the reply's reused_tokens, what the metric counted for it)."""
    before = _synced()
    r = svc.SyncDrafterSession(drafter_pb2.SyncDrafterSessionRequest(session_id=sid, token_ids=ids, prefill=prefill),
                               None)
    return r.reused_tokens, _synced() - before


def test_syncs_count_the_history_the_drafter_did_not_hold():
    lm = tiny_lm(sentencepiece_like_tokenizer(), seed=2)
    first, moved_to = _servicer(lm), _servicer(lm)
    history = list(range(5, 25))
    # a session new to the drafter: every token of its history, none reused
    assert _sync(first, "s", history, prefill=True) == (0, 20)
    # the next turn on the same drafter: the cache holds all but the last id (a sync never reuses
    # the last: the next forward feeds it), so the last id and the turn's 3 new ones count
    assert _sync(first, "s", history + [30, 31, 32]) == (19, 4)
    # the same session moved to another drafter (its history from the session store): all of it
    assert _sync(moved_to, "s", history + [30, 31, 32]) == (0, 23)
