"""The logits processors (engine/logits_processors.py) on the GPU: the same function on CUDA tensors as on the
CPU, captured in a CUDA graph, through the sampling kernels and the decode_step kernels (KernelSlotIO, whose
commits count the outputs with torch ops after the kernel); graph replay bit-identical to eager; rows without
processors untouched by rows with them; Verify equal to decode; refused steps rolled back.
Run on the H200: python -m pytest tests/gpu/test_sampling_extras_gpu.py -m gpu."""
from __future__ import annotations

import dataclasses
import pathlib

import numpy as np
import pytest
import torch

from engine import logits_processors as lp
from engine.api import PrefillItem, VerifyItem
from engine.checkpoint import write_checkpoint
from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling import SamplingParams, StoppingCriteria
from engine.state import SlotState

pytestmark = pytest.mark.gpu
VOCAB = 4096
EOS = 2  # write_checkpoint's eos_token_id
PLAIN = [SamplingParams(), SamplingParams(temperature=0.9, top_k=40, top_p=0.9, repetition_penalty=1.3, seed=7,
                                          top_logprobs=2)]
WITH_PROCESSORS = [
    SamplingParams(temperature=1.1, seed=9, min_p=0.05, presence_penalty=1.0, frequency_penalty=0.5,
                   logit_bias={5: 3.0, 77: -4.0}, repetition_penalty=1.2, top_k=50),
    SamplingParams(presence_penalty=1.5, logit_bias={EOS: 2.0}, top_logprobs=3),  # greedy
]
IGNORE_EOS = StoppingCriteria(ignore_eos=True)
MIN_TOKENS = StoppingCriteria(ignore_eos=True, min_tokens=6, stop_token_ids=frozenset({11, 12}))
HOLD_EOS = StoppingCriteria(ignore_eos=True, min_tokens=6)  # (no stop ids: a sequence here never ends early)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> pathlib.Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny") / "m", arch="qwen3", shape="tiny", seed=5,
                            dtype="bfloat16", vocab_size=VOCAB)


def gpu_engine(path, **kw) -> Engine:
    base = dict(model=str(path), device="cuda", num_kv_blocks=2048, max_seq_len=1024, max_slots=32, max_batch_size=32)
    base.update(kw)
    return Engine(EngineConfig(**base))


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def test_processors_on_cuda_tensors_match_the_cpu_and_replay_from_a_graph():
    """apply() on CUDA tensors equals apply() on the CPU (same masks, values to fp32 rounding); sample() through
    CudaOps, captured in a CUDA graph and replayed, gives what it gives eagerly, and greedy rows take the argmax of
    the processed logits; the logprobs of processed rows are the raw logits' log-softmax."""
    from engine.cuda.ops import CudaOps

    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(1)
    params = [PLAIN[0], PLAIN[1], *WITH_PROCESSORS, SamplingParams(min_p=0.2, temperature=0.7, seed=3)]
    stoppings = [IGNORE_EOS, IGNORE_EOS, MIN_TOKENS, MIN_TOKENS, IGNORE_EOS]
    states = {d: SlotState(8, 2, VOCAB, d, eos_token_ids=(EOS,), max_seq_len=1024) for d in (torch.device("cpu"), dev)}
    histories = [torch.randint(0, 200, (12,), generator=g).tolist() for _ in params]
    for state in states.values():
        for slot, (p, s, h) in enumerate(zip(params, stoppings, histories)):
            state.assign(slot, [1], dataclasses.replace(p, seed=p.seed or slot), s)
            state.rebuild_seen(slot, h, 8, counts=True)
            here = state.seen.device
            state.start_output(torch.tensor([slot], device=here), torch.tensor([8], device=here))
    flags = 0
    for p, s in zip(params, stoppings):
        flags |= lp.flags_of(p, s)
    logits = torch.randn(len(params), VOCAB, generator=g) * 3
    out = {}
    for d, state in states.items():
        slots = torch.arange(len(params), device=d)
        position = torch.full((len(params),), 12, device=d)
        st = state.sampling_rows(slots, position)
        out[d] = lp.apply(logits.to(d), st, lp.ProcessorRows.gather(state, slots, position, flags))
    x_cpu, x_gpu = out[torch.device("cpu")][0], out[dev][0].cpu()
    assert torch.equal(torch.isinf(x_cpu), torch.isinf(x_gpu))
    finite = torch.isfinite(x_cpu)
    torch.testing.assert_close(x_gpu[finite], x_cpu[finite], rtol=1e-5, atol=1e-5)

    ops = CudaOps.create(dev, 1024)
    state = states[dev]
    slots = torch.arange(len(params), device=dev)
    position = torch.full((len(params),), 12, device=dev)
    logits_dev = logits.to(dev)

    def step():
        st = state.sampling_rows(slots, position)
        rows = lp.ProcessorRows.gather(state, slots, position, flags)
        return lp.sample(ops, logits_dev, st, 3, rows)

    eager = step()
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up on the side stream, as capture needs
        with torch.cuda.graph(graph, stream=stream):
            captured = step()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured.token_ids, eager.token_ids)
    assert torch.equal(captured.logprobs, eager.logprobs) and torch.equal(captured.top_ids, eager.top_ids)
    x = out[dev][0]
    greedy = [i for i, p in enumerate(params) if p.greedy]
    assert torch.equal(eager.token_ids[greedy], x[greedy].argmax(-1))
    raw = torch.log_softmax(logits_dev, -1)
    torch.testing.assert_close(eager.logprobs, raw.gather(1, eager.token_ids[:, None]).squeeze(1), rtol=1e-4,
                               atol=1e-4)


