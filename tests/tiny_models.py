"""Tiny random-init causal LMs for fast engine tests (real transformers models, fake weights).

The lm_head is scaled up so that next-token distributions are peaked like a trained model's
(a freshly initialised head gives near-uniform distributions, which would make every check
trivially pass or need millions of samples).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TinyLM:
    """Same attributes the engine reads from crossdraft.models.loading.LoadedModel."""

    model: torch.nn.Module
    tokenizer: object
    name: str
    device: torch.device
    dtype: torch.dtype
    eos_token_ids: frozenset
    vocab_size: int


def tiny_lm(tokenizer, *, seed: int, hidden: int = 32, layers: int = 2, head_scale: float = 6.0,
            arch: str = "llama", extra_vocab: int = 0, with_eos: bool = True) -> TinyLM:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    vocab = len(tokenizer) + extra_vocab  # extra_vocab mimics models whose head is wider than the tokenizer
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
        if extra_vocab:
            model.lm_head.weight[len(tokenizer):] *= 0.2  # ids beyond the tokenizer: rare, distinct (no exact ties)
    model.eval()
    eos = set()
    if with_eos and tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    return TinyLM(model, tokenizer, f"tiny-{arch}-{seed}", torch.device("cpu"), torch.float32, frozenset(eos), vocab)


def noisy_copy(lm: TinyLM, noise: float, seed: int) -> TinyLM:
    """A drafter that is ``lm`` plus Gaussian noise of ``noise`` x each weight tensor's std (same
    tokenizer): it agrees with ``lm`` on most tokens, so both branches of acceptance are exercised."""
    import copy

    out = copy.deepcopy(lm)
    torch.manual_seed(seed)
    with torch.no_grad():
        for prm in out.model.parameters():
            prm.add_(noise * prm.std() * torch.randn_like(prm))
    return out


def early_exit_pair(tokenizer, *, seed: int, hidden: int = 64, layers: int = 6, keep: int = 1,
                    tail_scale: float = 0.05, head_scale: float = 25.0) -> tuple[TinyLM, TinyLM]:
    """(target, drafter) of one tokenizer where the drafter is much cheaper than the target and agrees
    with it on most tokens: the drafter is the target's first ``keep`` layers with its norm and head (an
    early exit), and the target's later layers change the residual stream by ``tail_scale`` of what
    theirs would. Priced by their weights' bytes (static costs), drafting pays -- unlike a noisy copy,
    which costs what the target costs."""
    import copy

    from transformers import Qwen2ForCausalLM

    target = tiny_lm(tokenizer, seed=seed, hidden=hidden, layers=layers, arch="qwen2", head_scale=head_scale)
    with torch.no_grad():
        for layer in target.model.model.layers[keep:]:
            layer.self_attn.o_proj.weight.mul_(tail_scale)
            layer.mlp.down_proj.weight.mul_(tail_scale)
    cfg = copy.deepcopy(target.model.config)
    cfg.num_hidden_layers = keep
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:keep]
    small = Qwen2ForCausalLM(cfg)
    small.load_state_dict(target.model.state_dict(), strict=False)
    small.eval()
    drafter = TinyLM(small, tokenizer, f"tiny-exit-{seed}", target.device, target.dtype, target.eos_token_ids,
                     target.vocab_size)
    return target, drafter
