"""Where the gRPC round trip of a step goes. Every figure is a client's wall time per call (sync stub,
one call at a time, unless it says aio client), as p50/p99 in microseconds over every call of every
round; rounds interleave the targets, so a noisy machine slows them all alike.

Over a socket (each server its own process):
  bare_aio / bare_sync     a trivial unary handler (health Check) on a bare grpc.aio server and on a
                           bare sync grpc.server (thread pool): the floor of each flavour
  bare_*_1ms               the same handler busy for 1 ms, minus that 1 ms: a call whose handler
                           takes as long as a step costs more than an instant one (the client's
                           threads and cores have gone idle meanwhile and must wake), so this is
                           the floor to hold a Decode's overhead against
  worker_health            the worker's health Check (no engine call)
  worker_info              Info: engine counters, no step
  decode_b1 / decode_b32   Decode of 1 and of 32 sequences in one call, as a router sends it;
                           `overhead` is each call's wall time minus its forward_ns (what the router's
                           RPC overhead per step counts), `forward` the forward_ns
  decode_b32_aio_client    the same through a grpc.aio client: what an asyncio router pays
  decode_b*_stream         the same steps on one DecodeStream (WorkerClient.decode_stream), each sent
                           after the previous answer
  decode_b1_stage_*        a unary batch-1 Decode cut by the worker's x-step-times stamps: to_handler,
                           to_launch, device_and_wake, finish, response, to_client
In-process (no socket), the parts the worker adds:
  engine_b1 / engine_b32   Engine.decode wall time minus its forward_ns: the engine's own host time
                           outside forward_ns, which the router's overhead also counts
  engine_call_inline       a no-op engine call through the worker's EngineRunner, run on its event loop
  engine_call_thread       the same run on the engine thread (Prefill, Verify): a hop each way
  response_b32             a 32-token step result -> DecodeResponse -> bytes
  metrics_b32              what one 32-sequence Decode call records for the metrics (on the call's path)
  metrics_b32_applied      the same, and its Prometheus observations (made at scrape time)

The worker runs with one torch thread (OMP_NUM_THREADS=1 unless set): on a small CPU box torch's
intra-op threads spin after each op and take the cores that gRPC's threads need.

    python bench/rpc_rtt.py [--model DIR] [--rounds 5] [--calls 200] [--out FILE.json]"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
if not (ROOT / "metrale" / "worker" / "v1" / "worker_pb2.py").exists():
    import runpy
    runpy.run_path(str(ROOT / "protos" / "generate.py"))["generate"]()

import grpc  # noqa: E402
import numpy as np  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from metrale.worker.v1 import worker_pb2 as pb  # noqa: E402
from metrale.worker.v1 import worker_pb2_grpc as pb_grpc  # noqa: E402

WARMUP = 10  # calls before each measurement


def p50_p99(us: list[float]) -> dict:
    return {"p50": round(float(np.percentile(us, 50)), 1), "p99": round(float(np.percentile(us, 99)), 1)}


def timed(fn, n: int) -> list[float]:
    """Wall time of each of n calls of fn, in us."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(1e6 * (time.perf_counter() - t0))
    return out


# --------------------------------------------------------------------------------------------------
# Bare servers: one trivial handler each, in their own process.

def _busy(request) -> health_pb2.HealthCheckResponse:
    """Answers at once, or after spinning for `service` microseconds when that is a number."""
    if request.service:
        end = time.perf_counter() + int(request.service) / 1e6
        while time.perf_counter() < end:
            pass
    return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


class _Health(health_pb2_grpc.HealthServicer):
    def Check(self, request, context):
        return _busy(request)


class _AioHealth(health_pb2_grpc.HealthServicer):
    async def Check(self, request, context):
        return _busy(request)


def serve_until_killed(flavour: str, add_to_server, servicer, threads: int = 8) -> None:
    """Serves `servicer` (add_to_server: the generated add_*Servicer_to_server) on a free local port, on
    a thread-pool grpc.server ("sync") or a grpc.aio server ("aio"): prints the port, then serves until
    killed."""
    if flavour == "sync":
        server = grpc.server(concurrent.futures.ThreadPoolExecutor(threads))
        add_to_server(servicer, server)
        print(server.add_insecure_port("127.0.0.1:0"), flush=True)
        server.start()
        server.wait_for_termination()
        return

    async def main():
        server = grpc.aio.server()
        add_to_server(servicer, server)
        print(server.add_insecure_port("127.0.0.1:0"), flush=True)
        await server.start()
        await server.wait_for_termination()
    asyncio.run(main())


def serve_bare(flavour: str) -> None:
    serve_until_killed(flavour, health_pb2_grpc.add_HealthServicer_to_server,
                       _Health() if flavour == "sync" else _AioHealth())


def spawn_bare(flavour: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, __file__, "--serve-bare", flavour], stdout=subprocess.PIPE, text=True)
    return proc, f"127.0.0.1:{int(proc.stdout.readline())}"


# --------------------------------------------------------------------------------------------------
# Over the socket

