"""DecodeStream over a real socket: steps answered in order with what Decode calls give (transformers as
the oracle), refused steps answered with their status while the stream goes on, nothing left behind
by a stream the client abandons, and the end of a drain closing open streams."""
from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from conftest import random_prompts, start_server
from metrale.worker.v1 import worker_pb2 as pb
from oracle import hf_greedy
from worker.client import AsyncWorkerClient, StepRefused, Stopping, WorkerClient


def _start(client: WorkerClient, prompts: list[list[int]], max_new: int) -> tuple[list[int], dict[int, list[int]]]:
    stopping = Stopping(max_new_tokens=max_new, ignore_eos=True)
    ids = [client.alloc(len(p) + max_new + 1, stopping=stopping).sequence_id for p in prompts]
    first = client.prefill([pb.PrefillItem(sequence_id=i, token_ids=p) for i, p in zip(ids, prompts)])
    return ids, {t.sequence_id: [t.token_id] for t in first.tokens}


def test_stream_steps_match_transformers_in_order(server, tiny_model):
    """Every step sent before any answer is read (the worker queues them): the answers come one per
    request, in order (each sequence's seq_len goes up by one per answer), with the tokens
    transformers' greedy decoding gives, and the last one finishes with LENGTH."""
    prompts = random_prompts([6, 13, 9], 512, seed=21)
    max_new = 7
    with WorkerClient(server.address) as client:
        ids, out = _start(client, prompts, max_new)
        with client.decode_stream() as stream:
            for _ in range(max_new - 1):
                stream.send(ids)
            answers = [stream.recv() for _ in range(max_new - 1)]
        for n, answer in enumerate(answers):
            assert [t.sequence_id for t in answer.tokens] == ids and answer.forward_ns > 0
            assert [t.seq_len for t in answer.tokens] == [len(p) + 2 + n for p in prompts]
            for t in answer.tokens:
                out[t.sequence_id].append(t.token_id)
        assert {t.finish_reason for t in answers[-1].tokens} == {pb.FINISH_REASON_LENGTH}
        assert client.release(ids) == len(ids)
    for sid, prompt in zip(ids, prompts):
        assert out[sid] == hf_greedy(tiny_model, prompt, max_new)


def test_stream_answers_carry_step_times_when_asked(server):
    """A stream opened with x-step-times metadata: each answer holds the step's five CLOCK_MONOTONIC ns
    stamps in order, inside the client's own window; without it, none."""
    import time
    with WorkerClient(server.address) as client:
        ids, _ = _start(client, [[1, 2, 3]], 4)
        before = time.monotonic_ns()
        with client.decode_stream(metadata=(("x-step-times", "1"),)) as stream:
            stream.send(ids)
            stamps = list(stream.recv_full().step_times_ns)
        after = time.monotonic_ns()
        assert len(stamps) == 5 and before <= stamps[0] and stamps == sorted(stamps) and stamps[-1] <= after
        with client.decode_stream() as stream:
            stream.send(ids)
            plain = stream.recv_full()
        assert plain.HasField("step") and not plain.step_times_ns
        client.release(ids)


def test_refused_steps_answer_their_status_and_the_stream_goes_on(server):
    """Unknown ids, a sequence before its prefill, duplicates in one batch and a finished sequence
    are each answered with the code a Decode call would fail with; none changes a sequence or a
    KV block, and the steps after them on the same stream run."""
    with WorkerClient(server.address) as client:
        ids, _ = _start(client, [[3, 4, 5]], 2)
        fresh = client.alloc(16).sequence_id  # no prefill yet
        free_blocks = client.info().free_blocks
        bad = [([999_999], grpc.StatusCode.NOT_FOUND), ([fresh], grpc.StatusCode.FAILED_PRECONDITION),
               (ids + ids, grpc.StatusCode.INVALID_ARGUMENT), ([], grpc.StatusCode.INVALID_ARGUMENT)]
        with client.decode_stream() as stream:
            for seq_ids, _ in bad:
                stream.send(seq_ids)
            stream.send(ids)  # the sequence's last token (max_new_tokens 2)
            stream.send(ids)  # now finished
            for seq_ids, code in bad:
                with pytest.raises(StepRefused) as info:
                    stream.recv()
                assert info.value.code() == code, seq_ids
            last = stream.recv().tokens[0]
            assert last.seq_len == 5 and last.finish_reason == pb.FINISH_REASON_LENGTH
            with pytest.raises(StepRefused) as info:
                stream.recv()
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "finished" in info.value.details()
            stream.close()
            with pytest.raises(StopIteration):
                stream.recv()
        assert client.info().free_blocks == free_blocks
        assert client.release(ids + [fresh]) == 2
    metrics = server.worker.metrics.registry
    assert metrics.get_sample_value("metrale_decode_stream_steps_total", {"code": "NOT_FOUND"}) >= 1
    assert metrics.get_sample_value("metrale_decode_stream_steps_total", {"code": "OK"}) >= 1


