"""Hugging Face transformers as the correctness oracle, on the same checkpoint files."""
from __future__ import annotations

import functools
import pathlib

import torch


@functools.lru_cache(maxsize=4)
def hf_model(path: pathlib.Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


@torch.no_grad()
def hf_logits(path: pathlib.Path, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), vocab] fp32 logits of one forward over the prompt."""
    return hf_model(path)(torch.tensor([prompt])).logits[0].float()


@torch.no_grad()
def hf_embedding(path: pathlib.Path, prompt: list[int]) -> torch.Tensor:
    """[hidden] fp32: the last token's final hidden state (transformers applies the model's final norm before it
    reports it), L2-normalized: what vLLM's "LAST" pooling with normalization gives for a decoder model."""
    out = hf_model(path)(torch.tensor([prompt]), output_hidden_states=True)
    return torch.nn.functional.normalize(out.hidden_states[-1][0, -1].float(), dim=0)


@torch.no_grad()
def hf_greedy(path: pathlib.Path, prompt: list[int], max_new_tokens: int, **generate_kw) -> list[int]:
    """transformers' generate(do_sample=False), one sequence at a time (no padding); generate_kw: more
    generate() arguments (e.g. repetition_penalty)."""
    model = hf_model(path)
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0, **generate_kw)
    return out[0, len(prompt):].tolist()
