"""Verify: greedy match with KV rollback (over gRPC), and rejection sampling's distribution."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import alloc, engine_config, random_prompts
from engine.api import PrefillItem, VerifyItem
from engine.engine import Engine
from engine.checkpoint import write_checkpoint
from engine.sampling import SamplingParams, StoppingCriteria
from metrale.worker.v1 import worker_pb2 as pb
from oracle import hf_logits
from pipeline_checks import verify_as_decoded

GREEDY = pb.StoppingCriteria(max_new_tokens=40, ignore_eos=True)


def plain_decode(stub, prompt: list[int], n: int) -> list[int]:
    sid = alloc(stub, 128, stopping=GREEDY)
    toks = [stub.Prefill(pb.PrefillRequest(items=[pb.PrefillItem(sequence_id=sid, token_ids=prompt)])).tokens[0].token_id]
    while len(toks) < n:
        toks.append(stub.Decode(pb.DecodeRequest(sequence_ids=[sid])).tokens[0].token_id)
    stub.Release(pb.ReleaseRequest(sequence_ids=[sid]))
    return toks


def verify(stub, sid: int, drafts: list[int], probs: list[float] | None = None) -> pb.VerifyResult:
    item = pb.VerifyItem(sequence_id=sid, draft_token_ids=drafts, draft_probs=probs or [])
    return stub.Verify(pb.VerifyRequest(items=[item])).results[0]


def test_correct_drafts_are_all_accepted(stub):
    prompt = random_prompts([11], 512, seed=3)[0]
    ref = plain_decode(stub, prompt, 25)
    sid = alloc(stub, 128, stopping=GREEDY)
    got = [stub.Prefill(pb.PrefillRequest(items=[pb.PrefillItem(sequence_id=sid, token_ids=prompt)])).tokens[0].token_id]
    while len(got) < 25:
        drafts = ref[len(got):len(got) + 4]
        res = verify(stub, sid, drafts)
        assert res.num_accepted == len(drafts)
        got += [t.token_id for t in res.tokens]
        assert [t.token_id for t in res.tokens[:-1]] == drafts
    assert got[:25] == ref
    stub.Release(pb.ReleaseRequest(sequence_ids=[sid]))


@pytest.mark.parametrize("j", [0, 1, 3])
def test_wrong_draft_at_j_accepts_j_and_rolls_back(stub, j):
    prompt = random_prompts([13], 512, seed=4)[0]
    ref = plain_decode(stub, prompt, 20)
    sid = alloc(stub, 128, stopping=GREEDY)
    got = [stub.Prefill(pb.PrefillRequest(items=[pb.PrefillItem(sequence_id=sid, token_ids=prompt)])).tokens[0].token_id]
    drafts = ref[1:6]
    drafts[j] = (drafts[j] + 1) % 512
    res = verify(stub, sid, drafts)
    assert res.num_accepted == j
    got += [t.token_id for t in res.tokens]
    assert got == ref[:len(got)]  # the correction token is the true greedy token
    assert res.tokens[-1].seq_len == len(prompt) + len(got)
    # Decoding continues exactly as if the wrong drafts had never been seen (their KV is rolled back).
    while len(got) < 20:
        got.append(stub.Decode(pb.DecodeRequest(sequence_ids=[sid])).tokens[0].token_id)
    assert got == ref
    stub.Release(pb.ReleaseRequest(sequence_ids=[sid]))


def test_verify_batch_mixes_lengths_and_empty_drafts(stub):
    prompts = random_prompts([5, 9, 14], 512, seed=8)
    refs = [plain_decode(stub, p, 12) for p in prompts]
    ids = [alloc(stub, 128, stopping=GREEDY) for _ in prompts]
    resp = stub.Prefill(pb.PrefillRequest(items=[pb.PrefillItem(sequence_id=i, token_ids=p) for i, p in zip(ids, prompts)]))
    got = [[t.token_id] for t in resp.tokens]
    drafts = [refs[0][1:4], [], refs[2][1:3] + [7]]
    resp = stub.Verify(pb.VerifyRequest(items=[pb.VerifyItem(sequence_id=i, draft_token_ids=d) for i, d in zip(ids, drafts)]))
    for g, r in zip(got, resp.results):
        g += [t.token_id for t in r.tokens]
    assert [r.num_accepted for r in resp.results][:2] == [3, 0]
    while min(len(g) for g in got) < 12:
        resp = stub.Decode(pb.DecodeRequest(sequence_ids=ids))
        for g, t in zip(got, resp.tokens):
            g.append(t.token_id)
    assert [g[:12] for g in got] == refs
    stub.Release(pb.ReleaseRequest(sequence_ids=ids))


# -----------------------------------------------------------------------------------------------
# Rejection sampling keeps the target distribution.

VOCAB = 16
TRIALS = 4096
TEMPERATURE = 2.0
# Chi-square goodness of fit over the 16 tokens (15 degrees of freedom) at significance 0.001.
CHI2_CRITICAL_15DOF_P001 = 37.70


def chi_square(counts: np.ndarray, expected: np.ndarray) -> float:
    mask = expected > 0
    assert counts[~mask].sum() == 0, "a token with zero target probability was emitted"
    return float((((counts - expected) ** 2)[mask] / expected[mask]).sum())


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("v16"), arch="llama", shape="tiny", seed=21, vocab_size=VOCAB)


@pytest.mark.parametrize("with_probs", [True, False], ids=["draft-probs", "deterministic-drafts"])
def test_rejection_sampling_matches_target_distribution(small_vocab_model, with_probs):
    """Over many seeds, the first token out of Verify (an accepted draft or the correction) is
    distributed as the target model's distribution (from transformers), whatever the drafts."""
    engine = Engine(engine_config(small_vocab_model, max_slots=128, num_kv_blocks=600))
    prompt = [3, 1, 4, 1, 5]
    rng = np.random.default_rng(0)
    q = rng.dirichlet(np.ones(VOCAB))  # the draft distribution
    # Target distribution after prompt + t0, for each possible first token t0 (transformers).
    target = {t0: torch.softmax(hf_logits(small_vocab_model, prompt + [t0])[-1] / TEMPERATURE, -1).double().numpy()
              for t0 in range(VOCAB)}
    counts, expected = np.zeros(VOCAB), np.zeros(VOCAB)
    for start in range(0, TRIALS, 128):
        ids = [engine.alloc_sequence(16, SamplingParams(temperature=TEMPERATURE, seed=1000 + start + i),
                                     StoppingCriteria(ignore_eos=True)).seq_id for i in range(128)]
        first = engine.prefill([PrefillItem(i, prompt) for i in ids]).tokens
        drafts = rng.choice(VOCAB, size=len(ids), p=q) if with_probs else np.full(len(ids), 5)
        items = [VerifyItem(i, [int(d)], q.tolist() if with_probs else None) for i, d in zip(ids, drafts)]
        for t0, res in zip(first, engine.verify(items).results):
            counts[res.tokens[0].token_id] += 1
            expected += target[t0.token_id]
        engine.release(ids)
    stat = chi_square(counts, expected)
    assert stat < CHI2_CRITICAL_15DOF_P001, f"chi2={stat:.1f}: counts {counts} vs expected {expected.round(1)}"
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks


@pytest.mark.parametrize("mixed", [False, True], ids=["uniform-step", "general-path"])
def test_sampled_verify_emits_exactly_what_decode_draws(small_vocab_model, mixed):
    """Drafts without distributions are accepted while they equal the token decode would draw at that
    position (same seed, position, top-k/top-p and repetition penalty), so a seeded sequence emits the
    same tokens whether it decodes or verifies; in a uniform batch (one CUDA-graph-able step) and in a
    batch whose draft lengths differ (the general path)."""
    engine = Engine(engine_config(small_vocab_model))
    params = SamplingParams(temperature=1.5, top_k=12, top_p=0.95, seed=99, repetition_penalty=1.2)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    total = 16

    ref, sid, other = verify_as_decoded(engine, params, StoppingCriteria(ignore_eos=True), prompt, total, VOCAB,
                                        mixed)
    assert len(set(ref)) > 3  # actually sampled
    engine.release([sid, other])
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks
