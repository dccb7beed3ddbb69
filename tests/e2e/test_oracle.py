"""Exactness against transformers: prefill logits, and greedy generation through the real gRPC server."""
from __future__ import annotations

import pytest
import torch

from conftest import TINY_CONFIGS, engine_config, generate_via_grpc, random_prompts, start_server
from engine.api import PrefillItem
from engine.batch import build_extend_batch
from engine.engine import Engine
from engine.sampling import SamplingParams, StoppingCriteria
from oracle import hf_greedy, hf_logits

CONFIG_NAMES = list(TINY_CONFIGS)
PROMPT_LENGTHS = [3, 9, 17, 30]
NEW_TOKENS = 32


def engine_logits(engine: Engine, prompt: list[int]) -> torch.Tensor:
    """The engine's logits at every prompt position, from one prefill forward."""
    seq = engine.alloc_sequence(len(prompt) + 1, SamplingParams(), StoppingCriteria())
    sequence = engine.sequences[seq.seq_id]
    sequence.blocks.grow_all()  # what its first prefill would do
    engine.runtime.state.assign(seq.slot, sequence.blocks.block_ids, sequence.sampling)
    try:
        batch = build_extend_batch(engine.runtime.state.block_table, [seq.slot], [0], [prompt], [list(range(len(prompt)))],
                                   engine.block_size, engine.device, engine.runtime.dynamic_rope)
        return engine.runtime.model.forward(batch)
    finally:
        engine.release([seq.seq_id])


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_prefill_logits_match_transformers(name, checkpoints):
    path = checkpoints[name]
    engine = Engine(engine_config(path))
    for prompt in random_prompts([1, 7, 40], engine.model_config.vocab_size, seed=11):
        ours, ref = engine_logits(engine, prompt), hf_logits(path, prompt)
        assert ours.shape == ref.shape
        diff = (ours - ref).abs().max().item()
        assert diff <= 1e-4, f"{name}: prefill logits differ by {diff} (logit scale {ref.abs().max():.1f})"


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_greedy_generation_over_grpc_matches_transformers(name, checkpoints):
    """A batch of 4 prompts of different lengths, prefilled together and decoded together for 32 tokens
    through the real server, equals transformers' greedy generate of each prompt."""
    path = checkpoints[name]
    server = start_server(path)
    try:
        vocab = server.engine.model_config.vocab_size
        prompts = random_prompts(PROMPT_LENGTHS, vocab, seed=5)
        ours = generate_via_grpc(server.stub(), prompts, NEW_TOKENS)
        for prompt, got in zip(prompts, ours):
            assert len(got) == NEW_TOKENS  # the prefill's token, then 31 decode steps
            assert got == hf_greedy(path, prompt, NEW_TOKENS), f"{name}: prompt of {len(prompt)} tokens"
        # Chunked prefill (chunks of 4 tokens, interleaved across the batch) gives the same tokens.
        # Dynamic NTK rope is the exception: its frequencies depend on the length in each forward.
        if TINY_CONFIGS[name][1].get("rope_scaling", {}).get("rope_type") != "dynamic":
            assert generate_via_grpc(server.stub(), prompts, NEW_TOKENS, chunk=4) == ours
        free = server.engine_call(lambda e: (e.blocks.num_free_blocks, e.slots.num_free_slots))
        assert free == (server.engine.blocks.num_usable_blocks, server.engine.config.max_slots)
    finally:
        server.stop()


def test_chunked_prefill_budget_splits_forwards(checkpoints):
    """max_prefill_tokens smaller than the prompts: the engine chunks internally; tokens unchanged."""
    path = checkpoints["qwen3-qknorm"]
    prompts = random_prompts([20, 45, 7], 512, seed=9)
    results = []
    for budget in (8192, 16, 5):
        server = start_server(path, max_prefill_tokens=budget)
        try:
            results.append(generate_via_grpc(server.stub(), prompts, 8))
        finally:
            server.stop()
    assert results[0] == results[1] == results[2]
    assert results[0][0] == hf_greedy(path, prompts[0], 8)


@pytest.mark.parametrize("budget", [8192, 6])
def test_repetition_penalty_counts_the_prompt_as_transformers_does(checkpoints, budget):
    """Greedy with a repetition penalty equals transformers' generate(repetition_penalty=...), which
    penalises prompt tokens as well as generated ones; also when the prompt is computed in chunks of 6
    tokens over several forwards (budget 6)."""
    path = checkpoints[CONFIG_NAMES[0]]
    engine = Engine(engine_config(path, max_prefill_tokens=budget))
    prompt = random_prompts([25], engine.model_config.vocab_size, seed=21)[0]
    prompt = prompt + prompt[:10]  # repeated tokens: the penalty has something to act on
    penalty = 3.0

    def greedy(params: SamplingParams) -> list[int]:
        seq = engine.alloc_sequence(len(prompt) + 20, params, StoppingCriteria(ignore_eos=True))
        got = [engine.prefill([PrefillItem(seq.seq_id, prompt)]).tokens[0].token_id]
        got += [engine.decode([seq.seq_id]).tokens[0].token_id for _ in range(11)]
        engine.release([seq.seq_id])
        return got

    ours = greedy(SamplingParams(repetition_penalty=penalty))
    assert ours == hf_greedy(path, prompt, 12, repetition_penalty=penalty)
    assert ours != greedy(SamplingParams())  # the penalty changed the output: the comparison has teeth
