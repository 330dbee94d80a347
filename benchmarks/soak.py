"""Soak test: a real stack on tiny models under mixed load for a bounded time (``make soak``).

Starts Redis, ``--verifiers`` verifier replicas (default 2), a drafter and the gateway as separate
processes on 127.0.0.1 (tiny random-init models saved as real HF directories, as the e2e tests
use; the gateway is given every verifier's address), then ``--users`` threads (default 16) drive
it for ``--duration-s`` seconds (default 600) with a mix of:

* plain and streamed (SSE) REST completions and chat completions, greedy and sampled (some with
  ``n`` = 2);
* chat sessions of 3-6 turns over REST or gRPC (and a few text sessions over REST): the session is
  read back and its transcript must hold every turn's prompt and reply in order; then it is
  deleted -- or kept alive a while (each user keeps up to ``--keep-max``; the oldest is read back
  and checked again when a newer one is kept, the rest at the end, then deleted). A conversation
  that outgrows the tiny target's 512-token context is refused with 400 naming max_tokens
  (counted as an expected 4xx; the session ends there, its transcript still checked);
* gRPC completions, plain and streamed;
* client cancellations: an SSE stream closed after its first chunk, a plain REST request whose
  client gives up after a short read timeout, a gRPC call with a short deadline, a gRPC stream
  cancelled after its first delta;
* bad requests (each must be answered 4xx / INVALID_ARGUMENT / NOT_FOUND naming the field);
* two restarts, each a SIGKILL (or SIGTERM with ``--restart-signal term``) and a new process on
  the same port: the drafter's at ``--restart-at`` of the run (requests meanwhile must succeed,
  target-only), and verifier ``--restart-verifier``'s at ``--verifier-restart-at`` (sessions
  placed on it move to another replica; requests in flight on it may fail with a 503, see below).
  A share outside (0, 1) skips that restart.

The gateway runs with a small admission limit, so some requests are refused with 429 (counted
as such; the client waits and retries, as a real client would).

Every request ends in one outcome: ``ok``, ``expected_4xx``, ``cancelled`` (the client gave up
on purpose), ``429``, ``expected_503``, or ``unexpected`` (anything else: a 5xx, a connection
error, an error event in a stream, a 4xx to a good request, a malformed answer, a broken
transcript). ``expected_503``: a request whose [start, end] overlaps a verifier restart's window
(from the signal to ``--restart-grace-s`` after the new process is healthy) and that got HTTP 503
with a Retry-After of delta-seconds, an SSE error event with code 503 (a stream that had begun:
its headers went out with its 200), or gRPC UNAVAILABLE; a 503 outside the windows, or one without
Retry-After, is unexpected. A failed session turn leaves its session as it was (the transcript
check holds the turns that succeeded). Greedy one-off requests are also compared with the first
answer to the same prompt and length (lossless decoding: the drafter, its fallback, batching and
the replica must not change a token); a difference is counted as ``greedy_mismatch``.

Every ``--window-s`` seconds it records the outcomes, the p50/p95/p99 latency of the ``ok``
requests that ended in the window, the RSS of each process (psutil), the Redis keys and the
model servers' KV-pool blocks in use; the JSON also has each service's RSS per minute. At the end:
the Redis keys vs the sessions alive (no leak), the transcripts, RSS growth after warm-up (the
median of the first ``--compare-s`` seconds after warm-up vs the last ``--compare-s`` seconds;
``--warmup-s`` is capped at a third of the run). A restarted process is measured per process:
its old life from the start, its new one with a warm-up of ``--warmup-s`` or a third of that life,
whichever is shorter.

Writes ``<out>/<tag>.json`` (stamped with the commit and a dirty flag) and ``<out>/<tag>.png``.
Exit code 0 when the goals hold (0 unexpected, every transcript intact, RSS growth of every
service at most ``--rss-limit``, no Redis keys left over), 1 otherwise. ``--gateway-wrapper``
runs the gateway under a command (a native heap profiler); ``CROSSDRAFT_TRACEMALLOC`` in the
environment reaches the gateway (gateway/memtrace.py).

Usage: python benchmarks/soak.py [--duration-s 600] [--users 16] [--tag soak]
       python benchmarks/soak.py --duration-s 3600 --warmup-s 300 --rss-limit 0.02   # the hour of issue 42
       python benchmarks/soak.py --duration-s 60 --tag soak-smoke --out .cache/soak   # a smoke run
       python benchmarks/soak.py --scenarios rest_completion,grpc_completion --restart-at 2 \
           --verifier-restart-at 2 --verifiers 1   # one path only, no restarts
"""


from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import platform
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import psutil  # noqa: E402
import redis  # noqa: E402
import requests  # noqa: E402

from crossdraft.client import Client  # noqa: E402
from crossdraft.serving.redis_server import RedisServer  # noqa: E402
from tests.service_fixtures import Proc, free_port, wait_grpc_healthy, wait_http_ready  # noqa: E402

OUTCOMES = ("ok", "expected_4xx", "cancelled", "429", "expected_503", "unexpected")
RETRY_AFTER = re.compile(r"\A\d+\Z")  # Retry-After in delta-seconds
PROMPTS = [
    "def fibonacci(n):\n",
    "def is_prime(n):\n    \"\"\"Return True if n is prime.\"\"\"\n",
    "SELECT name, COUNT(*) FROM users",
    "The quick brown fox",
    "Once upon a time, in a small village,",
    "import numpy as np\n\ndef softmax(x):\n",
    "class Stack:\n    def __init__(self):\n",
    "Dear team, the results of the soak test",
    "for (int i = 0; i < n; ++i) {",
    "Explain the difference between TCP and UDP.",
    "\u4eca\u5929\u5929\u6c14\u5f88\u597d\uff0c",  # Chinese: multi-byte characters split across tokens
    "Caf\u00e9 cr\u00e8me br\u00fbl\u00e9e \U0001f370 recipe:",
]
CHAT_TEMPLATE = ("{% for m in messages %}### {{ m['role'] }}:\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}### assistant:\n{% endif %}")
USER_LINES = ["Hi! Who are you?", "Write a haiku about caches.", "And another one, shorter.", "What is 2 + 2?",
              "Summarise our talk so far.", "Translate 'good morning' into French.", "Tell me a joke.",
              "Why is the sky blue?", "List three prime numbers.", "Thanks, bye."]


def git_stamp() -> dict:
    """The commit measured, and whether the served code (or this script) had uncommitted changes."""
    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    dirty = git("status", "--porcelain", "--", "crossdraft", "drafter", "verifier", "gateway", "benchmarks/soak.py")
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(dirty)}


