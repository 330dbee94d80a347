"""The gateway's Prometheus metrics, and a run's speculative statistics as the APIs report them."""

from __future__ import annotations

import threading
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        self.requests = Counter("crossdraft_requests_total", "Requests by API and outcome", ["api", "status"],
                                registry=r)
        self.tokens = Counter("crossdraft_completion_tokens_total", "Tokens generated", registry=r)
        self.prompt_tokens = Counter("crossdraft_prompt_tokens_total", "Prompt tokens", registry=r)
        self.forks = Counter("crossdraft_prefill_forks_total",
                             "Model-server sessions forked from a shared prompt prefill (n completions)", registry=r)
        self.rounds = Counter("crossdraft_rounds_total", "Verification rounds", registry=r)
        self.drafted = Counter("crossdraft_drafted_tokens_total", "Draft tokens verified", registry=r)
        self.accepted = Counter("crossdraft_accepted_tokens_total", "Draft tokens accepted", registry=r)
        self.pos_drafted = Counter("crossdraft_drafted_by_position_total", "Drafts verified at each block position",
                                   ["position"], registry=r)
        self.pos_accepted = Counter("crossdraft_accepted_by_position_total", "Drafts accepted at each block position",
                                    ["position"], registry=r)
        self.round_seconds = Histogram(
            "crossdraft_round_seconds",
            "Round latency split by phase: the models' own time (draft, verify), their waits in the model servers' "
            "queues (queue) and the rest of the round (overhead)", ["phase"], registry=r,
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5))
        self.fallbacks = Counter("crossdraft_drafter_fallbacks_total", "Requests that went on target-only", registry=r)
        self.active = Gauge("crossdraft_active_requests", "Requests in progress", registry=r)
        self.queued = Gauge("crossdraft_queued_requests", "Requests waiting for a slot (--max-concurrent-requests)",
                            registry=r)
        self.placement_retries = Counter(
            "crossdraft_placement_retries_total",
            "Requests moved to another replica because the chosen one refused them before their first token "
            "(reason: resource_exhausted or unavailable)", ["kind", "reason"], registry=r)

        # the chooser of draft lengths (crossdraft.decoding.policy): what it chose, why it drafted nothing,
        # and what it expected against what the rounds gave (GOODPUT_WINDOW rounds)
        self.draft_length = Histogram(
            "crossdraft_draft_length", "Draft tokens verified per speculative round (0: the chooser drafted none)",
            buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64), registry=r)
        self.skipped = Counter("crossdraft_skipped_rounds_total",
                               "Speculative rounds that drafted nothing, by the chooser's reason "
                               "(acceptance, load, drafter busy, short, starting)", ["reason"], registry=r)
        self.goodput = Gauge("crossdraft_round_goodput_tokens_per_second",
                             "Tokens per second of a session's rounds over the latest rounds priced with measured "
                             "costs: what the chooser predicted (kind=predicted) and what they gave (kind=measured)",
                             ["kind"], registry=r)
        # pipelined rounds: the blocks drafted during a verification, and what became of them (used: verified
        # next; dropped: the block before them was not accepted whole)
        self.ahead = Counter("crossdraft_blocks_drafted_ahead_total",
                             "Blocks drafted while the block before them was verified (pipelined rounds), by "
                             "outcome: used (verified next), dropped, or branch (dropped, and the branch drafted "
                             "beside it on the likeliest correction verified next)", ["outcome"], registry=r)
        # a pool of drafter kinds (gateway/pool.py): each request's choices of kind, and each kind's drafts
        self.pool_choices = Counter("crossdraft_drafter_choices_total",
                                    "Drafter kinds chosen for requests, by kind and outcome: start (a request's first "
                                    "kind), prior (a new session's first kind, the best for similar requests), "
                                    "explore (a kind not yet measured, tried), exploit (a measured kind worth "
                                    "more), failover (the kind's drafter failed), none (no kind pays: target-only "
                                    "rounds with rare probes)", ["drafter", "outcome"], registry=r)
        self.kind_tokens = Counter("crossdraft_drafter_tokens_total",
                                   "Draft tokens verified per drafter kind, by outcome (drafted, accepted): the "
                                   "acceptance of each kind", ["drafter", "outcome"], registry=r)
        self._window: deque = deque(maxlen=self.GOODPUT_WINDOW)
        self._sums = [0.0, 0.0, 0.0, 0.0]  # predicted tokens, predicted s, tokens, s over the window
        self._wlock = threading.Lock()

    GOODPUT_WINDOW = 256

    def watch_gates(self, gates) -> None:
        """Export the load gates (crossdraft.decoding.gate) at each scrape: ``gates()`` -> {verifier address:
        LoadGate}."""
        self.registry.register(_GateCollector(gates))

    def pool_choice(self, drafter: str, outcome: str) -> None:
        self.pool_choices.labels(drafter, outcome).inc()

    def round(self, ev) -> None:
        self.rounds.inc()
        self.drafted.inc(ev.drafted)
        self.accepted.inc(ev.accepted)
        for i in range(ev.drafted):
            self.pos_drafted.labels(str(i)).inc()
            if i < ev.accepted:
                self.pos_accepted.labels(str(i)).inc()
        d_queue, v_queue = getattr(ev, "draft_queue_s", 0.0), ev.queue_wait_s
        self.round_seconds.labels("draft").observe(max(0.0, ev.draft_s - d_queue))
        self.round_seconds.labels("verify").observe(max(0.0, ev.verify_s - v_queue))
        self.round_seconds.labels("queue").observe(d_queue + v_queue)
        self.round_seconds.labels("overhead").observe(ev.overhead_s)
        if getattr(ev, "ahead", ""):
            self.ahead.labels(ev.ahead).inc()
        if getattr(ev, "drafter", "") and ev.drafted:
            self.kind_tokens.labels(ev.drafter, "drafted").inc(ev.drafted)
            self.kind_tokens.labels(ev.drafter, "accepted").inc(ev.accepted)
        if getattr(ev, "speculative", False):
            self.draft_length.observe(ev.drafted)
            if ev.skip_reason:
                self.skipped.labels(ev.skip_reason).inc()
            if ev.predicted_s > 0 and ev.wall_s > 0:
                got = ev.accepted + (0 if ev.ahead == "used" else 1)
                row = (ev.predicted_tokens, ev.predicted_s, got, ev.wall_s)
                with self._wlock:  # running sums over the window: add the new round, drop the oldest
                    if len(self._window) == self._window.maxlen:
                        old = self._window[0]
                        self._sums = [a - b for a, b in zip(self._sums, old, strict=True)]
                    self._window.append(row)
                    self._sums = [a + b for a, b in zip(self._sums, row, strict=True)]
                    pt, ps, mt, ms = self._sums
                self.goodput.labels("predicted").set(pt / ps if ps > 0 else 0.0)
                self.goodput.labels("measured").set(mt / ms if ms > 0 else 0.0)


