"""The event loop's host time per streamed token of a Generate call, without a model: what the worker spends
on each token it streams besides the step itself, on the loop that also launches the steps.

Two parts, each its own process-free measurement on this machine's CPU:
  handler  the gateway service's per-token path (worker/gateway_stream.responses building each chunk, and the
           token metrics as the tree records them) over a queue that a producer task fills one token per loop
           iteration, minus the same producer feeding a bare consumer: microseconds per token of our Python;
  grpc     a grpc.aio server streaming GenerateResponse chunks to a client in another process, STREAMS at once:
           the server process's CPU time per message (grpc.aio's own cost of a streamed message).

    python bench/stream_host_cost.py                 # both parts
    python bench/stream_host_cost.py --only handler  # in an A/B: AB_CMD="python3 bench/stream_host_cost.py"
"""
from __future__ import annotations

import argparse
import asyncio
import inspect
import multiprocessing
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.api import TokenResult  # noqa: E402
from engine.sampling import SamplingParams, StoppingCriteria  # noqa: E402
from engine.sequence import FinishReason  # noqa: E402
from worker import gateway_convert as convert  # noqa: E402
from worker import gateway_stream  # noqa: E402
from worker.gateway_pb import vpb, vpb_grpc  # noqa: E402
from worker.gateway_requests import Requests  # noqa: E402
from worker.metrics import Metrics  # noqa: E402

BATCH = 26  # tokens a decode step hands out at once (the gateway load's mean batch at C = 32)


async def handler_us_per_token(tokens: int) -> tuple[float, float]:
    """(our Python per token, the bare queue handoff per token), microseconds."""
    metrics, requests = Metrics(), Requests()
    live = requests.add("r", 128, 1)
    choice = live.choices[0]
    choice.seq_id, choice.out = 7, asyncio.Queue()
    spec = convert.GenerateSpec(prompt=[1] * 128, sampling=SamplingParams(),
                                stopping=StoppingCriteria(max_new_tokens=tokens), max_total_tokens=tokens + 256,
                                num_logprobs=None)
    items = [TokenResult(7, 100 + i % 50, -0.5, [], FinishReason.NONE, 129 + i) for i in range(tokens)]
    takes_metrics = "metrics" in inspect.signature(gateway_stream.responses).parameters
    step_metrics = hasattr(metrics, "observe_stream_step")  # recorded per step by GenerateStreams

    async def produce(queue: asyncio.Queue, record: bool) -> None:
        for i, item in enumerate(items):
            queue.put_nowait(item)
            if record and step_metrics and i % BATCH == 0:
                metrics.observe_stream_step(items[i:i + BATCH])
            await asyncio.sleep(0)
        queue.put_nowait(None)

    if takes_metrics:
        metrics.start_stream(7, time.perf_counter())
        args = (live, spec, True, None, None, metrics, requests, None, 1)
    else:
        args = (live, spec, True, None, None, requests, None, 1)
    producer = asyncio.ensure_future(produce(choice.out, True))
    t0 = time.perf_counter()
    async for _ in gateway_stream.responses(*args):
        pass
    metrics.apply_pending()
    ours = time.perf_counter() - t0
    await producer
    bare_queue: asyncio.Queue = asyncio.Queue()
    producer = asyncio.ensure_future(produce(bare_queue, False))
    t0 = time.perf_counter()
    while await bare_queue.get() is not None:
        pass
    bare = time.perf_counter() - t0
    await producer
    return 1e6 * (ours - bare) / tokens, 1e6 * bare / tokens


class _Streamer(vpb_grpc.VllmEngineServicer):
    def __init__(self, messages: int):
        self.messages = messages

    async def Generate(self, request, context):
        msg = convert.chunk([TokenResult(7, 1234, -0.5, [], FinishReason.NONE, 129)], 128, None)
        for _ in range(self.messages):
            yield msg
            await asyncio.sleep(0)  # as the worker's handlers: one message per loop iteration


def _serve(port_queue, messages: int) -> None:
    import grpc

    async def serve():
        server = grpc.aio.server()
        vpb_grpc.add_VllmEngineServicer_to_server(_Streamer(messages), server)
        port_queue.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()
    asyncio.run(serve())


def grpc_us_per_message(streams: int, messages: int) -> float:
    """The server process's CPU microseconds per streamed message, `streams` streams at once."""
    import grpc

    ports = multiprocessing.Queue()
    proc = multiprocessing.Process(target=_serve, args=(ports, messages), daemon=True)
    proc.start()
    port = ports.get(timeout=60)

    async def client() -> int:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = vpb_grpc.VllmEngineStub(channel)

            async def one() -> int:
                return sum([1 async for _ in stub.Generate(vpb.GenerateRequest(request_id="x"))])
            await one()  # connected and warm
            cpu0 = _cpu_s(proc.pid)
            got = sum(await asyncio.gather(*[one() for _ in range(streams)]))
            return got, _cpu_s(proc.pid) - cpu0
    try:
        got, cpu = asyncio.run(client())
    finally:
        proc.kill()
    return 1e6 * cpu / got


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc)."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    import os
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=["handler", "grpc"])
    p.add_argument("--tokens", type=int, default=20000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--streams", type=int, default=32)
    args = p.parse_args()
    if args.only in (None, "handler"):
        runs = [asyncio.run(handler_us_per_token(args.tokens)) for _ in range(args.repeats)]
        print(f"handler: {statistics.median(r[0] for r in runs):.2f} us of our Python a streamed token (median of "
              f"{args.repeats}; the bare queue handoff {statistics.median(r[1] for r in runs):.2f} us besides)")
    if args.only in (None, "grpc"):
        runs = [grpc_us_per_message(args.streams, 2000) for _ in range(args.repeats)]
        print(f"grpc: {statistics.median(runs):.1f} us of server CPU a streamed message, {args.streams} streams "
              f"(median of {args.repeats})")


if __name__ == "__main__":
    main()