def pct(xs: list[float], q: float) -> float | None:
    """The q-th percentile (nearest rank) of xs, or None."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q / 100 * len(s) + 0.5)) - 1))]


# ---- the stack ------------------------------------------------------------------------------------


class Stack:
    """Redis, ``--verifiers`` verifiers, a drafter and the gateway, each its own process on 127.0.0.1.

    Processes are named ``verifier-0``, ``verifier-1``, ... and ``drafter``, ``gateway``; the
    gateway is given every verifier's address (static discovery: its placement moves a request
    that a replica refuses before its first token to another replica)."""

    def __init__(self, work: Path, a):
        self.work, self.a = work, a
        self.log_dir = work / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.redis: RedisServer | None = None
        self.procs: dict[str, Proc] = {}
        self.addrs: dict[str, str] = {}  # model server name -> host:port
        self.metrics_ports: dict[str, int] = {}

    @property
    def verifiers(self) -> list[str]:
        return [n for n in self.procs if n.startswith("verifier")]

    def _model_server(self, name: str, model: str) -> Proc:
        kind = name.split("-")[0]
        port, mport = free_port(), free_port()
        self.metrics_ports[name] = mport
        self.addrs[name] = f"127.0.0.1:{port}"
        args = [kind, "--model", model, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
                "--metrics-port", str(mport)]
        return Proc(name, args, self.log_dir, env={"CROSSDRAFT_COST_PROFILE": "static"})

    def start(self) -> "Stack":
        t_dir, d_dir = self.work / "models" / "tiny-target", self.work / "models" / "tiny-drafter"
        if not (t_dir / "config.json").exists() or not (d_dir / "config.json").exists():
            # in a child process: torch and transformers stay out of the load generator
            code = ("import sys; from pathlib import Path; from tests.service_fixtures import save_tiny_pair; "
                    "save_tiny_pair(Path(sys.argv[1]))")
            subprocess.run([sys.executable, "-c", code, str(self.work / "models")], cwd=ROOT, check=True,
                           env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))
        # the tiny target has no chat template (chat requests would be refused): give it one
        cfg_path = t_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        if not cfg.get("chat_template"):
            cfg["chat_template"] = CHAT_TEMPLATE
            cfg_path.write_text(json.dumps(cfg))
        self.redis = RedisServer(data_dir=self.work / "redis").start()
        for i in range(self.a.verifiers):
            self.procs[f"verifier-{i}"] = self._model_server(f"verifier-{i}", str(t_dir)).start()
        self.procs["drafter"] = self._model_server("drafter", str(d_dir)).start()
        for name in list(self.procs):
            wait_grpc_healthy(self.addrs[name], self.procs[name])
        hp, gp = free_port(), free_port()
        gw = ["gateway", "--verifier", ",".join(self.addrs[n] for n in self.verifiers),
              "--drafter", self.addrs["drafter"], "--redis-url", self.redis.url,
              "--host", "127.0.0.1", "--http-port", str(hp), "--grpc-port", str(gp),
              "--drafter-timeout-s", "10", "--connect-timeout-s", "120",
              "--max-concurrent-requests", str(self.a.gw_max_concurrent),
              "--max-queued-requests", str(self.a.gw_max_queued), "--queue-timeout-s", str(self.a.gw_queue_timeout_s)]
        self.procs["gateway"] = WrappedProc("gateway", gw, self.log_dir, env={"CROSSDRAFT_COST_PROFILE": "static"},
                                            wrapper=self.a.gateway_wrapper).start()
        self.http, self.grpc = f"http://127.0.0.1:{hp}", f"127.0.0.1:{gp}"
        wait_http_ready(self.http, self.procs["gateway"])
        return self

    def pids(self) -> dict[str, int | None]:
        out = {"redis": self.redis.pid if self.redis else None}
        for name, p in self.procs.items():
            out[name] = p.p.pid if p.alive() else None
        return out

    def restart(self, name: str, how: str, on_down=None) -> dict:
        """Stop model server `name` (SIGKILL, or SIGTERM and its graceful stop) and start a new
        process of it on the same port. on_down(t): called with the time the stop began."""
        d = self.procs[name]
        ev = {"name": name, "signal": how, "old_pid": d.p.pid}
        ev["t_down"] = time.time()
        if on_down is not None:
            on_down(ev["t_down"])
        if how == "kill":
            d.kill()
        else:
            d.stop(timeout=30)
        ev["t_exited"] = time.time()
        ev["old_exit_code"] = d.p.returncode
        d.log.close()
        d.start()
        ev["new_pid"] = d.p.pid
        wait_grpc_healthy(self.addrs[name], d, timeout=180)
        ev["t_up"] = time.time()
        return ev

    def metrics(self, name: str) -> dict[str, float]:
        """Prometheus samples of a model server (its process name) or the gateway ("gateway"), {} if
        unreachable."""
        url = (self.http + "/metrics" if name == "gateway"
               else f"http://127.0.0.1:{self.metrics_ports[name]}/metrics")
        try:
            text = requests.get(url, timeout=5).text
        except requests.RequestException:
            return {}
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                metric, _, value = line.rpartition(" ")
                with contextlib.suppress(ValueError):
                    out[metric] = float(value)
        return out

    def kv_blocks_used(self, name: str) -> float | None:
        kind = name.split("-")[0]
        return self.metrics(name).get(f"crossdraft_{kind}_kv_cache_blocks_used")

    def stop(self) -> dict[str, int | None]:
        codes = {}
        for name in ("gateway", "drafter", *self.verifiers):
            p = self.procs.get(name)
            if p is not None:
                p.stop(timeout=30)
                codes[name] = p.p.returncode if p.p is not None else None
        if self.redis is not None:
            self.redis.stop()
        return codes


class WrappedProc(Proc):
    """A Proc whose command may run under a wrapper (``--gateway-wrapper``, e.g. heaptrack)."""

    def __init__(self, *args, wrapper: str = "", **kw):
        super().__init__(*args, **kw)
        self.wrapper = shlex.split(wrapper)

    def start(self) -> "WrappedProc":
        if not self.wrapper:
            return super().start()
        self.log = open(self.log_path, "ab")
        self.p = subprocess.Popen([*self.wrapper, sys.executable, "-m", *self.args], cwd=ROOT, stdout=self.log,
                                  stderr=subprocess.STDOUT, env=self.env)
        return self


# ---- recording ------------------------------------------------------------------------------------


class Recorder:
    """Every request's outcome and latency; unexpected errors and transcript checks with details."""

    def __init__(self, t0: float):
        self.t0 = t0
        self.lock = threading.Lock()
        self.requests: list[tuple] = []  # (t_start, t_end, kind, outcome, latency_s, fallback)
        self.unexpected: list[dict] = []
        self.greedy: dict[tuple, str] = {}
        self.greedy_checked = 0
        self.greedy_mismatches: list[dict] = []
        self.context_full = 0  # session turns refused because the conversation outgrew the context
        self.transcripts = {"checked": 0, "intact": 0, "broken": []}
        self.sessions_alive: dict[str, dict] = {}  # id -> {"api", "kind", "expected", "turns"}
        self.sessions = {"created": 0, "deleted": 0}
        # verifier restarts: [lo, hi] seconds since t0 in which a 503 is expected (hi is infinite
        # while the restart runs); see unavailable()
        self.restart_windows: list[list[float]] = []
        self.expected_503 = {"http_503_retry_after": 0, "sse_error_503": 0, "grpc_unavailable": 0}

    def in_restart_window(self, t_start: float, t_end: float) -> bool:
        """Whether a request (absolute times) overlaps a verifier restart's window."""
        a, b = t_start - self.t0, t_end - self.t0
        with self.lock:
            return any(a <= hi and b >= lo for lo, hi in self.restart_windows)

    def unavailable(self, kind: str, t_start: float, latency_s: float, e: "Unavailable503") -> str:
        """Record a 503: expected when the request overlaps a verifier restart's window and the
        answer has the form a client can act on -- HTTP 503 with a Retry-After of delta-seconds,
        an SSE error event with code 503 (a stream that has begun sent its headers with its 200,
        so the event is how its 503 arrives), gRPC UNAVAILABLE (gRPC's retry-later status) --
        else unexpected."""
        form_ok = e.form != "http" or bool(RETRY_AFTER.match(e.retry_after or ""))
        if form_ok and self.in_restart_window(t_start, t_start + latency_s):
            with self.lock:
                self.expected_503[{"http": "http_503_retry_after", "sse": "sse_error_503",
                                   "grpc": "grpc_unavailable"}[e.form]] += 1
            return self.add(kind, "expected_503", t_start, latency_s)
        why = "outside a verifier restart's window" if form_ok else f"Retry-After {e.retry_after!r}"
        return self.add(kind, "unexpected", t_start, latency_s, f"{e.form} 503 ({why}): {e}")

    def add(self, kind: str, outcome: str, t_start: float, latency_s: float, detail: str = "",
            fallback: bool | None = None) -> str:
        t_end = t_start + latency_s
        with self.lock:
            self.requests.append((t_start - self.t0, t_end - self.t0, kind, outcome, latency_s, fallback))
            if outcome == "unexpected":
                self.unexpected.append({"t_s": round(t_start - self.t0, 2), "kind": kind, "detail": detail[:2000]})
        return outcome

    def check_greedy(self, key: tuple, text: str, kind: str) -> None:
        with self.lock:
            ref = self.greedy.get(key)
            if ref is None:
                self.greedy[key] = text
            else:
                self.greedy_checked += 1
                if ref != text:
                    self.greedy_mismatches.append({"t_s": round(time.time() - self.t0, 2), "kind": kind,
                                                   "key": repr(key)[:300], "first": ref[:300], "now": text[:300]})

    def transcript(self, sid: str, ok: bool, detail: str = "") -> None:
        with self.lock:
            self.transcripts["checked"] += 1
            if ok:
                self.transcripts["intact"] += 1
            else:
                self.transcripts["broken"].append({"session_id": sid, "detail": detail[:2000]})


class Unexpected(Exception):
    """An answer that breaks the contract (recorded as ``unexpected``)."""


class Unavailable503(Exception):
    """HTTP 503, an SSE error event with code 503, or gRPC UNAVAILABLE (Recorder.unavailable)."""

    def __init__(self, detail: str, form: str, retry_after: str | None = None):
        super().__init__(detail)
        self.form, self.retry_after = form, retry_after


class Refused(Exception):
    """429 / RESOURCE_EXHAUSTED: the caller may retry later."""


class ContextFull(Exception):
    """400 / INVALID_ARGUMENT naming max_tokens (max_new_tokens): the conversation and the reply no
    longer fit the target's context (the tiny models have 512 tokens). Expected for long sessions."""


CONTEXT_FULL = object()  # what timed() returns for a ContextFull answer


# ---- the users ------------------------------------------------------------------------------------


def _error_param(r: requests.Response):
    try:
        return (r.json().get("error") or {}).get("param")
    except ValueError:
        return None


