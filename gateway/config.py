"""The gateway's configuration: one frozen dataclass, built from flags and CROSSDRAFT_* variables by
``server.config_from_args`` and passed to every part of the gateway."""

from __future__ import annotations

from dataclasses import dataclass, field

from crossdraft.decoding.policy import DEFAULT_DRAFT_VOCAB
from crossdraft.serving.tls import TLSConfig


@dataclass(frozen=True)
class GatewayConfig:
    """Configuration of the gateway (flags override CROSSDRAFT_* env vars)."""

    verifier: str | None  # verifier address(es) host:port[,host:port] (static discovery)
    redis_url: str  # Redis URL for sessions
    drafter: str | None = None  # drafter address(es) (None = target-only, unless discovered)
    discovery: str = "static"  # "static" (the addresses above) | "kubernetes" (watch EndpointSlices)
    verifier_service: str | None = None  # kubernetes: headless Service of the verifier pods
    drafter_service: str | None = None  # kubernetes: headless Service of the drafter pods (None = no drafter)
    # a pool of drafter kinds beyond the first (gateway/pool.py): ((NAME, "host:port[,host:port]"), ...) with
    # static discovery, ((NAME, SERVICE), ...) with kubernetes; per-kind tokenizers ((NAME, PATH), ...)
    drafter_name: str | None = None  # the first drafter kind's name (None: from its model's name)
    drafter_pool: tuple = ()
    drafter_pool_services: tuple = ()
    drafter_tokenizers: tuple = ()
    namespace: str = "default"  # kubernetes: namespace of those Services
    port_name: str = "grpc"  # kubernetes: name of the gRPC port in the EndpointSlices
    host: str = "0.0.0.0"  # bind address
    http_port: int = 8000  # REST port (0 = pick a free one)
    grpc_port: int = 50051  # gRPC port (0 = pick a free one)
    target_tokenizer: str | None = None  # tokenizer of the target (default: the verifier's model name)
    drafter_tokenizer: str | None = None  # tokenizer of the drafter (default: the drafter's model name)
    session_ttl_s: float = 3600.0  # sessions expire after this long unused
    drafter_timeout_s: float = 10.0  # deadline of one Draft call; past it the request goes on target-only
    round_log: str | None = None  # a file: one JSON line per round appended (the cost model's view; tracing)
    # whether a drafter computes on its verifier's hardware (its steps then stall every session's
    # verification; the draft-length policy prices a lone drafter under load by that): "auto" = both
    # addresses on this host's loopback or the same host, "yes", "no"
    colocated: str = "auto"
    # pipelined rounds (crossdraft.decoding.pipeline): each block's successor is drafted while it is
    # verified; "auto" = on where the drafter does not share the verifier's hardware (see colocated)
    pipeline: str = "auto"
    # (pipelined greedy TLI rounds) "on" = a branch beside each block ahead, on the block's likeliest
    # correction (crossdraft.decoding.pipeline.Branch); "off" = none
    branch: str = "off"
    # the load gate (crossdraft.decoding.gate; experimental): "on" = drafting is held at a load where
    # target-only rounds measure more goodput; "off" = the draft-length policy alone decides
    load_gate: str = "off"
    # the drafter drafts from its this many most frequent tokens only (vocab.TokenPair); 0 = every token
    draft_vocab: int = DEFAULT_DRAFT_VOCAB
    verifier_timeout_s: float = 120.0  # deadline of one Verify call
    max_new_tokens_limit: int = 4096  # largest max_new_tokens accepted
    default_max_new_tokens: int = 64  # when a request gives none
    default_temperature: float = 0.0  # when a request gives none (0 = greedy)
    max_prompt_chars: int = 200_000  # longer prompts are rejected (HTTP 413 / INVALID_ARGUMENT)
    connect_timeout_s: float = 900.0  # wait this long at start for a verifier to become healthy
    # then wait at most this long for each drafter kind; a kind not up by then is paired in the background as
    # soon as one of its replicas answers (meanwhile requests draft with the other kinds, or run target-only)
    drafter_start_wait_s: float = 60.0
    default_num_draft_tokens: int = 4  # initial block size
    # if non-empty, /v1/* and the gRPC API need "Authorization: Bearer <key>" (env CROSSDRAFT_API_KEYS only)
    api_keys: frozenset = frozenset()
    drain_timeout_s: float = 30.0  # on SIGTERM: how long in-flight requests may take to finish
    # every verifier serving the paired model at another revision this long (a rollout finished after
    # this gateway paired the old one): /healthz turns 503 so that the orchestrator restarts the
    # gateway, which then pairs the new revision. 0 = never
    stale_pairing_restart_s: float = 60.0
    max_concurrent_requests: int = 256  # generations running at once; more wait in the queue
    max_queued_requests: int = 256  # generations waiting for a slot; more are refused (429 / RESOURCE_EXHAUSTED)
    queue_timeout_s: float = 30.0  # a queued generation that gets no slot in this long is refused
    tls: TLSConfig = TLSConfig()  # public side: certificate + key -> HTTPS and gRPC over TLS
    # to the model servers: their CA (turns TLS on), the gateway's client certificate, the expected name
    upstream_tls: TLSConfig = TLSConfig(prefix="upstream_tls")
    redis_password: str = field(default="", repr=False)  # Redis AUTH (--redis-password-file or env), never shown
    redis_tls_ca_file: str = ""  # CA of a rediss:// server's certificate (default: system roots)
