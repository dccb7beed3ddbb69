"""Bad input gets a clear status code and message, changes nothing, leaks nothing; the server keeps serving.
Start-up problems (in process here; through the command line in test_cli.py) are one ConfigError that
names the flag, file or port."""
from __future__ import annotations

import asyncio
import json
import socket

import grpc
import pytest

from conftest import alloc, start_server
from metrale.worker.v1 import worker_pb2 as pb

C = grpc.StatusCode


def expect(code: grpc.StatusCode, fn, *args, match: str = ""):
    with pytest.raises(grpc.RpcError) as info:
        fn(*args)
    assert info.value.code() == code, info.value.details()
    assert match.lower() in info.value.details().lower()
    return info.value.details()


def prefill(stub, sid, tokens, partial=False):
    return stub.Prefill(pb.PrefillRequest(items=[pb.PrefillItem(sequence_id=sid, token_ids=tokens, partial=partial)]))


@pytest.fixture(scope="module")
def small():
    """A server with few slots and blocks, so exhaustion is reachable."""
    from conftest import TINY_CONFIGS  # noqa: F401
    import pathlib
    import tempfile
    from engine.checkpoint import write_checkpoint
    path = write_checkpoint(pathlib.Path(tempfile.mkdtemp()) / "m", arch="llama", shape="tiny", seed=3)
    srv = start_server(path, max_slots=4, num_kv_blocks=17, block_size=16, max_batch_size=3, max_seq_len=128)
    yield srv
    srv.stop()


def state(srv):
    return srv.engine_call(lambda e: (e.blocks.num_free_blocks, e.slots.num_free_slots, len(e.sequences),
                                      {s.seq_id: (list(s.token_ids), s.num_cached) for s in e.sequences.values()}))


