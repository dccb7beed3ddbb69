"""Structured output (worker/structured_output.py, Engine.set_token_mask) on the real default model
(SmolLM2-135M-Instruct, fp32 on CPU), over the gateway service's Generate on a real socket.

The oracle is transformers' greedy generate on the same checkpoint with xgrammar's own transformers logits
processor (xgrammar.contrib.hf) over the same grammar: a constrained greedy answer must be the same tokens.
The engine's token-mask contract (a mask before every sampled token, Verify refused) is checked in process."""
from __future__ import annotations

import json
import re

import grpc
import numpy as np
import pytest
import torch

from conftest import engine_config, start_server
from engine.api import PrefillItem, VerifyItem
from engine.engine import Engine
from engine.errors import FailedPrecondition, InvalidArgument
from engine.sampling import SamplingParams, StoppingCriteria
from engine.tokenizer import Tokenizer
from worker.gateway_pb import vpb, vpb_grpc

xgrammar = pytest.importorskip("xgrammar")
pytestmark = pytest.mark.timeout(600)

MAX_TOKENS = 64
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
          "required": ["city", "population"]}


@pytest.fixture(scope="module")
def srv(default_model):
    s = start_server(default_model, max_seq_len=512)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def vllm(srv) -> vpb_grpc.VllmEngineStub:
    return vpb_grpc.VllmEngineStub(grpc.insecure_channel(srv.address))


@pytest.fixture(scope="module")
def text(default_model) -> Tokenizer:
    return Tokenizer.from_dir(default_model)


@pytest.fixture(scope="module")
def compiler(default_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model)
    info = xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok), stop_token_ids=[tok.eos_token_id])
    return xgrammar.GrammarCompiler(info)


def chat_prompt(text: Tokenizer, question: str) -> list[int]:
    return text.encode_chat([{"role": "user", "content": question}])


def generate(vllm, prompt: list[int], rid: str, stream: bool = False, n: int = 1, **sampling):
    """(output ids, finish reason) of each choice."""
    req = vpb.GenerateRequest(request_id=rid, tokenized=vpb.TokenizedInput(input_ids=prompt), stream=stream,
                              sampling_params=vpb.SamplingParams(**{"temperature": 0.0, "max_tokens": MAX_TOKENS,
                                                                    "n": n, **sampling}))
    ids: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    for r in vllm.Generate(req, timeout=120):
        if r.WhichOneof("response") == "chunk":
            ids.setdefault(r.chunk.index, []).extend(r.chunk.token_ids)
        else:
            if not stream:
                ids[r.complete.index] = list(r.complete.output_ids)
            reasons[r.complete.index] = r.complete.finish_reason
    return [(ids.get(i, []), reasons[i]) for i in range(n)]


@torch.no_grad()
def hf_constrained_greedy(default_model, compiled, prompt: list[int], eos: int) -> list[int]:
    from tests.oracle import hf_model
    from xgrammar.contrib.hf import LogitsProcessor

    model = hf_model(default_model)
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=eos, pad_token_id=eos,
                         logits_processor=[LogitsProcessor(compiled)])
    answer = out[0, len(prompt):].tolist()
    return answer[:answer.index(eos) + 1] if eos in answer else answer


CASES = {
    "json_schema": (dict(json_schema=json.dumps(SCHEMA)), "Describe Paris as JSON with its population."),
    "json_object": (dict(json_object=True), "Give me a JSON object with a cat's name."),
    "regex": (dict(regex=r"(yes|no), because [a-z ]{5,30}\."), "Is the sky blue? Answer yes or no and why."),
    "choice": (dict(choice=vpb.ChoiceConstraint(choices=["Paris", "London", "Berlin", "Rome"])),
               "What is the capital of France?"),
    "grammar": (dict(grammar='root ::= "The answer is " [0-9]+ "."'), "What is 6 times 7?"),
}


def compile_case(compiler, kind: str, value):
    if kind == "json_schema":
        return compiler.compile_json_schema(value, any_whitespace=True)
    if kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=True)
    if kind == "regex":
        return compiler.compile_regex(value)
    if kind == "choice":
        return compiler.compile_grammar("root ::= " + " | ".join(f'"{c}"' for c in value.choices))
    return compiler.compile_grammar(value)


@pytest.mark.parametrize("kind", sorted(CASES))
def test_constrained_greedy_is_transformers_with_xgrammar(vllm, srv, text, compiler, default_model, kind):
    """Each kind of constraint: the worker's greedy tokens equal transformers' greedy tokens under xgrammar's
    logits processor over the same grammar, streamed and not; the text satisfies the constraint and the choice
    ends "stop" (the grammar completes, then EOS); nothing stays allocated."""
    sampling, question = CASES[kind]
    prompt = chat_prompt(text, question)
    want = hf_constrained_greedy(default_model, compile_case(compiler, kind, next(iter(sampling.values()))), prompt,
                                 text.encode(text.special_tokens["eos_token"], add_special_tokens=False)[0])
    for stream in (False, True):
        [(ids, reason)] = generate(vllm, prompt, f"{kind}-{stream}", stream, **sampling)
        assert ids == want, (text.decode(ids), text.decode(want))
    out = text.decode(ids)
    if len(want) == MAX_TOKENS:  # cut by max_tokens: a prefix the grammar allows, as the oracle's
        assert reason == "length" and kind.startswith("json")
        return
    assert reason == "stop"
    if kind == "json_schema":
        value = json.loads(out)
        assert isinstance(value["city"], str) and isinstance(value["population"], int)
    elif kind == "json_object":
        assert isinstance(json.loads(out), dict)
    elif kind == "regex":
        assert re.fullmatch(r"(yes|no), because [a-z ]{5,30}\.", out), out
    elif kind == "choice":
        assert out in ("Paris", "London", "Berlin", "Rome")
    else:
        assert re.fullmatch(r"The answer is [0-9]+\.", out), out
    assert srv.engine_call(lambda e: len(e.sequences)) == 0


