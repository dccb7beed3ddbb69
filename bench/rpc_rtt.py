"""Where gRPC round-trip time goes on this machine: a bare grpc.aio health server, our worker's
Health and Info (through the engine thread), and Decode minus its forward time. Sync client, one call
at a time, median of many.

    python bench/rpc_rtt.py [--model DIR]"""
from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import statistics
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from grpc_health.v1.health import aio as health_aio  # noqa: E402


def median_us(fn, n: int = 400) -> float:
    for _ in range(50):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(1e6 * statistics.median(times), 1)


def bare_server(port_box: list, ready: threading.Event) -> None:
    async def main():
        server = grpc.aio.server()
        health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        port_box.append(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        ready.set()
        await server.wait_for_termination()
    asyncio.run(main())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model")
    args = p.parse_args()
    out = {}
    box, ready = [], threading.Event()
    threading.Thread(target=bare_server, args=(box, ready), daemon=True).start()
    ready.wait(30)
    bare = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{box[0]}"))
    out["bare_aio_health_us"] = median_us(lambda: bare.Check(health_pb2.HealthCheckRequest()))

    from bench.load import spawn_worker
    from engine.checkpoint import write_checkpoint
    from metrale.worker.v1 import worker_pb2 as pb
    from worker.client import Stopping, WorkerClient
    model = args.model or str(write_checkpoint(pathlib.Path(tempfile.mkdtemp()) / "tiny", shape="tiny"))
    proc, target = spawn_worker(model, ["--max-seq-len", "4096"])
    try:
        client = WorkerClient(target)
        out["worker_health_us"] = median_us(lambda: client.health())
        out["worker_info_us"] = median_us(lambda: client.info())
        seq = client.session(4000, stopping=Stopping(max_new_tokens=3900, ignore_eos=True))
        seq.prefill([1, 2, 3])
        fwd = []

        def decode():
            r = client.decode([seq.seq_id])
            fwd.append(r.forward_ns / 1e3)
        out["worker_decode_us"] = median_us(decode, 1000)
        out["decode_forward_us"] = round(statistics.median(fwd), 1)
        out["decode_overhead_us"] = round(out["worker_decode_us"] - out["decode_forward_us"], 1)
        seq.release()
        _ = pb
    finally:
        proc.terminate()
        proc.wait(30)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
