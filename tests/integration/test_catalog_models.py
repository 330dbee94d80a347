"""The catalog's real models, loaded from the cache (CI runs `make models` first).

These do not skip when a model is missing: ``load_model`` pulls it (network + a few minutes), and
a failed pull fails the test.
"""

from __future__ import annotations

import pytest
import torch

from crossdraft.models.catalog import CATALOG, is_pulled, list_models, model_path
from crossdraft.models.loading import load_model

pytestmark = pytest.mark.real_models


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m")


def test_smollm2_loads_from_cache(smollm2):
    lm = smollm2
    assert is_pulled("smollm2-135m") and lm.path == model_path("smollm2-135m")
    assert lm.kind == "catalog" and lm.name == "smollm2-135m"
    assert lm.vocab_size == 49152 == CATALOG["smollm2-135m"].vocab_size
    assert lm.dtype == torch.float32 and lm.device == torch.device("cpu")
    assert lm.eos_token_ids, "no EOS ids"
    vocab = lm.tokenizer.get_vocab()
    assert vocab["<|im_end|>"] in lm.eos_token_ids
    assert not lm.model.training
    row = next(r for r in list_models() if r["name"] == "smollm2-135m")
    assert row["cached"] and row["path"] == str(lm.path)


def test_smollm2_forward_logits_width(smollm2):
    ids = smollm2.tokenizer("def fibonacci(n):", return_tensors="pt").input_ids.to(smollm2.device)
    with torch.no_grad():
        logits = smollm2.model(ids).logits
    assert logits.shape == (1, ids.shape[1], 49152)
    assert torch.isfinite(logits).all()


def test_qwen_coder_05b_eos_ids(catalog_model):
    lm = catalog_model("qwen2.5-coder-0.5b")  # fp32, the package's shared copy (tests/integration/conftest.py)
    vocab = lm.tokenizer.get_vocab()
    assert 151643 in lm.eos_token_ids  # <|endoftext|>: ends a completion though the GGUF names only <|im_end|>
    assert vocab["<|endoftext|>"] == 151643
    assert vocab["<|im_end|>"] in lm.eos_token_ids
    assert lm.vocab_size == 151936
    ids = lm.tokenizer("print(", return_tensors="pt").input_ids
    with torch.no_grad():
        assert lm.model(ids).logits.shape[-1] == lm.vocab_size
