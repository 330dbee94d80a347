"""A small Python client for the gateway's gRPC API (crossdraft.v1.GatewayService).

    from crossdraft.client import Client
    with Client("127.0.0.1:50051") as c:
        print(c.generate("def add(a, b):", max_new_tokens=32).text)
        for piece in c.stream("def fib(n):", max_new_tokens=64):
            print(piece, end="", flush=True)
        sid = c.create_session(temperature=0.7, seed=1)
        c.generate(messages=[{"role": "user", "content": "Hi"}], session_id=sid)

gRPC errors surface as :class:`grpc.RpcError` (INVALID_ARGUMENT names the bad field).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from crossdraft.v1 import gateway_pb2, gateway_pb2_grpc

_OPTIONS = ("max_new_tokens", "temperature", "top_k", "top_p", "repetition_penalty", "seed", "num_draft_tokens",
            "adaptive_draft", "use_drafter")


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str
    session_id: str
    usage: dict
    stats: dict = field(default_factory=dict)
    # with top_logprobs: per token, (log-probability, top ids, their log-probabilities)
    logprobs: list | None = None


def _opts(kw: dict) -> gateway_pb2.GenerationOptions:
    bad = set(kw) - set(_OPTIONS)
    if bad:
        raise TypeError(f"unknown option(s): {', '.join(sorted(bad))}")
    return gateway_pb2.GenerationOptions(**{k: v for k, v in kw.items() if v is not None})


def _msg_to_dict(m) -> dict:
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(m, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


class Client:
    """A gateway client. ``tls_ca_file``: talk TLS and verify the gateway with this CA bundle (PEM);
    ``tls_ca_file=""`` with ``tls=True`` uses the system roots; ``tls_cert_file`` + ``tls_key_file``:
    present a client certificate; ``tls_server_name``: the name to expect in the gateway's
    certificate when dialling it by another name or IP. ``api_key``: sent as ``Authorization:
    Bearer`` on every call (the gateway's CROSSDRAFT_API_KEYS)."""

    def __init__(self, address: str, *, timeout_s: float = 600.0, channel: grpc.Channel | None = None,
                 tls: bool | None = None, tls_ca_file: str | None = None, tls_cert_file: str | None = None,
                 tls_key_file: str | None = None, tls_server_name: str | None = None, api_key: str | None = None):
        if channel is None:
            if tls or tls_ca_file or tls_cert_file:
                from crossdraft.serving.tls import TLSConfig, channel_credentials

                creds = channel_credentials(TLSConfig(cert_file=tls_cert_file or "", key_file=tls_key_file or "",
                                                      ca_file=tls_ca_file or ""))
                opts = [("grpc.ssl_target_name_override", tls_server_name)] if tls_server_name else []
                channel = grpc.secure_channel(address, creds, options=opts)
            else:
                channel = grpc.insecure_channel(address)
        self.channel = channel
        self.stub = gateway_pb2_grpc.GatewayServiceStub(self.channel)
        self.timeout_s = timeout_s
        self.metadata = [("authorization", f"Bearer {api_key}")] if api_key else None

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def _request(self, prompt, messages, session_id, options, stop=None,
                 top_logprobs=None) -> gateway_pb2.GenerateRequest:
        req = gateway_pb2.GenerateRequest(session_id=session_id or "", options=_opts(options))
        if top_logprobs is not None:
            req.top_logprobs = top_logprobs
        req.stop.extend([stop] if isinstance(stop, str) else (stop or []))
        if prompt is not None:
            req.prompt = prompt
        for m in messages or []:
            req.messages.append(gateway_pb2.ChatMessage(role=m["role"], content=m["content"]))
        return req

    def events(self, prompt: str | None = None, *, messages: list[dict] | None = None, session_id: str | None = None,
               stop: str | list[str] | None = None, top_logprobs: int | None = None, **options):
        """Raw GenerateResponse messages (text deltas, then one done). ``stop``: up to 4 strings
        that end the completion (not included in it); ``top_logprobs`` (0-20): each delta carries
        its tokens' log-probabilities and that many alternatives."""
        yield from self.stub.Generate(self._request(prompt, messages, session_id, options, stop, top_logprobs),
                                      timeout=self.timeout_s, metadata=self.metadata)

    def stream(self, prompt: str | None = None, **kw):
        """Yield text pieces as they are generated."""
        for m in self.events(prompt, **kw):
            if m.HasField("delta") and m.delta.text:
                yield m.delta.text

    def generate(self, prompt: str | None = None, **kw) -> Completion:
        ids: list[int] = []
        lps: list = []
        for m in self.events(prompt, **kw):
            if m.HasField("delta"):
                ids.extend(m.delta.token_ids)
                lps.extend((x.logprob, list(x.top_ids), list(x.top_logprobs)) for x in m.delta.logprobs)
            else:
                d = m.done
                return Completion(d.text, ids, d.finish_reason, d.session_id, _msg_to_dict(d.usage),
                                  _msg_to_dict(d.stats), lps if kw.get("top_logprobs") is not None else None)
        raise RuntimeError("the stream ended without a final message")

    def create_session(self, session_id: str | None = None, **options) -> str:
        r = self.stub.CreateSession(
            gateway_pb2.CreateSessionRequest(session_id=session_id or "", options=_opts(options)), timeout=30,
            metadata=self.metadata)
        return r.session_id

    def get_session(self, session_id: str) -> dict:
        r = self.stub.GetSession(gateway_pb2.GetSessionRequest(session_id=session_id), timeout=30,
                                 metadata=self.metadata)
        return _msg_to_dict(r.session)

    def delete_session(self, session_id: str) -> bool:
        return self.stub.DeleteSession(gateway_pb2.DeleteSessionRequest(session_id=session_id), timeout=30,
                                       metadata=self.metadata).existed
