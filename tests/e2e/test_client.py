"""The Python client against a real server: sync and asyncio, sessions, streaming, deadlines, retries."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from conftest import random_prompts
from metrale.worker.v1 import worker_pb2 as pb
from worker.client import AsyncWorkerClient, Sampling, Stopping, WorkerClient


def test_sync_session_and_generate_agree(server):
    prompt = random_prompts([12], 512, seed=4)[0]
    with WorkerClient(server.address) as client:
        assert client.health() == 1 and client.info().vocab_size == 512
        with client.session(64, stopping=Stopping(max_new_tokens=10, ignore_eos=True)) as seq:
            tokens = [seq.prefill(prompt[:5], partial=True), seq.prefill(prompt[5:])]
            assert tokens[0] is None
            while not seq.finished:
                tokens.append(seq.decode())
        assert seq.released and client.info().live_sequences == 0
        session_ids = [t.token_id for t in tokens[1:]]
        streamed = list(client.generate(prompt, 10, ignore_eos=True))
        assert [t.token_id for t in streamed] == session_ids
        assert streamed[-1].finish_reason == pb.FINISH_REASON_LENGTH and streamed[-1].seq_len == 22


def test_async_client_matches_sync(server):
    prompt = random_prompts([9], 512, seed=6)[0]
    sampling = Sampling(temperature=0.8, top_k=20, seed=11)
    with WorkerClient(server.address) as client:
        expected = [t.token_id for t in client.generate(prompt, 8, sampling=sampling, ignore_eos=True)]

    async def run():
        async with AsyncWorkerClient(server.address) as client:
            streamed = [t.token_id async for t in client.generate(prompt, 8, sampling=sampling, ignore_eos=True)]
            alloc = await client.alloc(32, sampling=sampling, stopping=Stopping(max_new_tokens=8, ignore_eos=True))
            first = await client.prefill([pb.PrefillItem(sequence_id=alloc.sequence_id, token_ids=prompt)])
            stepped = [first.tokens[0].token_id]
            while len(stepped) < 8:
                stepped.append((await client.decode([alloc.sequence_id])).tokens[0].token_id)
            assert await client.release([alloc.sequence_id]) == 1
            return streamed, stepped, (await client.info()).live_sequences
    streamed, stepped, live = asyncio.run(run())
    assert streamed == expected == stepped and live == 0


def test_deadlines_and_no_retry_of_state_changing_calls(server):
    with WorkerClient(server.address, timeout=5) as client:
        sid = client.alloc(32).sequence_id
        with pytest.raises(grpc.RpcError) as info:
            client.decode([sid])  # before prefill: FAILED_PRECONDITION, not retried
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert client.release([sid]) == 1
        with pytest.raises(grpc.RpcError) as info:
            client.release([sid])  # first attempt NOT_FOUND: an error, not a retry artefact
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_unreachable_worker_fails_after_bounded_retries():
    with WorkerClient("127.0.0.1:1", timeout=0.5, retries=2) as client:
        with pytest.raises(grpc.RpcError) as info:
            client.info()
        assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_pipelined_decode_matches_one_at_a_time(server):
    """Up to three Decode calls in flight for the same batch (each sent before the previous reply) give
    the tokens one call at a time gives, placed by seq_len (calls in flight together may run in
    either order), and a step sent for sequences that finished meanwhile fails and changes nothing."""
    prompts = random_prompts([7, 11], 512, seed=9)
    stopping = Stopping(max_new_tokens=9, ignore_eos=True)
    with WorkerClient(server.address) as client:
        def run(depth: int) -> dict[int, list[pb.Token]]:
            ids = [client.alloc(32, stopping=stopping).sequence_id for _ in prompts]
            first = client.prefill([pb.PrefillItem(sequence_id=i, token_ids=p) for i, p in zip(ids, prompts)])
            out = {t.sequence_id: [t] for t in first.tokens}
            calls = [client.future("Decode", pb.DecodeRequest(sequence_ids=ids)) for _ in range(depth)]
            sent = depth
            while calls:
                for t in calls.pop(0).result().tokens:
                    out[t.sequence_id].append(t)
                if sent < stopping.max_new_tokens - 1:
                    calls.append(client.future("Decode", pb.DecodeRequest(sequence_ids=ids)))
                    sent += 1
            # One step past the end: both sequences finished, so it fails and changes nothing.
            late = client.future("Decode", pb.DecodeRequest(sequence_ids=ids))
            with pytest.raises(grpc.RpcError) as info:
                late.result()
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert client.release(ids) == 2
            return [sorted((t.seq_len, t.token_id, t.finish_reason) for t in out[i]) for i in ids]

        one, three = run(1), run(3)
    assert one == three
    for seq, prompt in zip(three, prompts):
        assert [n for n, _, _ in seq] == list(range(len(prompt) + 1, len(prompt) + 10))
        assert [r for _, _, r in seq] == [pb.FINISH_REASON_NONE] * 8 + [pb.FINISH_REASON_LENGTH]


def test_decode_reports_its_step_times_when_asked(server):
    """x-step-times request metadata: the Decode reply's trailer holds five CLOCK_MONOTONIC ns stamps in
    order (handler, launched, answer begun, result, response built), inside the client's own window;
    without it there is no such trailer."""
    import time
    with WorkerClient(server.address) as client:
        ids = [client.alloc(16, stopping=Stopping(max_new_tokens=4, ignore_eos=True)).sequence_id]
        client.prefill([pb.PrefillItem(sequence_id=ids[0], token_ids=[1, 2, 3])])
        before = time.monotonic_ns()
        call = client.future("Decode", pb.DecodeRequest(sequence_ids=ids), metadata=(("x-step-times", "1"),))
        call.result()
        after = time.monotonic_ns()
        times = dict(call.trailing_metadata() or ())["x-step-times"]
        stamps = [int(t) for t in times.split(",")]
        assert len(stamps) == 5
        assert before <= stamps[0] <= stamps[1] <= stamps[2] <= stamps[3] <= stamps[4] <= after
        plain = client.future("Decode", pb.DecodeRequest(sequence_ids=ids))
        plain.result()
        assert "x-step-times" not in dict(plain.trailing_metadata() or ())
        client.release(ids)


def test_async_client_pipelines_decode_with_tasks(server):
    """The asyncio client keeps two Decode calls in flight as two tasks; placed by seq_len, the tokens
    are those of one call at a time."""
    prompt = random_prompts([10], 512, seed=12)[0]
    stopping = Stopping(max_new_tokens=7, ignore_eos=True)

    async def run(depth: int) -> list[tuple[int, int]]:
        async with AsyncWorkerClient(server.address) as client:
            sid = (await client.alloc(32, stopping=stopping)).sequence_id
            tokens = list((await client.prefill([pb.PrefillItem(sequence_id=sid, token_ids=prompt)])).tokens)
            pending, sent = set(), 0
            while sent < 6 or pending:
                while sent < 6 and len(pending) < depth:
                    pending.add(asyncio.ensure_future(client.decode([sid])))
                    sent += 1
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                tokens += [t for d in done for t in d.result().tokens]
            assert await client.release([sid]) == 1
            return sorted((t.seq_len, t.token_id) for t in tokens)

    one, two = asyncio.run(run(1)), asyncio.run(run(2))
    assert one == two and [n for n, _ in two] == list(range(11, 18))
