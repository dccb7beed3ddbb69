"""Scale benchmark: decode steps and prefills at serving shapes, each beside its hardware floor, in one run.

    python bench/scale_bench.py --shape 1b 8b --profile --out DIR   # on a GPU (gpu_session.sh scale)
    python bench/scale_bench.py --quick --out DIR                   # on CPU (CI): the tiny shape, a few points

Per shape (a random-weight checkpoint written by engine.checkpoint, or --model DIR), one engine serves:
- decode, every batch B in --batches by context C in --contexts, B sequences of C tokens: step_ms, the median
  interval between results with each step launched before the last one finished (max_steps_in_flight, as the
  worker runs a router's pipelined Decodes) over --steps steps after a warm-up that captures the batch's graph;
  floor_ms, the larger of (the weight bytes a step reads + the KV bytes its attention reads) / the copy
  bandwidth measured in the same run and the step's FLOPs / the matmul peak measured in the same run (at
  batch 256 the 8B's linear layers alone need 3.8 TFLOP: about 5 ms of tensor-core time against 3.6 ms of
  weight reads); bound says which; share = floor / step. A point whose KV does not fit in the KV cache is
  reported skipped.
- prefill, each B x N in --prefill: tokens/s beside the FLOPs floor, (2 x the linear layers' parameters x
  tokens + 2 x the LM head's x prompts + causal attention's FLOPs) / the matmul peak measured in the same run.
- --profile: the --profile-points points of lowest share again, a few replayed steps under torch.profiler:
  device time per kernel name (top 10; on CPU, self time per torch op).
Prints a table per shape; writes one JSON and a plot (share of the floor by batch, a line per context) to --out.

How a context is filled: prefilling 256 x 32k tokens would take far longer than the run. Each sequence is
prefilled with a real prompt of PROMPT_TOKENS tokens (slot state, blocks, first token as a prefill makes
them), then fill_context moves it to where a prefill of C tokens would have left it; the positions past the
real prompt hold what the KV cache holds there: random values, written once per engine. Each sequence reads
its own blocks, as distinct requests do: a batch sharing one prefilled context through the prefix cache would
read the same blocks B times, partly from L2, so the step would read less from HBM than the floor counts."""

from __future__ import annotations

import argparse
import collections
import datetime
import gc
import pathlib
import platform
import shutil
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.engine_bench import (GREEDY_LONG, SAMPLING, copy_bandwidth, engine_prefill, graph_stats,  # noqa: E402
                                guarded, prompts_of, queued_steps, results_path, sync, write_results)
from engine.api import PrefillItem  # noqa: E402
from engine.checkpoint import write_checkpoint  # noqa: E402
from engine.config import EngineConfig, ModelConfig  # noqa: E402
from engine.device import select_dtype  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.kv_cache import KVCache  # noqa: E402
from engine.loader import weight_bytes  # noqa: E402
from engine.quant import FP8_DTYPE, Fp8Weight  # noqa: E402

BATCHES, CONTEXTS, PREFILL = [1, 8, 32, 64, 128, 256], [128, 2048, 8192, 32768], [(1, 32768), (8, 512)]
QUICK_BATCHES, QUICK_CONTEXTS, QUICK_PREFILL = [1, 4], [64, 256], [(1, 128), (2, 32)]
PROMPT_TOKENS = 16  # the real prompt of each sequence before fill_context (one KV block)
FILLER_TOKEN = 0  # the host's token ids of the filled positions (greedy sampling, no penalty: never read)
# A steady batch's own graph is captured within its warm-up (the worker's default waits longer: that decides
# when a batch gets its graph, not what a replayed step does).
CAPTURE_AFTER = 2
TOP_KERNELS = 10


def step_weight_bytes(engine: Engine, batch: int) -> int:
    """Weight bytes a decode step of `batch` sequences reads: every weight once, except an untied embedding
    table, of which it gathers only the batch's rows."""
    w = engine.runtime.weights
    total = weight_bytes(w)
    if isinstance(w.lm_head, Fp8Weight) or w.embed.data_ptr() != w.lm_head.data_ptr():
        total -= w.embed.nbytes - batch * w.embed[0].nbytes
    return total


def kv_token_bytes(engine: Engine) -> int:
    """K and V of one token over every layer, in the cache's dtype."""
    kv = engine.runtime.kv
    return kv.nbytes // (kv.num_blocks * kv.block_size)


