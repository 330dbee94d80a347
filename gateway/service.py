"""GatewayService servicer (public gRPC API)."""

from __future__ import annotations

from crossdraft.errors import ResourceExhausted
from crossdraft.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

from .auth import check_api_key, key_owner
from .core import Gateway
from .validation import OPTION_FIELDS


def options_from_proto(m) -> dict:
    return {f: getattr(m, f) for f in OPTION_FIELDS if m.HasField(f)}


def options_to_proto(d: dict) -> gateway_pb2.GenerationOptions:
    return gateway_pb2.GenerationOptions(**{k: v for k, v in d.items() if k in OPTION_FIELDS})


def stats_to_proto(d: dict) -> gateway_pb2.SpeculativeStats:
    fields = gateway_pb2.SpeculativeStats.DESCRIPTOR.fields_by_name
    return gateway_pb2.SpeculativeStats(**{k: v for k, v in d.items() if k in fields})


def session_to_proto(s) -> gateway_pb2.SessionInfo:
    return gateway_pb2.SessionInfo(
        session_id=s.session_id, turns=s.turns, target_tokens=len(s.target_ids), drafter_tokens=len(s.drafter_ids),
        options=options_to_proto(s.options), stats=stats_to_proto(s.stats), drafter_instance=s.drafter_instance,
        verifier_instance=s.verifier_instance, created_unix_s=s.created_unix_s, updated_unix_s=s.updated_unix_s,
        messages=[gateway_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in s.messages], text=s.text,
        drafter_address=s.drafter_address, verifier_address=s.verifier_address, drafter_kind=s.drafter_kind)


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(self, gw: Gateway):
        self.gw = gw

    def _auth(self, context) -> str:
        """Check the caller's API key (if keys are on); the owner hash of its sessions."""
        if self.gw.cfg.api_keys:
            md = {k.lower(): v for k, v in (context.invocation_metadata() or ())}
            check_api_key(self.gw.cfg, md.get("authorization"))
            return key_owner(self.gw.cfg, md.get("authorization"))
        return ""

    def Generate(self, request, context):
        owner = self._auth(context)
        messages = [{"role": m.role, "content": m.content} for m in request.messages] or None
        prompt = request.prompt if (request.prompt or not messages) else None
        try:
            options = options_from_proto(request.options)
            top_logprobs = int(request.top_logprobs) if request.HasField("top_logprobs") else -1
            self.gw.precheck(session_id=request.session_id or None, messages=messages, options=options,
                             stop=list(request.stop) or None, prompt=prompt, top_logprobs=top_logprobs)
            self.gw.admission.enter()
            job = self.gw.start(session_id=request.session_id or None, prompt=prompt, messages=messages,
                                options=options, api="grpc",
                                stop=list(request.stop) or None, admitted=True, owner=owner,
                                top_logprobs=top_logprobs)
        except Exception as e:
            # as REST counts its rejections
            self.gw.metrics.requests.labels("grpc", "overloaded" if isinstance(e, ResourceExhausted)
                                            else "rejected").inc()
            raise
        # a cancelled call or one past its deadline ends the request before its next round
        context.add_callback(lambda: job.cancel() if not context.is_active() else None)
        return self._stream(job, context)

    def _stream(self, job, context=None):
        events = job.events()  # held here: a cancelled call marks the job before its generator closes
        try:
            for ev in events:
                if ev["type"] == "delta":
                    lps = [common_pb2.TokenLogprob(logprob=lp, top_ids=ids, top_logprobs=vals)
                           for lp, ids, vals in (ev.get("logprobs") or [])]
                    yield gateway_pb2.GenerateResponse(
                        delta=gateway_pb2.TextDelta(text=ev["text"], token_ids=ev["token_ids"], logprobs=lps))
                    if context is not None and not context.is_active():
                        job.cancel()
                else:
                    yield gateway_pb2.GenerateResponse(done=gateway_pb2.GenerateDone(
                        session_id=ev["session_id"], finish_reason=ev["finish_reason"], text=ev["text"],
                        usage=gateway_pb2.Usage(**ev["usage"]), stats=stats_to_proto(ev["stats"])))
        except GeneratorExit:  # gRPC stopped reading us: the call was cancelled or timed out
            job.cancel()
            raise
        finally:
            if context is not None and not context.is_active():
                job.cancel()
            events.close()
            job.close()

    def CreateSession(self, request, context):
        owner = self._auth(context)
        opts = options_from_proto(request.options) if request.HasField("options") else {}
        s = self.gw.create_session(opts, request.session_id or None, owner=owner)
        return gateway_pb2.CreateSessionResponse(session_id=s.session_id)

    def GetSession(self, request, context):
        owner = self._auth(context)
        return gateway_pb2.GetSessionResponse(session=session_to_proto(self.gw.get_session(request.session_id,
                                                                                         owner)))

    def DeleteSession(self, request, context):
        owner = self._auth(context)
        return gateway_pb2.DeleteSessionResponse(existed=self.gw.delete_session(request.session_id, owner))
