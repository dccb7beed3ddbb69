"""The logits processors (engine/logits_processors.py): min_tokens, logit_bias, frequency / presence penalties and
min_p, on CPU.

Each processor against a float64 numpy implementation written here from vLLM's documented sampler order
(vllm/v1/sample/sampler.py: min_tokens and logit_bias, then the repetition, frequency and presence penalties,
then temperature and min_p); greedy generations over real gRPC against transformers with the same formulas;
rows without processors untouched by rows with them; Verify equal to decode step by step; counts rolled back
with refused steps; bad values refused with INVALID_ARGUMENT."""
from __future__ import annotations

import collections
import dataclasses

import grpc
import numpy as np
import pytest
import torch

import pipeline_checks
from conftest import alloc, engine_config, random_prompts
from engine import logits_processors as lp
from engine.api import PrefillItem
from engine.checkpoint import write_checkpoint
from engine.engine import Engine
from engine.errors import FailedPrecondition, InvalidArgument
from engine.sampling import SamplingParams, StoppingCriteria
from engine.sequence import FinishReason
from engine.state import SlotState
from metrale.worker.v1 import worker_pb2 as pb
from oracle import hf_logits

VOCAB = 512  # the tiny checkpoints'
EOS = 2  # their eos_token_id


# ---------------------------------------------------------------------------------------------
# Each processor against an independent implementation of vLLM's formulas


def vllm_reference(logits: np.ndarray, prompt: list[int], output: list[int], params: SamplingParams,
                   stopping: StoppingCriteria, eos: list[int]) -> np.ndarray:
    """One row's logits after vLLM's processors, in float64, before temperature (min_p judged on softmax(x / T),
    as vLLM applies it after temperature; masked tokens are -inf)."""
    x = logits.astype(np.float64).copy()
    if len(output) < stopping.min_tokens:  # MinTokensLogitsProcessor: stop ids and EOS
        for t in set(stopping.stop_token_ids) | set(eos):
            x[t] = -np.inf
    for t, b in params.logit_bias:  # LogitBiasLogitsProcessor
        x[t] += b
    r = params.repetition_penalty  # apply_penalties: repetition over prompt and output ...
    for t in set(prompt) | set(output):
        x[t] = x[t] / r if x[t] > 0 else x[t] * r
    counts = collections.Counter(output)  # ... then frequency and presence over the output only
    for t, c in counts.items():
        x[t] -= params.frequency_penalty * c
        x[t] -= params.presence_penalty
    if params.min_p and params.temperature > 0:  # MinPLogitsProcessor, after temperature
        z = x / params.temperature
        p = np.exp(z - z[np.isfinite(z)].max())
        p /= p.sum()
        x[p < params.min_p * p.max()] = -np.inf
    return x


ROWS = [  # (sampling, stopping, prompt length, output length); vocabulary 300, EOS ids 2 and 7
    (SamplingParams(temperature=0.8, repetition_penalty=1.3, seed=1), StoppingCriteria(), 6, 5),  # no processor
    (SamplingParams(logit_bias={3: 5.0, 250: -7.5, 17: 0.25}), StoppingCriteria(), 5, 3),
    (SamplingParams(temperature=1.0), StoppingCriteria(min_tokens=6, stop_token_ids=frozenset({9, 40})), 4, 2),
    (SamplingParams(temperature=1.0), StoppingCriteria(min_tokens=3, stop_token_ids=frozenset({9})), 4, 3),  # past
    (SamplingParams(frequency_penalty=0.7, presence_penalty=1.1), StoppingCriteria(), 7, 9),
    (SamplingParams(frequency_penalty=-1.5, presence_penalty=-0.4, temperature=0.5), StoppingCriteria(), 3, 8),
    (SamplingParams(min_p=0.05, temperature=0.7), StoppingCriteria(), 5, 4),
    (SamplingParams(min_p=0.3, temperature=1.9), StoppingCriteria(), 5, 0),
    (SamplingParams(min_p=0.5), StoppingCriteria(), 5, 4),  # greedy: min_p is moot
    (SamplingParams(temperature=1.2, repetition_penalty=1.4, min_p=0.02, frequency_penalty=0.9, presence_penalty=0.3,
                    logit_bias={5: 3.0, 9: -2.0}),
     StoppingCriteria(min_tokens=12, stop_token_ids=frozenset({5, 11})), 8, 10),
    (SamplingParams(temperature=0.6, repetition_penalty=0.8, top_k=5), StoppingCriteria(), 9, 2),  # no processor
]


