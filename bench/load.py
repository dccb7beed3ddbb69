"""Router-like load on a worker over real gRPC, and the same workload on the engine in-process.

A router keeps up to C sequences in flight: it admits new ones as others finish (AllocSequence +
Prefill), decodes the running batch with one Decode RPC per step (or, with --spec K, drafts up to K
tokens per sequence by prompt lookup and sends one Verify RPC for the batch), and releases finished
ones. Requests are (prompt_len, output_len) pairs from a seeded distribution or a trace file.

Reported per concurrency level: output tokens/s; time to first token p50/p99 (Alloc+Prefill call to
the first token); inter-token latency p50/p99 (between a sequence's consecutive steps); RPC overhead
per step (Decode/Verify wall time, as the sync client sees it, minus the worker's forward_ns). The
in-process run drives the same scheduler against Engine directly, so gRPC's share is the difference.

    python bench/load.py --shape tiny --concurrency 1 4 16 64 128             # spawns a worker
    python bench/load.py --target localhost:50051 --concurrency 32              # an existing worker
    python bench/load.py --shape tiny --soak 60                                 # memory/blocks over time

Writes bench/results/load-<date>-<device>.json and PNG plots beside it (--out to change)."""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import pathlib
import platform
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
if not (ROOT / "metrale" / "worker" / "v1" / "worker_pb2.py").exists():
    import runpy
    runpy.run_path(str(ROOT / "protos" / "generate.py"))["generate"]()

import numpy as np  # noqa: E402

from metrale.worker.v1 import worker_pb2 as pb  # noqa: E402


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    output_len: int