def test_every_bad_call_gets_its_status_and_changes_nothing(small):
    stub = small.stub()
    a = alloc(stub, 40, stopping=pb.StoppingCriteria(max_new_tokens=3, ignore_eos=True))
    b = alloc(stub, 40)
    prefill(stub, a, [1, 2, 3])
    before = state(small)
    cases = [
        (C.INVALID_ARGUMENT, stub.Prefill, pb.PrefillRequest(items=[pb.PrefillItem(sequence_id=b, token_ids=[512])]), "vocabulary"),
        (C.INVALID_ARGUMENT, stub.Decode, pb.DecodeRequest(), "empty"),
        (C.INVALID_ARGUMENT, stub.Prefill, pb.PrefillRequest(), "empty"),
        (C.INVALID_ARGUMENT, stub.Decode, pb.DecodeRequest(sequence_ids=[a, a]), "duplicate"),
        (C.INVALID_ARGUMENT, stub.Prefill, pb.PrefillRequest(items=[pb.PrefillItem(sequence_id=b, token_ids=list(range(40)))]), "room"),
        (C.INVALID_ARGUMENT, stub.Prefill, pb.PrefillRequest(items=[pb.PrefillItem(sequence_id=b, token_ids=[])]), "empty"),
        (C.INVALID_ARGUMENT, stub.Decode, pb.DecodeRequest(sequence_ids=[a], input_token_ids=[1, 2]), "input_token_ids"),
        (C.INVALID_ARGUMENT, stub.Decode, pb.DecodeRequest(sequence_ids=[a], input_token_ids=[9999]), "vocabulary"),
        (C.INVALID_ARGUMENT, stub.Verify, pb.VerifyRequest(items=[pb.VerifyItem(sequence_id=a, draft_token_ids=[1] * 17)]), "draft"),
        (C.INVALID_ARGUMENT, stub.Verify, pb.VerifyRequest(items=[pb.VerifyItem(sequence_id=a, draft_token_ids=[1, 2], draft_probs=[0.5])]), "draft_probs"),
        (C.INVALID_ARGUMENT, stub.AllocSequence, pb.AllocSequenceRequest(max_total_tokens=1), "max_total_tokens"),
        (C.INVALID_ARGUMENT, stub.AllocSequence, pb.AllocSequenceRequest(max_total_tokens=100000), "max_total_tokens"),
        (C.INVALID_ARGUMENT, stub.AllocSequence, pb.AllocSequenceRequest(max_total_tokens=8, sampling=pb.SamplingParams(temperature=-1)), "temperature"),
        (C.INVALID_ARGUMENT, stub.AllocSequence, pb.AllocSequenceRequest(max_total_tokens=8, sampling=pb.SamplingParams(top_p=1.5)), "top_p"),
        (C.INVALID_ARGUMENT, stub.AllocSequence, pb.AllocSequenceRequest(max_total_tokens=8, sampling=pb.SamplingParams(temperature=float("nan"))), "temperature"),
        (C.INVALID_ARGUMENT, stub.AllocSequence, pb.AllocSequenceRequest(max_total_tokens=8, sampling=pb.SamplingParams(top_logprobs=1000)), "top_logprobs"),
        (C.INVALID_ARGUMENT, stub.AllocSequence, pb.AllocSequenceRequest(max_total_tokens=8, stopping=pb.StoppingCriteria(stop_token_ids=[600])), "stop_token_ids"),
        (C.NOT_FOUND, stub.Decode, pb.DecodeRequest(sequence_ids=[a, 987654]), "987654"),
        (C.NOT_FOUND, stub.Release, pb.ReleaseRequest(sequence_ids=[b, 987654]), "987654"),
        (C.NOT_FOUND, stub.Prefill, pb.PrefillRequest(items=[pb.PrefillItem(sequence_id=987654, token_ids=[1])]), "987654"),
        (C.FAILED_PRECONDITION, stub.Decode, pb.DecodeRequest(sequence_ids=[a, b]), "prefill first"),
        (C.FAILED_PRECONDITION, stub.Verify, pb.VerifyRequest(items=[pb.VerifyItem(sequence_id=b, draft_token_ids=[1])]), "prefill first"),
        (C.FAILED_PRECONDITION, stub.Prefill, pb.PrefillRequest(items=[pb.PrefillItem(sequence_id=a, token_ids=[1])]), "already complete"),
        (C.RESOURCE_EXHAUSTED, stub.Decode, pb.DecodeRequest(sequence_ids=[a, b, 5, 6]), "max_batch_size"),
    ]
    for code, fn, req, match in cases:
        expect(code, fn, req, match=match)
        assert state(small) == before, f"{fn._method} {req} changed state"
    # A finished sequence refuses further steps until released.
    stub.Decode(pb.DecodeRequest(sequence_ids=[a]))
    last = stub.Decode(pb.DecodeRequest(sequence_ids=[a])).tokens[0]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    expect(C.FAILED_PRECONDITION, stub.Decode, pb.DecodeRequest(sequence_ids=[a]), match="finished")
    stub.Release(pb.ReleaseRequest(sequence_ids=[a, b]))
    free_blocks, free_slots, live, _ = state(small)
    assert (free_blocks, free_slots, live) == (16, 4, 0)
    assert stub.Info(pb.InfoRequest()).free_blocks == 16


def test_slots_and_blocks_exhaust_with_resource_exhausted(small):
    stub = small.stub()
    ids = [alloc(stub, 60) for _ in range(4)]  # 4 blocks each: 16 blocks, 4 slots
    expect(C.RESOURCE_EXHAUSTED, alloc, stub, 16, match="slots")
    stub.Release(pb.ReleaseRequest(sequence_ids=ids[:1]))
    details = expect(C.RESOURCE_EXHAUSTED, alloc, stub, 128, match="blocks")
    # 128 tokens are 8 blocks of 16; 3 live sequences hold 12 of the 16 usable blocks (17 less the scratch one).
    for figure in ("128 tokens", "8 KV blocks", "16 tokens", "4 of 16", "--kv-cache-memory", "--num-kv-blocks"):
        assert figure in details, (figure, details)
    ids[0] = alloc(stub, 60)
    stub.Release(pb.ReleaseRequest(sequence_ids=ids))
    assert state(small)[:3] == (16, 4, 0)


def test_chunked_prefill_rules(small):
    stub = small.stub()
    sid = alloc(stub, 40)
    assert list(prefill(stub, sid, [1, 2], partial=True).tokens) == []
    expect(C.FAILED_PRECONDITION, stub.Decode, pb.DecodeRequest(sequence_ids=[sid]), match="prefill first")
    prefill(stub, sid, [3], partial=True)
    tok = prefill(stub, sid, [], partial=False).tokens[0]  # an empty final chunk completes the prompt
    assert tok.seq_len == 4
    stub.Release(pb.ReleaseRequest(sequence_ids=[sid]))