SeqView = collections.namedtuple("SeqView", "sampling stopping")


def state_with_rows(vocab: int, eos: tuple[int, ...], g: torch.Generator):
    """A SlotState holding ROWS (slot i = row i, with random histories), and their histories."""
    state = SlotState(len(ROWS) + 2, 4, vocab, torch.device("cpu"), eos_token_ids=eos, max_seq_len=512)
    histories = []
    for slot, (params, stopping, n_prompt, n_out) in enumerate(ROWS):
        tokens = torch.randint(0, 60, (n_prompt + n_out,), generator=g).tolist()  # repeats are likely
        state.assign(slot, [1], dataclasses.replace(params, seed=slot), stopping)
        state.rebuild_seen(slot, tokens, n_prompt, counts=True)
        state.start_output(torch.tensor([slot]), torch.tensor([n_prompt]))
        histories.append((tokens[:n_prompt], tokens[n_prompt:]))
    return state, histories


def test_each_processor_matches_vllm_formulas_and_other_rows_pass_untouched():
    vocab, eos = 300, (2, 7)
    g = torch.Generator().manual_seed(3)
    state, histories = state_with_rows(vocab, eos, g)
    logits = torch.randn(len(ROWS), vocab, generator=g) * 4
    # Make the interesting tokens likely, so the masks and biases change what is sampled.
    logits[:, :60] += 2.0
    slots = torch.arange(len(ROWS))
    position = torch.tensor([len(p) + len(o) for p, o in histories])
    st = state.sampling_rows(slots, position)
    flags = 0
    for params, stopping, _, _ in ROWS:
        flags |= lp.flags_of(params, stopping)
    assert flags == lp.MIN_TOKENS | lp.LOGIT_BIAS | lp.PENALTIES | lp.MIN_P | lp.REPETITION
    rows = lp.ProcessorRows.gather(state, slots, position, flags)
    before = logits.clone()
    x, st_x = lp.apply(logits, st, rows)
    assert torch.equal(logits, before), "apply() changed its input"
    for i, (params, stopping, _, _) in enumerate(ROWS):
        prompt, output = histories[i]
        if not lp.flags_of(params, stopping):
            assert torch.equal(x[i], logits[i]), f"row {i} uses no processor but changed"
            assert float(st_x.repetition_penalty[i]) == pytest.approx(params.repetition_penalty)
            continue
        want = vllm_reference(logits[i].numpy(), prompt, output, params, stopping, list(eos))
        got = x[i].double().numpy()
        assert np.array_equal(np.isinf(got), np.isinf(want)), f"row {i}: masked tokens differ"
        finite = np.isfinite(want)
        np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-5, err_msg=f"row {i}")
        assert float(st_x.repetition_penalty[i]) == 1.0  # applied above, in vLLM's place
    # The masks did something: the early min_tokens row lost its stop ids and EOS, min_p rows lost tokens.
    assert torch.isinf(x[2, [9, 40, 2, 7]]).all() and not torch.isinf(x[3]).any()
    assert int(torch.isinf(x[6]).sum()) > vocab // 2 and not torch.isinf(x[8]).any()