def prefill_flops(mc: ModelConfig, batch: int, length: int) -> float:
    """FLOPs of prefilling `batch` prompts of `length` tokens: the linear layers for every token, the LM head
    for each prompt's last token, and causal attention (QK^T and PV, 2 * head_dim FLOPs each per query-key
    pair, length * (length + 1) / 2 pairs per head)."""
    h = mc.hidden_size
    linear = h * (mc.q_size + 2 * mc.kv_size) + mc.q_size * h + 3 * h * mc.intermediate_size
    attention = 4 * mc.num_heads * mc.head_dim * length * (length + 1) / 2
    return batch * (mc.num_layers * (2 * linear * length + attention) + 2 * h * mc.vocab_size)


def decode_flops(mc: ModelConfig, batch: int, keys: float) -> float:
    """FLOPs of a decode step of `batch` sequences attending to `keys` keys each: the linear layers and the LM
    head for every sequence's token, and attention (QK^T and PV, 2 * head_dim FLOPs each per key and head)."""
    h = mc.hidden_size
    linear = h * (mc.q_size + 2 * mc.kv_size) + mc.q_size * h + 3 * h * mc.intermediate_size
    return batch * (mc.num_layers * (2 * linear + 4 * mc.num_heads * mc.head_dim * keys) + 2 * h * mc.vocab_size)


