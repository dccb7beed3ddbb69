"""Engine benchmark, side by side with Hugging Face transformers on the same checkpoint, in one run.

    python bench/engine_bench.py --shape 1b                # on a GPU: the H200 floors of issues 3 and 4
    python bench/engine_bench.py --shape tiny --quick      # on CPU (CI): exercises every code path

Measures, in one process:
- the device's copy bandwidth (bytes read + written) and the decode floor = weight bytes / bandwidth;
- this engine: prefill throughput (1 x 2048 and 8 x 512 tokens), decode step latency at several batch
  sizes with 128-token prompts (median wall time per Engine.decode call, and device time; at batch 1
  and 32 also the step interval with the next step launched before the last is finished), a steady
  and a churning batch (one leave + one join every 8 steps) with the CUDA-graph hit rate, and Verify
  of 4 drafts at batch 1;
- transformers on the same files: eager prefill and decode steps, and (GPU) a static cache with a
  compiled decode step.
Prints one table with ratios to transformers and to the floor, and writes the figures with date,
GPU and versions to bench/results/engine-<date>-<device>.json."""
from __future__ import annotations

import argparse
import collections
import datetime
import gc
import json
import pathlib
import platform
import statistics
import sys
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engine.api import PrefillItem, VerifyItem  # noqa: E402
from engine.checkpoint import write_temporary_checkpoint  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.loader import weight_bytes  # noqa: E402
from engine.sampling import SamplingParams, StoppingCriteria  # noqa: E402