def test_processed_rows_report_raw_logprobs_and_sample_from_processed_logits():
    """vLLM's default logprobs (raw_logprobs): the chosen token's log-softmax of the raw logits, and the raw top
    alternatives; the token itself comes from the processed distribution."""
    from engine.ops.torch_ops import TorchOps

    vocab = 300
    g = torch.Generator().manual_seed(5)
    state, histories = state_with_rows(vocab, (2, 7), g)
    logits = torch.randn(len(ROWS), vocab, generator=g)
    slots = torch.arange(len(ROWS))
    position = torch.tensor([len(p) + len(o) for p, o in histories])
    st = state.sampling_rows(slots, position)
    rows = lp.ProcessorRows.gather(state, slots, position, lp.MIN_TOKENS | lp.LOGIT_BIAS | lp.PENALTIES | lp.MIN_P
                                   | lp.REPETITION)
    out = lp.sample(TorchOps(), logits, st, 4, rows)
    assert rows.flags == lp.batch_flags(SeqView(p, s) for p, s, _, _ in ROWS)
    raw = torch.log_softmax(logits, -1)
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))
    torch.testing.assert_close(out.top_logprobs, torch.topk(raw, 4).values)
    assert torch.equal(out.top_ids, torch.topk(raw, 4).indices)
    x, st_x = lp.apply(logits, st, rows)
    plain = TorchOps().sample(x, st_x, 0)
    assert torch.equal(out.token_ids, plain.token_ids)
    assert out.token_ids[1] == 3  # +5 on token 3 of a greedy row with unit-variance logits


def test_flags_and_validation():
    assert lp.flags_of(SamplingParams(), StoppingCriteria()) == 0
    assert lp.flags_of(SamplingParams(min_p=0.2), StoppingCriteria()) == 0  # greedy: moot
    assert lp.flags_of(SamplingParams(repetition_penalty=1.2), StoppingCriteria()) == 0  # the kernel's own
    assert lp.flags_of(SamplingParams(presence_penalty=0.1, repetition_penalty=1.2), StoppingCriteria()) \
        == lp.PENALTIES | lp.REPETITION
    assert lp.flags_of(SamplingParams(), StoppingCriteria(min_tokens=2)) == lp.MIN_TOKENS
    assert SamplingParams(logit_bias={9: 1.0, 3: -1.0}).logit_bias == ((3, -1.0), (9, 1.0))
    bad_sampling = {
        "min_p must be in [0, 1]": SamplingParams(min_p=1.5),
        "frequency_penalty must be in [-2, 2]": SamplingParams(frequency_penalty=2.5),
        "presence_penalty must be in [-2, 2]": SamplingParams(presence_penalty=float("nan")),
        "at most 64": SamplingParams(logit_bias={i: 1.0 for i in range(65)}),
        "outside the vocabulary": SamplingParams(logit_bias={VOCAB: 1.0}),
        "[-100, 100]": SamplingParams(logit_bias={4: 100.5}),
    }
    for words, params in bad_sampling.items():
        with pytest.raises(InvalidArgument) as e:
            params.validate(VOCAB, 20)
        assert words in str(e.value)
    SamplingParams(min_p=1.0, frequency_penalty=-2.0, presence_penalty=2.0,
                   logit_bias={i: 100.0 - i for i in range(64)}).validate(VOCAB, 20)
    bad_stopping = {
        "min_tokens (5) must be <= max_new_tokens (4)": StoppingCriteria(max_new_tokens=4, min_tokens=5),
        "stop_token_ids may hold at most 64 ids": StoppingCriteria(min_tokens=1, stop_token_ids=frozenset(range(65))),
    }
    for words, stopping in bad_stopping.items():
        with pytest.raises(InvalidArgument) as e:
            stopping.validate(VOCAB)
        assert words in str(e.value)
    StoppingCriteria(stop_token_ids=frozenset(range(65))).validate(VOCAB)  # many stop ids: fine without min_tokens


