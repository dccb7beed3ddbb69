"""The Decode RPC overhead a router sees with steps in flight, on a stand-in worker with no engine: what
Python gRPC itself costs in issue #5's pattern, next to what an engine thread's GIL work adds to it.

The stand-in serves ModelWorker.Decode on a grpc.aio server in its own process, the way the worker does:
the handler hands the call to one "engine" thread and awaits its future. That thread plays a GPU that
runs one step after another: step i ends STEP us after the later of its arrival and the end of step
i - 1 (a timed sleep, GIL released), then the thread holds the GIL for `--gil-us` of pure-Python work
(the engine's commit of a step) and answers with a DecodeResponse of `--batch` tokens whose forward_ns
is STEP. The router is bench/load.py's: the sync client, `--pipeline` calls in flight, each reply's
wait measured from when the call was sent or the previous reply arrived (the later), minus forward_ns.

    python bench/pipeline_floor.py [--step-us 1330] [--pipeline 3] [--gil-us 0 150 300] [--steps 1500]
                                   [--server aio sync] [--decode call stream]

Prints one JSON line per server flavour and --gil-us value: overhead p50 / p90 / p99 and the share of steps over 500 us."""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import pathlib
import queue
import subprocess
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
if not (ROOT / "metrale" / "worker" / "v1" / "worker_pb2.py").exists():
    import runpy
    runpy.run_path(str(ROOT / "protos" / "generate.py"))["generate"]()

import grpc  # noqa: E402

from metrale.worker.v1 import worker_pb2 as pb  # noqa: E402
from bench.rpc_rtt import serve_until_killed  # noqa: E402
from metrale.worker.v1 import worker_pb2_grpc as pb_grpc  # noqa: E402

OUTLIER_US = 500


def serve(step_us: int, gil_us: int, batch: int, flavour: str = "aio") -> None:
    """The stand-in worker: prints its port, then serves until killed. flavour "aio": a grpc.aio server
    whose handler awaits the engine thread's future (as the worker does); "sync": a thread-pool
    grpc.server whose handler blocks on it."""
    work: queue.SimpleQueue = queue.SimpleQueue()
    reply = pb.DecodeResponse(tokens=[pb.Token(sequence_id=i, token_id=100 + i, logprob=-0.5, seq_len=50)
                                      for i in range(batch)], forward_ns=step_us * 1000)

    def engine() -> None:
        end = 0.0
        while True:
            fut = work.get()
            end = max(time.perf_counter(), end) + step_us / 1e6
            left = end - time.perf_counter()
            if left > 0:
                time.sleep(left)
            spin = time.perf_counter() + gil_us / 1e6
            while time.perf_counter() < spin:  # the engine's Python work, holding the GIL
                pass
            fut.set_result(reply)

    threading.Thread(target=engine, daemon=True).start()

    class SyncWorker(pb_grpc.ModelWorkerServicer):
        def Decode(self, request, context):
            fut: concurrent.futures.Future = concurrent.futures.Future()
            work.put(fut)
            return fut.result()

    class Worker(pb_grpc.ModelWorkerServicer):
        async def Decode(self, request, context):
            fut: concurrent.futures.Future = concurrent.futures.Future()
            work.put(fut)
            return await asyncio.wrap_future(fut)

        async def DecodeStream(self, requests, context):  # the worker's pattern: a reader task, answers in order
            steps: asyncio.Queue = asyncio.Queue()

            async def read():
                async for _ in requests:
                    fut: concurrent.futures.Future = concurrent.futures.Future()
                    work.put(fut)
                    steps.put_nowait(asyncio.wrap_future(fut))
                steps.put_nowait(None)
            reader = asyncio.get_running_loop().create_task(read())
            try:
                while (fut := await steps.get()) is not None:
                    yield pb.DecodeStreamResponse(step=await fut)
            finally:
                reader.cancel()

    serve_until_killed(flavour, pb_grpc.add_ModelWorkerServicer_to_server,
                       SyncWorker() if flavour == "sync" else Worker(), threads=16)