def matmul_peak(device: torch.device, n: int, dtype: torch.dtype) -> float:
    """FLOP/s of an n x n x n matmul (median of 10, after 3 warm-up runs)."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    times = []
    for _ in range(13):
        sync(device)
        t0 = time.perf_counter()
        a @ b
        sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * n ** 3 / statistics.median(times[3:])


def randomize_kv(engine: Engine) -> None:
    """Random values in every KV block (what fill_context's positions hold); layer by layer. An E4M3 cache
    (--kv-cache-dtype fp8; normal_ has no fp8 kernel) gets normal values converted from a 16-bit layer."""
    kv = engine.runtime.kv
    for t in (kv.k, kv.v):
        for layer in t:
            if t.element_size() >= 2:
                layer.normal_()
            else:
                layer.copy_(torch.empty(layer.shape, dtype=torch.bfloat16, device=layer.device).normal_())
    sync(engine.device)


def fill_context(engine: Engine, ids: list[int], context: int) -> None:
    """Sequences whose real prompt is complete (a prefill sampled their first token) set to where a prefill of
    a `context`-token prompt would have left them: on the host the token list (filler tokens, then the sampled
    token), the prompt length and the cached count; on the device the slot's position. Their blocks are all
    taken (a completed prompt takes its whole reservation), so positions up to the context lie in their own
    blocks."""
    rt = engine.runtime
    seqs = [engine.sequences[i] for i in ids]
    for seq in seqs:
        assert seq.prompt_done and seq.num_cached == seq.prompt_len == seq.seq_len - 1 < context
        seq.token_ids[seq.prompt_len:-1] = [FILLER_TOKEN] * (context - seq.prompt_len)
        seq.prompt_len = seq.num_cached = context
    with rt.dispatch.on_device():  # behind the prefill's work on the compute stream
        rt.state.num_cached[torch.tensor([s.slot for s in seqs], device=rt.device)] = context
    sync(rt.device)


def start_point(engine: Engine, batch: int, context: int, room: int) -> list[int]:
    """`batch` sequences at `context` tokens, with room for `room` more each (released on failure)."""
    ids: list[int] = []
    try:
        for _ in range(batch):
            ids.append(engine.alloc_sequence(context + room, SAMPLING, GREEDY_LONG).seq_id)
        prompts = prompts_of([PROMPT_TOKENS] * batch, engine.model_config.vocab_size, seed=context)
        engine.prefill([PrefillItem(i, p) for i, p in zip(ids, prompts)])
        fill_context(engine, ids, context)
    except BaseException:
        if ids:
            engine.release(ids)
        raise
    return ids


def warm_up(engine: Engine, ids: list[int]) -> int:
    """Decode steps until the batch replays its own graph; returns how many ran."""
    steps = engine.config.capture_after + 3
    for _ in range(steps):
        engine.decode(ids)
    return steps


def measure_point(engine: Engine, batch: int, context: int, steps: int, room: int, bandwidth: float,
                  peak: float) -> dict:
    ids = start_point(engine, batch, context, room)
    try:
        warm = warm_up(engine, ids)
        h0, m0 = graph_stats(engine)
        q = queued_steps(engine, ids, steps)
        h1, m1 = graph_stats(engine)
    finally:
        engine.release(ids)
    keys = context + warm + (steps - 1) / 2 + 1  # keys each sequence's attention reads, mean over the steps
    weights, kv = step_weight_bytes(engine, batch), batch * keys * kv_token_bytes(engine)
    bytes_ms, flops_ms = 1e3 * (weights + kv) / bandwidth, 1e3 * decode_flops(engine.model_config, batch, keys) / peak
    floor_ms, step_ms = max(bytes_ms, flops_ms), q["interval_ms_median"]
    return {"batch": batch, "context": context, "step_ms": step_ms, "floor_ms": floor_ms, "share": floor_ms / step_ms,
            "bound": "bytes" if bytes_ms >= flops_ms else "FLOPs", "bytes_floor_ms": bytes_ms,
            "flops_floor_ms": flops_ms,
            "weight_gb": weights / 1e9, "kv_gb": kv / 1e9, "tokens_per_s": 1e3 * batch / step_ms,
            "step_ms_mean": q["step_ms"], "device_ms": q["device_ms_median"], "launch_ms": q["launch_ms_median"],
            "finish_ms": q["finish_ms_median"], "graph_hit_rate": (h1 - h0) / max(1, (h1 - h0) + (m1 - m0))}


def kernel_times(prof, device: torch.device) -> collections.Counter:
    """Total us by kernel name (device time) on a GPU; on CPU self time by torch op."""
    totals: collections.Counter = collections.Counter()
    if device.type == "cuda":
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0:
                totals[e.name] += e.device_time_total
    else:
        for e in prof.key_averages():
            totals[e.key] += e.self_cpu_time_total
    return totals


def profile_point(engine: Engine, batch: int, context: int, steps: int, room: int) -> dict:
    """Kernel time of `steps` queued steps of a point (its graph replayed). Should the profiler see no kernel
    of a replayed graph, the steps run again eagerly (replayed: False)."""
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if engine.device.type == "cuda" else ProfilerActivity.CPU
    dispatch = engine.runtime.dispatch
    graphs, replayed = dispatch.graphs, dispatch.graphs is not None
    ids = start_point(engine, batch, context, room)
    try:
        warm_up(engine, ids)
        with profile(activities=[activity]) as prof:
            queued_steps(engine, ids, steps)
        totals = kernel_times(prof, engine.device)
        if not totals and replayed:
            dispatch.graphs, replayed = None, False
            with profile(activities=[activity]) as prof:
                queued_steps(engine, ids, steps)
            totals = kernel_times(prof, engine.device)
    finally:
        dispatch.graphs = graphs
        engine.release(ids)
    return {"batch": batch, "context": context, "steps": steps, "replayed": replayed,
            "device_us_per_step": sum(totals.values()) / steps, "kernels": dict(totals.most_common(TOP_KERNELS))}


def make_engine(model_dir: str, device: torch.device, args, max_seq_len: int) -> Engine:
    """One engine for every point of a shape: slots for the largest batch, the longest context, no prefix
    caching (every sequence's blocks its own), and its KV cache from --kv-memory-gib or the free memory."""
    max_batch = max(args.batches + [b for b, _ in args.prefill])
    cfg = EngineConfig(model=model_dir, device=device.type, max_slots=max_batch, max_batch_size=max_batch,
                       max_seq_len=max_seq_len, max_prefill_tokens=args.max_prefill_tokens, capture_after=CAPTURE_AFTER,
                       prefix_caching=False, kv_cache_memory=0.8 if device.type == "cuda" else 0.9,
                       quantization=args.quantization, quantize_lm_head=args.quantize_lm_head,
                       fp8_activation_scheme=args.fp8_activation_scheme, kv_cache_dtype=args.kv_cache_dtype)
    if args.kv_memory_gib:
        mc = ModelConfig.from_dir(model_dir)
        kv_dtype = FP8_DTYPE if args.kv_cache_dtype == "fp8" else select_dtype(cfg, mc, device)
        per_block = KVCache.bytes_per_block(mc.num_layers, cfg.block_size, mc.num_kv_heads, mc.head_dim, kv_dtype)
        cfg = cfg.replace(num_kv_blocks=max(2, int(args.kv_memory_gib * 2 ** 30 // per_block)))
    return Engine(cfg)


def run_shape(label: str, model_dir: str, device: torch.device, args, bandwidth: float, peak: float) -> dict:
    room = CAPTURE_AFTER + 3 + max(args.steps, args.profile_steps) + 8  # decode steps a point's sequences take
    max_seq_len = max(max(args.contexts) + room, max(n for _, n in args.prefill) + 2)
    engine = make_engine(model_dir, device, args, max_seq_len)
    mc, log = engine.model_config, {}
    out: dict = {"meta": {
        "model": model_dir, "dtype": str(engine.dtype), "kernel_backend": engine.runtime.ops.name,
        "kv_cache_dtype": str(engine.runtime.kv.k.dtype).removeprefix("torch."),
        "quantization": engine.runtime.quantization, "fp8_activation_scheme": engine.runtime.fp8_activation_scheme,
        "weight_bytes": weight_bytes(engine.runtime.weights), "kv_token_bytes": kv_token_bytes(engine),
        "kv_cache_gib": engine.blocks.num_usable_blocks * kv_token_bytes(engine) * engine.block_size / 2 ** 30,
        "max_seq_len": max_seq_len, "max_prefill_tokens": engine.config.max_prefill_tokens,
        "block_size": engine.block_size, "steps_in_flight": engine.config.max_steps_in_flight},
        "prefill": [], "points": [], "profiles": []}
    try:
        randomize_kv(engine)
        for b, n in args.prefill:
            r = guarded(log, f"{label} prefill {b}x{n}", engine_prefill, engine, b, n, 1 if args.quick else 3)
            if "error" not in r:
                flops = prefill_flops(mc, b, n)
                r.update(tflop=flops / 1e12, floor_s=flops / peak, floor_tokens_per_s=b * n * peak / flops,
                         share=flops / peak / r["seconds"])
            out["prefill"].append({"batch": b, "length": n, **r})
        per_block = kv_token_bytes(engine) * engine.block_size
        for context in args.contexts:
            for batch in args.batches:  # the KV the point's sequences reserve, against the cache's free blocks
                need = batch * -(-(context + room) // engine.block_size) * per_block
                free = engine.blocks.num_free_blocks * per_block
                if need > free:
                    p = {"batch": batch, "context": context, "kv_gib": need / 2 ** 30, "free_gib": free / 2 ** 30,
                         "skipped": f"KV {need / 2 ** 30:.3g} GiB > {free / 2 ** 30:.3g} GiB free"}
                    print(f"  {label} b{batch} c{context}: skipped ({p['skipped']})", flush=True)
                else:
                    p = guarded(log, f"{label} b{batch} c{context}", measure_point, engine, batch, context, args.steps,
                                room, bandwidth, peak)
                out["points"].append({"batch": batch, "context": context, **p})
        if args.profile:
            worst = sorted((p for p in out["points"] if "share" in p), key=lambda p: p["share"])[:args.profile_points]
            for p in worst:
                r = guarded(log, f"{label} profile b{p['batch']} c{p['context']}", profile_point, engine, p["batch"],
                            p["context"], args.profile_steps, room)
                out["profiles"].append({"batch": p["batch"], "context": p["context"], "share": p["share"], **r})
    finally:
        engine.close()
    return out


def table(label: str, r: dict, meta: dict) -> str:
    m = r["meta"]
    lines = [f"== {label} ({m['dtype']}, KV {m['kv_cache_dtype']}, {m['kernel_backend']}) | weights "
             f"{m['weight_bytes'] / 1e9:.3g} GB | KV cache {m['kv_cache_gib']:.3g} GiB | "
             f"{meta['copy_bandwidth_TBps']:.3g} TB/s, {meta['matmul_TFLOPs']:.3g} TFLOP/s | "
             f"{m['steps_in_flight']} steps in flight",
             f"{'context':>8} {'batch':>6} {'step ms':>9} {'floor ms':>9} {'share':>6}  bound"]
    for p in r["points"]:
        head = f"{p['context']:>8} {p['batch']:>6}"
        if "skipped" in p:
            lines.append(f"{head}  skipped ({p['skipped']})")
        elif "error" in p:
            lines.append(f"{head}  error: {p['error']}")
        else:
            lines.append(f"{head} {p['step_ms']:9.3f} {p['floor_ms']:9.3f} {p['share']:6.0%}  {p['bound']}")
    for p in r["prefill"]:
        what = f"prefill {p['batch']} x {p['length']}:"
        lines.append(f"{what} error: {p['error']}" if "error" in p else
                     f"{what} {p['tokens_per_s'] / 1e3:.1f}k tok/s, floor {p['floor_tokens_per_s'] / 1e3:.1f}k tok/s "
                     f"({p['tflop']:.3g} TFLOP), share {p['share']:.0%}")
    return "\n".join(lines)


def plot(results: dict, png: pathlib.Path) -> str | None:
    """Share of the floor by batch, one line per context, one panel per shape; None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib is not installed")
        return None
    shapes = results["shapes"]
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4), squeeze=False)
    for ax, (label, r) in zip(axes[0], shapes.items()):
        for context in sorted({p["context"] for p in r["points"]}):
            pts = [p for p in r["points"] if p["context"] == context and "share" in p]
            if pts:
                ax.plot([p["batch"] for p in pts], [100 * p["share"] for p in pts], marker="o",
                        label=f"context {context}")
        ax.axhline(85, color="gray", linestyle="--", linewidth=0.8, label="85%")
        ax.set_xscale("log", base=2)
        batches = sorted({p["batch"] for p in r["points"]})
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("batch")
        ax.set_ylabel("share of the floor (%)")
        ax.set_title(f"{label} decode ({results['meta']['device']})")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png.name


def prefill_shape(text: str) -> tuple[int, int]:
    """'8x512' -> (8, 512): 8 prompts of 512 tokens (argparse reports a ValueError as a bad value)."""
    batch, length = (int(x) for x in text.lower().split("x"))
    if min(batch, length) < 1:
        raise ValueError(text)
    return batch, length


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", nargs="+", default=["1b", "8b"], choices=["tiny", "1b", "8b"])
    p.add_argument("--arch", default="llama", choices=["llama", "mistral", "qwen2", "qwen3"])
    p.add_argument("--model", help="an existing checkpoint dir instead of --shape's random-weight ones")
    p.add_argument("--batches", type=int, nargs="+", help=f"decode batch sizes (default {BATCHES})")
    p.add_argument("--contexts", type=int, nargs="+", help=f"decode contexts in tokens (default {CONTEXTS})")
    p.add_argument("--prefill", nargs="+", metavar="BxN", type=prefill_shape,
                   help="prefills of B prompts of N tokens (default 1x32768 8x512)")
    p.add_argument("--steps", type=int, default=50, help="measured decode steps per point")
    p.add_argument("--max-prefill-tokens", type=int, default=EngineConfig.max_prefill_tokens,
                   help="the engine's tokens per prefill forward")
    p.add_argument("--kv-memory-gib", type=float, default=None,
                   help="the KV cache's size (default: 80%% of the device memory free after the weights; on CPU "
                        "90%% of the engine's CPU budget)")
    p.add_argument("--matmul-size", type=int, default=8192, help="the matmul whose FLOP/s is the prefill's peak")
    p.add_argument("--quantization", default="none", choices=["none", "fp8"], help="the engine's weight quantization")
    p.add_argument("--quantize-lm-head", action="store_true", help="with --quantization fp8, the LM head too")
    p.add_argument("--fp8-activation-scheme", default="dynamic", choices=["dynamic", "none"],
                   help="with --quantization fp8: dynamic (W8A8 past 8 rows) or none (W8A16 throughout)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="the engine's KV cache: the model dtype, or E4M3 (half the KV bytes a step reads)")
    p.add_argument("--decode-min-splits", type=int, default=None,
                   help="experiment: decode attention's key splits at least this many (a multiple of the cluster "
                        "past it; at most one per 64-key tile), where the shipped rule gives fewer")
    p.add_argument("--profile", action="store_true", help="profile the points of lowest share")
    p.add_argument("--profile-points", type=int, default=3)
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="the tiny shape, a few small points (CPU / CI)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = p.parse_args(argv)
    quick = args.quick
    args.batches = args.batches or (QUICK_BATCHES if quick else BATCHES)
    args.contexts = args.contexts or (QUICK_CONTEXTS if quick else CONTEXTS)
    args.prefill = args.prefill or (QUICK_PREFILL if quick else PREFILL)
    if quick:
        args.shape, args.steps, args.matmul_size = ["tiny"], min(args.steps, 8), min(args.matmul_size, 256)
        args.profile_points, args.profile_steps = min(args.profile_points, 1), min(args.profile_steps, 2)
    if min(args.contexts) <= PROMPT_TOKENS:
        p.error(f"--contexts must exceed the {PROMPT_TOKENS}-token prompt each sequence starts from")
    if min(args.batches) < 1 or args.steps < 3 or args.profile_steps < 1 or args.profile_points < 0 or \
            (args.kv_memory_gib is not None and args.kv_memory_gib <= 0):
        p.error("--batches, --profile-steps >= 1, --steps >= 3, --profile-points >= 0, --kv-memory-gib > 0")
    if args.model and not (pathlib.Path(args.model) / "config.json").is_file():
        p.error(f"--model {args.model}: no config.json there (a checkpoint directory)")
    return args


def free_device_memory(device: torch.device) -> None:
    """Gives the memory Python no longer holds back to the device: an engine sizes its KV cache from the free
    memory. (guarded froze every object alive, an engine among them: unfrozen, its cycles can be collected.)"""
    gc.unfreeze()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def force_min_splits(n: int) -> None:
    """--decode-min-splits: wraps decode_attention.key_splits (which CudaOps and fits_one_wave call through the
    module) so that it returns at least n splits, rounded down to a multiple of the cluster past it."""
    from engine.cuda.wrappers import decode_attention
    shipped = decode_attention.key_splits

    def key_splits(lib, batch, num_heads, num_kv_heads, head_dim, max_seq_len, fp8_kv=False):
        s = shipped(lib, batch, num_heads, num_kv_heads, head_dim, max_seq_len, fp8_kv)
        forced = min(n, max(1, -(-max_seq_len // decode_attention.DECODE_TILE)), lib.decode_max_splits)
        return max(s, decode_attention.cluster_splits(lib, forced))
    decode_attention.key_splits = key_splits


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.decode_min_splits:
        force_min_splits(args.decode_min_splits)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    matmul_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the engine's dtype there
    results: dict = {"meta": {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.machine()})",
        "torch": torch.__version__, "python": platform.python_version(), "argv": sys.argv[1:], "steps": args.steps,
        "prompt_tokens": PROMPT_TOKENS, "capture_after": CAPTURE_AFTER}, "shapes": {}}
    bandwidth = copy_bandwidth(device)
    peak = matmul_peak(device, args.matmul_size, matmul_dtype)
    free_device_memory(device)
    results["meta"].update(copy_bandwidth_TBps=bandwidth / 1e12, matmul_TFLOPs=peak / 1e12,
                           matmul=f"{args.matmul_size}^3 {str(matmul_dtype).removeprefix('torch.')}")
    print(f"scale_bench: {results['meta']}", flush=True)
    for shape in [None] if args.model else args.shape:
        tmp = None if args.model else pathlib.Path(tempfile.mkdtemp())
        t0 = time.perf_counter()
        model_dir = args.model or str(write_checkpoint(tmp / shape, arch=args.arch, shape=shape, device=str(device)))
        write_s = round(time.perf_counter() - t0, 1) if tmp else None
        free_device_memory(device)  # the weights written from device memory
        label = shape or pathlib.Path(args.model).name
        try:
            r = run_shape(label, model_dir, device, args, bandwidth, peak)
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        r["meta"]["checkpoint_write_s"] = write_s
        results["shapes"][label] = r
        print(table(label, r, results["meta"]), flush=True)
        free_device_memory(device)  # the engine's, before the next one's
    kv = "-kvfp8" if args.kv_cache_dtype == "fp8" else ""
    path = results_path(results, args.out, "scale-" + "-".join(results["shapes"]) + kv)
    results["plot"] = plot(results, path.with_suffix(".png"))
    return write_results(results, args, path)


if __name__ == "__main__":
    sys.exit(main())