def test_constrained_and_free_choices_share_steps(vllm, srv, text):
    """Several constrained calls and unconstrained ones at once (their steps batched together): each gives what
    it gives alone, so no mask leaks into another row."""
    from concurrent.futures import ThreadPoolExecutor

    prompt = chat_prompt(text, "Name a colour.")
    regex = dict(regex=r"[A-Z][a-z]+ and [a-z]+\.")
    alone_free = generate(vllm, prompt, "free-alone")[0]
    alone_regex = generate(vllm, prompt, "regex-alone", **regex)[0]
    assert alone_free != alone_regex
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(generate, vllm, prompt, f"mix-{i}", i % 2 == 1, **(regex if i % 2 else {}))
                   for i in range(6)]
        results = [f.result()[0] for f in futures]
    for i, r in enumerate(results):
        assert r == (alone_regex if i % 2 else alone_free), i
    assert srv.engine_call(lambda e: len(e.sequences)) == 0


def test_bad_constraints_are_invalid_argument(vllm, srv):
    bad = {"json_schema": dict(json_schema="{not json"), "regex": dict(regex="(unclosed"),
           "grammar": dict(grammar="root ::= undefined_rule"),
           "choice": dict(choice=vpb.ChoiceConstraint(choices=[]))}
    for kind, sampling in bad.items():
        with pytest.raises(grpc.RpcError) as e:
            generate(vllm, [1, 2, 3], f"bad-{kind}", **sampling)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, kind
        assert f"sampling_params.{kind}" in e.value.details(), e.value.details()
    assert generate(vllm, [1, 2, 3], "after-bad", max_tokens=2)[0][1] == "length"  # it keeps serving
    assert srv.engine_call(lambda e: len(e.sequences)) == 0


def test_engine_token_mask_contract(default_model):
    """A token-mask sequence samples only from the mask set for that token, and needs one before each sampled
    token; a refused call changes nothing; Verify refuses it; unmasked sequences are unaffected."""
    engine = Engine(engine_config(default_model, max_seq_len=256))
    words = engine.runtime.state.token_mask.shape[1]

    def mask(allowed: list[int]) -> np.ndarray:
        w = np.zeros(words, dtype=np.uint32)
        for t in allowed:
            w[t // 32] |= np.uint32(1 << (t % 32))
        return w.view(np.int32)

    stopping = StoppingCriteria(max_new_tokens=8, ignore_eos=True)
    free = engine.alloc_sequence(64, SamplingParams(), stopping).seq_id
    masked = engine.alloc_sequence(64, SamplingParams(token_mask=True), stopping).seq_id
    prompt = [1, 504, 3458, 282, 4649, 314]
    with pytest.raises(FailedPrecondition, match="token mask"):
        engine.prefill([PrefillItem(masked, prompt)])
    with pytest.raises(FailedPrecondition, match="not allocated"):
        engine.set_token_mask(free, mask([5]))
    with pytest.raises(InvalidArgument, match="int32"):
        engine.set_token_mask(masked, np.zeros(words + 1, dtype=np.int32))
    first_free = engine.prefill([PrefillItem(free, prompt)]).tokens[0].token_id
    allowed = [first_free + 1, 7, 1200]
    engine.set_token_mask(masked, mask(allowed))
    first = engine.prefill([PrefillItem(masked, prompt)]).tokens[0]
    logits = engine.score(prompt)[-1]
    assert first.token_id == max(allowed, key=lambda t: logits[t].item())  # greedy among the allowed ones
    with pytest.raises(FailedPrecondition, match="token mask"):
        engine.decode([free, masked])
    engine.set_token_mask(masked, mask([42]))
    step = engine.decode([masked, free]).tokens
    assert step[0].token_id == 42 and step[0].logprob == pytest.approx(0.0, abs=1e-6)  # the only allowed token
    alone = engine.alloc_sequence(64, SamplingParams(), stopping).seq_id
    engine.prefill([PrefillItem(alone, prompt)])
    assert step[1].token_id == engine.decode([alone]).tokens[0].token_id  # the free row: as without masks
    engine.set_token_mask(masked, mask([42]))
    with pytest.raises(InvalidArgument, match="Verify"):
        engine.verify([VerifyItem(masked, [42, 42])])
    engine.release([free, masked, alone])
    assert len(engine.sequences) == 0
    engine.close()


def test_sampled_choices_each_follow_the_grammar(vllm, srv, text):
    """n = 4 choices sampled at temperature 1 (seeded): each has a grammar state of its own and ends inside it."""
    prompt = chat_prompt(text, "Pick a number between one and nine, in words.")
    words = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    out = generate(vllm, prompt, "n4", n=4, temperature=1.0, seed=5,
                   choice=vpb.ChoiceConstraint(choices=words))
    assert [reason for _, reason in out] == ["stop"] * 4
    assert all(text.decode(ids) in words for ids, _ in out)
    assert srv.engine_call(lambda e: len(e.sequences)) == 0