def workload(engine: Engine, seed: int = 0) -> list[tuple]:
    """Four sequences (two plain, two with processors) decoded 24 steps in batches that change (all, the plain
    two, the processed two), then two uniform Verify rounds of the processed two: every token and logprob."""
    ps = prompts([7, 30, 12, 65], seed)
    params = PLAIN + WITH_PROCESSORS
    stoppings = [IGNORE_EOS, IGNORE_EOS, HOLD_EOS, HOLD_EOS]
    ids = [engine.alloc_sequence(200, p, s).seq_id for p, s in zip(params, stoppings)]
    log = [(t.seq_id, t.token_id, t.logprob) for t in engine.prefill([PrefillItem(i, p) for i, p in
                                                                      zip(ids, ps)]).tokens]
    batches = [ids, ids[:2], ids[2:]]
    for step in range(24):
        for t in engine.decode(batches[step // 2 % 3]).tokens:
            log.append((step, t.seq_id, t.token_id, t.logprob, tuple(t.top_logprobs)))
    for _ in range(2):
        items = [VerifyItem(i, [5, 6, 7]) for i in ids[2:]]
        for r in engine.verify(items).results:
            log.append((r.seq_id, r.num_accepted, tuple((t.token_id, t.logprob) for t in r.tokens)))
    engine.release(ids)
    return log


def test_graph_replay_with_processors_is_bit_identical_to_eager(ckpt):
    graphs = gpu_engine(ckpt, capture_after=1, max_graphs=64)
    eager = gpu_engine(ckpt, cuda_graphs=False)
    a, b = workload(graphs), workload(eager)
    assert a == b
    s = graphs.runtime.dispatch.graphs.stats
    assert s.hits > 10 and s.captures >= 4, s


def test_rows_without_processors_are_untouched_on_gpu(ckpt):
    """Through the sampling kernels and graphs: plain rows give the same tokens, logprobs and alternatives
    whether the other rows of their batch use processors or not."""
    engine = gpu_engine(ckpt, capture_after=1)
    ps = prompts([9, 14, 6, 21], seed=2)

    def run(others: list[SamplingParams]) -> list[list[tuple]]:
        ids = [engine.alloc_sequence(100, p, IGNORE_EOS).seq_id for p in PLAIN + others]
        out = {i: [] for i in ids}
        for t in engine.prefill([PrefillItem(i, p) for i, p in zip(ids, ps)]).tokens:
            out[t.seq_id].append((t.token_id, t.logprob, tuple(t.top_logprobs)))
        for _ in range(20):
            for t in engine.decode(ids).tokens:
                out[t.seq_id].append((t.token_id, t.logprob, tuple(t.top_logprobs)))
        engine.release(ids)
        return [out[i] for i in ids]

    mixed = run(WITH_PROCESSORS)
    plain = run([SamplingParams(temperature=1.1, seed=9, top_k=50), SamplingParams(top_logprobs=3)])
    assert mixed[:2] == plain[:2] and mixed[2:] != plain[2:]


def test_verify_with_processors_emits_what_decode_draws_on_gpu(ckpt):
    """The uniform Verify step (graph captured, then replayed) with every processor: drafts taken from a decode
    run are all accepted and the same tokens come out; the output counts the verify commit keeps (torch ops after
    the verify_commit kernel) are the emitted tokens'."""
    engine = gpu_engine(ckpt, capture_after=1)
    params, prompt = WITH_PROCESSORS[0], [5, 6, 7, 8, 9]

    def start() -> tuple[int, list[int]]:
        sid = engine.alloc_sequence(80, params, HOLD_EOS).seq_id
        return sid, [engine.prefill([PrefillItem(sid, prompt)]).tokens[0].token_id]

    sid, ref = start()
    while len(ref) < 33:
        ref.append(engine.decode([sid]).tokens[0].token_id)
    engine.release([sid])
    sid, got = start()
    for _ in range(6):
        res = engine.verify([VerifyItem(sid, ref[len(got):len(got) + 4])]).results[0]
        assert res.num_accepted == 4
        got += [t.token_id for t in res.tokens]
    drafts = list(ref[len(got):len(got) + 4])
    drafts[1] = (drafts[1] + 1) % VOCAB
    res = engine.verify([VerifyItem(sid, drafts)]).results[0]
    got += [t.token_id for t in res.tokens]
    assert res.num_accepted == 1 and got == ref[:len(got)]
    assert engine.runtime.dispatch.graphs.stats.hits > 0
    seq = engine.sequences[sid]
    counts = engine.runtime.state.output_counts[seq.slot].long().cpu()
    assert torch.equal(counts, torch.bincount(torch.tensor(seq.token_ids[seq.prompt_len:]), minlength=VOCAB))
    engine.release([sid])


def test_a_stop_token_refusal_rolls_the_penalty_counts_back_on_gpu(ckpt, monkeypatch):
    """tests/pipeline_checks.py's refusal pattern with the penalties, on the kernels and the engine's streams."""
    import pipeline_checks

    monkeypatch.setattr(pipeline_checks, "SAMPLED", SamplingParams(
        temperature=0.9, top_k=40, repetition_penalty=1.3, top_logprobs=2, seed=5, frequency_penalty=0.8,
        presence_penalty=0.6, min_p=0.02))
    pipeline_checks.check_stop_token_refusal(lambda reference=False: gpu_engine(ckpt), VOCAB)


def token_mask(engine: Engine, allowed) -> np.ndarray:
    words = np.zeros(engine.runtime.state.token_mask.shape[1], dtype=np.uint32)
    for t in allowed:
        words[t // 32] |= np.uint32(1 << (t % 32))
    return words.view(np.int32)


def test_token_masks_hold_in_graphs_and_leave_other_rows_untouched_on_gpu(ckpt):
    """Structured output's token masks (Engine.set_token_mask) through the sampling kernels and replayed graphs:
    each masked row (greedy or sampled) draws only from its mask of that step, and the plain rows of the batch
    give what they give alone."""
    engine = gpu_engine(ckpt, capture_after=1)
    ps = prompts([9, 14, 6, 21], seed=3)
    g = torch.Generator().manual_seed(11)

    def run(masked: bool) -> tuple[list[list[int]], list[list[set]]]:
        params = PLAIN + ([SamplingParams(token_mask=True), SamplingParams(temperature=1.0, seed=3, token_mask=True)]
                          if masked else [SamplingParams(), SamplingParams(temperature=1.0, seed=3)])
        ids = [engine.alloc_sequence(100, p, IGNORE_EOS).seq_id for p in params]
        allowed: list[list[set]] = [[], []]

        def set_masks():
            for k, i in enumerate(ids[2:]):
                choice = set(torch.randint(0, VOCAB, (1 + 5 * k,), generator=g).tolist())
                allowed[k].append(choice)
                if masked:
                    engine.set_token_mask(i, token_mask(engine, choice))

        set_masks()
        out = {t.seq_id: [t.token_id] for t in engine.prefill([PrefillItem(i, p) for i, p in zip(ids, ps)]).tokens}
        for _ in range(24):
            set_masks()
            for t in engine.decode(ids).tokens:
                out[t.seq_id].append(t.token_id)
        engine.release(ids)
        return [out[i] for i in ids], allowed

    mixed, allowed = run(True)
    plain, _ = run(False)
    assert mixed[:2] == plain[:2]
    for k in range(2):
        assert all(tok in allowed[k][step] for step, tok in enumerate(mixed[2 + k])), k
    assert engine.runtime.dispatch.graphs.stats.hits > 10
