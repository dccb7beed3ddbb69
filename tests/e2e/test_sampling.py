"""Sampling: the counter-based RNG, the logits processing against transformers' warpers, the draw's
distribution, and seeds that do not depend on the batch (over gRPC)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import alloc, random_prompts
from engine import sampling
from engine.sampling import SamplingTensors
from metrale.worker.v1 import worker_pb2 as pb


def py_hash(seed: int, position: int, stream: int, index: int) -> int:
    """The RNG's hash written independently, on Python ints with explicit uint32 wrap-around."""
    def mix(x):
        for _ in range(2):
            x = (((x >> 16) ^ x) * 0x45D9F3B) % 2**32
        return (x >> 16) ^ x
    h = mix((index + stream * 0x9E3779B9) % 2**32)
    h = mix(h ^ (position % 2**32))
    h = mix(h ^ (seed % 2**32))
    return mix(h ^ (seed >> 32))


def test_counter_hash_matches_independent_uint32_implementation():
    rng = np.random.default_rng(1)
    for _ in range(200):
        seed, pos, idx = int(rng.integers(0, 2**64, dtype=np.uint64)), int(rng.integers(0, 2**31)), int(rng.integers(0, 2**20))
        stream = int(rng.integers(0, 2))
        got = sampling.counter_hash(torch.tensor(sampling.seed_as_int64(seed)), torch.tensor(pos), stream,
                                    torch.tensor(idx))
        assert int(got) == py_hash(seed, pos, stream, idx)


def test_uniform_is_open_interval_and_uniform():
    seeds = torch.arange(64, dtype=torch.int64)[:, None]
    u = sampling.uniform(seeds, torch.tensor(7), 0, torch.arange(4096)[None, :])
    assert float(u.min()) > 0 and float(u.max()) < 1
    hist = torch.histc(u.flatten(), bins=16, min=0, max=1)
    expected = u.numel() / 16
    assert float(((hist - expected) ** 2 / expected).sum()) < 37.70  # chi2, 15 dof, p=0.001


def rows(n: int, vocab: int, **kw) -> SamplingTensors:
    def full(value, dtype):
        return torch.full((n,), value, dtype=dtype)
    return SamplingTensors(
        temperature=kw.get("temperature", full(1.0, torch.float32)), top_k=kw.get("top_k", full(0, torch.int64)),
        top_p=kw.get("top_p", full(1.0, torch.float32)), seed=kw.get("seed", torch.arange(n, dtype=torch.int64)),
        repetition_penalty=kw.get("repetition_penalty", full(1.0, torch.float32)),
        seen=kw.get("seen", torch.zeros(n, vocab, dtype=torch.bool)), position=kw.get("position", full(5, torch.int64)))


@pytest.mark.parametrize("temperature,top_k,top_p,penalty", [
    (0.7, 0, 1.0, 1.0), (1.0, 5, 1.0, 1.0), (1.3, 0, 0.8, 1.0), (0.9, 20, 0.5, 1.0), (1.0, 0, 1.0, 1.3),
    (0.6, 8, 0.9, 0.8)])
def test_processing_matches_transformers_warpers(temperature, top_k, top_p, penalty):
    from transformers.generation.logits_process import (RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)
    vocab, n = 300, 8
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(n, vocab, generator=g) * 3
    history = torch.randint(0, vocab, (n, 12), generator=g)
    seen = torch.zeros(n, vocab, dtype=torch.bool).scatter(1, history, True)
    st = rows(n, vocab, temperature=torch.full((n,), temperature), top_k=torch.full((n,), top_k),
              top_p=torch.full((n,), top_p), repetition_penalty=torch.full((n,), penalty), seen=seen)
    ours = sampling.target_logprobs(logits, st)
    ref = logits.clone()
    if penalty != 1.0:
        ref = RepetitionPenaltyLogitsProcessor(penalty)(history, ref)
    ref = TemperatureLogitsWarper(temperature)(history, ref)
    if top_k:
        ref = TopKLogitsWarper(top_k)(history, ref)
    if top_p < 1.0:
        ref = TopPLogitsWarper(top_p)(history, ref)
    ref = torch.log_softmax(ref, -1)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref)), "kept token sets differ"
    finite = torch.isfinite(ref)
    assert torch.allclose(ours[finite], ref[finite], atol=1e-5)


def test_greedy_rows_are_argmax_of_penalized_logits():
    logits = torch.tensor([[1.0, 3.0, 2.5, -1.0]])
    seen = torch.tensor([[False, True, False, False]])
    st = rows(1, 4, temperature=torch.zeros(1), repetition_penalty=torch.full((1,), 1.5), seen=seen)
    assert int(sampling.sample(logits, st).token_ids[0]) == 2  # 3.0 / 1.5 = 2.0 < 2.5


def test_draw_follows_the_distribution():
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    n = 20000
    st = rows(n, 5, seed=torch.full((n,), 99), position=torch.arange(n))
    tokens = sampling.draw(torch.log(p).expand(n, 5), st)
    counts = torch.bincount(tokens, minlength=5).double()
    stat = float(((counts - n * p) ** 2 / (n * p)).sum())
    assert stat < 18.47  # chi2, 4 dof, p=0.001


def test_same_seed_same_tokens_alone_or_in_any_batch(server):
    stub = server.stub()
    params = pb.SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=1234, repetition_penalty=1.1)
    stopping = pb.StoppingCriteria(max_new_tokens=20, ignore_eos=True)
    prompt = random_prompts([10], 512, seed=1)[0]

    def run(batch_prompts: list[list[int]], others: list[pb.SamplingParams], extra_allocs: int) -> list[int]:
        junk = [alloc(stub, 32) for _ in range(extra_allocs)]  # move our sequence to another slot
        ids = [alloc(stub, 64, sampling=params, stopping=stopping)]
        ids += [alloc(stub, 64, sampling=o, stopping=stopping) for o in others]
        resp = stub.Prefill(pb.PrefillRequest(items=[pb.PrefillItem(sequence_id=i, token_ids=p)
                                                     for i, p in zip(ids, [prompt] + batch_prompts)]))
        toks = [resp.tokens[0].token_id]
        while len(toks) < 20:
            toks.append(stub.Decode(pb.DecodeRequest(sequence_ids=ids[::-1])).tokens[-1].token_id)
        stub.Release(pb.ReleaseRequest(sequence_ids=ids + junk))
        return toks

    alone = run([], [], 0)
    others = [pb.SamplingParams(temperature=1.0, seed=s) for s in range(5)] + [pb.SamplingParams()]
    batched = run(random_prompts([3, 7, 20, 4, 9, 15], 512, seed=2), others, 3)
    assert alone == batched
    assert len(set(alone)) > 3  # actually sampled, not a constant
    different_seed = pb.SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=4321, repetition_penalty=1.1)
    params = different_seed
    assert run([], [], 0) != alone