class WorkerTarget:
    """The worker's calls; each Decode measurement decodes fresh sequences (short contexts)."""

    def __init__(self, target: str):
        self.target = target
        channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.ModelWorkerStub(channel)
        self.health = health_pb2_grpc.HealthStub(channel)

    def sequences(self, n: int, steps: int) -> list[int]:
        stopping = pb.StoppingCriteria(max_new_tokens=steps + 8, ignore_eos=True)
        ids = [self.stub.AllocSequence(pb.AllocSequenceRequest(max_total_tokens=steps + 16, stopping=stopping))
               .sequence_id for _ in range(n)]
        self.stub.Prefill(pb.PrefillRequest(items=[pb.PrefillItem(sequence_id=i, token_ids=[1, 2, 3]) for i in ids]))
        return ids

    def decode(self, batch: int, calls: int, aio_client: bool = False, stream: bool = False) \
            -> tuple[list[float], list[float]]:
        """(overheads, forwards) of `calls` Decode calls of `batch` sequences, in us; stream: `calls` steps
        on one DecodeStream instead (WorkerClient.decode_stream), each sent after the previous answer."""
        ids = self.sequences(batch, WARMUP + calls)
        req = pb.DecodeRequest(sequence_ids=ids)
        timings: list[tuple[float, float]] = []  # (wall, forward) per call, us

        def keep(t0: float, resp: pb.DecodeResponse) -> None:
            timings.append((1e6 * (time.perf_counter() - t0), resp.forward_ns / 1e3))

        if stream:
            from worker.client import WorkerClient
            with WorkerClient(self.target) as client, client.decode_stream() as steps:
                for _ in range(WARMUP + calls):
                    t0 = time.perf_counter()
                    steps.send(ids)
                    keep(t0, steps.recv())
        elif aio_client:
            async def run():
                async with grpc.aio.insecure_channel(self.target) as channel:
                    stub = pb_grpc.ModelWorkerStub(channel)
                    for _ in range(WARMUP + calls):
                        t0 = time.perf_counter()
                        keep(t0, await stub.Decode(req))
            asyncio.run(run())
        else:
            for _ in range(WARMUP + calls):
                t0 = time.perf_counter()
                keep(t0, self.stub.Decode(req))
        self.stub.Release(pb.ReleaseRequest(sequence_ids=ids))
        timings = timings[WARMUP:]
        return [wall - fwd for wall, fwd in timings], [fwd for _, fwd in timings]

    def decode_stages(self, calls: int) -> dict[str, list[float]]:
        """Where a batch-1 unary Decode's wall time goes, from the worker's x-step-times trailer (CLOCK_MONOTONIC,
        the same clock as the client's on one host), us per call: client -> handler, handler -> launched,
        launched -> answer begun (waiting for the device and the loop's wake-up), answer -> result ready (the
        commit), result -> response built, response -> client."""
        ids = self.sequences(1, WARMUP + calls)
        req, md = pb.DecodeRequest(sequence_ids=ids), (("x-step-times", "1"),)
        names = ("to_handler", "to_launch", "device_and_wake", "finish", "response", "to_client")
        stages: dict[str, list[float]] = {n: [] for n in names}
        for i in range(WARMUP + calls):
            t0 = time.monotonic_ns()
            _, call = self.stub.Decode.with_call(req, metadata=md)
            t1 = time.monotonic_ns()
            if i < WARMUP:
                continue
            st = [int(x) for x in dict(call.trailing_metadata())["x-step-times"].split(",")]
            for name, a, b in zip(names, [t0, *st], [*st, t1]):
                stages[name].append((b - a) / 1e3)
        self.stub.Release(pb.ReleaseRequest(sequence_ids=ids))
        return stages


def measure_network(model: str, rounds: int, calls: int) -> dict:
    from bench.load import spawn_worker

    procs = []
    try:
        bare = {}
        for flavour in ("aio", "sync"):
            proc, target = spawn_bare(flavour)
            procs.append(proc)
            bare[flavour] = health_pb2_grpc.HealthStub(grpc.insecure_channel(target))
        env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        proc, target = spawn_worker(model, ["--max-seq-len", "4096", "--max-slots", "64"], env=env)
        procs.append(proc)
        worker = WorkerTarget(target)
        samples: dict[str, list[float]] = {}
        forwards: dict[str, list[float]] = {}
        check, busy = health_pb2.HealthCheckRequest(), health_pb2.HealthCheckRequest(service="1000")
        for stub in bare.values():
            timed(lambda: stub.Check(check), 5 * WARMUP)  # noqa: B023 (called at once)
        for _ in range(rounds):
            for flavour, stub in bare.items():
                samples.setdefault(f"bare_{flavour}", []).extend(timed(lambda: stub.Check(check), calls))  # noqa: B023
                samples.setdefault(f"bare_{flavour}_1ms", []).extend(
                    us - 1000 for us in timed(lambda: stub.Check(busy), calls))  # noqa: B023
            samples.setdefault("worker_health", []).extend(timed(lambda: worker.health.Check(check), calls))
            samples.setdefault("worker_info", []).extend(timed(lambda: worker.stub.Info(pb.InfoRequest()), calls))
            for name, batch, aio_client, stream in (("decode_b1", 1, False, False), ("decode_b1_stream", 1, False, True),
                                                    ("decode_b32", 32, False, False),
                                                    ("decode_b32_stream", 32, False, True),
                                                    ("decode_b32_aio_client", 32, True, False)):
                overhead, forward = worker.decode(batch, calls, aio_client, stream)
                samples.setdefault(name, []).extend(overhead)
                forwards.setdefault(name, []).extend(forward)
            for stage, us in worker.decode_stages(calls).items():
                samples.setdefault(f"decode_b1_stage_{stage}", []).extend(us)
        out = {name: p50_p99(us) for name, us in samples.items()}
        for name, fw in forwards.items():
            out[name] = {"overhead": out[name], "forward": p50_p99(fw)}
        return out
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)