def test_output_counts_are_int16_while_a_sequence_cannot_overflow_them():
    dev = torch.device("cpu")
    assert SlotState(2, 1, 8, dev, max_seq_len=32768).output_counts.dtype == torch.int16
    assert SlotState(2, 1, 8, dev, max_seq_len=32769).output_counts.dtype == torch.int32
    assert SlotState(2, 1, 8, dev).output_counts.dtype == torch.int32  # unknown bound


# ---------------------------------------------------------------------------------------------
# Over real gRPC, greedy, against transformers with the same formulas


def grpc_generate(stub, prompt: list[int], sampling: pb.SamplingParams | None = None,
                  stopping: pb.StoppingCriteria | None = None, n: int = 10) -> list[pb.Token]:
    stopping = stopping or pb.StoppingCriteria(max_new_tokens=n, ignore_eos=True)
    sid = alloc(stub, len(prompt) + (stopping.max_new_tokens or n) + 1, sampling=sampling, stopping=stopping)
    tokens = list(stub.Prefill(pb.PrefillRequest(items=[pb.PrefillItem(sequence_id=sid, token_ids=prompt)])).tokens)
    while not tokens[-1].finish_reason:
        tokens += stub.Decode(pb.DecodeRequest(sequence_ids=[sid])).tokens
    stub.Release(pb.ReleaseRequest(sequence_ids=[sid]))
    return tokens


def hf_greedy_processed(model, prompt: list[int], n: int, bias: dict[int, float] | None = None,
                        frequency: float = 0.0, presence: float = 0.0, banned_until: tuple[int, set] = (0, set())
                        ) -> list[int]:
    """Greedy decoding with transformers' logits and vLLM's formulas written here: logit_bias, then
    logit -= frequency * count + presence * (count > 0) over the output tokens; tokens in banned_until[1] are
    -inf while fewer than banned_until[0] tokens are out (min_tokens)."""
    out: list[int] = []
    for _ in range(n):
        x = hf_logits(model, prompt + out)[-1].double()
        if len(out) < banned_until[0]:
            x[list(banned_until[1])] = float("-inf")
        for t, b in (bias or {}).items():
            x[t] += b
        for t, c in collections.Counter(out).items():
            x[t] -= frequency * c + presence
        out.append(int(torch.argmax(x)))
    return out


def test_logit_bias_forces_and_bans_tokens_and_logprobs_stay_raw(server, stub, tiny_model):
    prompt = random_prompts([7], VOCAB, seed=21)[0]
    base = [t.token_id for t in grpc_generate(stub, prompt, n=6)]
    forced = grpc_generate(stub, prompt, pb.SamplingParams(logit_bias={77: 100.0}, top_logprobs=3), n=6)
    assert [t.token_id for t in forced] == [77] * 6 != base
    for i, t in enumerate(forced):  # the logprobs of the raw logits (vLLM's default), not of the biased ones
        raw = torch.log_softmax(hf_logits(tiny_model, prompt + [77] * i)[-1], -1)
        assert t.logprob == pytest.approx(float(raw[77]), abs=1e-4) and t.logprob < -1.0
        top = torch.topk(raw, 3)
        assert [a.token_id for a in t.top_logprobs] == top.indices.tolist()
    banned = {base[0]: -100.0}
    got = [t.token_id for t in grpc_generate(stub, prompt, pb.SamplingParams(logit_bias=banned), n=6)]
    assert got == hf_greedy_processed(tiny_model, prompt, 6, bias=banned) and base[0] not in got