def route(target: str, pipeline: int, steps: int, batch: int) -> list[float]:
    """bench/load.py's router on one fixed batch: the overhead of each step, in us."""
    stub = pb_grpc.ModelWorkerStub(grpc.insecure_channel(target))
    req = pb.DecodeRequest(sequence_ids=list(range(batch)))
    replies: queue.SimpleQueue = queue.SimpleQueue()
    overheads, sent, in_flight = [], 0, {}
    last = time.perf_counter()
    while len(overheads) < steps:
        while len(in_flight) < pipeline and sent < steps:
            call = stub.Decode.future(req, timeout=30)
            in_flight[id(call)] = time.perf_counter()
            call.add_done_callback(replies.put)
            sent += 1
        call = replies.get()
        now = time.perf_counter()
        forward_us = call.result().forward_ns / 1e3
        overheads.append(1e6 * (now - max(in_flight.pop(id(call)), last)) - forward_us)
        last = now
    return overheads


def route_stream(target: str, pipeline: int, steps: int, batch: int) -> list[float]:
    """The same router with its steps on one DecodeStream (WorkerClient.decode_stream): answers come in
    order, read on a thread of their own as bench/load.py --decode stream does."""
    from worker.client import WorkerClient
    client = WorkerClient(target)
    replies: queue.SimpleQueue = queue.SimpleQueue()
    with client.decode_stream() as stream:
        def read() -> None:
            for _ in range(steps):
                replies.put(stream.recv())
        threading.Thread(target=read, daemon=True).start()
        ids = list(range(batch))
        overheads, sent_at, last = [], [], time.perf_counter()
        while len(overheads) < steps:
            while len(sent_at) - len(overheads) < pipeline and len(sent_at) < steps:
                sent_at.append(time.perf_counter())
                stream.send(ids)
            reply = replies.get()
            now = time.perf_counter()
            overheads.append(1e6 * (now - max(sent_at[len(overheads)], last)) - reply.forward_ns / 1e3)
            last = now
    client.close()
    return overheads


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q / 100 * len(s)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--step-us", type=int, default=1330, help="device time of a step (1B at C = 32: ~1330)")
    p.add_argument("--pipeline", type=int, default=3)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--gil-us", type=int, nargs="+", default=[0, 150, 300])
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--server", nargs="+", choices=["aio", "sync"], default=["aio"],
                   help="the stand-in's gRPC server: grpc.aio (the worker's) and/or a thread-pool grpc.server")
    p.add_argument("--decode", nargs="+", choices=["call", "stream"], default=["call"],
                   help="the router's steps as Decode calls and/or over one DecodeStream (grpc.aio server only)")
    p.add_argument("--serve", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        serve(*map(int, args.serve[:3]), args.serve[3])
        return
    runs = [(f, g, d) for f in args.server for g in args.gil_us for d in args.decode if f == "aio" or d == "call"]
    for flavour, gil_us, decode in runs:
        proc = subprocess.Popen([sys.executable, __file__, "--serve", str(args.step_us), str(gil_us), str(args.batch),
                                 flavour], stdout=subprocess.PIPE, text=True)
        router = route_stream if decode == "stream" else route
        try:
            target = f"127.0.0.1:{int(proc.stdout.readline())}"
            router(target, args.pipeline, 100, args.batch)  # warm-up
            us = router(target, args.pipeline, args.steps, args.batch)
        finally:
            proc.terminate()
            proc.wait(30)
        print(json.dumps({"server": flavour, "decode": decode, "step_us": args.step_us, "pipeline": args.pipeline,
                          "batch": args.batch, "gil_us": gil_us,
                          "steps": len(us), "overhead_p50_us": round(percentile(us, 50), 1),
                          "overhead_p90_us": round(percentile(us, 90), 1),
                          "overhead_p99_us": round(percentile(us, 99), 1),
                          "over_500us": round(sum(u > OUTLIER_US for u in us) / len(us), 3)}), flush=True)


if __name__ == "__main__":
    main()
