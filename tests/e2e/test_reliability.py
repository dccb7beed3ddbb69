"""Reliability over the real server: concurrency, deadlines and cancellation, leases, the watchdog,
Generate streams sharing steps, and graceful drain on SIGTERM."""
from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

from conftest import ROOT, engine_config, random_prompts, start_server
from engine.api import PrefillItem
from engine.engine import Engine
from engine.sampling import SamplingParams, StoppingCriteria
from grpc_health.v1 import health_pb2
from metrale.worker.v1 import worker_pb2 as pb
from worker.client import Stopping, WorkerClient


def solo_greedy(engine: Engine, prompt: list[int], n: int) -> list[int]:
    seq = engine.alloc_sequence(len(prompt) + n + 1, SamplingParams(), StoppingCriteria(max_new_tokens=n,
                                                                                        ignore_eos=True))
    out = [engine.prefill([PrefillItem(seq.seq_id, prompt)]).tokens[0].token_id]
    while len(out) < n:
        out.append(engine.decode([seq.seq_id]).tokens[0].token_id)
    engine.release([seq.seq_id])
    return out


@pytest.fixture(scope="module")
def solo(tiny_model) -> Engine:
    return Engine(engine_config(tiny_model, max_slots=2, num_kv_blocks=64))


def run_sequence(client: WorkerClient, prompt: list[int], n: int, use_verify: bool) -> list[int]:
    """A full sequence; with use_verify, drafts come from prompt-lookup (the last token's earlier
    continuation), right or wrong."""
    with client.session(len(prompt) + n + 8, stopping=Stopping(max_new_tokens=n, ignore_eos=True)) as seq:
        history = list(prompt)
        history.append(seq.prefill(prompt).token_id)
        while not seq.finished:
            if use_verify:
                last = history[-1]
                where = [i for i in range(len(history) - 1) if history[i] == last]
                drafts = history[where[-1] + 1:where[-1] + 4] if where else [last]
                drafts = drafts[:max(0, seq.reserved_tokens - len(history))]
                history += [t.token_id for t in seq.verify(drafts).tokens]
            else:
                history.append(seq.decode().token_id)
        return history[len(prompt):]


def test_64_concurrent_clients_get_their_solo_outputs(tiny_model, solo):
    server = start_server(tiny_model, max_slots=80, num_kv_blocks=1200)
    try:
        prompts = random_prompts([1 + (7 * i) % 40 for i in range(64)], 512, seed=77)
        lengths = [8 + (5 * i) % 24 for i in range(64)]
        expected = [solo_greedy(solo, p, n) for p, n in zip(prompts, lengths)]

        def client_job(i: int) -> list[int]:
            with WorkerClient(server.address, timeout=60) as client:
                return run_sequence(client, prompts[i], lengths[i], use_verify=i % 3 == 0)

        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(64) as pool:
            results = list(pool.map(client_job, range(64), timeout=300))
        assert time.monotonic() - t0 < 300
        for i, (got, want) in enumerate(zip(results, expected)):
            assert got == want, f"client {i} (verify={i % 3 == 0})"
        info = server.stub().Info(pb.InfoRequest())
        assert info.free_blocks == info.total_blocks and info.free_slots == info.max_slots and not info.live_sequences
    finally:
        server.stop()


class SlowForward:
    """Makes every forward of an engine sleep first (to hold a step in flight)."""

    def __init__(self, engine: Engine, seconds: float):
        self.engine, self.seconds, self.original = engine, seconds, engine.runtime.model.forward

    def __enter__(self):
        def slow(batch):
            time.sleep(self.seconds)
            return self.original(batch)
        self.engine.runtime.model.forward = slow

    def __exit__(self, *exc):
        self.engine.runtime.model.forward = self.original


def test_deadline_during_a_step_leaves_it_whole_and_queued_calls_are_skipped(tiny_model, solo):
    server = start_server(tiny_model)
    try:
        client = WorkerClient(server.address)
        prompt = random_prompts([9], 512, seed=5)[0]
        expected = solo_greedy(solo, prompt, 12)
        seq = client.session(64, stopping=Stopping(max_new_tokens=12, ignore_eos=True))
        got = [seq.prefill(prompt).token_id]
        seq_len = lambda: server.engine_call(lambda e: e.sequences[seq.seq_id].seq_len)  # noqa: E731
        with SlowForward(server.engine, 0.5):
            # In flight when the deadline passes: the step runs to its end.
            with pytest.raises(grpc.RpcError) as info:
                client.decode([seq.seq_id], timeout=0.1)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            time.sleep(0.6)
            assert seq_len() == len(prompt) + 2
            got.append(server.engine_call(lambda e: e.sequences[seq.seq_id].token_ids[-1]))
            # Queued behind a slow step when its deadline passes: skipped, never run.
            flush = threading.Thread(target=lambda: client.info(timeout=5))  # runs after the skipped call
            slow = threading.Thread(target=lambda: server.engine_call(lambda e: time.sleep(0.8)))
            slow.start()
            time.sleep(0.1)
            with pytest.raises(grpc.RpcError) as info:
                client.decode([seq.seq_id], timeout=0.2)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            slow.join()
            flush.start()
            flush.join()
        assert seq_len() == len(prompt) + 2
        while not seq.finished:
            got.append(seq.decode().token_id)
        assert got == expected
        seq.release()
        info = client.info()
        assert info.free_blocks == info.total_blocks
    finally:
        server.stop()


