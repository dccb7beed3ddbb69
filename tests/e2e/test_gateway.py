"""The gateway service (vllm.grpc.engine.VllmEngine) over real gRPC on a real socket, and the real Shepherd
Model Gateway (smg, from the test extras) in front of the worker.

The tiny random checkpoints have no tokenizer of their own: tests that need one write a word-level
tokenizer whose vocabulary ("w3".."w511" plus three special tokens) is exactly the model's 512 ids."""
from __future__ import annotations

import hashlib
import io
import json
import pathlib
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zipfile

import grpc
import pytest
import torch

from conftest import random_prompts, start_server
from engine.checkpoint import write_checkpoint
from metrale.worker.v1 import worker_pb2 as pb
from worker.gateway_pb import SERVICE_NAME, cpb, vpb, vpb_grpc

VOCAB = 512
SPECIAL = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2: the checkpoint's bos is 1 and eos is 2


def write_word_tokenizer(directory: pathlib.Path) -> None:
    """tokenizer.json (word level, whitespace split) and tokenizer_config.json with a chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    vocab.update({f"w{i}": i for i in range(len(SPECIAL), VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()  # joins the words with spaces
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL])
    assert tok.get_vocab_size() == VOCAB
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "model_max_length": VOCAB,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}"
                         "{% if add_generation_prompt %}w3 {% endif %}"}))


def checkpoint_with_tokenizer(directory: pathlib.Path, seed: int = 11) -> pathlib.Path:
    write_checkpoint(directory, arch="llama", shape="tiny", seed=seed)
    write_word_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def tok_model(tmp_path_factory) -> pathlib.Path:
    return checkpoint_with_tokenizer(tmp_path_factory.mktemp("gateway") / "tiny-words")


@pytest.fixture(scope="module")
def tok_server(tok_model):
    srv = start_server(tok_model)
    yield srv
    srv.stop()


@pytest.fixture()
def vllm(tok_server) -> vpb_grpc.VllmEngineStub:
    return vpb_grpc.VllmEngineStub(grpc.insecure_channel(tok_server.address))


def generate_request(prompt: list[int], rid: str = "", stream: bool = False, **sampling) -> vpb.GenerateRequest:
    return vpb.GenerateRequest(request_id=rid, tokenized=vpb.TokenizedInput(input_ids=prompt), stream=stream,
                               sampling_params=vpb.SamplingParams(**sampling))


def model_worker_generate(srv, prompt: list[int], n: int, **sampling) -> list[pb.Token]:
    """The same engine through ModelWorker's Generate: the reference for the gateway's tokens."""
    req = pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(**sampling),
                             stopping=pb.StoppingCriteria(max_new_tokens=n, ignore_eos=True))
    return [r.token for r in srv.stub().Generate(req, timeout=60)]


def live_sequences(srv) -> int:
    return srv.stub().Info(pb.InfoRequest()).live_sequences


def wait_until_no_live_sequences(srv, timeout_s: float = 10.0) -> int:
    deadline = time.monotonic() + timeout_s
    while (n := live_sequences(srv)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return n


def test_stubs_import_under_our_protobuf():
    code = ("import google.protobuf, grpc; "
            "from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc, common_pb2; "
            "print(google.protobuf.__version__)")
    out = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split(".")[0]) >= 7


def test_health_reflection_and_grpc_health(tok_server, vllm):
    resp = vllm.HealthCheck(vpb.HealthCheckRequest(), timeout=10)
    assert resp.healthy and resp.message == "serving"
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(tok_server.address))
    status = health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
    services = ProtoReflectionDescriptorDatabase(grpc.insecure_channel(tok_server.address)).get_services()
    assert "vllm.grpc.engine.VllmEngine" in services and "metrale.worker.v1.ModelWorker" in services


def test_model_and_server_info(tok_server, tok_model, vllm):
    info = tok_server.stub().Info(pb.InfoRequest())
    m = vllm.GetModelInfo(vpb.GetModelInfoRequest(), timeout=10)
    assert m.served_model_name == "tiny-words" and m.model_path == str(tok_model.resolve())
    assert m.tokenizer_path == str(tok_model.resolve())
    assert m.is_generation and not m.supports_vision
    assert (m.vocab_size, m.max_context_length, m.max_req_input_len) == (VOCAB, 512, 511)
    assert list(m.eos_token_ids) == [2] and m.bos_token_id == 1
    assert m.model_type == "llama" and list(m.architectures) == ["LlamaForCausalLM"]
    s = vllm.GetServerInfo(vpb.GetServerInfoRequest(), timeout=10)
    assert s.block_size == info.block_size and s.max_num_seqs == min(info.max_slots, info.max_batch_size)
    assert s.data_parallel_size == 1 and not s.is_paused and s.uptime_seconds > 0
    assert s.model_dtype == f"torch.{info.dtype}" and s.kv_cache_dtype == info.dtype



def test_served_model_name_is_the_model_id_everywhere(tok_model):
    """--served-model-name (vLLM's): the model id of Info, of the gateway service's model info (what smg lists in
    /v1/models) and of the metrics' model label, instead of the checkpoint directory's name."""
    from test_cli import free_port
    from test_metrics import scrape

    name, port = "acme/tiny-words-chat", free_port()
    srv = start_server(tok_model, worker_changes=dict(metrics_port=port), served_model_name=name)
    try:
        assert srv.stub().Info(pb.InfoRequest()).model_id == name
        stub = vpb_grpc.VllmEngineStub(grpc.insecure_channel(srv.address))
        m = stub.GetModelInfo(vpb.GetModelInfoRequest(), timeout=10)
        assert m.served_model_name == name and m.model_path == str(tok_model.resolve())
        weights = [labels for (metric, labels) in scrape(port) if metric == "metrale_weights_info"]
        assert [dict(labels)["model"] for labels in weights] == [name]
    finally:
        srv.stop()

@pytest.mark.parametrize("stream", [False, True])
def test_greedy_generate_equals_model_worker(tok_server, vllm, stream):
    prompts = random_prompts([7, 19], VOCAB, seed=3)
    for i, prompt in enumerate(prompts):
        n = 12
        want = [t.token_id for t in model_worker_generate(tok_server, prompt, n, temperature=0.0)]
        responses = list(vllm.Generate(generate_request(prompt, f"greedy-{stream}-{i}", stream, temperature=0.0,
                                                        max_tokens=n, ignore_eos=True), timeout=60))
        *chunks, last = responses
        assert last.WhichOneof("response") == "complete"
        done = last.complete
        assert done.finish_reason == "length" and done.prompt_tokens == len(prompt)
        if stream:
            assert all(r.WhichOneof("response") == "chunk" for r in chunks)
            assert [t for r in chunks for t in r.chunk.token_ids] == want
            # a chunk per token, or several where the handler fell behind the steps (gateway_stream._with_queued)
            assert all(r.chunk.completion_tokens == len(r.chunk.token_ids) >= 1 and r.chunk.prompt_tokens == len(prompt)
                       for r in chunks)
            assert list(done.output_ids) == want[-1:] and done.completion_tokens == 1  # repeats the last delta
        else:
            assert not chunks
            assert list(done.output_ids) == want and done.completion_tokens == n
    assert wait_until_no_live_sequences(tok_server) == 0


def test_unset_temperature_samples_at_one(tok_server, vllm):
    """vLLM's default: an unset temperature is 1.0, not greedy (same seed, same tokens as T=1 there)."""
    prompt = random_prompts([9], VOCAB, seed=4)[0]
    want = [t.token_id for t in model_worker_generate(tok_server, prompt, 16, temperature=1.0, seed=1234)]
    greedy = [t.token_id for t in model_worker_generate(tok_server, prompt, 16, temperature=0.0)]
    done = list(vllm.Generate(generate_request(prompt, "unset-t", seed=1234, max_tokens=16, ignore_eos=True)))[-1]
    assert list(done.complete.output_ids) == want != greedy


def test_logprobs_and_stop_token(tok_server, vllm):
    prompt = random_prompts([11], VOCAB, seed=5)[0]
    ref = model_worker_generate(tok_server, prompt, 8, temperature=0.0, top_logprobs=3)
    done = list(vllm.Generate(generate_request(prompt, "lp", temperature=0.0, max_tokens=8, ignore_eos=True,
                                               logprobs=3)))[-1].complete
    lp = done.output_logprobs
    assert list(lp.token_ids) == [t.token_id for t in ref]
    assert lp.token_logprobs == pytest.approx([t.logprob for t in ref], abs=1e-5)
    assert len(lp.top_logprobs) == 8
    for top, t in zip(lp.top_logprobs, ref):
        assert list(top.token_ids) == [a.token_id for a in t.top_logprobs]
        assert top.values == pytest.approx([a.logprob for a in t.top_logprobs], abs=1e-5)
    # logprobs=0: the sampled token's logprob only.
    done = list(vllm.Generate(generate_request(prompt, "lp0", temperature=0.0, max_tokens=3, ignore_eos=True,
                                               logprobs=0)))[-1].complete
    assert len(done.output_logprobs.token_logprobs) == 3 and not done.output_logprobs.top_logprobs
    # A stop token ends the sequence with "stop" and names the token; not asking for logprobs sends none.
    stop = ref[4].token_id
    first = [t.token_id for t in ref].index(stop)
    done = list(vllm.Generate(generate_request(prompt, "stop", temperature=0.0, max_tokens=8, ignore_eos=True,
                                               stop_token_ids=[stop])))[-1].complete
    assert done.finish_reason == "stop" and done.matched_token_id == stop
    assert list(done.output_ids) == [t.token_id for t in ref[:first + 1]]
    assert not done.HasField("output_logprobs")


def test_get_loads_while_requests_run(tok_server, vllm):
    info = tok_server.stub().Info(pb.InfoRequest())
    idle = vllm.GetLoads(vpb.GetLoadsRequest(), timeout=10)
    assert idle.dp_rank_count == 1 and len(idle.loads) == 1
    assert idle.loads[0].num_running_reqs == 0 and idle.loads[0].token_usage == 0.0
    assert idle.loads[0].max_total_num_tokens == info.total_blocks * info.block_size
    prompts = random_prompts([8, 8, 8], VOCAB, seed=6)
    streams = [vllm.Generate(generate_request(p, f"load-{i}", True, temperature=0.0, max_tokens=480,
                                              ignore_eos=True)) for i, p in enumerate(prompts)]
    try:
        for s in streams:
            next(s)
        load = vllm.GetLoads(vpb.GetLoadsRequest(), timeout=10).loads[0]
        assert load.num_running_reqs == 3 and load.num_total_reqs == 3 and load.num_waiting_reqs == 0
        blocks = 3 * -(-488 // info.block_size)  # each stream reserves prompt + max_tokens up front
        assert load.num_used_tokens == blocks * info.block_size
        assert load.token_usage == pytest.approx(blocks / info.total_blocks)
        assert load.gen_throughput > 0 and load.max_running_requests == min(info.max_slots, info.max_batch_size)
    finally:
        for s in streams:
            s.cancel()
    assert wait_until_no_live_sequences(tok_server) == 0


def test_abort_ends_the_stream_and_frees_the_sequence(tok_server, vllm):
    prompt = random_prompts([6], VOCAB, seed=7)[0]
    stream = vllm.Generate(generate_request(prompt, "abort-me", True, temperature=0.0, max_tokens=480,
                                            ignore_eos=True), timeout=60)
    assert next(stream).chunk.token_ids and next(stream).chunk.token_ids
    with pytest.raises(grpc.RpcError) as e:  # a request id already running is refused
        list(vllm.Generate(generate_request(prompt, "abort-me", max_tokens=2), timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "abort-me" in e.value.details()
    vllm.Abort(vpb.AbortRequest(request_ids=["abort-me", "never-seen"]), timeout=10)
    rest = list(stream)
    assert rest[-1].complete.finish_reason == "abort" and not rest[-1].complete.output_ids
    assert len(rest) < 470  # it did not run to max_tokens
    assert wait_until_no_live_sequences(tok_server) == 0
    # A caller that goes away frees its sequence too.
    stream = vllm.Generate(generate_request(prompt, "walk-away", True, temperature=0.0, max_tokens=480,
                                            ignore_eos=True), timeout=60)
    next(stream)
    stream.cancel()
    assert wait_until_no_live_sequences(tok_server) == 0


UNSUPPORTED = {
    "stop": dict(stop=["w9", ""]), "prompt_logprobs": dict(prompt_logprobs=-1), "logprobs": dict(logprobs=-1),
    # Structured output that cannot be compiled (tests/e2e/test_structured_output.py has what can).
    "json_schema": dict(json_schema='{"type": "nonsense"}'), "regex": dict(regex="(w"),
    # Values outside what the engine serves (vLLM's ranges, and this worker's limits).
    "min_p": dict(min_p=1.5), "frequency_penalty": dict(frequency_penalty=2.5),
    "presence_penalty": dict(presence_penalty=-3.0), "logit_bias": dict(logit_bias={i: 1.0 for i in range(65)}),
    "min_tokens": dict(min_tokens=5), "n": dict(n=65),
}


@pytest.mark.parametrize("field", sorted(UNSUPPORTED))
def test_unsupported_sampling_field_is_invalid_argument(vllm, field):
    req = generate_request([5, 6, 7], f"bad-{field}", max_tokens=4, **UNSUPPORTED[field])
    with pytest.raises(grpc.RpcError) as e:
        list(vllm.Generate(req, timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"sampling_params.{field}" in e.value.details()


def model_worker_tokens(srv, prompt: list[int], max_new: int, stopping: dict | None = None, **sampling) -> list[int]:
    req = pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(**sampling),
                             stopping=pb.StoppingCriteria(max_new_tokens=max_new, **(stopping or {})))
    return [r.token.token_id for r in srv.stub().Generate(req, timeout=60)]


PROCESSORS = dict(min_p=0.2, frequency_penalty=1.5, presence_penalty=1.0, logit_bias={5: 4.0, 9: -1.5})


def test_logits_processors_through_the_gateway_are_the_engines(tok_server, vllm):
    """min_p, frequency/presence penalties, logit_bias and min_tokens map to the engine's own: the gateway's
    tokens are ModelWorker's with the same fields, and they change what is generated."""
    prompt = random_prompts([9], VOCAB, seed=13)[0]
    want = model_worker_tokens(tok_server, prompt, 12, dict(min_tokens=4), temperature=0.8, seed=77, **PROCESSORS)
    plain = model_worker_tokens(tok_server, prompt, 12, temperature=0.8, seed=77)
    done = list(vllm.Generate(generate_request(prompt, "procs", temperature=0.8, seed=77, max_tokens=12, min_tokens=4,
                                               **PROCESSORS), timeout=60))[-1].complete
    assert list(done.output_ids) == want != plain
    # +100 forces a token; min_tokens holds EOS (here favoured) back for 3 tokens, then it ends the sequence.
    done = list(vllm.Generate(generate_request(prompt, "eos", temperature=0.0, max_tokens=10, min_tokens=3,
                                               logit_bias={2: 100.0}), timeout=60))[-1].complete
    assert len(done.output_ids) == 4 and list(done.output_ids).index(2) == 3 and done.finish_reason == "stop"
    assert wait_until_no_live_sequences(tok_server) == 0


def split_by_index(responses) -> tuple[dict[int, list[int]], dict[int, vpb.GenerateComplete]]:
    chunks: dict[int, list[int]] = {}
    completes: dict[int, vpb.GenerateComplete] = {}
    for r in responses:
        if r.WhichOneof("response") == "chunk":
            assert r.chunk.index not in completes, "a chunk after its choice's Complete"
            chunks.setdefault(r.chunk.index, []).extend(r.chunk.token_ids)
        else:
            assert r.complete.index not in completes, "two Completes for one choice"
            completes[r.complete.index] = r.complete
    return chunks, completes


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_are_seeded_seed_plus_index_and_tagged_by_index(tok_server, vllm, stream):
    """n > 1: n sequences of the prompt, choice i seeded seed + i (vLLM's parallel sampling), each equal to
    ModelWorker's sequence with that seed; streamed chunks carry their choice's index (interleaved), each
    choice ends with its own Complete; a non-streamed call sends one Complete per choice, in index order.
    Choices end on their own: one stops early on a stop token."""
    prompt = random_prompts([8], VOCAB, seed=14)[0]
    want = [model_worker_tokens(tok_server, prompt, 10, dict(ignore_eos=True), temperature=1.0, seed=500 + i)
            for i in range(3)]
    assert len({tuple(w) for w in want}) == 3
    stop = next(t for t in want[1][2:] if t not in want[1][:2] and t not in want[0] + want[2])
    cut = want[1].index(stop) + 1
    responses = list(vllm.Generate(generate_request(prompt, f"n3-{stream}", stream, temperature=1.0, seed=500, n=3,
                                                    max_tokens=10, ignore_eos=True, stop_token_ids=[stop]),
                                   timeout=60))
    chunks, completes = split_by_index(responses)
    assert sorted(completes) == [0, 1, 2]
    assert [completes[i].finish_reason for i in range(3)] == ["length", "stop", "length"]
    assert completes[1].matched_token_id == stop
    expected = [want[0], want[1][:cut], want[2]]
    if stream:
        assert [chunks[i] for i in range(3)] == expected
        assert [list(completes[i].output_ids) for i in range(3)] == [e[-1:] for e in expected]
        indices = [r.chunk.index for r in responses if r.WhichOneof("response") == "chunk"]
        assert indices[:3] == [0, 1, 2], "choices' chunks interleave as their tokens come"
    else:
        assert not chunks and [r.complete.index for r in responses] == [0, 1, 2]
        assert [list(completes[i].output_ids) for i in range(3)] == expected
        assert [completes[i].completion_tokens for i in range(3)] == [len(e) for e in expected]
    assert wait_until_no_live_sequences(tok_server) == 0


def words_of(ids: list[int]) -> list[str]:
    """The word tokenizer's text of each id (its decoder joins them with one space)."""
    return [f"w{t}" for t in ids]


def first_stop_at(words: list[str], start: int) -> tuple[int, str]:
    """(k, stop): the first k >= start where the stop string "<last character of word k-1> <word k>", which
    spans two tokens, appears in the text only as completed by token k."""
    for k in range(max(start, 1), len(words)):
        stop = f"{words[k - 1][-1]} {words[k]}"
        if stop not in " ".join(words[:k]) and stop not in " ".join(words[:k + 1])[:-1]:
            return k, stop
    raise AssertionError(f"no usable stop string in {words}")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_end_a_choice_at_the_token_that_completes_one(tok_server, vllm, stream):
    """A stop string (vLLM's `stop`) ends a choice with the token whose text completes it: finish reason
    "stop", the string in matched_stop_str, no token after it, and its sequence freed at once; before
    min_tokens output tokens no string stops it; a choice whose string never appears runs to max_tokens."""
    prompt = random_prompts([7], VOCAB, seed=16)[0]
    ref = model_worker_tokens(tok_server, prompt, 16, dict(ignore_eos=True), temperature=0.0)
    words = words_of(ref)
    k, stop = first_stop_at(words, 3)

    def run(rid: str, **sampling) -> tuple[list[int], vpb.GenerateComplete]:
        responses = list(vllm.Generate(generate_request(prompt, rid, stream, temperature=0.0, max_tokens=16,
                                                        ignore_eos=True, **sampling), timeout=60))
        chunks, completes = split_by_index(responses)
        assert list(completes) == [0]
        return (chunks.get(0, []) if stream else list(completes[0].output_ids)), completes[0]

    ids, done = run(f"stop-{stream}", stop=["never there", stop])
    assert ids == ref[:k + 1]
    assert (done.finish_reason, done.matched_stop_str, done.WhichOneof("matched_stop")) == \
        ("stop", stop, "matched_stop_str")
    assert done.completion_tokens == (1 if stream else k + 1)
    assert wait_until_no_live_sequences(tok_server) == 0

    # min_tokens: a string that appears only in the first tokens does not stop the choice.
    early = words[0]
    assert all(early not in w for w in words[1:])
    ids, done = run(f"stop-min-{stream}", stop=[early], min_tokens=2)
    assert ids == ref and done.finish_reason == "length" and done.WhichOneof("matched_stop") is None
    ids, done = run(f"stop-first-{stream}", stop=[early])
    assert ids == ref[:1] and done.matched_stop_str == early
    assert wait_until_no_live_sequences(tok_server) == 0


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_logprobs_are_transformers(tok_server, tok_model, vllm, stream):
    """prompt_logprobs=k: one entry per prompt token, the first without a value; each later one the token's
    log-probability after the ones before it and the k most likely tokens there, as transformers computes them
    on the same checkpoint (fp32); in a stream on each choice's first chunk and on every Complete."""
    from tests.oracle import hf_logits

    prompt = random_prompts([12], VOCAB, seed=21)[0]
    ref = torch.log_softmax(hf_logits(tok_model, prompt), dim=-1)
    responses = list(vllm.Generate(generate_request(prompt, f"plp-{stream}", stream, temperature=0.0, max_tokens=3,
                                                    ignore_eos=True, prompt_logprobs=3, n=2, seed=1), timeout=60))
    carriers = [r.chunk if r.WhichOneof("response") == "chunk" else r.complete for r in responses
                if (r.chunk if r.WhichOneof("response") == "chunk" else r.complete).HasField("input_logprobs")]
    chunks = [r.chunk for r in responses if r.WhichOneof("response") == "chunk"]
    if stream:  # each choice's first chunk, and its Complete
        assert len(carriers) == 4 and sum(c.HasField("input_logprobs") for c in chunks) == 2
        assert sorted(c.index for c in chunks if c.HasField("input_logprobs")) == [0, 1]
    else:
        assert len(carriers) == 2 and not chunks
    for c in carriers:
        lp = c.input_logprobs
        assert list(lp.token_ids) == prompt and len(lp.token_logprobs) == len(lp.top_logprobs) == len(prompt)
        assert not lp.token_logprobs[0].HasField("value") and not lp.top_logprobs[0].token_ids
        for i in range(1, len(prompt)):
            assert lp.token_logprobs[i].value == pytest.approx(ref[i - 1, prompt[i]].item(), abs=1e-4)
            top = ref[i - 1].topk(3)
            assert list(lp.top_logprobs[i].token_ids) == top.indices.tolist()
            assert list(lp.top_logprobs[i].values) == pytest.approx(top.values.tolist(), abs=1e-4)
    assert wait_until_no_live_sequences(tok_server) == 0


def test_stop_strings_and_text_prompts_need_the_checkpoints_tokenizer(server):
    stub = vpb_grpc.VllmEngineStub(grpc.insecure_channel(server.address))
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(generate_request([5, 6, 7], "no-tok", max_tokens=4, stop=["w9"]), timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling_params.stop needs the checkpoint's tokenizer" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(vpb.GenerateRequest(text="w5 w6", sampling_params=vpb.SamplingParams(max_tokens=2)),
                           timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "text input needs the checkpoint's tokenizer" in e.value.details()
    assert live_sequences(server) == 0


def test_a_text_prompt_is_the_tokenizers_ids(tok_server, tok_model, vllm):
    """A text prompt (vLLM's gRPC `text` input; smg sends token ids) is encoded with the checkpoint's tokenizer,
    special tokens included as vLLM does: the tokens and the reported prompt length are those of its ids."""
    from engine.tokenizer import Tokenizer

    text = "w5 w17 w9 w33"
    ids = Tokenizer.from_dir(tok_model).encode(text)
    assert len(ids) >= 4
    want = list(vllm.Generate(generate_request(ids, "ids", max_tokens=6, temperature=0.0, ignore_eos=True),
                              timeout=30))[-1].complete
    got = list(vllm.Generate(vpb.GenerateRequest(request_id="text", text=text, sampling_params=vpb.SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True)), timeout=30))[-1].complete
    assert list(got.output_ids) == list(want.output_ids) and got.prompt_tokens == len(ids)
    assert wait_until_no_live_sequences(tok_server) == 0


def test_abort_ends_every_choice(tok_server, vllm):
    prompt = random_prompts([6], VOCAB, seed=15)[0]
    stream = vllm.Generate(generate_request(prompt, "abort-n", True, temperature=0.0, n=2, max_tokens=480,
                                            ignore_eos=True), timeout=60)
    first = [next(stream) for _ in range(4)]
    assert sorted(r.chunk.index for r in first) == [0, 0, 1, 1]
    assert live_sequences(tok_server) == 2
    vllm.Abort(vpb.AbortRequest(request_ids=["abort-n"]), timeout=10)
    _, completes = split_by_index(list(stream))
    assert sorted(completes) == [0, 1] and all(c.finish_reason == "abort" for c in completes.values())
    assert wait_until_no_live_sequences(tok_server) == 0


def test_bad_requests_are_refused_and_the_worker_keeps_serving(tok_server, vllm):
    cases = {
        "context length is 512": generate_request(list(range(3, 13)), max_tokens=503),
        "leaves no room": generate_request([5] * 512),
        "text is empty": vpb.GenerateRequest(text="", sampling_params=vpb.SamplingParams(max_tokens=2)),
        "mm_inputs": vpb.GenerateRequest(tokenized=vpb.TokenizedInput(input_ids=[5]), mm_inputs=vpb.MultimodalInputs()),
        "kv_transfer_params_json": vpb.GenerateRequest(tokenized=vpb.TokenizedInput(input_ids=[5]),
                                                       kv_transfer_params_json="{}"),
        "data_parallel_rank": vpb.GenerateRequest(tokenized=vpb.TokenizedInput(input_ids=[5]), data_parallel_rank=1),
        "outside the vocabulary": generate_request([5, VOCAB], max_tokens=2),
    }
    for words, req in cases.items():
        with pytest.raises(grpc.RpcError) as e:
            list(vllm.Generate(req, timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, words
        assert words in e.value.details(), e.value.details()
    ok = list(vllm.Generate(generate_request([5, 6], max_tokens=3, temperature=0.0, ignore_eos=True, top_p=0.0,
                                             repetition_penalty=0.0, truncate_prompt_tokens=1), timeout=10))
    assert len(ok[-1].complete.output_ids) == 3 and ok[-1].complete.prompt_tokens == 1
    assert wait_until_no_live_sequences(tok_server) == 0


def test_embed_is_transformers_last_hidden_state_normalized(tok_model):
    """Embed: the prompt's last token's hidden state after the final norm, L2-normalized (vLLM's embedding of a
    decoder model), as transformers computes it on the same checkpoint (fp32), for prompts within one forward and
    over several (max_prefill_tokens 16); bad prompts get INVALID_ARGUMENT; no slot or block stays taken."""
    from tests.oracle import hf_embedding

    srv = start_server(tok_model, max_prefill_tokens=16)
    try:
        stub = vpb_grpc.VllmEngineStub(grpc.insecure_channel(srv.address))
        free_blocks = srv.engine_call(lambda e: e.blocks.num_free_blocks)
        for prompt in random_prompts([1, 7, 16, 41], VOCAB, seed=5):
            got = stub.Embed(vpb.EmbedRequest(request_id="e", tokenized=vpb.TokenizedInput(input_ids=prompt)),
                             timeout=30)
            want = hf_embedding(tok_model, prompt)
            assert got.prompt_tokens == len(prompt) and got.embedding_dim == want.numel() == len(got.embedding)
            assert torch.tensor(list(got.embedding)).sub(want).abs().max().item() <= 1e-4, len(prompt)
        too_long = [1] * (srv.engine.config.max_seq_len + 1)
        for ids, named in (([], "input_ids"), ([VOCAB + 3], "token_ids"), (too_long, "--max-seq-len")):
            with pytest.raises(grpc.RpcError) as e:
                stub.Embed(vpb.EmbedRequest(tokenized=vpb.TokenizedInput(input_ids=ids)), timeout=30)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and named in e.value.details(), e.value.details()
        assert live_sequences(srv) == 0 and srv.engine_call(lambda e: e.blocks.num_free_blocks) == free_blocks
        assert list(stub.Generate(generate_request([3, 5], max_tokens=2, temperature=0.0), timeout=30))[-1] \
            .HasField("complete")
    finally:
        srv.stop()


def test_profiling_needs_a_profile_dir(vllm):
    for call, req in [(vllm.StartProfile, cpb.StartProfileRequest()), (vllm.StopProfile, cpb.StopProfileRequest())]:
        with pytest.raises(grpc.RpcError) as e:
            call(req, timeout=10)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION, e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        vllm.StartProfile(cpb.StartProfileRequest(), timeout=10)
    assert "profiling is off" in e.value.details() and "--profile-dir" in e.value.details()


def test_start_and_stop_profile_write_a_trace_of_the_steps(tok_model, tmp_path):
    """With --profile-dir: StartProfile, a Generate, StopProfile write a Chrome trace holding the forward's ops
    under the directory (or a subdirectory the call names); num_steps ends a profile by itself, start_step arms
    one; bad requests get their status, naming the field, and the worker keeps serving."""
    root = tmp_path / "profiles"
    srv = start_server(tok_model, worker_changes={"profile_dir": str(root)})
    try:
        stub = vpb_grpc.VllmEngineStub(grpc.insecure_channel(srv.address))
        bad = [(cpb.StartProfileRequest(output_dir="../elsewhere"), grpc.StatusCode.INVALID_ARGUMENT, "output_dir"),
               (cpb.StartProfileRequest(output_dir="/etc"), grpc.StatusCode.INVALID_ARGUMENT, "output_dir"),
               (cpb.StartProfileRequest(activities=["bogus"]), grpc.StatusCode.INVALID_ARGUMENT, "activities"),
               (cpb.StartProfileRequest(num_steps=0), grpc.StatusCode.INVALID_ARGUMENT, "num_steps"),
               (cpb.StartProfileRequest(start_step=-1), grpc.StatusCode.INVALID_ARGUMENT, "start_step"),
               (cpb.StartProfileRequest(profile_by_stage=True), grpc.StatusCode.INVALID_ARGUMENT, "profile_by_stage")]
        if not torch.cuda.is_available():
            bad.append((cpb.StartProfileRequest(activities=["GPU"]), grpc.StatusCode.INVALID_ARGUMENT, "GPU"))
        for req, code, named in bad:
            with pytest.raises(grpc.RpcError) as e:
                stub.StartProfile(req, timeout=10)
            assert e.value.code() == code and named in e.value.details(), (req, e.value.details())
        with pytest.raises(grpc.RpcError) as e:
            stub.StopProfile(cpb.StopProfileRequest(), timeout=10)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION

        for output_dir in ("", "run-2"):
            started = stub.StartProfile(cpb.StartProfileRequest(output_dir=output_dir, activities=["cpu"],
                                                                record_shapes=True), timeout=10)
            assert started.success and str(root / output_dir).rstrip("/") in started.message
            with pytest.raises(grpc.RpcError) as e:  # one profile at a time
                stub.StartProfile(cpb.StartProfileRequest(), timeout=10)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "StopProfile" in e.value.details()
            done = list(stub.Generate(generate_request([3, 5, 7], max_tokens=6, temperature=0.0, stream=True),
                                      timeout=30))
            assert done[-1].HasField("complete")
            stopped = stub.StopProfile(cpb.StopProfileRequest(), timeout=60)
            path = pathlib.Path(stopped.message.rsplit(" ", 1)[-1])
            assert stopped.success and path.parent == (root / output_dir).resolve() and path.is_file()
            names = {ev.get("name", "") for ev in json.loads(path.read_text())["traceEvents"]}
            assert any(n.startswith("aten::") and ("mm" in n or "linear" in n) for n in names), sorted(names)[:20]
        assert len(list(root.rglob("*.json"))) == 2

        # num_steps: the profile ends by itself as the step after its third starts, and writes its trace
        started = stub.StartProfile(cpb.StartProfileRequest(output_dir="bounded", num_steps=3), timeout=10)
        assert started.success and "for 3 forward steps" in started.message
        list(stub.Generate(generate_request([3, 5, 7], max_tokens=8, temperature=0.0, ignore_eos=True), timeout=30))
        deadline = time.monotonic() + 30
        while not list((root / "bounded").glob("*.json")) and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(grpc.RpcError) as e:  # written already: nothing runs
            stub.StopProfile(cpb.StopProfileRequest(), timeout=60)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "bounded" in e.value.details()
        trace = next((root / "bounded").glob("*.json"))
        assert any(ev.get("name", "").startswith("aten::") for ev in json.loads(trace.read_text())["traceEvents"])
        # start_step in the future: armed, and dropped by StopProfile before it begins
        armed = stub.StartProfile(cpb.StartProfileRequest(start_step=10 ** 9), timeout=10)
        assert "from forward step 1000000000" in armed.message
        assert "dropped before it began" in stub.StopProfile(cpb.StopProfileRequest(), timeout=10).message
        # and the worker still serves
        assert list(stub.Generate(generate_request([3, 5], max_tokens=2, temperature=0.0), timeout=30))[-1] \
            .HasField("complete")
    finally:
        srv.stop()


def fetch_tokenizer(stub) -> tuple[bytes, list[cpb.GetTokenizerChunk]]:
    pieces = list(stub.GetTokenizer(cpb.GetTokenizerRequest(), timeout=30))
    return b"".join(p.data for p in pieces), pieces


def test_get_tokenizer_zip_and_sha256(vllm, tok_model):
    data, pieces = fetch_tokenizer(vllm)
    assert pieces[-1].sha256 == hashlib.sha256(data).hexdigest()
    assert all(not p.sha256 for p in pieces[:-1])
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        names = set(zf.namelist())
        assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= names
        assert "model.safetensors" not in names
        assert zf.read("tokenizer.json") == (tok_model / "tokenizer.json").read_bytes()
    assert fetch_tokenizer(vllm)[0] == data  # served from memory, the same archive


def test_tokenizer_chunks_are_64k_with_the_digest_on_the_last():
    from worker.tokenizer_bundle import CHUNK_BYTES, chunks

    data = bytes(range(256)) * 600  # 153600 bytes: two full chunks and a partial one
    pieces = list(chunks(data, "digest"))
    assert [len(p.data) for p in pieces] == [CHUNK_BYTES, CHUNK_BYTES, len(data) - 2 * CHUNK_BYTES]
    assert [p.sha256 for p in pieces] == ["", "", "digest"] and b"".join(p.data for p in pieces) == data


def test_get_tokenizer_without_tokenizer_files(server):
    stub = vpb_grpc.VllmEngineStub(grpc.insecure_channel(server.address))
    with pytest.raises(grpc.RpcError) as e:
        fetch_tokenizer(stub)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "no tokenizer files" in e.value.details()
    assert stub.GetModelInfo(vpb.GetModelInfoRequest(), timeout=10).tokenizer_path == ""


def test_bearer_token_guards_the_gateway_service(tiny_model, tmp_path):
    """With auth_token_file every VllmEngine call needs the token, streaming ones refused as streams."""
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    srv = start_server(tiny_model, {"auth_token_file": str(token_file)})
    try:
        stub = vpb_grpc.VllmEngineStub(grpc.insecure_channel(srv.address))
        for call in (lambda md: stub.HealthCheck(vpb.HealthCheckRequest(), timeout=10, metadata=md),
                     lambda md: list(stub.Generate(generate_request([5], max_tokens=2), timeout=10, metadata=md)),
                     lambda md: list(stub.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(), timeout=10,
                                                            metadata=md))):
            with pytest.raises(grpc.RpcError) as e:
                call(())
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        authorized = (("authorization", "Bearer s3cret"),)
        assert stub.HealthCheck(vpb.HealthCheckRequest(), timeout=10, metadata=authorized).healthy
        done = list(stub.Generate(generate_request([5], max_tokens=2, ignore_eos=True), timeout=10,
                                  metadata=authorized))[-1]
        assert len(done.complete.output_ids) == 2
    finally:
        srv.stop()


def test_unavailable_while_the_model_loads():
    """Before the engine is attached every call fails UNAVAILABLE, HealthCheck too: smg 1.13 registers a
    worker whose HealthCheck answers at all and reads its model info only then (it would be "unknown")."""
    import asyncio
    import threading

    from worker.gateway import VllmEngineServicer
    from worker.metrics import Metrics

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def serve() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        vpb_grpc.add_VllmEngineServicer_to_server(VllmEngineServicer(Metrics(), lambda: ""), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = asyncio.run_coroutine_threadsafe(serve(), loop).result(30)
    try:
        stub = vpb_grpc.VllmEngineStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        for call in (lambda: stub.HealthCheck(vpb.HealthCheckRequest(), timeout=10),
                     lambda: stub.GetModelInfo(vpb.GetModelInfoRequest(), timeout=10),
                     lambda: stub.GetLoads(vpb.GetLoadsRequest(), timeout=10),
                     lambda: list(stub.Generate(generate_request([5], max_tokens=2), timeout=10)),
                     lambda: list(stub.GetTokenizer(cpb.GetTokenizerRequest(), timeout=10))):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "loading" in e.value.details()
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def test_health_check_false_while_a_step_is_stuck(tiny_model):
    import threading

    srv = start_server(tiny_model, {"step_watchdog_s": 0.3})
    try:
        stub = vpb_grpc.VllmEngineStub(grpc.insecure_channel(srv.address))
        assert stub.HealthCheck(vpb.HealthCheckRequest(), timeout=10).healthy
        stuck = threading.Thread(target=lambda: srv.engine_call(lambda e: time.sleep(2.0)))
        stuck.start()
        answers = []
        deadline = time.monotonic() + 1.8
        while time.monotonic() < deadline:
            answers.append(stub.HealthCheck(vpb.HealthCheckRequest(), timeout=10))
            time.sleep(0.05)
        stuck.join()
        assert any(not a.healthy and "watchdog" in a.message for a in answers)
        deadline = time.monotonic() + 5
        while not (resp := stub.HealthCheck(vpb.HealthCheckRequest(), timeout=10)).healthy \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert resp.healthy and resp.message == "serving"
    finally:
        srv.stop()


def test_health_check_false_while_draining(tiny_model):
    srv = start_server(tiny_model)
    drain = None
    try:
        stub = vpb_grpc.VllmEngineStub(grpc.insecure_channel(srv.address))
        stream = stub.Generate(generate_request([5, 6], "held", True, temperature=0.0, max_tokens=400,
                                                ignore_eos=True), timeout=60)
        next(stream)  # a live sequence keeps the drain waiting
        import asyncio
        drain = asyncio.run_coroutine_threadsafe(srv.worker.drain(grace_s=30), srv.loop)
        deadline = time.monotonic() + 10
        while (resp := stub.HealthCheck(vpb.HealthCheckRequest(), timeout=10)).healthy and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not resp.healthy and "draining" in resp.message
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(generate_request([5], max_tokens=2), timeout=10))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            stub.Embed(vpb.EmbedRequest(tokenized=vpb.TokenizedInput(input_ids=[5, 6])), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in e.value.details()
        assert stub.GetServerInfo(vpb.GetServerInfoRequest(), timeout=10).is_paused
        stream.cancel()
        drain.result(30)  # the drain ends with the worker stopped
    finally:
        if drain is None or not drain.done():
            srv.stop()
        else:
            srv.loop.call_soon_threadsafe(srv.loop.stop)
            srv.thread.join(10)


# ---------------------------------------------------------------------------------------------
# The real gateway


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, body: dict | None = None, timeout: float = 30) -> tuple[int, dict | str]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read().decode()
            return r.status, raw if body is not None and body.get("stream") else json.loads(raw)
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def smg_binary() -> str:
    path = shutil.which("smg", path=str(pathlib.Path(sys.executable).parent)) or shutil.which("smg")
    if path is None:
        pytest.fail("smg is not installed; it is in the test extras: pip install -e '.[test]'")
    return path


def test_smg_routes_openai_requests_to_the_worker(tmp_path):
    """smg 1.13 detects the worker's service by its HealthCheck, registers it (GetModelInfo, GetServerInfo),
    fetches its tokenizer (GetTokenizer: the checkpoint directory is moved away after the worker loaded,
    so smg has no local copy) and serves /v1/completions, streaming and not, with the worker's tokens; the
    logits processors and n > 1 go through to the worker."""
    from tokenizers import Tokenizer

    model = checkpoint_with_tokenizer(tmp_path / "smg-tiny", seed=12)
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    srv = start_server(model)
    proc = None
    log_path = tmp_path / "smg.log"
    try:
        vllm = vpb_grpc.VllmEngineStub(grpc.insecure_channel(srv.address))
        fetch_tokenizer(vllm)  # the worker keeps the archive in memory
        model.rename(tmp_path / "moved-away")
        text = " ".join(f"w{i}" for i in range(5, 13))
        prompt = tokenizer.encode(text).ids
        want = [t.token_id for t in model_worker_generate(srv, prompt, 8, temperature=0.0)]

        port, metrics_port = free_port(), free_port()
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [smg_binary(), "launch", "--worker-urls", f"grpc://127.0.0.1:{srv.port}", "--host", "127.0.0.1",
                 "--port", str(port), "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
                 "--policy", "round_robin", "--log-level", "info"], stdout=log, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        deadline, models = time.monotonic() + 60, []
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                status, body = http_json(f"{base}/v1/models", timeout=5)
                models = [m["id"] for m in body["data"]] if status == 200 else []
            except (OSError, ValueError):
                models = []
            if "smg-tiny" in models:
                break
            time.sleep(0.2)
        assert "smg-tiny" in models, log_path.read_text()[-4000:]

        request = {"model": "smg-tiny", "prompt": text, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        deadline = time.monotonic() + 60  # the tokenizer fetch finishes in the background after registration
        while (reply := http_json(f"{base}/v1/completions", request))[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        status, body = reply
        assert status == 200, (body, log_path.read_text()[-4000:])
        assert body["usage"]["completion_tokens"] == 8 and body["usage"]["prompt_tokens"] == len(prompt)
        expected_text = tokenizer.decode(want, skip_special_tokens=True)
        assert body["choices"][0]["text"].split() == expected_text.split()
        assert body["choices"][0]["finish_reason"] == "length"

        status, sse = http_json(f"{base}/v1/completions", dict(request, stream=True))
        assert status == 200
        events = [json.loads(line[6:]) for line in sse.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        streamed = "".join(c["text"] for e in events for c in e.get("choices", []))
        assert streamed.split() == expected_text.split()

        status, body = http_json(f"{base}/v1/completions", dict(request, min_p=1.5))  # outside [0, 1]
        assert 400 <= status < 500 and "min_p" in body, body
        # The logits processors and n reach the worker: choice i is ModelWorker's sequence with seed 3 + i (smg
        # 1.13 does not forward logit_bias: not asserted here).
        extras = dict(min_p=0.3, presence_penalty=1.0, frequency_penalty=0.5)
        texts = [tokenizer.decode([t.token_id for t in model_worker_generate(srv, prompt, 8, temperature=1.0,
                                                                             seed=3 + i, **extras)],
                                  skip_special_tokens=True).split() for i in range(2)]
        plain = tokenizer.decode([t.token_id for t in model_worker_generate(srv, prompt, 8, temperature=1.0, seed=3)],
                                 skip_special_tokens=True).split()
        assert texts[0] != plain and texts[0] != texts[1]
        status, body = http_json(f"{base}/v1/completions", dict(request, temperature=1.0, seed=3, n=2, **extras))
        assert status == 200 and [c["text"].split() for c in body["choices"]] == texts, body
        fetched = srv.worker.metrics.registry.get_sample_value(
            "metrale_rpc_total", {"method": "VllmEngine.GetTokenizer", "code": "OK"})
        assert fetched == 2  # ours above, then smg's
        assert wait_until_no_live_sequences(srv) == 0
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        srv.stop()


def test_waiting_calls_and_throughput_in_the_load():
    from worker.gateway_requests import THROUGHPUT_WINDOW_S, Requests

    requests = Requests()
    waiting, started = requests.add("a", 7), requests.add("b", 5, n=3)
    started.choices[0].seq_id = 3
    requests.count_tokens(4)
    requests.count_tokens(6)
    load = requests.load()
    assert (load.waiting, load.waiting_prompt_tokens) == (3, 17)  # choices not started: a's one, b's last two
    assert load.gen_throughput == pytest.approx(10 / THROUGHPUT_WINDOW_S)
    requests.remove(waiting)
    assert requests.load().waiting == 2 and requests.num_active == 1
    for i, choice in enumerate(started.choices):
        choice.seq_id = 10 + i
    assert requests.load().waiting == 0


def test_a_generate_waits_for_room_in_arrival_order(tok_model):
    """With every slot taken, a Generate (n = 1, of either service) waits, as vLLM's queued requests do, and GetLoads
    counts it waiting; it runs once a sequence ends. The waits end in arrival order; one whose caller's deadline
    passes leaves nothing behind; one that could never fit the KV cache is refused at once; a drain sends the
    waiting ones away with UNAVAILABLE."""
    import threading

    from worker.client import WorkerClient

    srv = start_server(tok_model, max_slots=2, num_kv_blocks=17)  # 16 usable blocks: 256 tokens of KV
    try:
        vllm = vpb_grpc.VllmEngineStub(grpc.insecure_channel(srv.address))
        stub = srv.stub()
        prompt = random_prompts([5], VOCAB, seed=71)[0]

        def hold() -> int:  # a router's sequence: it holds its slot until released
            return stub.AllocSequence(pb.AllocSequenceRequest(max_total_tokens=32)).sequence_id
        holders = [hold(), hold()]  # both slots are taken
        finished: list[str] = []
        counts: dict[str, int] = {}

        def gateway_call(rid: str) -> None:
            calls = vllm.Generate(generate_request(prompt, rid, True, temperature=0.0, max_tokens=3, ignore_eos=True),
                                  timeout=60)
            counts[rid] = sum(len(r.chunk.token_ids) for r in calls)
            finished.append(rid)

        def worker_call() -> None:
            counts["mw"] = len(list(WorkerClient(srv.address).generate(prompt, max_new_tokens=3, ignore_eos=True)))
            finished.append("mw")

        threads = [threading.Thread(target=gateway_call, args=("w1",))]
        threads[0].start()
        deadline = time.monotonic() + 10
        while vllm.GetLoads(vpb.GetLoadsRequest()).loads[0].num_waiting_reqs < 1:
            assert time.monotonic() < deadline, "the third Generate did not wait"
            time.sleep(0.02)
        threads.append(threading.Thread(target=worker_call))
        threads[1].start()
        with pytest.raises(grpc.RpcError) as e:  # a caller that gives up while it waits
            list(vllm.Generate(generate_request(prompt, "gives-up", True, max_tokens=3), timeout=0.5))
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        deadline = time.monotonic() + 10
        while srv.worker.runner.streams.num_waiting != 2:  # w1 and mw: the one that gave up waits no more
            assert time.monotonic() < deadline, srv.worker.runner.streams.num_waiting
            time.sleep(0.02)
        with pytest.raises(grpc.RpcError) as e:  # 5 + 400 tokens need 26 blocks of the 16 there are: never fits
            list(vllm.Generate(generate_request(prompt, "never", True, max_tokens=400), timeout=10))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "KV blocks" in e.value.details()
        assert finished == [] and live_sequences(srv) == 2
        stub.Release(pb.ReleaseRequest(sequence_ids=[holders[0]]))  # a slot comes free: w1 (first) runs, then mw
        for t in threads:
            t.join(timeout=30)
        assert finished == ["w1", "mw"] and counts == {"w1": 3, "mw": 3}
        # A drain sends a waiting call away (the live ones may finish).
        holders.append(hold())
        waiting = vllm.Generate(generate_request(prompt, "drained", True, max_tokens=3), timeout=30)
        waiter = threading.Thread(target=lambda: counts.update(drained=_status(waiting)))
        waiter.start()
        deadline = time.monotonic() + 10
        while vllm.GetLoads(vpb.GetLoadsRequest()).loads[0].num_waiting_reqs < 1:
            assert time.monotonic() < deadline, "the drained Generate did not wait"
            time.sleep(0.02)
        srv.run(srv.worker.drain(0.5))  # (it stops the worker)
        waiter.join(timeout=30)
        assert counts["drained"] == grpc.StatusCode.UNAVAILABLE
    except BaseException:
        srv.stop()
        raise
    srv.loop.call_soon_threadsafe(srv.loop.stop)
    srv.thread.join(10)



@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_start_together_in_one_prefill(tok_server, vllm, stream):
    """The choices of an n > 1 call start at once and share one engine prefill (Info's step counters: one prefill
    call for the four, where starting them one after another took four)."""
    prompt = random_prompts([9], VOCAB, seed=73)[0]
    before = tok_server.stub().Info(pb.InfoRequest()).steps.prefill_calls
    responses = list(vllm.Generate(generate_request(prompt, f"n4-one-prefill-{stream}", stream, temperature=1.0,
                                                    seed=5, n=4, max_tokens=3, ignore_eos=True), timeout=60))
    assert sorted(split_by_index(responses)[1]) == [0, 1, 2, 3]
    assert tok_server.stub().Info(pb.InfoRequest()).steps.prefill_calls - before == 1


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_beyond_the_free_slots_or_blocks_wait_for_room(tok_model, stream):
    """n = 3 with one slot of three free (two held by a router's sequences), then n = 2 whose KV reservations do not
    fit the cache together (10 blocks each of 16): the choices that find no room wait, each for the slot or blocks
    the started ones free as they end (those run on unread), and each is ModelWorker's
    sequence with its seed, as with room for all. Nothing is left behind."""
    srv = start_server(tok_model, max_slots=3, num_kv_blocks=17)  # 16 usable blocks: 256 tokens of KV
    try:
        vllm = vpb_grpc.VllmEngineStub(grpc.insecure_channel(srv.address))
        prompt = random_prompts([6], VOCAB, seed=72)[0]

        def choices(n: int, max_tokens: int, rid: str) -> list[list[int]]:
            responses = list(vllm.Generate(generate_request(prompt, rid, stream, temperature=1.0, seed=900, n=n,
                                                            max_tokens=max_tokens, ignore_eos=True), timeout=60))
            chunks, completes = split_by_index(responses)
            assert [completes[i].finish_reason for i in range(n)] == ["length"] * n
            return [chunks[i] for i in range(n)] if stream else [list(completes[i].output_ids) for i in range(n)]

        want = [model_worker_tokens(srv, prompt, 150, dict(ignore_eos=True), temperature=1.0, seed=900 + i)
                for i in range(3)]
        holders = [srv.stub().AllocSequence(pb.AllocSequenceRequest(max_total_tokens=32)).sequence_id
                   for _ in range(2)]
        assert choices(3, 12, f"n3-one-slot-{stream}") == [w[:12] for w in want]
        srv.stub().Release(pb.ReleaseRequest(sequence_ids=holders))
        assert wait_until_no_live_sequences(srv) == 0
        assert choices(2, 150, f"n2-blocks-{stream}") == want[:2]  # 6 + 150 tokens: 10 blocks each
        assert wait_until_no_live_sequences(srv) == 0
        assert srv.worker.runner.streams.num_waiting == 0
    finally:
        srv.stop()

def _status(call) -> grpc.StatusCode:
    try:
        list(call)
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()
