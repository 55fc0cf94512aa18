"""Greedy equality on the real embedded default model (SmolLM2-135M-Instruct GGUF).

For every draft method, speculative greedy decoding must give token-for-token the
output of target-only greedy decoding; target-only greedy must in turn match
transformers' own greedy ``generate``. Prompts are run as one ragged batch, so
this also covers batching requests of different lengths.
"""

from __future__ import annotations

import pytest
import torch

from specdist import Engine, SamplingParams
from specdist.config import load_config
from specdist.models.fusion import quantized_copy

PROMPTS = [
    "Explain gravity in two sentences.",
    "List three colours of the rainbow.",
    "Write one line about cats and one about dogs.",
    "What is 12 plus 30?",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def default_model(smollm2_model, smollm2_tokenizer):
    target, tok = smollm2_model, smollm2_tokenizer
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in PROMPTS
    ]
    return target, tok, prompts


def _engine(target, tok, method: str, k: int = 4, draft=None) -> Engine:
    cfg = load_config(
        {
            "draft": {"method": method, **({"num_speculative_tokens": k} if method != "none" else {})},
            "engine": {"max_model_len": 256, "max_batch_size": 4, "device": "cpu"},
        }
    )
    return Engine(cfg, target, tok, draft)


@pytest.fixture(scope="module")
def reference(default_model):
    target, tok, prompts = default_model
    outs = _engine(target, tok, "none").generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    return [o.token_ids for o in outs]


@pytest.mark.slow
def test_target_only_matches_transformers_greedy(default_model, reference):
    target, tok, prompts = default_model
    for prompt, ref in list(zip(prompts, reference))[:2]:
        ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.inference_mode():
            out = target.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                top_k=None,
                top_p=None,
                temperature=None,
            )
        hf = out[0, ids.shape[1] :].tolist()
        eos = tok.eos_token_id
        hf = hf[: hf.index(eos)] if eos in hf else hf  # the engine does not emit the EOS token itself
        assert ref == hf


@pytest.mark.slow
@pytest.mark.parametrize("method,k", [("self-w8", 4), ("ngram", 3), ("self-w8", 7)])
def test_speculative_greedy_equals_target_greedy(default_model, reference, method, k):
    target, tok, prompts = default_model
    draft = quantized_copy(target) if method == "self-w8" else None
    engine = _engine(target, tok, method, k, draft)
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    assert [o.token_ids for o in outs] == reference
    drafted = sum(o.metrics.drafted for o in outs)
    accepted = sum(o.metrics.accepted for o in outs)
    assert drafted > 0
    if method == "self-w8":  # the int8 copy agrees with the target most of the time
        assert accepted / drafted > 0.6
    assert engine.kv_slots_in_use() == {"target": 0, "draft": 0}