def test_idle_sequences_are_released_by_their_lease(tiny_model):
    server = start_server(tiny_model, worker_changes=dict(sequence_idle_timeout_s=1.0))
    try:
        client = WorkerClient(server.address)
        kept = client.session(40, max_new_tokens=30)
        lost = client.session(40, max_new_tokens=30)
        kept.prefill([1, 2, 3])
        lost.prefill([1, 2, 3])
        for _ in range(8):  # kept stays busy; lost's router "crashed"
            kept.decode()
            time.sleep(0.35)
        with pytest.raises(grpc.RpcError) as info:
            lost.decode()
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        kept.release()
        info = client.info()
        assert info.free_blocks == info.total_blocks and info.live_sequences == 0
    finally:
        server.stop()


def test_per_client_live_sequence_limit(tiny_model):
    server = start_server(tiny_model, worker_changes=dict(max_live_sequences_per_client=2))
    try:
        a = WorkerClient(server.address, client_id="router-a")
        b = WorkerClient(server.address, client_id="router-b")
        held = [a.alloc(16).sequence_id, a.alloc(16).sequence_id]
        with pytest.raises(grpc.RpcError) as info:
            a.alloc(16)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "router-a" in info.value.details()
        other = b.alloc(16).sequence_id
        a.release(held[:1])
        held[0] = a.alloc(16).sequence_id
        a.release(held)
        b.release([other])
    finally:
        server.stop()


def test_watchdog_turns_health_not_serving_while_a_step_is_stuck(tiny_model):
    server = start_server(tiny_model, worker_changes=dict(step_watchdog_s=0.3))
    try:
        client = WorkerClient(server.address)
        assert client.health() == health_pb2.HealthCheckResponse.SERVING
        stuck = threading.Thread(target=lambda: server.engine_call(lambda e: time.sleep(2.0)))
        stuck.start()
        deadline = time.monotonic() + 1.8
        statuses = set()
        while time.monotonic() < deadline:
            statuses.add(client.health())
            time.sleep(0.1)
        stuck.join()
        assert health_pb2.HealthCheckResponse.NOT_SERVING in statuses
        time.sleep(1.3)
        assert client.health() == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop()


def test_generate_streams_share_decode_steps_and_match_solo(tiny_model, solo):
    server = start_server(tiny_model)
    try:
        prompts = random_prompts([4, 11, 19, 6, 25, 2, 13, 8], 512, seed=12)
        expected = [solo_greedy(solo, p, 20) for p in prompts]
        steps_before = server.worker.runner.steps

        def stream(p):
            with WorkerClient(server.address) as c:
                return [t.token_id for t in c.generate(p, 20, ignore_eos=True)]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(stream, prompts))
        assert results == expected
        # 8 streams x 19 decode steps would be 152 steps unbatched; shared steps need far fewer.
        assert server.worker.runner.steps - steps_before < 100
        # A client that leaves mid-stream: its sequence is released.
        with WorkerClient(server.address) as c:
            for i, _ in enumerate(c.generate(prompts[0], 200, ignore_eos=True)):
                if i == 3:
                    break
        deadline = time.monotonic() + 5
        while server.stub().Info(pb.InfoRequest()).live_sequences and time.monotonic() < deadline:
            time.sleep(0.05)
        info = server.stub().Info(pb.InfoRequest())
        assert info.live_sequences == 0 and info.free_blocks == info.total_blocks
    finally:
        server.stop()


def test_sigterm_drains_live_sequences_then_exits_zero(tmp_path, tiny_model):
    from test_cli import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "worker", "serve", "--model", str(tiny_model), "--host",
                             "127.0.0.1", "--port", str(port), "--grace-period-s", "20", "--device", "cpu",
                             "--num-kv-blocks", "600"], cwd=ROOT, env={**os.environ, "METRALE_CACHE_DIR": str(tmp_path)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        client = WorkerClient(f"127.0.0.1:{port}", timeout=10)
        deadline = time.monotonic() + 60
        while True:
            try:
                if client.health() == health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.RpcError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.2)
        sessions = [client.session(80, stopping=Stopping(max_new_tokens=60, ignore_eos=True)) for _ in range(16)]
        for s in sessions:
            s.prefill([1, 2, 3])
        for _ in range(5):
            client.decode([s.seq_id for s in sessions])
        t_term = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert client.health() == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as info:
            client.alloc(16)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        running, final = [s.seq_id for s in sessions], {}
        while running:  # in-flight sequences keep decoding to their end
            resp = client.decode(running)
            final.update({t.sequence_id: t for t in resp.tokens})
            running = [t.sequence_id for t in resp.tokens if t.finish_reason == pb.FINISH_REASON_NONE]
        assert all(t.seq_len == 3 + 60 and t.finish_reason == pb.FINISH_REASON_LENGTH for t in final.values())
        client.release([s.seq_id for s in sessions])
        assert proc.wait(timeout=20) == 0
        assert time.monotonic() - t_term < 20
    finally:
        if proc.poll() is None:
            proc.kill()


def test_gil_switch_interval_is_set_for_the_serving_process(tiny_model):
    """--gil-switch-interval-us: once serving, the process's switch interval is the one asked for (and a
    worker left at 0 does not touch it)."""
    before = sys.getswitchinterval()
    server = start_server(tiny_model, worker_changes=dict(gil_switch_interval_us=300))
    try:
        assert sys.getswitchinterval() == pytest.approx(300e-6)
        with WorkerClient(server.address) as client:
            assert client.info().max_slots > 0  # and it serves
    finally:
        server.stop()
        sys.setswitchinterval(before)
    server = start_server(tiny_model)
    try:
        assert sys.getswitchinterval() == before
    finally:
        server.stop()