def test_input_token_override_on_a_stream_matches_the_call(server):
    """input_token_ids on a stream step replace the last token exactly as on a Decode call."""
    prompt = random_prompts([8], 512, seed=5)[0]
    with WorkerClient(server.address) as client:
        results = []
        for use_stream in (False, True):
            ids, _ = _start(client, [prompt], 4)
            if use_stream:
                with client.decode_stream() as stream:
                    stream.send(ids, [77])
                    stream.send(ids)
                    tokens = [stream.recv().tokens[0].token_id, stream.recv().tokens[0].token_id]
            else:
                tokens = [client.decode(ids, [77]).tokens[0].token_id, client.decode(ids).tokens[0].token_id]
            results.append(tokens)
            client.release(ids)
    assert results[0] == results[1]


def test_an_abandoned_stream_leaves_nothing_behind(server):
    """A client that cancels its stream with steps still queued: the sequence stays consistent (its
    length counts exactly the steps that ran), Release frees everything, and the worker keeps serving."""
    with WorkerClient(server.address) as client:
        total_free = client.info().free_blocks
        ids, _ = _start(client, [[1, 2, 3, 4]], 40)
        stream = client.decode_stream()
        for _ in range(30):
            stream.send(ids)
        stream.recv()
        stream.cancel()
        step = client.decode(ids).tokens[0]  # after the 1 to 30 stream steps that ran
        assert 7 <= step.seq_len <= 36
        assert server.engine_call(lambda e: (e.sequences[ids[0]].seq_len, e.sequences[ids[0]].num_cached)) == \
            (step.seq_len, step.seq_len - 1)
        assert client.release(ids) == 1
        info = client.info()
        assert info.live_sequences == 0 and info.free_blocks == total_free


def test_async_client_stream(server):
    prompt = random_prompts([10], 512, seed=8)[0]
    with WorkerClient(server.address) as client:
        expected = [t.token_id for t in client.generate(prompt, 5, ignore_eos=True)]

    async def run() -> list[int]:
        async with AsyncWorkerClient(server.address) as client:
            alloc = await client.alloc(32, stopping=Stopping(max_new_tokens=5, ignore_eos=True))
            first = await client.prefill([pb.PrefillItem(sequence_id=alloc.sequence_id, token_ids=prompt)])
            stream = client.decode_stream()
            for _ in range(4):
                await stream.send([alloc.sequence_id])
            tokens = [first.tokens[0].token_id] + [(await stream.recv()).tokens[0].token_id for _ in range(4)]
            await stream.send([alloc.sequence_id])  # past the end
            with pytest.raises(StepRefused):
                await stream.recv()
            await stream.close()
            with pytest.raises(StopAsyncIteration):
                await stream.recv()
            await client.release([alloc.sequence_id])
            return tokens
    assert asyncio.run(run()) == expected


def test_drain_ends_open_streams_with_ok(tiny_model):
    """A router's idle stream does not hold a drain to its grace period: once no sequence is left,
    the worker ends its open DecodeStreams with OK (a stream cut at the grace would end CANCELLED)."""
    srv = start_server(tiny_model, worker_changes=dict(grace_period_s=60))
    try:
        with WorkerClient(srv.address) as client:
            ids, _ = _start(client, [[5, 6, 7]], 3)
            stream = client.decode_stream()
            stream.send(ids)
            stream.recv()
            client.release(ids)
            ended = {}

            def read_to_end():
                try:
                    stream.recv()
                except StopIteration:
                    ended["code"] = grpc.StatusCode.OK
                except grpc.RpcError as e:
                    ended["code"] = e.code()
            reader = threading.Thread(target=read_to_end)
            reader.start()
            srv.run(srv.worker.drain(), timeout=60)
            reader.join(10)
            assert ended.get("code") == grpc.StatusCode.OK
    finally:
        srv.loop.call_soon_threadsafe(srv.loop.stop)
        srv.thread.join(10)