def make_requests(n: int, seed: int, vocab: int, prompt_mean: int, output_mean: int,
                  trace: str | None) -> list[Request]:
    rng = np.random.default_rng(seed)
    if trace:
        pairs = [tuple(int(x) for x in line.replace(",", " ").split()[:2])
                 for line in pathlib.Path(trace).read_text().splitlines() if line.strip() and not line.startswith("#")]
        pairs = [pairs[i % len(pairs)] for i in range(n)]
    else:  # lengths ~ lognormal around the means, like chat traffic
        prompts = np.clip(rng.lognormal(np.log(prompt_mean), 0.6, n), 1, 8 * prompt_mean).astype(int)
        outputs = np.clip(rng.lognormal(np.log(output_mean), 0.5, n), 1, 8 * output_mean).astype(int)
        pairs = list(zip(prompts.tolist(), outputs.tolist()))
    # Prompts repeat short n-grams so prompt-lookup drafting has something to find.
    return [Request(tuple(int(t) for t in np.tile(rng.integers(0, vocab, 8), p // 8 + 1)[:p]), o) for p, o in pairs]


def quantiles_ms(xs: list[float], n: int = 1000) -> list[float]:
    """The distribution in at most n evenly spaced quantiles (enough for a CDF plot), in ms."""
    if not xs:
        return []
    qs = np.linspace(0, 100, min(n, len(xs)))
    return [round(1e3 * float(v), 4) for v in np.percentile(xs, qs)]


def percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def prompt_lookup(history: list[int], k: int, ngram: int = 2) -> list[int]:
    """Drafts: what followed the last occurrence of the history's final n-gram."""
    if len(history) <= ngram:
        return []
    tail = history[-ngram:]
    for start in range(len(history) - ngram - 1, -1, -1):
        if history[start:start + ngram] == tail:
            return history[start + ngram:start + ngram + k]
    return []


# --------------------------------------------------------------------------------------------------
# Backends: the same five calls over gRPC or in-process.

class GrpcBackend:
    """The router's calls through the sync client. The router loop makes one call at a time, so a
    blocking call inside the coroutine costs the loop nothing, and a sync stub call skips the
    event-loop wake-ups of a grpc.aio call: the RPC overhead measured is what a lean Python router
    pays, not what an asyncio client adds (bench/rpc_rtt.py measures that difference)."""

    def __init__(self, target: str):
        from worker.client import WorkerClient
        self.client = WorkerClient(target, timeout=120)

    async def alloc(self, total: int, max_new: int) -> int:
        from worker.client import Stopping
        return self.client.alloc(total, stopping=Stopping(max_new_tokens=max_new, ignore_eos=True)).sequence_id

    async def prefill(self, items):
        resp = self.client.prefill([pb.PrefillItem(sequence_id=i, token_ids=t) for i, t in items])
        return [(t.sequence_id, t.token_id, t.finish_reason != 0) for t in resp.tokens], resp.forward_ns

    async def decode(self, ids):
        resp = self.client.decode(ids)
        return [(t.sequence_id, [t.token_id], t.finish_reason != 0) for t in resp.tokens], resp.forward_ns

    async def verify(self, items):
        resp = self.client.verify([pb.VerifyItem(sequence_id=i, draft_token_ids=d) for i, d in items])
        return ([(r.sequence_id, [t.token_id for t in r.tokens], r.tokens[-1].finish_reason != 0)
                 for r in resp.results], resp.forward_ns)

    async def release(self, ids):
        self.client.release(ids)

    async def close(self):
        self.client.close()


class EngineBackend:
    def __init__(self, engine):
        self.engine = engine

    async def alloc(self, total: int, max_new: int) -> int:
        from engine.sampling import SamplingParams, StoppingCriteria
        return self.engine.alloc_sequence(total, SamplingParams(), StoppingCriteria(max_new, ignore_eos=True)).seq_id

    async def prefill(self, items):
        from engine.api import PrefillItem
        r = self.engine.prefill([PrefillItem(i, list(t)) for i, t in items])
        return [(t.seq_id, t.token_id, bool(t.finish_reason)) for t in r.tokens], r.forward_ns

    async def decode(self, ids):
        r = self.engine.decode(ids)
        return [(t.seq_id, [t.token_id], bool(t.finish_reason)) for t in r.tokens], r.forward_ns

    async def verify(self, items):
        from engine.api import VerifyItem
        r = self.engine.verify([VerifyItem(i, d) for i, d in items])
        return [(v.seq_id, [t.token_id for t in v.tokens], bool(v.tokens[-1].finish_reason)) for v in r.results], \
            r.forward_ns

    async def release(self, ids):
        self.engine.release(ids)

    async def close(self):
        pass


# --------------------------------------------------------------------------------------------------
# The router loop.

@dataclass
class LevelResult:
    concurrency: int
    output_tokens: int = 0
    seconds: float = 0.0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    overhead_us: list[float] = field(default_factory=list)
    steps: int = 0
    accepted_drafts: int = 0
    proposed_drafts: int = 0

    def summary(self) -> dict:
        return {
            "concurrency": self.concurrency, "output_tokens": self.output_tokens, "seconds": round(self.seconds, 3),
            "tokens_per_s": round(self.output_tokens / self.seconds, 1) if self.seconds else 0.0,
            "ttft_p50_ms": round(1e3 * percentile(self.ttft, 50), 3), "ttft_p99_ms": round(1e3 * percentile(self.ttft, 99), 3),
            "itl_p50_ms": round(1e3 * percentile(self.itl, 50), 3), "itl_p99_ms": round(1e3 * percentile(self.itl, 99), 3),
            "rpc_overhead_p50_us": round(percentile(self.overhead_us, 50), 1),
            "rpc_overhead_p99_us": round(percentile(self.overhead_us, 99), 1),
            "steps": self.steps,
            "draft_acceptance": round(self.accepted_drafts / self.proposed_drafts, 3) if self.proposed_drafts else None,
        }


async def run_level(backend, requests: list[Request], concurrency: int, spec: int, duration: float = 0.0,
                    on_tick=None) -> LevelResult:
    """Serves `requests` (cycled until `duration` seconds when duration > 0) at `concurrency`."""
    res = LevelResult(concurrency)
    queue = list(requests)
    running: dict[int, dict] = {}
    t_start = time.perf_counter()
    next_req = 0

    def more() -> bool:
        return next_req < len(queue) or (duration and time.perf_counter() - t_start < duration)

    async def retire(done: list[int]) -> None:
        for sid in done:
            running.pop(sid)
        if done:
            await backend.release(done)

    while running or more():
        # Admit new sequences up to the concurrency, prefilled together.
        admit = []
        while len(running) + len(admit) < concurrency and more():
            admit.append(queue[next_req % len(queue)])
            next_req += 1
        if admit:
            t0 = time.perf_counter()
            ids = [await backend.alloc(len(r.prompt) + r.output_len + spec + 1, r.output_len) for r in admit]
            toks, _ = await backend.prefill(list(zip(ids, [r.prompt for r in admit])))
            now = time.perf_counter()
            done = []
            for (sid, tok, finished), r in zip(toks, admit):
                res.ttft.append(now - t0)
                res.output_tokens += 1
                running[sid] = {"history": list(r.prompt) + [tok], "last": now}
                if finished:
                    done.append(sid)
            await retire(done)
        if not running:
            continue
        ids = list(running)
        t0 = time.perf_counter()
        if spec:
            drafts = {i: prompt_lookup(running[i]["history"], spec) for i in ids}
            outs, forward_ns = await backend.verify([(i, drafts[i]) for i in ids])
            res.proposed_drafts += sum(len(d) for d in drafts.values())
            res.accepted_drafts += sum(len(t) - 1 for _, t, _ in outs)
        else:
            outs, forward_ns = await backend.decode(ids)
        now = time.perf_counter()
        res.overhead_us.append(((now - t0) - forward_ns / 1e9) * 1e6)
        res.steps += 1
        finished = []
        for sid, tokens, fin in outs:
            state = running[sid]
            res.itl.append((now - state["last"]) / len(tokens))
            state["last"] = now
            state["history"] += tokens
            res.output_tokens += len(tokens)
            if fin:
                finished.append(sid)
        await retire(finished)
        if on_tick:
            on_tick(res)
    res.seconds = time.perf_counter() - t_start
    return res


# --------------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_worker(model: str, engine_flags: list[str], env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """Starts `metrale-worker serve` on a free port (env: extra environment variables); returns it once healthy."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "worker", "serve", "--model", model, "--host", "127.0.0.1",
                             "--port", str(port), *engine_flags], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    from worker.client import WorkerClient
    client = WorkerClient(f"127.0.0.1:{port}", timeout=5)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited: {proc.stderr.read()[-2000:]}")
        try:
            if client.health() == 1:
                return proc, f"127.0.0.1:{port}"
        except Exception:
            pass
        time.sleep(0.2)
    raise TimeoutError("worker did not become healthy")


def rss_mb(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def plot(results: dict, out_png: pathlib.Path) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in ("grpc", "in_process"):
        levels = results.get(name) or []
        if levels:
            ax.plot([r["concurrency"] for r in levels], [r["tokens_per_s"] for r in levels], marker="o",
                    label=name.replace("_", "-"))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent sequences")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"Throughput vs concurrency ({results['meta']['device']})")
    ax.legend()
    ax.grid(alpha=0.3)
    path = out_png.with_name(out_png.stem + "-throughput.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    written.append(str(path))
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "ttft_ms", "time to first token"), (axes[1], "itl_ms", "inter-token latency")):
        for level in results.get("raw_grpc", []):
            xs = np.sort(np.asarray(level[key]))
            if len(xs):
                ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=f"C={level['concurrency']}")
        ax.set_xscale("log")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction")
        ax.set_title(f"{title} CDF (gRPC)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    path = out_png.with_name(out_png.stem + "-latency-cdf.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    written.append(str(path))
    plt.close(fig)
    return written


def device_name(engine) -> str:
    if engine.device.type == "cuda":
        import torch
        return torch.cuda.get_device_name(engine.device)
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="an existing worker host:port (default: spawn one)")
    p.add_argument("--model", help="checkpoint dir (default: make one of --shape)")
    p.add_argument("--shape", default="tiny", choices=["tiny", "1b", "8b"])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64, 128])
    p.add_argument("--requests", type=int, default=0, help="requests per level (default: max(4C, 32))")
    p.add_argument("--prompt-len", type=int, default=128, help="mean prompt length")
    p.add_argument("--output-len", type=int, default=64, help="mean output length")
    p.add_argument("--trace", help="file of 'prompt_len output_len' lines")
    p.add_argument("--spec", type=int, default=0, help="draft tokens per step by prompt lookup (Verify); 0: Decode")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-in-process", action="store_true", help="skip the in-process comparison")
    p.add_argument("--soak", type=float, default=0.0, help="run C=16 for this many seconds; report memory/blocks")
    p.add_argument("--engine-flags", default="", help="extra flags for the spawned worker, e.g. '--max-slots 256'")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)

    from engine.checkpoint import write_checkpoint
    from engine.config import EngineConfig
    from engine.engine import Engine

    model = args.model
    if not model:
        model = str(write_checkpoint(pathlib.Path(tempfile.mkdtemp()) / args.shape, arch="llama", shape=args.shape,
                                     device="cuda" if _has_cuda() else "cpu"))
    max_c = max(args.concurrency + ([16] if args.soak else []))
    engine_flags = ["--max-slots", str(max(256, 2 * max_c)), "--max-batch-size", str(max(256, 2 * max_c)),
                    *args.engine_flags.split()]
    proc, target = (None, args.target) if args.target else spawn_worker(model, engine_flags)
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        return asyncio.run(_run(args, model, target, proc, engine_flags, out_dir, Engine, EngineConfig))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)