def test_presence_and_frequency_penalties_stop_a_greedy_loop(server, stub, tiny_model):
    prompt = random_prompts([5], VOCAB, seed=2)[0]
    base = [t.token_id for t in grpc_generate(stub, prompt, n=12)]
    repeated = collections.Counter(base).most_common(1)[0]
    assert repeated[1] >= 3, f"the greedy baseline should loop: {base}"
    for presence, frequency in [(2.0, 0.0), (0.0, 1.5), (1.0, 0.5)]:
        sampling = pb.SamplingParams(presence_penalty=presence, frequency_penalty=frequency)
        got = [t.token_id for t in grpc_generate(stub, prompt, sampling, n=12)]
        assert got == hf_greedy_processed(tiny_model, prompt, 12, frequency=frequency, presence=presence)
        assert got.count(repeated[0]) < repeated[1], (presence, frequency, got)
    # Prompt tokens do not count: a penalty on a token that is only in the prompt changes nothing at first.
    sampling = pb.SamplingParams(presence_penalty=2.0)
    assert grpc_generate(stub, prompt, sampling, n=1)[0].token_id == base[0]


def test_min_tokens_masks_eos_and_stop_tokens(server, stub, tiny_model):
    prompt = random_prompts([6], VOCAB, seed=23)[0]
    eos_first = pb.SamplingParams(logit_bias={EOS: 100.0})  # EOS would be sampled at once ...
    assert len(grpc_generate(stub, prompt, eos_first, pb.StoppingCriteria(max_new_tokens=10))) == 1
    got = grpc_generate(stub, prompt, eos_first, pb.StoppingCriteria(max_new_tokens=10, min_tokens=4))
    assert [t.finish_reason for t in got] == [0] * 4 + [pb.FINISH_REASON_EOS]  # ... and is after min_tokens
    assert [t.token_id for t in got[:4]] == hf_greedy_processed(tiny_model, prompt, 4, banned_until=(4, {EOS}))
    # stop_token_ids too; and EOS (here favoured, but below the stop token) stays masked under ignore_eos, as
    # vLLM does.
    favoured = pb.SamplingParams(logit_bias={EOS: 30.0, 19: 50.0})
    got = grpc_generate(stub, prompt, favoured, pb.StoppingCriteria(max_new_tokens=10, min_tokens=3, ignore_eos=True,
                                                                     stop_token_ids=[19]))
    ids = [t.token_id for t in got]
    assert ids[:3] == hf_greedy_processed(tiny_model, prompt, 3, banned_until=(3, {EOS, 19})) and ids[3:] == [19]
    assert got[-1].finish_reason == pb.FINISH_REASON_STOP_TOKEN


BAD_OVER_GRPC = {
    "min_p": (dict(min_p=1.5), None),
    "frequency_penalty": (dict(frequency_penalty=-3.0), None),
    "presence_penalty": (dict(presence_penalty=2.5), None),
    "logit_bias": (dict(logit_bias={i: 1.0 for i in range(65)}), None),
    "outside the vocabulary": (dict(logit_bias={VOCAB + 3: 1.0}), None),
    "[-100, 100]": (dict(logit_bias={3: -250.0}), None),
    "min_tokens": (None, dict(max_new_tokens=2, min_tokens=3)),
}


@pytest.mark.parametrize("words", sorted(BAD_OVER_GRPC))
def test_bad_values_are_invalid_argument_over_grpc(stub, words):
    sampling, stopping = BAD_OVER_GRPC[words]
    with pytest.raises(grpc.RpcError) as e:
        alloc(stub, 16, sampling=pb.SamplingParams(**(sampling or {})),
              stopping=pb.StoppingCriteria(**(stopping or {})))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in e.value.details(), e.value.details()


# ---------------------------------------------------------------------------------------------
# Batches, graphs, Verify and refused steps (the engine on CPU)

PLAIN = [SamplingParams(), SamplingParams(temperature=0.9, top_k=40, top_p=0.9, repetition_penalty=1.3, seed=7,
                                          top_logprobs=2)]
WITH_PROCESSORS = SamplingParams(temperature=1.1, seed=9, min_p=0.05, presence_penalty=1.0, frequency_penalty=0.5,
                                 logit_bias={5: 3.0}, repetition_penalty=1.2)