def test_unexpected_engine_exception_is_internal_and_server_keeps_serving(small, caplog):
    stub = small.stub()
    sid = alloc(stub, 40)
    prefill(stub, sid, [1, 2, 3])
    engine = small.engine
    original = engine.runtime.model.forward

    def boom(batch):
        raise RuntimeError("injected fault")
    engine.runtime.model.forward = boom
    try:
        details = expect(C.INTERNAL, stub.Decode, pb.DecodeRequest(sequence_ids=[sid]),
                         match="request id")
    finally:
        engine.runtime.model.forward = original
    rid = details.split("request id ")[1].split(")")[0]
    assert any(rid in r.getMessage() and r.exc_info for r in caplog.records)
    assert stub.Decode(pb.DecodeRequest(sequence_ids=[sid])).tokens[0].seq_len == 5
    stub.Release(pb.ReleaseRequest(sequence_ids=[sid]))
    assert state(small)[:3] == (16, 4, 0)


# ----------------------------------------------------------------------------------------------------
# Start-up errors, in process

def test_the_block_allocator_names_the_figures_and_flags():
    from engine.errors import ResourceExhausted
    from engine.kv_cache import BlockAllocator
    blocks = BlockAllocator(10)
    blocks.allocate(7)
    with pytest.raises(ResourceExhausted) as info:
        blocks.allocate(3)
    for figure in ("need 3", "2 of 9", "--kv-cache-memory", "--num-kv-blocks"):
        assert figure in str(info.value), (figure, str(info.value))


def test_a_kv_cache_that_does_not_fit_names_its_size_and_the_flags(tiny_model, monkeypatch):
    import torch

    import engine.runtime
    from conftest import engine_config
    from engine.engine import Engine
    from engine.errors import ConfigError
    from engine.kv_cache import KVCache

    class NoRoom(KVCache):
        def __init__(self, *args, **kwargs):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB\nmore detail")
    monkeypatch.setattr(engine.runtime, "KVCache", NoRoom)
    with pytest.raises(ConfigError) as info:
        Engine(engine_config(tiny_model, num_kv_blocks=4096, block_size=32))
    message = str(info.value)
    for figure in ("4096 blocks", "32 tokens", "--num-kv-blocks 4096", "--kv-cache-memory", "Tried to allocate"):
        assert figure in message, (figure, message)
    assert "\n" not in message


@pytest.mark.parametrize("change,names", [
    (lambda raw: [raw], ["JSON object"]),
    (lambda raw: {**raw, "num_key_value_heads": -2}, ["num_key_value_heads", "-2"]),
    (lambda raw: {**raw, "num_attention_heads": 0, "head_dim": None}, ["num_attention_heads"]),
    (lambda raw: {**raw, "vocab_size": None}, ["None"]),
    (lambda raw: {**raw, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, ["yarn"]),
    (lambda raw: {k: v for k, v in raw.items() if k != "hidden_size"}, ["hidden_size"]),
])
def test_a_bad_config_json_is_a_config_error_naming_the_file(tmp_path, change, names):
    from engine.checkpoint import make_config
    from engine.config import ModelConfig
    from engine.errors import ConfigError
    (tmp_path / "config.json").write_text(json.dumps(change(make_config("llama", "tiny"))))
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_dir(tmp_path)
    for name in [str(tmp_path / "config.json"), *names]:
        assert name in str(info.value), (name, str(info.value))


def test_a_port_taken_after_the_check_is_still_a_config_error_and_leaves_nothing_running(tiny_model, monkeypatch):
    """The race the pre-check cannot close: the port is taken between the check and gRPC's bind."""
    from conftest import engine_config
    from engine.errors import ConfigError
    from worker import preflight
    from worker.config import WorkerConfig
    from worker.server import Worker

    monkeypatch.setattr(preflight, "check_port", lambda *args: None)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        worker = Worker(WorkerConfig(host="127.0.0.1", port=0, health_port=port), engine_config(tiny_model))

        async def start():
            with pytest.raises(ConfigError, match=f"--health-port {port}"):
                await worker.start()
        asyncio.run(start())
    assert worker._stopped.is_set() and worker.runner is None