def _has_cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


async def _run(args, model, target, proc, engine_flags, out_dir, Engine, EngineConfig) -> int:
    from worker.config import config_from_args, serve_parser

    grpc_backend = GrpcBackend(target)
    info = grpc_backend.client.info()
    vocab = info.vocab_size
    engine_cfg = config_from_args(EngineConfig, serve_parser().parse_args(["--model", model, *engine_flags]))
    engine = None
    if not args.no_in_process or args.soak:
        engine = Engine(engine_cfg) if not args.no_in_process else None
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": info.device if engine is None else device_name(engine), "model": model,
            "architecture": info.architecture, "dtype": info.dtype, "kernel_backend": info.kernel_backend,
            "worker_version": info.version, "python": platform.python_version(), "spec": args.spec,
            "prompt_len_mean": args.prompt_len, "output_len_mean": args.output_len, "seed": args.seed}
    try:
        import torch
        import grpc as grpc_mod
        meta.update(torch=torch.__version__, grpcio=grpc_mod.__version__)
    except Exception:
        pass
    results: dict = {"meta": meta, "grpc": [], "in_process": [], "raw_grpc": []}

    if args.soak:
        reqs = make_requests(256, args.seed, vocab, args.prompt_len, args.output_len, args.trace)
        samples = []

        def tick(res: LevelResult):
            if res.steps % 50 == 0 and proc is not None:
                samples.append((round(time.perf_counter() - t0, 2), rss_mb(proc.pid)))
        t0 = time.perf_counter()
        warm = await run_level(grpc_backend, reqs[:32], 16, args.spec)
        start = {"rss_mb": rss_mb(proc.pid) if proc else None, "free_blocks": grpc_backend.client.info().free_blocks}
        level = await run_level(grpc_backend, reqs, 16, args.spec, duration=args.soak, on_tick=tick)
        end = {"rss_mb": rss_mb(proc.pid) if proc else None, "free_blocks": grpc_backend.client.info().free_blocks,
               "live_sequences": grpc_backend.client.info().live_sequences}
        results["soak"] = {"seconds": args.soak, "start": start, "end": end, "rss_samples": samples,
                           "level": level.summary(), "warmup": warm.summary()}
        print(json.dumps(results["soak"], indent=2))
    else:
        for c in args.concurrency:
            n = args.requests or max(4 * c, 32)
            reqs = make_requests(n, args.seed + c, vocab, args.prompt_len, args.output_len, args.trace)
            await run_level(grpc_backend, reqs[:min(n, 2 * c)], c, args.spec)  # warm-up
            level = await run_level(grpc_backend, reqs, c, args.spec)
            results["grpc"].append(level.summary())
            results["raw_grpc"].append({"concurrency": c, "ttft_ms": quantiles_ms(level.ttft),
                                        "itl_ms": quantiles_ms(level.itl)})
            line = level.summary()
            if engine is not None:
                eb = EngineBackend(engine)
                await run_level(eb, reqs[:min(n, 2 * c)], c, args.spec)
                ref = await run_level(eb, reqs, c, args.spec)
                results["in_process"].append(ref.summary())
                line["in_process_tokens_per_s"] = ref.summary()["tokens_per_s"]
                line["grpc_vs_in_process"] = round(line["tokens_per_s"] / ref.summary()["tokens_per_s"], 3)
            print(json.dumps(line))
    await grpc_backend.close()

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
    dev = "".join(ch if ch.isalnum() else "-" for ch in meta["device"].split("(")[0].strip().lower()) or "device"
    path = out_dir / f"load-{'soak-' if args.soak else ''}{stamp}-{dev}.json"
    if not args.soak and not args.no_plots:
        results["plots"] = plot(results, path.with_suffix(".png"))
    path.write_text(json.dumps(results, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