def decode_rows(engine: Engine, params: list[SamplingParams], prompts: list[list[int]], steps: int,
                stoppings: list[StoppingCriteria] | None = None) -> list[list[tuple]]:
    """Each sequence's (token, logprob, top alternatives), prefill then `steps` decode steps of the batch."""
    stoppings = stoppings or [StoppingCriteria(ignore_eos=True)] * len(params)
    ids = [engine.alloc_sequence(64, p, s).seq_id for p, s in zip(params, stoppings)]
    out = [[] for _ in ids]
    for _ in range(steps + 1):
        res = engine.prefill([PrefillItem(i, p) for i, p in zip(ids, prompts)]) if not out[0] else engine.decode(ids)
        for row, t in zip(out, res.tokens):
            row.append((t.token_id, t.logprob, tuple(t.top_logprobs)))
    engine.release(ids)
    return out


@pytest.mark.parametrize("graphs", [False, True])
def test_rows_without_processors_sample_what_they_sample_without_them(tiny_model, graphs):
    """Greedy and seeded rows give the same tokens, logprobs and alternatives whether the third row of their
    batch uses every processor or none (also through graphs). A batch without processors keeps the graph key it
    has without them (slot vector, top-logprob count); one with them adds their flags."""
    from engine.cuda.graphs import GraphCache
    from conftest import ExecBackend

    engine = Engine(engine_config(tiny_model, fallback_graphs=False))
    if graphs:
        engine.runtime.dispatch.graphs = GraphCache(ExecBackend(), max_graphs=8, capture_after=2)
    prompts = random_prompts([6, 9, 5], VOCAB, seed=31)
    alone = decode_rows(engine, PLAIN, prompts[:2], 8)
    mixed = decode_rows(engine, PLAIN + [WITH_PROCESSORS], prompts, 8,
                        [StoppingCriteria(ignore_eos=True)] * 2 + [StoppingCriteria(ignore_eos=True, min_tokens=4)])
    plain_third = decode_rows(engine, PLAIN + [SamplingParams(temperature=1.1, seed=9)], prompts, 8)
    assert mixed[:2] == plain_third[:2] and plain_third[2] != mixed[2]
    # Alone (a prefill of two prompts, whose padded shape differs) the logprobs may differ in the last bits.
    assert [[t for t, _, _ in row] for row in mixed[:2]] == [[t for t, _, _ in row] for row in alone]
    if graphs:
        stats = engine.info().graph_cache
        assert stats.captures >= 3 and stats.hits > 0
    ids = [engine.alloc_sequence(16, p, StoppingCriteria(ignore_eos=True)).seq_id for p in PLAIN + [WITH_PROCESSORS]]
    engine.prefill([PrefillItem(i, p) for i, p in zip(ids, prompts)])
    engine.decode(ids[:2])
    plan = engine.decoder._last_plan
    slots = tuple(sorted(engine.sequences[i].slot for i in ids))
    assert plan.processors == 0 and plan.decode_key == ("decode", slots[:2], engine.config.max_top_logprobs)
    engine.decode(ids)
    plan = engine.decoder._last_plan
    flags = lp.PENALTIES | lp.MIN_P | lp.LOGIT_BIAS | lp.REPETITION
    assert plan.processors == flags and plan.decode_key == ("decode", slots, engine.config.max_top_logprobs, flags)
    engine.release(ids)


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("v32"), arch="llama", shape="tiny", seed=22, vocab_size=32)


