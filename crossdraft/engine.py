"""The in-process reference engine: target-only, same-vocabulary SD and TLI speculative decoding.

:class:`Engine` loads nothing itself: it takes loaded models, builds the vocabulary pair, one
in-process worker per model (:mod:`crossdraft.runtime.workers`, the same code the model servers run) and
the round loop (:class:`crossdraft.decoding.decode.Decoder`, the same code the gateway runs), so the
engine and the services produce the same tokens.

The engine is a top module: it joins the model side (:mod:`crossdraft.runtime`) to the model-free
round loop (:mod:`crossdraft.decoding`), which never imports it (docs/layout.md, "Layers";
tests/unit/test_layout.py checks the layers). ``__all__`` is what users import from here.
"""

from __future__ import annotations

from crossdraft.decoding.decode import Decoder
from crossdraft.decoding.pipeline import pipeline_on
from crossdraft.decoding.policy import DEFAULT_DRAFT_VOCAB, DraftConfig
from crossdraft.decoding.sampling import SamplingParams
from crossdraft.decoding.stats import GenerationResult, Stats
from crossdraft.errors import InvalidArgument
from crossdraft.runtime.workers import DrafterWorker, VerifierWorker, WorkerConfig
from crossdraft.vocab.pair import TokenPair

__all__ = ["DraftConfig", "Engine", "GenerationResult", "SamplingParams", "Stats"]


class Engine:
    """Speculative decoding with a target and an optional drafter, in one process.

    target / drafter: :class:`crossdraft.models.loading.LoadedModel`-like objects with ``model``,
    ``tokenizer``, ``device``, ``eos_token_ids`` and ``vocab_size``. The round loop is
    :class:`crossdraft.decoding.decode.Decoder` over in-process workers -- the same code the gateway runs
    over gRPC, so both produce the same tokens.
    """

    def __init__(self, target, drafter=None, *, mapping=None, vocab_cache_dir=None,
                 draft_vocab: int = DEFAULT_DRAFT_VOCAB, pipeline: str = "auto", branch: str = "off"):
        self.target = target
        self.drafter = drafter
        self.pair = TokenPair(target.tokenizer, drafter.tokenizer if drafter is not None else None,
                              int(target.vocab_size), int(drafter.vocab_size) if drafter is not None else 0,
                              mapping=mapping, vocab_cache_dir=vocab_cache_dir, draft_vocab=draft_vocab)
        self.mapping = self.pair.mapping
        cfg = WorkerConfig(max_sessions=4)
        self.verifier = VerifierWorker(target, cfg)
        self.drafter_worker = DrafterWorker(drafter, cfg) if drafter is not None else None
        self.decoder = Decoder(self.pair, self.verifier, self.drafter_worker, eos_ids=target.eos_token_ids,
                               max_context=self.verifier.max_context, check_context=False,
                               pipeline=pipeline_on(pipeline, colocated=True), branch=branch == "on")
        if self.drafter_worker is not None:  # time the forwards now, not inside the first request
            self.verifier.timings()
            self.drafter_worker.timings()
        self._n = 0

    # the vocabulary pair's tables, for callers that inspect the mapping (tests, `crossdraft vocab`)
    @property
    def d2t(self):
        """[drafter rows] drafter id -> target id, -1 outside the intersection."""
        return self.pair.d2t

    @property
    def t2d(self):
        """[target rows] target id -> canonical drafter id, -1 outside the intersection."""
        return self.pair.t2d

    @property
    def allowed(self):
        """[drafter rows] bool: drafter ids in the intersection (what TLI drafting may propose)."""
        return self.pair.allowed

    @property
    def same_vocab(self) -> bool:
        return self.pair.same_vocab

    def generate_chat(self, messages: list[dict], **kwargs) -> GenerationResult:
        """Generate the assistant's reply; each model sees the conversation in its own template."""
        t_ids, d_ids = self.pair.chat_ids(messages)
        return self.generate(prompt_ids=t_ids, drafter_prompt_ids=d_ids, **kwargs)

    def generate(
        self,
        prompt: str | None = None,
        *,
        prompt_ids: list[int] | None = None,
        drafter_prompt_ids: list[int] | None = None,
        max_new_tokens: int = 64,
        params: SamplingParams | None = None,
        seed: int = 0,
        draft: DraftConfig | None = None,
        use_drafter: bool = True,
        stop: str | list[str] | None = None,
        top_logprobs: int = -1,
    ) -> GenerationResult:
        """Generate after ``prompt`` (or ``prompt_ids``); ``stop``: up to 4 strings that end the output;
        ``top_logprobs`` >= 0: each token's log-probability and that many alternatives (result.logprobs)."""
        if prompt_ids is None:
            if not isinstance(prompt, str) or not prompt:
                raise InvalidArgument("prompt", "must be a non-empty string")
            prompt_ids = self.pair.encode_target(prompt)
        if not prompt_ids:
            raise InvalidArgument("prompt", "must not be empty")
        d_ids = None
        if self.drafter is not None and use_drafter:
            if drafter_prompt_ids is not None:
                d_ids = list(drafter_prompt_ids)
            else:
                if prompt is None:
                    prompt = self.target.tokenizer.decode(prompt_ids, skip_special_tokens=True)
                d_ids = self.pair.encode_drafter(prompt)
        self._n += 1
        sid = f"engine-{self._n}"
        try:
            run = self.decoder.run(sid, list(prompt_ids), d_ids, max_new_tokens=max_new_tokens,
                                   params=params or SamplingParams(), seed=seed, draft=draft or DraftConfig(),
                                   use_drafter=use_drafter, stop=stop, top_logprobs=top_logprobs)
            for _ in run:
                pass
            return run.result
        finally:
            self.verifier.end(sid)
            if self.drafter_worker is not None:
                self.drafter_worker.end(sid)