# --------------------------------------------------------------------------------------------------
# In-process parts

def measure_parts(model: str, calls: int) -> dict:
    import torch

    from engine import api
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.sampling import SamplingParams, StoppingCriteria
    from worker import convert
    from worker.metrics import Metrics
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    out = {}
    engine = Engine(EngineConfig(model=model, max_seq_len=4096, max_slots=64))
    for batch in (1, 32):
        stopping = StoppingCriteria(max_new_tokens=calls + 20, ignore_eos=True)
        ids = [engine.alloc_sequence(calls + 32, SamplingParams(), stopping).seq_id for _ in range(batch)]
        engine.prefill([api.PrefillItem(i, [1, 2, 3]) for i in ids])
        host = []
        for i in range(calls + 10):
            t0 = time.perf_counter()
            result = engine.decode(ids)
            if i >= 10:
                host.append(1e6 * (time.perf_counter() - t0) - result.forward_ns / 1e3)
        engine.release(ids)
        out[f"engine_b{batch}"] = p50_p99(host)
    out.update(asyncio.run(_runner_calls(engine, 10 * calls)))

    tokens = [api.TokenResult(i, 100 + i, -0.5, [], api.FinishReason.NONE, 50) for i in range(32)]
    result = api.StepResult(tokens, 1000)
    out["response_b32"] = p50_p99(timed(lambda: convert.decode_response(result).SerializeToString(), 10 * calls))
    metrics = Metrics()
    now = time.monotonic_ns()

    def record():  # what a Decode call records (the observations are made at scrape time)
        metrics.record_call("Decode", grpc.StatusCode.OK, time.perf_counter())
        metrics.observe_step("decode", result)
        metrics.observe_decode_stages([now, now + 1, now + 2, now + 3, now + 4])
    out["metrics_b32"] = p50_p99(timed(record, 10 * calls))
    out["metrics_b32_applied"] = p50_p99(timed(lambda: (record(), metrics.apply_pending()), 10 * calls))
    return out


async def _runner_calls(engine, n: int) -> dict:
    """No-op calls through the worker's EngineRunner, from its event loop: a short call (inline on the loop) and
    a long one (on the engine thread: one hop each way). Closes the engine."""
    from worker.runner import EngineRunner

    runner = EngineRunner(engine, concurrent.futures.ThreadPoolExecutor(1))
    out = {}
    for name, call in (("engine_call_inline", runner.run), ("engine_call_thread", runner.call)):
        us = []
        for _ in range(n):
            t0 = time.perf_counter()
            await call(lambda engine: None)
            us.append(1e6 * (time.perf_counter() - t0))
        out[name] = p50_p99(us)
    await runner.shutdown()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint dir (default: a tiny one)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=200, help="calls per target per round")
    p.add_argument("--out", help="also write the figures to this JSON file")
    p.add_argument("--serve-bare", choices=["aio", "sync"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_bare:
        serve_bare(args.serve_bare)
        return
    from engine.checkpoint import write_checkpoint

    model = args.model or str(write_checkpoint(pathlib.Path(tempfile.mkdtemp()) / "tiny", shape="tiny"))
    out = {"grpcio": grpc.__version__, "cpus": os.cpu_count(), "rounds": args.rounds, "calls": args.calls}
    out.update(measure_network(model, args.rounds, args.calls))
    out.update(measure_parts(model, args.calls))
    print(table(out))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(out, indent=1))


def table(out: dict) -> str:
    lines = [f"grpcio {out['grpcio']}, {out['cpus']} CPUs, {out['rounds']} rounds x {out['calls']} calls",
             f"{'':32} {'p50 us':>9} {'p99 us':>9}   forward p50/p99 us"]
    for name, v in out.items():
        if isinstance(v, dict) and "overhead" in v:
            o, f = v["overhead"], v["forward"]
            lines.append(f"{name + ' overhead':32} {o['p50']:9.1f} {o['p99']:9.1f}   {f['p50']:.1f} / {f['p99']:.1f}")
        elif isinstance(v, dict):
            lines.append(f"{name:32} {v['p50']:9.1f} {v['p99']:9.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