class _GateCollector:
    """The load gates' state per verifier and load level (2 ** level requests): the regime kept, the goodput
    each regime measured, the switches."""

    def __init__(self, gates):
        self.gates = gates

    def describe(self):
        return []  # (collected at each scrape only)

    def collect(self):
        held = GaugeMetricFamily("crossdraft_load_gate_held",
                                 "Whether the load gate holds drafting at this load (1: speculative requests with "
                                 "measured costs run target-only rounds; 0: each request's policy chooses)",
                                 labels=["verifier", "load"])
        good = GaugeMetricFamily("crossdraft_load_gate_goodput",
                                 "Tokens per request-second the load gate measured at this load, by regime "
                                 "(free: the policies draft; held: target-only rounds)",
                                 labels=["verifier", "load", "regime"])
        switches = CounterMetricFamily("crossdraft_load_gate_switches",
                                       "Times the load gate changed the regime it keeps at this load",
                                       labels=["verifier", "load"])
        for addr, gate in sorted(self.gates().items()):
            for level, st in gate.snapshot().items():
                load = str(2 ** level)
                held.add_metric([addr, load], 1.0 if st["held"] else 0.0)
                for regime, key in (("free", "free"), ("held", "held_goodput")):
                    if st[key] is not None:
                        good.add_metric([addr, load, regime], st[key])
                switches.add_metric([addr, load], st["switches"])
        yield held
        yield good
        yield switches


def stats_dict(stats) -> dict:
    d = stats.to_dict()
    return {
        "mode": d["mode"], "draft_mode": d["draft_mode"], "draws": d["draws"], "rounds": d["rounds"],
        "drafted": d["drafted"],
        "accepted": d["accepted"], "acceptance_rate": d["acceptance_rate"],
        "acceptance_by_position": d["acceptance_by_position"], "resyncs": d["resyncs"],
        "skipped_rounds": d["skipped_rounds"], "pipelined_blocks": d["pipelined_blocks"],
        "dropped_blocks": d["dropped_blocks"], "branches": d["branches"], "branch_blocks": d["branch_blocks"],
        "caught_up": d["caught_up"], "elided": d["elided"], "drafter_fallback": d["drafter_fallback"],
        "fallback_reason": d["fallback_reason"], "prefill_ms": d["prefill_s"] * 1e3, "draft_ms": d["draft_s"] * 1e3,
        "verify_ms": d["verify_s"] * 1e3, "draft_queue_ms": d["draft_queue_s"] * 1e3,
        "verify_queue_ms": d["verify_queue_s"] * 1e3, "overhead_ms": d["overhead_s"] * 1e3,
        "total_ms": d["total_s"] * 1e3,
        "reused_target_tokens": d["reused_target_tokens"], "reused_drafter_tokens": d["reused_drafter_tokens"],
        "drafter": d["drafter"], "drafter_switches": d["drafter_switches"], "drafter_choice": d["drafter_choice"],
    }


def add_stats(total: dict, s: dict) -> dict:
    """Stats of two runs added up (counts and times summed, acceptance recomputed)."""
    out = dict(total)
    for k in ("rounds", "drafted", "accepted", "resyncs", "skipped_rounds", "pipelined_blocks", "dropped_blocks",
              "branches", "branch_blocks", "caught_up", "elided", "prefill_ms", "draft_ms", "verify_ms",
              "draft_queue_ms", "verify_queue_ms",
              "overhead_ms", "total_ms", "reused_target_tokens", "reused_drafter_tokens", "drafter_switches"):
        out[k] = out.get(k, 0) + s.get(k, 0)
    out["acceptance_rate"] = out["accepted"] / out["drafted"] if out.get("drafted") else 0.0
    out["mode"], out["draft_mode"], out["draws"] = s["mode"], s["draft_mode"], s["draws"]
    out["drafter_fallback"] = bool(total.get("drafter_fallback")) or s["drafter_fallback"]
    out["fallback_reason"] = s["fallback_reason"] or total.get("fallback_reason", "")
    out["drafter"], out["drafter_choice"] = s.get("drafter", ""), s.get("drafter_choice", "")
    return out