# what a simulated user does, and how often (relative weights); --scenarios picks some of them
SCENARIO_WEIGHTS = (("rest_completion", 18), ("rest_stream", 16), ("chat_session", 16), ("text_session", 4),
                    ("grpc_completion", 12), ("cancel_sse", 5), ("cancel_rest", 3), ("cancel_grpc_deadline", 4),
                    ("cancel_grpc_stream", 3), ("bad_request", 10))
SCENARIOS = tuple(name for name, _ in SCENARIO_WEIGHTS)


def sessions_run(a) -> bool:
    """Whether the run's scenarios include sessions (whose transcripts are then checked)."""
    return not a.scenarios or any(x in a.scenarios for x in ("chat_session", "text_session"))


class User(threading.Thread):
    """One simulated user: picks a scenario at random, runs it, thinks a moment, again until the end."""

    def __init__(self, uid: int, stack: Stack, rec: Recorder, a, stop_at: float, stop_ev: threading.Event):
        super().__init__(name=f"user-{uid}", daemon=True)
        self.uid, self.stack, self.rec, self.a = uid, stack, rec, a
        self.rng = random.Random(a.seed * 1000 + uid)
        self.stop_at, self.stop_ev = stop_at, stop_ev
        self.http = requests.Session()
        self.client = Client(stack.grpc, timeout_s=a.request_timeout_s)
        self.n_sessions = 0
        self.kept: list[tuple[str, str]] = []  # (api, session id) of the sessions this user keeps alive
        self.scenarios = [(getattr(self, name), w) for name, w in SCENARIO_WEIGHTS
                          if not a.scenarios or name in a.scenarios]  # (only those asked for, if any)

    def done(self) -> bool:
        return self.stop_ev.is_set() or time.time() >= self.stop_at

    def run(self) -> None:
        fns, weights = zip(*self.scenarios, strict=True)
        while not self.done():
            fn = self.rng.choices(fns, weights)[0]
            t = time.time()
            try:
                fn()
            except Exception:  # a bug of this script or an unforeseen failure: never silent
                self.rec.add(fn.__name__, "unexpected", t, time.time() - t, "uncaught: " + traceback.format_exc())
            self.stop_ev.wait(self.rng.uniform(0, 2 * self.a.think_s))
        self.client.close()
        self.http.close()

    # -- helpers ---------------------------------------------------------------------------------
    def opts(self) -> dict:
        o = {"max_tokens": self.rng.choice((8, 16, 24, 32)), "temperature": self.rng.choice((0.0, 0.0, 0.8))}
        if o["temperature"]:
            o["seed"] = self.rng.randrange(2**31)
            if self.rng.random() < 0.3:
                o["top_p"] = 0.9
        return o

    def retrying(self, kind: str, fn):
        """Run one request; on 429 record it, wait and retry (a 429 is refused before any work)."""
        for _ in range(50):
            t = time.time()
            try:
                return fn()
            except Refused as e:
                self.rec.add(kind, "429", t, time.time() - t, str(e))
                if self.stop_ev.wait(self.rng.uniform(0.1, 0.5)):
                    return None  # the run ended while the request waited to retry (its 429s are counted)
        raise Unexpected(f"{kind}: still refused (429) after 50 tries")

    def post(self, path: str, body, stream: bool = False, timeout=None):
        kw = {"data": body} if isinstance(body, (str, bytes)) else {"json": body}
        return self.http.post(self.stack.http + path, stream=stream,
                              timeout=timeout or (10, self.a.request_timeout_s), **kw)

    def check_status(self, r: requests.Response, want: int = 200) -> None:
        if r.status_code == 429:
            raise Refused(r.text[:300])
        if r.status_code == 503:
            raise Unavailable503(r.text[:500], "http", r.headers.get("Retry-After"))
        if (r.status_code == 400 and _error_param(r) in ("max_tokens", "max_completion_tokens")
                and "exceeds the context" in r.text):
            raise ContextFull(r.text[:300])
        if r.status_code != want:
            raise Unexpected(f"HTTP {r.status_code} (wanted {want}): {r.text[:1000]}")

    @staticmethod
    def check_usage(usage: dict, finish: str, max_tokens: int, exact: bool = True) -> None:
        n = usage.get("completion_tokens")
        if not isinstance(n, int) or n < 0 or n > max_tokens:
            raise Unexpected(f"completion_tokens {n!r} outside [0, {max_tokens}]")
        if exact and finish == "length" and n != max_tokens:
            raise Unexpected(f"finish_reason length with {n} of {max_tokens} tokens")
        if finish not in ("length", "stop"):
            raise Unexpected(f"finish_reason {finish!r}")

    def rest_call(self, chat: bool, body: dict, stream: bool) -> tuple[str, bool]:
        """One REST completion (plain or SSE); returns (text of choice 0, drafter_fallback). Raises
        Refused / Unexpected; records nothing."""
        path = "/v1/chat/completions" if chat else "/v1/completions"
        n = body.get("n", 1)
        if not stream:
            r = self.post(path, body)
            self.check_status(r)
            d = r.json()
            if len(d.get("choices", [])) != n:
                raise Unexpected(f"{len(d.get('choices', []))} choices, wanted {n}: {r.text[:500]}")
            c = d["choices"][0]
            text = c["message"]["content"] if chat else c["text"]
            if not isinstance(text, str):
                raise Unexpected(f"no text: {r.text[:500]}")
            # n > 1: usage sums the choices (each up to max_tokens)
            self.check_usage(d["usage"], c["finish_reason"], body["max_tokens"] * n, exact=n == 1)
            return text, bool(d.get("speculative", {}).get("drafter_fallback"))
        with self.post(path, body, stream=True) as r:
            self.check_status(r)
            texts, finished, fallback, saw_done = [[] for _ in range(n)], [None] * n, False, False
            for line in r.iter_lines():
                if not line:
                    continue
                if not line.startswith(b"data: "):
                    raise Unexpected(f"not an SSE data line: {line[:200]!r}")
                if line == b"data: [DONE]":
                    saw_done = True
                    continue
                if saw_done:
                    raise Unexpected("data after [DONE]")
                obj = json.loads(line[6:])
                if "error" in obj:
                    if obj["error"].get("code") == 429:
                        raise Unexpected(f"429 in the middle of a stream: {obj}")
                    if obj["error"].get("code") == 503:
                        raise Unavailable503(f"error event in the stream: {obj}"[:500], "sse")
                    raise Unexpected(f"error event in the stream: {obj}")
                for ch in obj["choices"]:
                    i = ch["index"]
                    piece = ch["delta"].get("content", "") if chat else ch["text"]
                    texts[i].append(piece or "")
                    if ch["finish_reason"] is not None:
                        if finished[i] is not None:
                            raise Unexpected(f"choice {i} finished twice")
                        finished[i] = ch["finish_reason"]
                        self.check_usage(obj["usage"], ch["finish_reason"], body["max_tokens"])
                        fallback |= bool(obj.get("speculative", {}).get("drafter_fallback"))
            if not saw_done or any(f is None for f in finished):
                raise Unexpected(f"stream ended without [DONE] or a finish chunk (done={saw_done}, {finished})")
            return "".join(texts[0]), fallback

    def timed(self, kind: str, fn, greedy_key=None):
        """Run fn (returns (text, fallback)) with 429 retries; record its outcome and latency."""
        def attempt():
            t = time.time()
            try:
                text, fallback = fn()
            except Refused:
                raise
            except Unavailable503 as e:
                self.rec.unavailable(kind, t, time.time() - t, e)
                return None
            except ContextFull:
                self.rec.add(kind, "expected_4xx", t, time.time() - t)
                with self.rec.lock:
                    self.rec.context_full += 1
                return CONTEXT_FULL
            except Unexpected as e:
                self.rec.add(kind, "unexpected", t, time.time() - t, str(e))
                return None
            except (requests.RequestException, grpc.RpcError, ValueError, KeyError, TypeError) as e:
                self.rec.add(kind, "unexpected", t, time.time() - t, f"{type(e).__name__}: {e}")
                return None
            self.rec.add(kind, "ok", t, time.time() - t, fallback=fallback)
            if greedy_key is not None:
                self.rec.check_greedy(greedy_key, text, kind)
            return text
        try:
            return self.retrying(kind, attempt)
        except Unexpected as e:
            self.rec.add(kind, "unexpected", time.time(), 0.0, str(e))
            return None

    # -- scenarios -------------------------------------------------------------------------------
    def one_off_body(self, chat: bool) -> tuple[dict, tuple | None]:
        o = self.opts()
        prompt = self.rng.choice(PROMPTS)
        body = dict(o, **({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}))
        if o["temperature"] and self.rng.random() < 0.2:
            body["n"] = 2
        key = ("chat" if chat else "text", prompt, o["max_tokens"]) if not o["temperature"] else None
        return body, key

    def rest_completion(self):
        chat = self.rng.random() < 0.4
        body, key = self.one_off_body(chat)
        self.timed("rest_chat" if chat else "rest_completion", lambda: self.rest_call(chat, body, False), key)

    def rest_stream(self):
        chat = self.rng.random() < 0.4
        body, key = self.one_off_body(chat)
        body["stream"] = True
        if self.rng.random() < 0.3:
            body["stream_options"] = {"include_usage": True}
        self.timed("sse_chat" if chat else "sse_completion", lambda: self.rest_call(chat, body, True), key)

    def grpc_call(self, prompt, messages, o: dict, session_id=None, stream=False) -> tuple[str, bool]:
        kw = {"max_new_tokens": o["max_tokens"], "temperature": o.get("temperature"), "seed": o.get("seed"),
              "top_p": o.get("top_p")}
        try:
            if stream:
                pieces, done = [], None
                for m in self.client.events(prompt, messages=messages, session_id=session_id, **kw):
                    if m.HasField("delta"):
                        pieces.append(m.delta.text)
                    else:
                        done = m.done
                if done is None:
                    raise Unexpected("gRPC stream ended without its done message")
                if "".join(pieces) != done.text:
                    raise Unexpected(f"gRPC deltas {''.join(pieces)!r} != done.text {done.text!r}")
                text, usage, finish, fb = done.text, {"completion_tokens": done.usage.completion_tokens}, \
                    done.finish_reason, done.stats.drafter_fallback
            else:
                c = self.client.generate(prompt, messages=messages, session_id=session_id, **kw)
                text, usage, finish, fb = c.text, {"completion_tokens": len(c.token_ids)}, c.finish_reason, \
                    bool(c.stats.get("drafter_fallback"))
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise Refused(e.details()) from None
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                raise Unavailable503(f"gRPC UNAVAILABLE: {e.details()}", "grpc") from None
            if (e.code() == grpc.StatusCode.INVALID_ARGUMENT and (e.details() or "").startswith("max_new_tokens")
                    and "exceeds the context" in e.details()):
                raise ContextFull(e.details()) from None
            raise Unexpected(f"gRPC {e.code().name}: {e.details()}") from None
        self.check_usage(usage, finish, o["max_tokens"])
        return text, fb

    def grpc_completion(self):
        o = self.opts()
        prompt = self.rng.choice(PROMPTS)
        chat = self.rng.random() < 0.3
        stream = self.rng.random() < 0.5
        key = None if o["temperature"] else ("chat" if chat else "text", prompt, o["max_tokens"])
        msgs = [{"role": "user", "content": prompt}] if chat else None
        self.timed("grpc_chat" if chat else "grpc_completion",
                   lambda: self.grpc_call(None if chat else prompt, msgs, o, stream=stream), key)

    def create_session(self, api: str, o: dict) -> str | None:
        def attempt():
            t = time.time()
            try:
                if api == "grpc":
                    sid = self.client.create_session(**{"max_new_tokens": o["max_tokens"],
                                                        "temperature": o["temperature"], "seed": o.get("seed")})
                else:
                    r = self.post("/v1/sessions", o)
                    self.check_status(r, 201)
                    sid = r.json()["session_id"]
            except (requests.RequestException, grpc.RpcError, Unexpected, ValueError, KeyError) as e:
                self.rec.add("session_create", "unexpected", t, time.time() - t, f"{type(e).__name__}: {e}")
                return None
            self.rec.add("session_create", "ok", t, time.time() - t)
            return sid
        sid = self.retrying("session_create", attempt)
        if sid:
            with self.rec.lock:
                self.rec.sessions["created"] += 1
        return sid

    def read_session(self, api: str, sid: str) -> dict | None:
        t = time.time()
        try:
            if api == "grpc":
                s = self.client.get_session(sid)
                s = {"messages": s.get("messages", []), "text": s.get("text", ""), "turns": int(s.get("turns", 0))}
            else:
                r = self.http.get(f"{self.stack.http}/v1/sessions/{sid}", timeout=(10, 60))
                self.check_status(r)
                s = r.json()
        except (requests.RequestException, grpc.RpcError, Unexpected, ValueError, KeyError) as e:
            self.rec.add("session_get", "unexpected", t, time.time() - t, f"{sid}: {type(e).__name__}: {e}")
            return None
        self.rec.add("session_get", "ok", t, time.time() - t)
        return s

    def delete_session(self, api: str, sid: str) -> None:
        t = time.time()
        try:
            if api == "grpc":
                existed = self.client.delete_session(sid)
            else:
                r = self.http.delete(f"{self.stack.http}/v1/sessions/{sid}", timeout=(10, 60))
                self.check_status(r)
                existed = r.json().get("deleted") is True
            if not existed:
                raise Unexpected(f"session {sid} did not exist when deleted")
        except (requests.RequestException, grpc.RpcError, Unexpected, ValueError, KeyError) as e:
            self.rec.add("session_delete", "unexpected", t, time.time() - t, f"{sid}: {type(e).__name__}: {e}")
            return
        self.rec.add("session_delete", "ok", t, time.time() - t)
        with self.rec.lock:
            self.rec.sessions["deleted"] += 1
            self.rec.sessions_alive.pop(sid, None)
        # deleted means gone: reading it again is a 404 naming session_id
        t = time.time()
        r = self.http.get(f"{self.stack.http}/v1/sessions/{sid}", timeout=(10, 60))
        ok = r.status_code == 404 and _error_param(r) == "session_id"
        self.rec.add("session_get_deleted", "expected_4xx" if ok else "unexpected", t, time.time() - t,
                     "" if ok else f"GET of deleted session {sid}: HTTP {r.status_code} {r.text[:300]}")

    def finish_session(self, api: str, kind: str, sid: str, expected, turns: int) -> None:
        """Read the session back, check its transcript, then delete it (or keep it to the end)."""
        s = self.read_session(api, sid)
        if s is not None:
            check_transcript(self.rec, sid, kind, s, expected, turns)
        if self.rng.random() < self.a.keep_sessions:
            # stays alive for a while: re-checked and deleted when this user keeps too many, or at the end
            self.kept.append((api, sid))
            if len(self.kept) <= self.a.keep_max:
                return
            api, sid = self.kept.pop(0)
            with self.rec.lock:
                e = self.rec.sessions_alive[sid]
            s = self.read_session(api, sid)
            if s is not None:
                check_transcript(self.rec, sid, e["kind"], s, e["expected"], e["turns"])
        self.delete_session(api, sid)

    def chat_session(self):
        api = "grpc" if self.rng.random() < 0.35 else "rest"
        o = self.opts()
        sid = self.create_session(api, o)
        if sid is None:
            return
        self.n_sessions += 1
        expected: list[dict] = []
        turns = self.rng.randint(3, 6)
        entry = {"api": api, "kind": "chat", "expected": expected, "turns": 0}
        with self.rec.lock:
            self.rec.sessions_alive[sid] = entry
        for i in range(turns):
            if self.done():
                break
            msg = {"role": "user", "content": f"[user {self.uid} session {self.n_sessions} turn {i + 1}] "
                                              + self.rng.choice(USER_LINES)}
            stream = self.rng.random() < 0.5
            if api == "grpc":
                reply = self.timed("grpc_session_turn",
                                   lambda m=msg, st=stream: self.grpc_call(None, [m], o, session_id=sid, stream=st))
            else:
                body = {"messages": [msg], "session_id": sid, "stream": stream, "max_tokens": o["max_tokens"]}
                reply = self.timed("sse_session_turn" if stream else "rest_session_turn",
                                   lambda b=body, st=stream: self.rest_call(True, b, st))
            if reply is CONTEXT_FULL:
                break  # the conversation is as long as the target takes: the session ends here
            if reply is None:
                continue  # failed (recorded): the session must hold the turns that succeeded, intact
            expected += [msg, {"role": "assistant", "content": reply}]
            entry["turns"] += 1
        self.finish_session(api, "chat", sid, expected, entry["turns"])

    def text_session(self):
        o = self.opts()
        sid = self.create_session("rest", o)
        if sid is None:
            return
        self.n_sessions += 1
        entry = {"api": "rest", "kind": "text", "expected": "", "turns": 0}
        with self.rec.lock:
            self.rec.sessions_alive[sid] = entry
        for i in range(self.rng.randint(3, 6)):
            if self.done():
                break
            prompt = (self.rng.choice(PROMPTS) if i == 0 else f"\n# turn {i + 1}\n")
            stream = self.rng.random() < 0.5
            body = {"prompt": prompt, "session_id": sid, "stream": stream, "max_tokens": o["max_tokens"]}
            reply = self.timed("text_session_turn", lambda b=body, st=stream: self.rest_call(False, b, st))
            if reply is CONTEXT_FULL:
                break
            if reply is None:
                continue
            entry["expected"] += prompt + reply
            entry["turns"] += 1
        self.finish_session("rest", "text", sid, entry["expected"], entry["turns"])

    def cancel_sse(self):
        """Open a long SSE stream, read its first chunk, close the connection."""
        chat = self.rng.random() < 0.4
        body, _ = self.one_off_body(chat)
        body.update(stream=True, max_tokens=200)
        body.pop("n", None)
        path = "/v1/chat/completions" if chat else "/v1/completions"

        def attempt():
            t = time.time()
            try:
                with self.post(path, body, stream=True) as r:
                    self.check_status(r)
                    for line in r.iter_lines():
                        if line.startswith(b"data: {"):
                            if b'"error"' in line:
                                if (json.loads(line[6:]).get("error") or {}).get("code") == 503:
                                    raise Unavailable503(f"error event: {line[:500]!r}", "sse")
                                raise Unexpected(f"error event: {line[:500]!r}")
                            if b'"finish_reason": null' in line:
                                break  # text arrived, more follows: hang up here
                            self.rec.add("cancel_sse", "ok", t, time.time() - t)  # finished early
                            return
                    else:
                        raise Unexpected("stream ended before any text")
            except Refused:
                raise
            except Unavailable503 as e:
                self.rec.unavailable("cancel_sse", t, time.time() - t, e)
                return
            except (Unexpected, requests.RequestException) as e:
                self.rec.add("cancel_sse", "unexpected", t, time.time() - t, f"{type(e).__name__}: {e}")
                return
            self.rec.add("cancel_sse", "cancelled", t, time.time() - t)
        self.retrying("cancel_sse", attempt)

    def cancel_rest(self):
        """A plain (non-streamed) request whose client gives up after a short read timeout."""
        body, _ = self.one_off_body(False)
        body.update(max_tokens=200)

        def attempt():
            t = time.time()
            try:
                r = self.post("/v1/completions", body, timeout=(10, self.rng.uniform(0.05, 0.5)))
                self.check_status(r)
                r.json()
            except requests.exceptions.ReadTimeout:
                self.rec.add("cancel_rest", "cancelled", t, time.time() - t)
                return
            except Refused:
                raise
            except Unavailable503 as e:
                self.rec.unavailable("cancel_rest", t, time.time() - t, e)
                return
            except (Unexpected, requests.RequestException, ValueError) as e:
                self.rec.add("cancel_rest", "unexpected", t, time.time() - t, f"{type(e).__name__}: {e}")
                return
            self.rec.add("cancel_rest", "ok", t, time.time() - t)  # finished within the timeout
        self.retrying("cancel_rest", attempt)

    def cancel_grpc_deadline(self):
        """A gRPC call with a short deadline (DEADLINE_EXCEEDED is the expected end)."""
        o = self.opts()
        short = Client(self.stack.grpc, channel=self.client.channel, timeout_s=self.rng.uniform(0.05, 0.5))

        def attempt():
            t = time.time()
            try:
                short.generate(self.rng.choice(PROMPTS), max_new_tokens=200, temperature=o["temperature"],
                               seed=o.get("seed"))
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    self.rec.add("cancel_grpc_deadline", "cancelled", t, time.time() - t)
                    return
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise Refused(e.details()) from None
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    self.rec.unavailable("cancel_grpc_deadline", t, time.time() - t,
                                         Unavailable503(f"gRPC UNAVAILABLE: {e.details()}", "grpc"))
                    return
                self.rec.add("cancel_grpc_deadline", "unexpected", t, time.time() - t,
                             f"gRPC {e.code().name}: {e.details()}")
                return
            self.rec.add("cancel_grpc_deadline", "ok", t, time.time() - t)
        self.retrying("cancel_grpc_deadline", attempt)

    def cancel_grpc_stream(self):
        """A gRPC stream cancelled by the client after its first delta."""
        o = self.opts()

        def attempt():
            t = time.time()
            req = self.client._request(self.rng.choice(PROMPTS), None, None,
                                       {"max_new_tokens": 200, "temperature": o["temperature"], "seed": o.get("seed")})
            call = self.client.stub.Generate(req, timeout=self.a.request_timeout_s)
            try:
                for m in call:
                    if m.HasField("delta"):
                        call.cancel()
                        break
                    self.rec.add("cancel_grpc_stream", "ok", t, time.time() - t)  # done before any delta
                    return
                for _ in call:  # after cancel(): ends with CANCELLED
                    pass
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.CANCELLED:
                    self.rec.add("cancel_grpc_stream", "cancelled", t, time.time() - t)
                    return
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise Refused(e.details()) from None
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    self.rec.unavailable("cancel_grpc_stream", t, time.time() - t,
                                         Unavailable503(f"gRPC UNAVAILABLE: {e.details()}", "grpc"))
                    return
                self.rec.add("cancel_grpc_stream", "unexpected", t, time.time() - t,
                             f"gRPC {e.code().name}: {e.details()}")
                return
            self.rec.add("cancel_grpc_stream", "cancelled", t, time.time() - t)
        self.retrying("cancel_grpc_stream", attempt)

    def bad_request(self):
        """A malformed request: must be answered 4xx naming the field (gRPC: INVALID_ARGUMENT /
        NOT_FOUND with the field in the message)."""
        ghost = uuid.uuid4().hex  # a session that was never created
        cases = [
            ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
            ("POST", "/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
            ("POST", "/v1/completions", {"prompt": "x", "bogus": 1}, 400, "bogus"),
            ("POST", "/v1/completions", {"max_tokens": 5}, 400, "prompt"),
            ("POST", "/v1/completions", {"prompt": "x", "n": 99}, 400, "n"),
            ("POST", "/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
            ("POST", "/v1/completions", {"prompt": "x", "session_id": ghost}, 404, "session_id"),
            ("POST", "/v1/completions", "{not json", 400, "body"),
            ("POST", "/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
            ("POST", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400,
             "messages[0].role"),
            ("POST", "/v1/sessions", {"temperature": -1}, 400, "temperature"),
            ("GET", f"/v1/sessions/{ghost}", None, 404, "session_id"),
            ("DELETE", f"/v1/sessions/{ghost}", None, 404, "session_id"),
            ("GRPC", "Generate", {"max_new_tokens": 0}, grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens"),
            ("GRPC", "Generate", {"top_k": -1}, grpc.StatusCode.INVALID_ARGUMENT, "top_k"),
            ("GRPC", "GetSession", ghost, grpc.StatusCode.NOT_FOUND, "session_id"),
        ]
        method, path, body, want, field = self.rng.choice(cases)
        kind = f"bad_{'grpc' if method == 'GRPC' else 'rest'}"
        t = time.time()
        try:
            if method == "GRPC":
                try:
                    if path == "GetSession":
                        self.client.get_session(body)
                    else:
                        self.client.generate("x", **body)
                except grpc.RpcError as e:
                    if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # admission comes before validation
                        self.rec.add(kind, "429", t, time.time() - t)
                    elif e.code() == want and field in (e.details() or ""):
                        self.rec.add(kind, "expected_4xx", t, time.time() - t)
                    else:
                        self.rec.add(kind, "unexpected", t, time.time() - t,
                                     f"{path} {body}: gRPC {e.code().name} {e.details()} (wanted {want.name}, {field})")
                    return
                self.rec.add(kind, "unexpected", t, time.time() - t, f"{path} {body}: accepted")
                return
            if method == "POST":
                r = self.post(path, body)
            else:
                r = self.http.request(method, self.stack.http + path, timeout=(10, 60))
            if r.status_code == 429:
                self.rec.add(kind, "429", t, time.time() - t)
            elif r.status_code == want and _error_param(r) == field:
                self.rec.add(kind, "expected_4xx", t, time.time() - t)
            else:
                self.rec.add(kind, "unexpected", t, time.time() - t,
                             f"{method} {path} {body!r}: HTTP {r.status_code} {r.text[:300]} (wanted {want}, {field})")
        except requests.RequestException as e:
            self.rec.add(kind, "unexpected", t, time.time() - t, f"{method} {path}: {type(e).__name__}: {e}")


def check_transcript(rec: Recorder, sid: str, kind: str, s: dict, expected, turns: int) -> bool:
    """The stored session holds exactly the turns that succeeded, in order."""
    if kind == "chat":
        got = [{"role": m["role"], "content": m["content"]} for m in s.get("messages", [])]
        ok = got == expected and s.get("turns") == turns
        detail = "" if ok else (f"turns {s.get('turns')} (wanted {turns}); first difference at message "
                                f"{next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), min(len(got), len(expected)))}"  # noqa: E501
                                f": got {json.dumps(got)[:800]} wanted {json.dumps(expected)[:800]}")
    else:
        got = s.get("text", "")
        ok = got == expected and s.get("turns") == turns
        detail = "" if ok else f"turns {s.get('turns')} (wanted {turns}); text {got!r:.600} wanted {expected!r:.600}"
    rec.transcript(sid, ok, detail)
    return ok


# ---- monitoring ------------------------------------------------------------------------------------


def rss_tree(pid: int | None) -> int | None:
    """RSS of a process and its children, bytes (None if it is gone)."""
    if pid is None:
        return None
    try:
        p = psutil.Process(pid)
        total = p.memory_info().rss
        for c in p.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                total += c.memory_info().rss
        return total
    except psutil.Error:
        return None


def redis_keys(r: redis.Redis) -> dict:
    keys = [k.decode() for k in r.scan_iter("*", count=1000)]
    sessions = [k for k in keys if k.startswith("crossdraft:session:") and not k.endswith(":lease")]
    leases = [k for k in keys if k.endswith(":lease")]
    return {"total": len(keys), "sessions": len(sessions), "leases": len(leases),
            "other": sorted(set(keys) - set(sessions) - set(leases))[:20], "_session_keys": sessions}


class Monitor(threading.Thread):
    """Samples RSS, Redis keys and KV blocks every window; turns the request log into windows."""

    def __init__(self, stack: Stack, rec: Recorder, window_s: float, stop_ev: threading.Event):
        super().__init__(name="monitor", daemon=True)
        self.stack, self.rec, self.window_s, self.stop_ev = stack, rec, window_s, stop_ev
        self.samples: list[dict] = []
        self.r = redis.Redis.from_url(stack.redis.url, socket_timeout=5)
        self.me = psutil.Process()

    def sample(self) -> dict:
        t = time.time() - self.rec.t0
        pids = self.stack.pids()
        rss = {name: rss_tree(pid) for name, pid in pids.items()}
        rss["load_generator"] = self.me.memory_info().rss
        try:
            keys = redis_keys(self.r)
            keys.pop("_session_keys")
        except redis.RedisError as e:
            keys = {"error": str(e)}
        kv = {n: self.stack.kv_blocks_used(n) for n in (*self.stack.verifiers, "drafter")}
        g = self.stack.metrics("gateway")
        return {"t_s": round(t, 2), "pids": pids, "rss_bytes": rss, "redis_keys": keys, "kv_blocks_used": kv,
                "gateway_active": g.get("crossdraft_active_requests"),
                "gateway_queued": g.get("crossdraft_queued_requests")}

    def run(self) -> None:
        nxt = time.time()
        while not self.stop_ev.is_set():
            self.samples.append(self.sample())
            nxt += self.window_s
            self.stop_ev.wait(max(0.0, nxt - time.time()))


def windows(rec: Recorder, samples: list[dict], window_s: float) -> list[dict]:
    """Per window: outcomes of the requests that ended in it, latency percentiles of its ok requests,
    and the sample taken at its end."""
    out = []
    reqs = sorted(rec.requests, key=lambda x: x[1])
    j = 0
    prev = 0.0
    for s in samples[1:]:
        end = s["t_s"]
        counts = dict.fromkeys(OUTCOMES, 0)
        lat, fallbacks = [], 0
        while j < len(reqs) and reqs[j][1] <= end:
            _, _, _, outcome, latency, fb = reqs[j]
            counts[outcome] += 1
            if outcome == "ok":
                lat.append(latency)
                fallbacks += bool(fb)
            j += 1
        w = {"t_start_s": prev, "t_end_s": end, "outcomes": counts, "ok_requests": len(lat),
             "drafter_fallbacks": fallbacks,
             "latency_ms": {f"p{q}": (round(pct(lat, q) * 1e3, 1) if lat else None) for q in (50, 95, 99)},
             "rss_mb": {k: (round(v / 2**20, 1) if v else None) for k, v in s["rss_bytes"].items()},
             "redis_keys": s["redis_keys"], "kv_blocks_used": s["kv_blocks_used"],
             "gateway_active": s["gateway_active"], "gateway_queued": s["gateway_queued"]}
        out.append(w)
        prev = end
    return out


def rss_growth(samples: list[dict], name: str, lo: float, hi: float, warmup_s: float, compare_s: float) -> dict:
    """Median RSS of [lo + warmup, + compare) vs [hi - compare, hi] of one process life."""
    a0, a1, b0 = lo + warmup_s, lo + warmup_s + compare_s, hi - compare_s
    if b0 < a1:
        return {"measured": False, "why": f"life [{lo:.0f}, {hi:.0f}] s too short for the windows"}
    first = [s["rss_bytes"][name] for s in samples if a0 <= s["t_s"] < a1 and s["rss_bytes"].get(name)]
    last = [s["rss_bytes"][name] for s in samples if b0 <= s["t_s"] <= hi and s["rss_bytes"].get(name)]
    if not first or not last:
        return {"measured": False, "why": "no samples"}
    f, la = statistics.median(first), statistics.median(last)
    return {"measured": True, "first_window_s": [round(a0), round(a1)], "last_window_s": [round(b0), round(hi)],
            "first_mb": round(f / 2**20, 1), "last_mb": round(la / 2**20, 1), "growth": round((la - f) / f, 4),
            "max_mb": round(max(s["rss_bytes"][name] or 0 for s in samples if lo <= s["t_s"] <= hi) / 2**20, 1)}


def log_problems(log_dir: Path) -> dict:
    """Tracebacks and ERROR lines in the services' logs (first few of each)."""
    out = {}
    for f in sorted(log_dir.glob("*.log")):
        text = f.read_text(errors="replace")
        tbs = [m.start() for m in re.finditer(r"Traceback \(most recent call last\)", text)]
        errors = [ln for ln in text.splitlines() if re.search(r"\b(ERROR|CRITICAL|Exception)\b", ln)]
        out[f.stem] = {"tracebacks": len(tbs), "error_lines": len(errors),
                       "first_traceback": text[tbs[0]:tbs[0] + 3000] if tbs else "", "first_error_lines": errors[:10]}
    return out


# ---- the plot ---------------------------------------------------------------------------------------


def plot(result: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install -e '.[bench]')", file=sys.stderr)
        return False
    ws = result["windows"]
    t = [w["t_end_s"] for w in ws]
    fig, ax = plt.subplots(4, 1, figsize=(11, 13), sharex=True)
    for q, style in (("p50", "-"), ("p95", "--"), ("p99", ":")):
        ax[0].plot(t, [w["latency_ms"][q] for w in ws], style, label=q)
    ax[0].set_ylabel("latency of ok requests (ms)")
    ax[0].set_yscale("log")
    ax[0].set_title(f"soak: {result['config']['users']} users, {result['config']['duration_s']:.0f} s, "
                    f"commit {result['meta']['commit'][:9]}{' (dirty)' if result['meta']['dirty'] else ''}")
    colors = {"ok": "tab:green", "expected_4xx": "tab:blue", "cancelled": "tab:gray", "429": "tab:orange",
              "expected_503": "tab:purple",
              "unexpected": "tab:red"}
    width = result["config"]["window_s"] * 0.9
    bottom = [0] * len(ws)
    for o in OUTCOMES:
        vals = [w["outcomes"][o] for w in ws]
        ax[1].bar([w["t_start_s"] for w in ws], vals, width=width, bottom=bottom, color=colors[o], label=o,
                  align="edge")
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax[1].plot(t, [w["drafter_fallbacks"] for w in ws], "k.", markersize=3, label="ok with drafter fallback")
    ax[1].set_ylabel(f"requests per {result['config']['window_s']:g} s")
    for name in ws[0]["rss_mb"]:
        ax[2].plot(t, [w["rss_mb"].get(name) for w in ws], label=name)
    ax[2].set_ylabel("RSS (MiB)")
    ax[2].set_yscale("log")
    ax[3].plot(t, [w["redis_keys"].get("sessions") for w in ws], label="Redis session keys")
    ax[3].plot(t, [w["redis_keys"].get("leases") for w in ws], label="Redis lease keys")
    for name in ws[0]["kv_blocks_used"]:
        ax[3].plot(t, [w["kv_blocks_used"].get(name) for w in ws], ":", label=f"{name} KV blocks used")
    ax[3].set_ylabel("count")
    ax[3].set_xlabel("seconds since start of load")
    shade = {"drafter": "tab:red"}
    for a in ax:
        for rs in result.get("restarts") or ():
            a.axvspan(rs["t_down_s"], rs["t_up_s"], color=shade.get(rs["name"], "tab:purple"), alpha=0.15,
                      label=f"{rs['name']} down" if a is ax[0] else None)
        wu = result["config"]["warmup_s"]
        a.axvline(wu, color="k", lw=0.6, ls="--")
        a.legend(loc="upper left", fontsize=7, ncol=3)
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


# ---- main -------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration-s", type=float, default=600.0, help="load duration (the run stops by itself)")
    p.add_argument("--users", type=int, default=16, help="concurrent simulated users")
    p.add_argument("--window-s", type=float, default=5.0, help="sampling window")
    p.add_argument("--warmup-s", type=float, default=60.0,
                   help="warm-up excluded from the RSS comparison (at most a fifth of the duration)")
    p.add_argument("--compare-s", type=float, default=60.0,
                   help="RSS: the first this-many seconds after warm-up vs the last (shortened to fit)")
    p.add_argument("--verifiers", type=int, default=2, help="verifier replicas behind the gateway")
    p.add_argument("--restart-at", "--drafter-restart-at", dest="restart_at", type=float, default=0.5,
                   help="drafter restart at this share of the run (outside (0, 1): none)")
    p.add_argument("--verifier-restart-at", type=float, default=0.7,
                   help="restart of verifier --restart-verifier at this share of the run (outside (0, 1): none)")
    p.add_argument("--restart-verifier", type=int, default=0, help="which verifier (0-based) is restarted")
    p.add_argument("--restart-signal", choices=("kill", "term"), default="kill")
    p.add_argument("--restart-grace-s", type=float, default=10.0,
                   help="a verifier restart's window of expected 503s closes this long after the new process "
                        "is healthy")
    p.add_argument("--gateway-wrapper", default="",
                   help="run the gateway under this command (e.g. 'heaptrack -o <file>'): native heap profiles")
    p.add_argument("--think-s", type=float, default=0.15, help="mean pause of a user between scenarios")
    p.add_argument("--keep-sessions", type=float, default=0.15,
                   help="share of sessions kept alive for a while (re-checked later, then deleted)")
    p.add_argument("--keep-max", type=int, default=3,
                   help="sessions a user keeps alive at most (the oldest is re-checked and deleted)")
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument("--gw-max-concurrent", type=int, default=12, help="gateway --max-concurrent-requests")
    p.add_argument("--gw-max-queued", type=int, default=2, help="gateway --max-queued-requests")
    p.add_argument("--gw-queue-timeout-s", type=float, default=5.0, help="gateway --queue-timeout-s")
    p.add_argument("--rss-limit", type=float, default=0.10, help="goal: RSS growth after warm-up below this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scenarios", default="",
                   help=f"comma-separated: run only these scenarios ({', '.join(SCENARIOS)}); default all")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--tag", default="soak")
    p.add_argument("--work-dir", default=None, help="models and logs (default: a temporary directory, removed)")
    a = p.parse_args(argv)
    names = [x.strip() for x in a.scenarios.split(",") if x.strip()]
    unknown = [x for x in names if x not in SCENARIOS]
    if unknown:
        p.error(f"--scenarios: unknown {', '.join(unknown)} (known: {', '.join(SCENARIOS)})")
    a.scenarios = names
    if a.verifiers < 1:
        p.error("--verifiers: at least 1")
    if not 0 <= a.restart_verifier < a.verifiers:
        p.error(f"--restart-verifier: one of 0..{a.verifiers - 1}")
    if 0 < a.restart_at < 1 and 0 < a.verifier_restart_at < 1 and a.restart_at == a.verifier_restart_at:
        p.error("--restart-at and --verifier-restart-at: at different times (each restart's errors are told apart)")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    a.warmup_s = min(a.warmup_s, a.duration_s / 3)
    a.compare_s = min(a.compare_s, (a.duration_s - a.warmup_s) / 3)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = (Path(a.work_dir) if a.work_dir else Path(tempfile.mkdtemp(prefix="crossdraft-soak-"))).resolve()
    stack = Stack(work, a)
    stop_ev = threading.Event()
    faulthandler.register(signal.SIGUSR1)  # kill -USR1 <pid>: every thread's stack on stderr
    for sig in (signal.SIGINT, signal.SIGTERM):  # stop early, still clean up and write what was measured
        signal.signal(sig, lambda *_: stop_ev.set())
    meta = {**git_stamp(), "started_unix_s": time.time(), "python": platform.python_version(),
            "machine": platform.machine(), "cpus": os.cpu_count(), "psutil": psutil.__version__}
    print(f"soak: starting the stack in {work} ...", flush=True)
    t_stack = time.time()
    result = None
    try:
        stack.start()
        meta["stack_start_s"] = round(time.time() - t_stack, 1)
        print(f"soak: stack ready in {meta['stack_start_s']} s: {stack.http} / {stack.grpc}; "
              f"{a.users} users for {a.duration_s:.0f} s", flush=True)
        result = run_load(stack, a, stop_ev, meta)
    finally:
        exit_codes = stack.stop()
        problems = log_problems(stack.log_dir)
        if not a.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    if result is None:
        return 1
    result["service_exit_codes"] = exit_codes
    result["service_logs"] = problems
    path = out / f"{a.tag}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    png = out / f"{a.tag}.png"
    plot(result, png)
    print_summary(result, path, png)
    return 0 if result["goals"]["all_met"] else 1


def run_load(stack: Stack, a, stop_ev: threading.Event, meta: dict) -> dict | None:
    t0 = time.time()
    rec = Recorder(t0)
    mon = Monitor(stack, rec, a.window_s, threading.Event())
    mon.start()
    stop_at = t0 + a.duration_s
    users = [User(i, stack, rec, a, stop_at, stop_ev) for i in range(a.users)]
    for u in users:
        u.start()
    # the restarts, in time order: the drafter's, and one verifier's (its window of expected 503s
    # opens when it is stopped and closes --restart-grace-s after the new process is healthy)
    plan = sorted((at, name) for name, at in (("drafter", a.restart_at),
                                              (f"verifier-{a.restart_verifier}", a.verifier_restart_at))
                  if 0 < at < 1 and name in stack.procs)
    restarts: list[dict] = []
    last_print = t0
    reported = set()
    while time.time() < stop_at and not stop_ev.is_set():
        if plan and time.time() >= t0 + a.duration_s * plan[0][0]:
            _, name = plan.pop(0)
            window = None

            def opened(t_down, name=name):
                nonlocal window
                if name.startswith("verifier"):
                    window = [t_down - t0, float("inf")]
                    with rec.lock:
                        rec.restart_windows.append(window)

            print(f"soak: restarting {name} ({a.restart_signal}) at {time.time() - t0:.0f} s", flush=True)
            ev = stack.restart(name, a.restart_signal, on_down=opened)
            if window is not None:
                with rec.lock:
                    window[1] = ev["t_up"] - t0 + a.restart_grace_s
            restarts.append(ev)
            print(f"soak: {name} back after {ev['t_up'] - ev['t_down']:.1f} s", flush=True)
        if time.time() - last_print >= 30:
            last_print = time.time()
            with rec.lock:
                c = {o: sum(1 for r in rec.requests if r[3] == o) for o in OUTCOMES}
            print(f"soak: {time.time() - t0:5.0f} s {c}", flush=True)
        for p in stack.procs.values():
            if not p.alive() and p.p.pid not in reported:
                reported.add(p.p.pid)
                print(f"soak: {p.name} died:\n{p.tail()}", file=sys.stderr, flush=True)
        stop_ev.wait(0.5)
    stop_ev.set()
    t_stop = time.time()
    join_by = time.time() + a.request_timeout_s + 30  # one bound for all: a hung stack cannot hold us longer
    for u in users:
        u.join(max(0.1, join_by - time.time()))
    stuck = [u.name for u in users if u.is_alive()]
    load_end = time.time() - t0
    time.sleep(2)  # let the last cancelled requests end their rounds
    mon.stop_ev.set()
    mon.join(30)
    mon.samples.append(mon.sample())

    # ---- the end: keys vs sessions alive, the kept sessions re-checked, then deleted -------------
    r = mon.r
    final_keys = redis_keys(r)
    alive = dict(rec.sessions_alive)
    session_keys = {k.removeprefix("crossdraft:session:") for k in final_keys.pop("_session_keys")}
    leak = {"sessions_alive_by_client": len(alive), "session_keys_in_redis": len(session_keys),
            "lease_keys_in_redis": final_keys["leases"], "other_keys": final_keys["other"],
            "keys_without_a_live_session": sorted(session_keys - set(alive))[:20],
            "live_sessions_without_a_key": sorted(set(alive) - session_keys)[:20]}
    leak["no_leak"] = (session_keys == set(alive) and final_keys["leases"] == 0 and not final_keys["other"])
    checker = User(999, stack, rec, a, time.time() + 3600, threading.Event())
    recheck_ok = 0
    for sid, e in alive.items():
        s = checker.read_session(e["api"], sid)
        if s is not None and check_transcript(rec, sid, e["kind"], s, e["expected"], e["turns"]):
            recheck_ok += 1
        checker.delete_session(e["api"], sid)
    checker.client.close()
    time.sleep(1)
    after = redis_keys(r)
    after.pop("_session_keys")
    leak["kept_sessions_rechecked_intact"] = f"{recheck_ok}/{len(alive)}"
    leak["keys_after_deleting_the_kept_sessions"] = after["total"]
    leak["no_leak"] = leak["no_leak"] and after["total"] == 0
    kv_end = {n: stack.kv_blocks_used(n) for n in (*stack.verifiers, "drafter")}
    gm = stack.metrics("gateway")
    gateway_counts = {k.split("{", 1)[1].rstrip("}"): int(v) for k, v in gm.items()
                      if k.startswith("crossdraft_requests_total{")}
    final_sample = mon.sample()
    r.close()

    # ---- summary ----------------------------------------------------------------------------------
    restarts_rel = []
    for ev in restarts:
        lo, hi = ev["t_down"] - t0, ev["t_up"] - t0 + a.restart_grace_s
        during = [x for x in rec.requests if x[0] <= hi and x[1] >= lo]
        r = {"name": ev["name"], "signal": ev["signal"], "t_down_s": round(ev["t_down"] - t0, 2),
             "t_up_s": round(ev["t_up"] - t0, 2), "down_s": round(ev["t_up"] - ev["t_down"], 2),
             "old_pid": ev["old_pid"], "new_pid": ev["new_pid"], "old_exit_code": ev["old_exit_code"],
             "window_s": [round(lo, 2), round(hi, 2)],
             "requests_overlapping_the_restart": {o: sum(1 for x in during if x[3] == o) for o in OUTCOMES}}
        if ev["name"] == "drafter":
            r["ok_with_drafter_fallback"] = sum(1 for x in during if x[3] == "ok" and x[5])
        restarts_rel.append(r)
    totals = {o: sum(1 for x in rec.requests if x[3] == o) for o in OUTCOMES}
    kinds = sorted({x[2] for x in rec.requests})
    by_kind = {}
    for k in kinds:
        xs = [x for x in rec.requests if x[2] == k]
        lat = [x[4] for x in xs if x[3] == "ok"]
        by_kind[k] = {**{o: sum(1 for x in xs if x[3] == o) for o in OUTCOMES},
                      **{f"p{q}_ms": (round(pct(lat, q) * 1e3, 1) if lat else None) for q in (50, 95, 99)}}
    ok_lat = [x[4] for x in rec.requests if x[3] == "ok"]
    samples = mon.samples
    growth = {}
    for name in ("redis", *stack.verifiers, "drafter", "gateway", "load_generator"):
        lives = [[0.0, load_end]]  # each process's life: a restart ends one and begins the next
        for r in restarts_rel:
            if r["name"] == name:
                lives[-1][1] = r["t_down_s"]
                lives.append([r["t_up_s"], load_end])
        for i, (lo, hi) in enumerate(lives):
            # a restarted process's warm-up: as the run's, or a third of its life where that is shorter
            warm = a.warmup_s if i == 0 else min(a.warmup_s, (hi - lo) / 3)
            key = name if len(lives) == 1 else f"{name} ({'before' if i == 0 else 'after'} the restart)"
            growth[key] = dict(rss_growth(samples, name, lo, hi, warm, a.compare_s), warmup_s=round(warm, 1))
    services = ("redis", "verifier", "drafter", "gateway")
    measured = {k: v for k, v in growth.items() if v.get("measured") and k.split()[0].split("-")[0] in services}
    rss_ok = bool(measured) and all(v["growth"] <= a.rss_limit for v in measured.values())
    # every service sampled each minute: the median of the minute's samples (MiB; a restarted
    # process's minutes are its new process's after the restart)
    rss_per_minute = {"minute": [], **{n: [] for n in samples[0]["rss_bytes"]}} if samples else {}
    for m in range(int(load_end // 60) + 1):
        xs = [x for x in samples if m * 60 <= x["t_s"] < (m + 1) * 60]
        if not xs:
            continue
        rss_per_minute["minute"].append(m)
        for n in samples[0]["rss_bytes"]:
            vals = [x["rss_bytes"].get(n) for x in xs if x["rss_bytes"].get(n)]
            rss_per_minute[n].append(round(statistics.median(vals) / 2**20, 1) if vals else None)
    tr = rec.transcripts
    goals = {
        "zero_unexpected": {"met": totals["unexpected"] == 0, "unexpected": totals["unexpected"]},
        # (a run whose --scenarios hold no session has none to check)
        "transcripts_intact": {"met": (tr["checked"] > 0 or not sessions_run(a)) and not tr["broken"],
                               "checked": tr["checked"], "intact": tr["intact"]},
        "rss_growth_below_limit": {"met": rss_ok, "limit": a.rss_limit,
                                   "worst": max(((k, v["growth"]) for k, v in measured.items()),
                                                key=lambda kv: kv[1], default=None)},
        "no_redis_leak": {"met": leak["no_leak"]},
    }
    goals["all_met"] = all(g["met"] for g in goals.values())
    cfg = {k: v for k, v in vars(a).items() if k not in ("out", "work_dir")}
    return {
        "meta": meta, "config": cfg,
        "load": {"started_unix_s": t0, "load_end_s": round(load_end, 1), "users_stuck_at_the_end": stuck,
                 "stop_to_users_joined_s": round(time.time() - t_stop, 1)},
        "goals": goals,
        "totals": {**totals, "all": len(rec.requests),
                   "ok_latency_ms": {f"p{q}": (round(pct(ok_lat, q) * 1e3, 1) if ok_lat else None)
                                     for q in (50, 95, 99)},
                   "ok_with_drafter_fallback": sum(1 for x in rec.requests if x[3] == "ok" and x[5])},
        "by_kind": by_kind,
        "sessions": {**rec.sessions, "transcripts_checked": tr["checked"], "transcripts_intact": tr["intact"],
                     "turns_refused_context_full": rec.context_full,
                     "broken": tr["broken"][:20]},
        "greedy_consistency": {"compared": rec.greedy_checked, "distinct_keys": len(rec.greedy),
                               "mismatches": len(rec.greedy_mismatches),
                               "first_mismatches": rec.greedy_mismatches[:10]},
        "leak": leak, "kv_blocks_used_at_end": kv_end, "final_sample": final_sample,
        "gateway_request_counters": gateway_counts,
        "rss_growth": growth, "rss_per_minute_mb": rss_per_minute, "restarts": restarts_rel,
        "expected_503": {
            "definition": "a request whose [start, end] overlaps a verifier restart's window (from the "
                          f"SIGKILL/SIGTERM to {a.restart_grace_s:g} s after the new process is healthy) and "
                          "that got HTTP 503 with a Retry-After of delta-seconds, an SSE error event with code "
                          "503 (a stream that had begun), or gRPC UNAVAILABLE; any other 5xx, or a 503 outside "
                          "the windows or without Retry-After, is unexpected",
            "windows_s": [[round(lo, 2), round(hi, 2)] for lo, hi in rec.restart_windows],
            "count": totals["expected_503"], "by_form": dict(rec.expected_503)},
        "unexpected_errors": {"count": len(rec.unexpected), "first": rec.unexpected[:30]},
        "windows": windows(rec, samples, a.window_s),
    }


def print_summary(res: dict, path: Path, png: Path) -> None:
    g = res["goals"]
    t = res["totals"]
    print(f"\nsoak: {t['all']} requests: " + ", ".join(f"{o} {t[o]}" for o in OUTCOMES)
          + f"; ok latency p50/p95/p99 {t['ok_latency_ms']['p50']}/{t['ok_latency_ms']['p95']}/"
            f"{t['ok_latency_ms']['p99']} ms")
    for rs in res["restarts"]:
        fb = f" ({rs['ok_with_drafter_fallback']} ok with fallback)" if "ok_with_drafter_fallback" in rs else ""
        print(f"soak: {rs['name']} down {rs['down_s']} s at {rs['t_down_s']} s; requests overlapping "
              f"{rs['window_s']}: {rs['requests_overlapping_the_restart']}{fb}")
    print(f"soak: expected 503s: {res['expected_503']['count']} {res['expected_503']['by_form']}")
    print(f"soak: transcripts intact {g['transcripts_intact']['intact']}/{g['transcripts_intact']['checked']}; "
          f"leak check {res['leak']}")
    for name, v in res["rss_growth"].items():
        if v.get("measured"):
            print(f"soak: RSS {name}: {v['first_mb']} -> {v['last_mb']} MiB ({v['growth']:+.2%}; "
                  f"{v['first_window_s']} vs {v['last_window_s']} s)")
        else:
            print(f"soak: RSS {name}: not measured ({v['why']})")
    print(f"soak: greedy consistency: {res['greedy_consistency']['compared']} compared, "
          f"{res['greedy_consistency']['mismatches']} mismatches")
    for e in res["unexpected_errors"]["first"][:5]:
        print(f"soak: unexpected at {e['t_s']} s ({e['kind']}): {e['detail'][:300]}")
    print("soak: goals: " + ", ".join(f"{k} {'MET' if v['met'] else 'NOT MET'}" for k, v in g.items()
                                      if k != "all_met"))
    print(f"soak: wrote {path} and {png}")


if __name__ == "__main__":
    sys.exit(main())