SAMPLING = SamplingParams()  # every benchmarked sequence's (greedy; --top-logprobs N asks for N candidates)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device) -> float:
    """Bytes read + written per second by a large device-to-device copy (median of 20)."""
    if device.type != "cuda":
        n = 1 << 26
    else:
        n = 1 << 30
    src = torch.randn(n // 4, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(25):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * src.nbytes / statistics.median(times[5:])


def prompts_of(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


GREEDY_LONG = StoppingCriteria(max_new_tokens=0, ignore_eos=True)


# --------------------------------------------------------------------------------------------------
# This engine

def engine_prefill(engine: Engine, batch: int, length: int, repeats: int) -> dict:
    vocab = engine.model_config.vocab_size
    times = []
    for r in range(repeats + 2):
        ids = [engine.alloc_sequence(length + 2, SAMPLING, GREEDY_LONG, prefix_caching=False).seq_id
               for _ in range(batch)]
        prompts = prompts_of([length] * batch, vocab, seed=r)
        sync(engine.device)
        t0 = time.perf_counter()
        engine.prefill([PrefillItem(i, p) for i, p in zip(ids, prompts)])
        sync(engine.device)
        times.append(time.perf_counter() - t0)
        engine.release(ids)
    t = statistics.median(times[2:])
    return {"batch": batch, "length": length, "seconds": t, "tokens_per_s": batch * length / t}


def engine_prefix_ttft(engine: Engine, prompt_len: int, cached: int, repeats: int) -> dict:
    """Time to first token of a prompt_len-token prompt whose first `cached` tokens are in the prefix cache (its
    blocks registered by an earlier prompt with that prefix), against the same prompt with the cache flushed:
    medians over `repeats` fresh prompts. (The prefill measurements run with the cache off; decode steps with it
    on, as the worker runs them.)"""
    vocab = engine.model_config.vocab_size

    def ttft(prompt: list[int]) -> tuple[float, int]:
        sid = engine.alloc_sequence(len(prompt) + 2, SAMPLING, GREEDY_LONG).seq_id
        sync(engine.device)
        t0 = time.perf_counter()
        token = engine.prefill([PrefillItem(sid, prompt)]).tokens[0]
        sync(engine.device)
        seconds = time.perf_counter() - t0
        engine.release([sid])
        return seconds, token.cached_tokens

    uncached, hit, hits = [], [], []
    for r in range(repeats + 1):
        prefix, tails = prompts_of([cached], vocab, seed=100 + r)[0], prompts_of([prompt_len - cached] * 2, vocab, 200 + r)
        engine.flush_cache()
        seconds, n = ttft(prefix + tails[0])  # computes every token, then leaves its blocks cached
        assert n == 0, f"a flushed cache gave {n} cached tokens"
        t, n = ttft(prefix + tails[1])  # the same prefix, another tail
        if r:  # the first round warms the shapes
            uncached.append(seconds)
            hit.append(t)
            hits.append(n)
    u, c = statistics.median(uncached), statistics.median(hit)
    return {"prompt_len": prompt_len, "cached": cached, "cached_tokens": min(hits), "uncached_ms": 1e3 * u,
            "cached_ms": 1e3 * c, "speedup": u / c}


def start_batch(engine: Engine, batch: int, prompt_len: int, room: int, seed: int = 1) -> list[int]:
    vocab = engine.model_config.vocab_size
    ids = [engine.alloc_sequence(prompt_len + room, SAMPLING, GREEDY_LONG).seq_id for _ in range(batch)]
    for i, p in zip(ids, prompts_of([prompt_len] * batch, vocab, seed)):
        engine.prefill([PrefillItem(i, p)])
    return ids


def graph_stats(engine: Engine) -> tuple[int, int]:
    g = engine.runtime.dispatch.graphs
    return (g.stats.hits, g.stats.misses) if g is not None else (0, 0)


def batch_layout(engine: Engine, ids: list[int]) -> dict:
    """Where a batch lives: its slots, its KV block ids (range, and the fraction of a sequence's consecutive
    blocks that are adjacent ids) and the graphs captured so far. The same tree replays a batch-32 step up
    to 55 us faster or slower depending on the runs before it (docs/decode-step-budget.md, "Open questions")."""
    seqs = [engine.sequences[i] for i in ids]
    blocks = [b for s in seqs for b in s.blocks.block_ids]
    pairs = [(a, b) for s in seqs for a, b in zip(s.blocks.block_ids, s.blocks.block_ids[1:])]
    g = engine.runtime.dispatch.graphs
    return {"slots": [min(s.slot for s in seqs), max(s.slot for s in seqs)], "blocks": [min(blocks), max(blocks)],
            "adjacent_blocks": sum(b == a + 1 for a, b in pairs) / max(1, len(pairs)),
            "captures": g.stats.captures if g is not None else 0}


def engine_decode(engine: Engine, batch: int, steps: int, prompt_len: int = 128) -> dict:
    ids = start_batch(engine, batch, prompt_len, steps + engine.config.capture_after + 16)
    for _ in range(engine.config.capture_after + 2):  # warm-up: this slot vector's own graph gets captured here
        engine.decode(ids)
    h0, m0 = graph_stats(engine)
    wall, dev = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        r = engine.decode(ids)
        wall.append(time.perf_counter() - t0)
        dev.append(r.forward_ns / 1e9)
    h1, m1 = graph_stats(engine)
    layout = batch_layout(engine, ids)
    engine.release(ids)
    return {"batch": batch, "steps": steps, "step_ms": 1e3 * statistics.median(wall),
            "step_ms_mean": 1e3 * statistics.fmean(wall), "device_ms": 1e3 * statistics.median(dev),
            "graph_hit_rate": (h1 - h0) / max(1, (h1 - h0) + (m1 - m0)), "layout": layout}


def engine_decode_queued(engine: Engine, batch: int, steps: int, prompt_len: int = 128) -> dict:
    """The same steady batch with the next step launched before the last one is finished (what the worker
    does for a router that keeps Decodes in flight): see queued_steps."""
    ids = start_batch(engine, batch, prompt_len, steps + engine.config.capture_after + 16)
    for _ in range(engine.config.capture_after + 2):
        engine.decode(ids)
    result = {"batch": batch, **queued_steps(engine, ids, steps), "layout": batch_layout(engine, ids)}
    engine.release(ids)
    return result


def queued_steps(engine: Engine, ids: list[int], steps: int) -> dict:
    """`steps` decode steps of ids, each launched before the last one is finished (up to max_steps_in_flight in
    flight): step_ms = wall time of all steps / steps; interval_ms_median = the median interval between two
    results (the interval between tokens); the host's work per step overlaps the device's. finish() waits for
    the device: a device-bound run spends most of each interval there, a host-bound one launching and
    committing. device_ms_median: the median of the steps' own device times."""
    depth = engine.config.max_steps_in_flight
    in_flight: collections.deque = collections.deque()
    # When each result was ready; host time in finish() and in decode_launch(); each step's device time.
    done, finish_s, launch_s, device_s = [], [], [], []

    def finish() -> float:  # the host's time in it
        t = time.perf_counter()
        device_s.append(engine.finish(in_flight.popleft()).forward_ns / 1e9)
        done.append(time.perf_counter())
        return done[-1] - t

    t0 = time.perf_counter()
    for _ in range(steps):
        if len(in_flight) == depth:
            finish_s.append(finish())
        t = time.perf_counter()
        in_flight.append(engine.decode_launch(ids))
        launch_s.append(time.perf_counter() - t)
    while in_flight:
        finish()
    wall = time.perf_counter() - t0
    return {"steps": steps, "steps_in_flight": depth, "step_ms": 1e3 * wall / steps,
            "interval_ms_median": 1e3 * statistics.median(b - a for a, b in zip(done, done[1:])),
            "finish_ms_median": 1e3 * statistics.median(finish_s) if finish_s else 0.0,
            "launch_ms_median": 1e3 * statistics.median(launch_s),
            "device_ms_median": 1e3 * statistics.median(device_s)}


def engine_churn(engine: Engine, batch: int, steps: int, every: int = 8, prompt_len: int = 128) -> dict:
    """A batch whose membership changes: every `every` steps one sequence leaves and a new one joins."""
    vocab = engine.model_config.vocab_size
    room = steps + 32
    ids = start_batch(engine, batch, prompt_len, room)
    for _ in range(8):
        engine.decode(ids)
    h0, m0 = graph_stats(engine)
    wall = []
    for step in range(steps):
        if step and step % every == 0:
            engine.release([ids.pop(step % len(ids))])
            new = engine.alloc_sequence(prompt_len + room, SAMPLING, GREEDY_LONG).seq_id
            engine.prefill([PrefillItem(new, prompts_of([prompt_len], vocab, seed=step)[0])])
            ids.append(new)
        t0 = time.perf_counter()
        engine.decode(ids)
        wall.append(time.perf_counter() - t0)
    h1, m1 = graph_stats(engine)
    engine.release(ids)
    return {"batch": batch, "steps": steps, "every": every, "step_ms": 1e3 * statistics.median(wall),
            "step_ms_mean": 1e3 * statistics.fmean(wall),
            "graph_hit_rate": (h1 - h0) / max(1, (h1 - h0) + (m1 - m0))}


def engine_verify(engine: Engine, drafts: int, steps: int, prompt_len: int = 128) -> dict:
    """Verify of `drafts` drafts at batch 1, alternating with a decode step of the same sequence: the two
    medians come from the same stretch of time, so their ratio (the issue's floor: Verify <= 1.2x the
    batch-1 decode step) is not moved by the drift between separate runs (the batch-1 step measured
    0.91-0.99 ms in separate processes of one tree). step_ms: Verify; decode_step_ms: the decode steps
    in between."""
    warm_up = engine.config.capture_after + 2  # this slot vector's own verify and decode graphs get captured here
    ids = start_batch(engine, 1, prompt_len, (drafts + 2) * (steps + warm_up + 8) + 8)
    vocab = engine.model_config.vocab_size
    item = [VerifyItem(ids[0], [7 % vocab] * drafts)]
    for _ in range(warm_up):
        engine.verify(item)
        engine.decode(ids)
    wall, dec = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.verify(item)
        t1 = time.perf_counter()
        engine.decode(ids)
        dec.append(time.perf_counter() - t1)
        wall.append(t1 - t0)
    engine.release(ids)
    v, d = statistics.median(wall), statistics.median(dec)
    return {"drafts": drafts, "steps": steps, "step_ms": 1e3 * v, "decode_step_ms": 1e3 * d, "ratio": v / d}


# --------------------------------------------------------------------------------------------------
# transformers on the same checkpoint

def hf_load(path, dtype, device):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval()


@torch.no_grad()
def hf_prefill(model, device, batch: int, length: int, repeats: int) -> dict:
    vocab = model.config.vocab_size
    ids = torch.tensor(prompts_of([length] * batch, vocab), device=device)
    times = []
    for _ in range(repeats + 2):
        sync(device)
        t0 = time.perf_counter()
        model(ids, use_cache=False, logits_to_keep=1)
        sync(device)
        times.append(time.perf_counter() - t0)
    t = statistics.median(times[2:])
    return {"batch": batch, "length": length, "tokens_per_s": batch * length / t}


@torch.no_grad()
def hf_decode_eager(model, device, batch: int, steps: int, prompt_len: int = 128) -> dict:
    from transformers import DynamicCache
    vocab = model.config.vocab_size
    ids = torch.tensor(prompts_of([prompt_len] * batch, vocab), device=device)
    cache = DynamicCache()
    out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    tok = out.logits[:, -1].argmax(-1, keepdim=True)
    wall = []
    for _ in range(steps + 3):
        sync(device)
        t0 = time.perf_counter()
        out = model(tok, past_key_values=cache, use_cache=True)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        sync(device)
        wall.append(time.perf_counter() - t0)
    return {"batch": batch, "step_ms": 1e3 * statistics.median(wall[3:])}


@torch.no_grad()
def hf_decode_compiled(model, device, batch: int, steps: int, prompt_len: int = 128) -> dict:
    """Static cache + torch.compile(mode='reduce-overhead') decode step (transformers' fast path)."""
    from transformers import StaticCache
    vocab = model.config.vocab_size
    cache = StaticCache(config=model.config, max_cache_len=prompt_len + steps + 64)
    ids = torch.tensor(prompts_of([prompt_len] * batch, vocab), device=device)
    pos = torch.arange(prompt_len, device=device)
    out = model(ids, past_key_values=cache, cache_position=pos, use_cache=True, logits_to_keep=1)
    tok = out.logits[:, -1].argmax(-1, keepdim=True)
    step = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    t_compile = time.perf_counter()
    wall = []
    for i in range(steps + 5):
        cache_position = torch.tensor([prompt_len + i], device=device)
        sync(device)
        t0 = time.perf_counter()
        out = step(tok, past_key_values=cache, cache_position=cache_position, position_ids=cache_position[None],
                   use_cache=True)
        tok = out.logits[:, -1].argmax(-1, keepdim=True).clone()
        sync(device)
        wall.append(time.perf_counter() - t0)
        if i == 0:
            t_compile = time.perf_counter() - t_compile
    return {"batch": batch, "step_ms": 1e3 * statistics.median(wall[5:]), "compile_s": t_compile}


# --------------------------------------------------------------------------------------------------

def tune_kernels(lib, args) -> None:
    """The experiment flags (--skinny-wide-tiles, --decode-splits, --decode-cluster) applied to a KernelLibrary."""
    if getattr(args, "skinny_wide_tiles", None) is not None:
        lib.skinny_wide_tiles = args.skinny_wide_tiles
    if getattr(args, "decode_splits", None) is not None:
        lib.decode_max_splits = args.decode_splits
    if getattr(args, "decode_cluster", None) is not None:
        lib.decode_cluster = min(lib.decode_cluster, args.decode_cluster)


def use_kernels(kernel_dir: pathlib.Path, build_dir: pathlib.Path) -> None:
    """Engines created after this load their CUDA kernels from kernel_dir's sources and build_dir's fatbins."""
    import functools

    from engine.cuda import library
    from engine.cuda import ops as cuda_ops
    cuda_ops.KernelLibrary = functools.partial(library.KernelLibrary, build_dir=build_dir, kernel_dir=kernel_dir)


def guarded(results: dict, name: str, fn, *args, **kwargs):
    # As the worker does once it has started: what is alive now (torch, the models) leaves the collector's
    # reach, so no full collection over it (tens of ms) lands inside a timed phase. (It is not what moves the
    # queued batch-32 figure between processes: docs/decode-step-budget.md, "Open questions".)
    gc.collect()
    gc.freeze()
    try:
        value = fn(*args, **kwargs)
    except Exception as e:  # a failing section is recorded, the run goes on
        traceback.print_exc()
        value = {"error": f"{type(e).__name__}: {e}"}
    results[name] = value
    print(f"  {name}: {json.dumps(value)}", flush=True)
    return value


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="tiny", choices=["tiny", "1b", "8b"])
    p.add_argument("--arch", default="llama", choices=["llama", "mistral", "qwen2", "qwen3"])
    p.add_argument("--model", help="an existing checkpoint dir instead of writing one")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--quick", action="store_true", help="few steps and sizes (CPU / CI)")
    p.add_argument("--top-logprobs", type=int, default=0,
                   help="every sequence asks for this many top-logprob candidates per token")
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--no-hf-compile", action="store_true")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="the engine's dtype (EngineConfig.dtype; auto: bf16 on a GPU, "
                                                  "fp32 on CPU)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--kernels", nargs=2, metavar=("SOURCES", "BUILD"),
                   help="(GPU, A/B of kernel variants) load the kernels of this source dir from this build dir "
                        "(e.g. a copy of kernels_cu/ with one file changed; fatbins not current there are "
                        "compiled with NVRTC)")
    p.add_argument("--decode-splits", type=int, default=None,
                   help="(GPU, experiments) at most this many key splits in decode attention")
    p.add_argument("--decode-cluster", type=int, default=None,
                   help="(GPU, experiments) decode attention's cluster size (1: splits merge through global memory)")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="the engine's context limit (default 2048 + 16 + 512; it sizes decode attention's split grid)")
    p.add_argument("--prefix-ttft", type=int, nargs=2, metavar=("PROMPT", "CACHED"),
                   help="measure only the TTFT of a PROMPT-token prompt whose first CACHED tokens are in the prefix "
                        "cache, against the same prompt uncached (needs --max-seq-len > PROMPT)")
    p.add_argument("--skinny-wide-tiles", type=int, default=None,
                   help="(GPU, experiments) skinny grids of at most this many tiles get 16-warp blocks "
                        "(default: the SM count; 0: never)")
    args = p.parse_args(argv)
    global SAMPLING
    SAMPLING = SamplingParams(top_logprobs=args.top_logprobs)

    if args.kernels:
        use_kernels(pathlib.Path(args.kernels[0]), pathlib.Path(args.kernels[1]))
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    if args.quick:
        args.steps = min(args.steps, 10)
        args.batches = [b for b in args.batches if b <= 8] or [1]
    prefill_shapes = [(1, 2048), (8, 512)] if not args.quick else [(1, 64), (4, 32)]
    repeats = 3 if args.quick else 10

    results: dict = {"meta": {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.machine()})",
        "shape": pathlib.Path(args.model).name if args.model else args.shape, "arch": args.arch,
        "torch": torch.__version__, "python": platform.python_version(),
        "argv": sys.argv[1:]}}
    try:
        import transformers
        results["meta"]["transformers"] = transformers.__version__
    except ImportError:
        args.no_hf = True
    print(f"engine_bench: {results['meta']}", flush=True)

    bw = guarded(results, "copy_bandwidth_TBps", lambda: copy_bandwidth(device) / 1e12)
    t0 = time.perf_counter()
    model_dir = args.model or str(write_temporary_checkpoint(args.shape, arch=args.arch, device=str(device)))
    results["meta"]["checkpoint_write_s"] = round(time.perf_counter() - t0, 1)

    max_len = 2048 + 16 if not args.quick else 512
    cfg = EngineConfig(model=model_dir, device=device.type, max_slots=256, max_batch_size=256,
                       max_seq_len=args.max_seq_len or max_len + 512, max_prefill_tokens=8192,
                       kv_cache_memory=0.5 if device.type == "cuda" else 0.9, dtype=args.dtype)
    engine = Engine(cfg)
    lib = getattr(engine.runtime.ops, "lib", None)
    if lib is not None:  # before any step is captured
        tune_kernels(lib, args)
    results["meta"].update(dtype=str(engine.dtype), kernel_backend=engine.runtime.ops.name, capture_after=cfg.capture_after,
                           fallback_graphs=cfg.fallback_graphs, max_graphs=cfg.max_graphs,
                           weight_bytes=weight_bytes(engine.runtime.weights),
                           pdl=bool(getattr(lib, "pdl", False)),
                           skinny_wide_tiles=getattr(lib, "skinny_wide_tiles", None),
                           decode_max_splits=getattr(lib, "decode_max_splits", None),
                           decode_cluster=getattr(lib, "decode_cluster", None))
    floor_ms = (1e3 * results["meta"]["weight_bytes"] / (bw * 1e12)) if isinstance(bw, float) else None
    results["decode_floor_ms"] = floor_ms

    ours = results.setdefault("engine", {})
    if args.prefix_ttft:
        r = guarded(ours, "prefix_ttft", engine_prefix_ttft, engine, *args.prefix_ttft, repeats)
        if isinstance(r, dict):
            print(f"prefix TTFT, {r['prompt_len']}-token prompt: {r['cached_ms']:.2f} ms with {r['cached_tokens']} "
                  f"tokens cached vs {r['uncached_ms']:.2f} ms uncached = {r['speedup']:.1f}x")
        return write_results(results, args)
    for b, n in prefill_shapes:
        guarded(ours, f"prefill_{b}x{n}", engine_prefill, engine, b, n, repeats)
    for b in args.batches:
        guarded(ours, f"decode_b{b}", engine_decode, engine, b, args.steps)
    for b in sorted({1, 32} & set(args.batches)):
        guarded(ours, f"decode_queued_b{b}", engine_decode_queued, engine, b, args.steps)
    if engine.runtime.dispatch.graphs is not None:  # the same engine with its graph cache set aside: eager launches
        graphs, engine.runtime.dispatch.graphs = engine.runtime.dispatch.graphs, None
        guarded(ours, "eager_decode_b1", engine_decode, engine, 1, max(20, args.steps // 4))
        engine.runtime.dispatch.graphs = graphs
    churn_b = 32 if not args.quick else 4
    guarded(ours, f"decode_steady_b{churn_b}", engine_decode, engine, churn_b, args.steps)
    guarded(ours, f"decode_churn_b{churn_b}", engine_churn, engine, churn_b, args.steps)
    guarded(ours, "verify4_b1", engine_verify, engine, 4, max(10, args.steps // 2))
    if engine.runtime.dispatch.graphs is not None:
        ours["graph_cache"] = vars(engine.runtime.dispatch.graphs.stats).copy()
    engine.close()
    del engine
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    if not args.no_hf:
        hf = results.setdefault("transformers", {})
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = hf_load(model_dir, dtype, device)
        for b, n in prefill_shapes:
            guarded(hf, f"prefill_{b}x{n}", hf_prefill, model, device, b, n, repeats)
        for b in sorted({1, 32} & set(args.batches) or {args.batches[0]}):
            guarded(hf, f"eager_decode_b{b}", hf_decode_eager, model, device, b, max(10, args.steps // 4))
        if device.type == "cuda" and not args.no_hf_compile:
            guarded(hf, "compiled_decode_b1", hf_decode_compiled, model, device, 1, max(20, args.steps // 2))
        del model
        gc.collect()

    print(table(results, prefill_shapes, args.batches, churn_b))
    return write_results(results, args)


def results_path(results: dict, out: str | pathlib.Path, name: str) -> pathlib.Path:
    """out/NAME-<UTC stamp>-<device>.json, out made if missing (a plot of the run takes the same stem)."""
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
    dev = "".join(c if c.isalnum() else "-" for c in results["meta"]["device"].lower())
    return out / f"{name}-{stamp}-{dev}.json"


def write_results(results: dict, args, path: pathlib.Path | None = None) -> int:
    path = path or results_path(results, args.out, f"engine-{args.shape}")
    path.write_text(json.dumps(results, indent=1))
    print(f"wrote {path}")
    return 0


def table(r: dict, prefill_shapes, batches, churn_b) -> str:
    ours, hf = r.get("engine", {}), r.get("transformers", {})
    floor = r.get("decode_floor_ms")
    lines = [f"== {r['meta']['device']} | {r['meta']['shape']} ({r['meta'].get('dtype')}, "
             f"{r['meta'].get('kernel_backend')}, pdl {r['meta'].get('pdl')}) | floor {floor and round(floor, 3)} ms/step"]

    def get(d, k, f):
        v = d.get(k, {})
        return v.get(f) if isinstance(v, dict) else None

    for b, n in prefill_shapes:
        o, h = get(ours, f"prefill_{b}x{n}", "tokens_per_s"), get(hf, f"prefill_{b}x{n}", "tokens_per_s")
        ratio = f"{o / h:.2f}x transformers" if o and h else ""
        lines.append(f"prefill {b}x{n}: {'-' if o is None else round(o):>10} tok/s   transformers {h and round(h)}   {ratio}")
    for b in batches:
        o = get(ours, f"decode_b{b}", "step_ms")
        h = get(hf, f"eager_decode_b{b}", "step_ms")
        parts = [f"decode b{b}: {o and round(o, 3)} ms/step (hit rate {get(ours, f'decode_b{b}', 'graph_hit_rate')})"]
        if o and h:
            parts.append(f"transformers eager {h:.2f} ms = {h / o:.1f}x slower")
        if o and floor and b == 1:
            parts.append(f"floor/step = {floor / o:.0%} of bandwidth")
        q = get(ours, f"decode_queued_b{b}", "step_ms")
        if q:
            parts.append(f"{get(ours, f'decode_queued_b{b}', 'steps_in_flight')} steps in flight {q:.3f} ms/step")
        e = get(ours, "eager_decode_b1", "step_ms")
        he = get(hf, "eager_decode_b1", "step_ms")
        if b == 1 and e and he:
            parts.append(f"our eager (no graphs) {e:.2f} ms = {he / e:.1f}x faster than transformers eager")
        c = get(hf, "compiled_decode_b1", "step_ms")
        if b == 1 and o and c:
            parts.append(f"transformers static+compiled {c:.2f} ms = {c / o:.1f}x")
        lines.append("   ".join(parts))
    s, c = ours.get(f"decode_steady_b{churn_b}", {}), ours.get(f"decode_churn_b{churn_b}", {})
    if "step_ms_mean" in s and "step_ms_mean" in c:
        lines.append(f"churn b{churn_b}: mean {c['step_ms_mean']:.3f} ms vs steady {s['step_ms_mean']:.3f} ms = "
                     f"{c['step_ms_mean'] / s['step_ms_mean']:.2f}x (hit rate {c.get('graph_hit_rate'):.2f})")
    v, d1 = get(ours, "verify4_b1", "step_ms"), get(ours, "decode_b1", "step_ms")
    dv, r = get(ours, "verify4_b1", "decode_step_ms"), get(ours, "verify4_b1", "ratio")
    if v and r:
        lines.append(f"verify 4 drafts b1: {v:.3f} ms = {r:.2f}x the b1 decode step between its steps "
                     f"({dv:.3f} ms)" + (f"; {v / d1:.2f}x decode b1 above" if d1 else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