@pytest.mark.parametrize("greedy", [False, True], ids=["sampled", "greedy"])
@pytest.mark.parametrize("mixed", [False, True], ids=["uniform-step", "general-path"])
def test_verify_with_processors_emits_what_decode_draws(small_vocab_model, mixed, greedy):
    """The drafts before a Verify row count as its output tokens (penalties) and as its new tokens (min_tokens),
    so a sequence with every processor emits the same tokens whether it decodes or verifies, in the uniform
    step and in the general path."""
    engine = Engine(engine_config(small_vocab_model))
    params = SamplingParams(temperature=0.0 if greedy else 1.5, top_k=12, seed=99, repetition_penalty=1.2,
                            min_p=0.05, frequency_penalty=0.6, presence_penalty=0.4, logit_bias={EOS: 1.5, 7: -1.0})
    stopping = StoppingCriteria(ignore_eos=True, min_tokens=4)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    total = 16

    ref, sid, other = pipeline_checks.verify_as_decoded(engine, params, stopping, prompt, total, 32, mixed)
    assert EOS not in ref[:4] and EOS in ref[4:], ref  # favoured by its bias once min_tokens are out
    counts = engine.runtime.state.output_counts[engine.sequences[sid].slot]
    assert counts.tolist() == torch.bincount(torch.tensor(ref), minlength=32).tolist()
    engine.release([sid, other])


PENALIZED = SamplingParams(temperature=0.9, top_k=40, repetition_penalty=1.3, top_logprobs=2, seed=5,
                           frequency_penalty=0.8, presence_penalty=0.6, min_p=0.02)


def test_a_stop_token_refusal_rolls_the_penalty_counts_back(tiny_model, monkeypatch):
    """tests/pipeline_checks.py's refusal pattern with the penalties: the refused step and the rerun one give what
    one step at a time gives."""
    monkeypatch.setattr(pipeline_checks, "SAMPLED", PENALIZED)
    pipeline_checks.check_stop_token_refusal(lambda reference=False: Engine(engine_config(tiny_model)), VOCAB)


def test_refused_and_rewritten_steps_leave_exact_counts(tiny_model):
    """X stops by a stop token its logit_bias forces once min_tokens are out (at its 4th new token); the step
    launched behind that one is refused after it wrote its counts, and Y's counts are rebuilt from its tokens;
    so are they after input_token_ids rewrite the last token."""
    x_params = SamplingParams(logit_bias={19: 100.0}, presence_penalty=0.5)
    x_stop = StoppingCriteria(ignore_eos=True, min_tokens=3, stop_token_ids=frozenset({19}))
    prompts = random_prompts([6, 9], VOCAB, seed=41)

    def start(engine):
        ids = [engine.alloc_sequence(64, x_params, x_stop).seq_id,
               engine.alloc_sequence(64, PENALIZED, StoppingCriteria(ignore_eos=True)).seq_id]
        engine.prefill([PrefillItem(i, p) for i, p in zip(ids, prompts)])
        return ids

    def counts_match(engine, seq_id):
        seq = engine.sequences[seq_id]
        counts = engine.runtime.state.output_counts[seq.slot].long()
        return torch.equal(counts, torch.bincount(torch.tensor(seq.token_ids[seq.prompt_len:]), minlength=VOCAB))

    ref = Engine(engine_config(tiny_model))
    x, y = start(ref)
    want = [ref.decode([x, y]).tokens[1].token_id for _ in range(3)] + [ref.decode([y]).tokens[0].token_id
                                                                         for _ in range(3)]
    assert ref.sequences[x].finish_reason == FinishReason.STOP_TOKEN and ref.sequences[x].token_ids[-1] == 19

    engine = Engine(engine_config(tiny_model))
    x, y = start(engine)
    got = [engine.decode([x, y]).tokens[1].token_id for _ in range(2)]
    step3 = engine.decode_launch([x, y])
    behind = engine.decode_launch([x, y])
    after = engine.decode_launch([y])
    got.append(engine.finish(step3).tokens[1].token_id)
    with pytest.raises(FailedPrecondition, match="has finished"):
        engine.finish(behind)
    got.append(engine.finish(after).tokens[0].token_id)
    assert engine.decoder.refused_steps == 1 and counts_match(engine, y) and counts_match(engine, x)
    got += [engine.decode([y]).tokens[0].token_id for _ in range(2)]
    assert got == want and counts_match(engine, y)
    engine.decode([y], input_token_ids=[4])
    assert counts_match(engine, y) and engine.sequences[y].token_ids[-2] == 4
