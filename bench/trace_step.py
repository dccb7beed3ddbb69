"""Timeline of replayed decode steps, launch by launch, from the kernels' own clocks (GPU only).

nsys cannot make a report on the device machines and ncu runs kernels one at a time, so neither shows how
the launches of a replayed step overlap under programmatic dependent launch. This script builds the kernels
with -DMETRALE_TRACE (kernels_cu/common.cuh: thread 0 of each block that waits records when its wait began
and returned, and, in the skinny and decode-attention kernels, when it left), runs queued decode steps of a
steady batch through the engine with those kernels, and prints per launch of one step, and per kind of launch
as medians over the layers and steps:

  release   when the launch's first block returned from its wait (the launch before it had completed)
  span      from this launch's release to the next one's: its share of the step's critical path
  tail      from the last time thread 0 of one of its blocks left to the next launch's release (the
            completion and release latency of a launch boundary; skinny and attention launches only)
  ahead     how long before its release the launch's first block was waiting (PDL's head start)

    python bench/trace_step.py --shape 1b --batch 1 [--steps 20]

The traced kernels are built once into kernels_cu/build-trace (from a copy of kernels_cu/ with METRALE_TRACE
defined); the trace adds a clock read, an atomic and a 64-byte store per block, so spans are a little longer
than untraced ones. %globaltimer's resolution is printed (it may be coarse; the spans are medians)."""
from __future__ import annotations

import argparse
import collections
import json
import pathlib
import statistics
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

TRACE_BUILD = ROOT / "kernels_cu" / "build-trace"
TRACE_SOURCES = ROOT / "kernels_cu" / "build-trace" / "src"
RECORD = np.dtype([("g_wait", "<u8"), ("g_released", "<u8"), ("g_end", "<u8"), ("c_wait", "<u8"),
                   ("c_released", "<u8"), ("c_end", "<u8"), ("grid", "<u4"), ("threads", "<u4"),
                   ("smid", "<u4"), ("block", "<u4"), ("c_mark", "<u8", (4,))])
HEADER = 16  # TraceBuffer: count, capacity, two words of padding


def build_traced() -> None:
    """kernels_cu/*.cu and *.cuh copied with METRALE_TRACE defined, built into TRACE_BUILD for sm_90 only (a third
    of the size: the device tool carries 64 MiB). The loader checks stamps against the same flags."""
    from engine.cuda import build
    build.NVCC_FLAGS = ("-fatbin", "-O3", "-std=c++17", "-no-compress", "-gencode", "arch=compute_90,code=sm_90")
    TRACE_SOURCES.mkdir(parents=True, exist_ok=True)
    for src in [*build.sources(), *build.headers()]:
        text = src.read_text()
        if src.name == "common.cuh":
            text = text.replace("#pragma once\n", "#pragma once\n#define METRALE_TRACE 1\n", 1)
        dst = TRACE_SOURCES / src.name
        if not dst.is_file() or dst.read_text() != text:
            dst.write_text(text)
    build.build_all(TRACE_BUILD, TRACE_SOURCES)


def attach(lib, capacity: int) -> torch.Tensor:
    """A trace buffer on the device, its address written into every loaded module's metrale_trace."""
    from engine.cuda.driver import check, cuda_driver
    driver = cuda_driver()
    buf = torch.zeros(HEADER + capacity * RECORD.itemsize, dtype=torch.uint8, device=lib.device)
    buf[4:8] = torch.tensor([capacity], dtype=torch.int32).view(torch.uint8).to(lib.device)
    addr = buf.data_ptr()
    for name, mod in lib.modules.items():
        err, dptr, _ = driver.cuModuleGetGlobal(mod, b"metrale_trace")
        if err != driver.CUresult.CUDA_SUCCESS:
            raise SystemExit(f"module {name} has no metrale_trace: not a traced build ({lib.origin[name]})")
        check("cuMemsetD32", driver.cuMemsetD32(dptr, addr & 0xFFFFFFFF, 1))
        check("cuMemsetD32", driver.cuMemsetD32(int(dptr) + 4, addr >> 32, 1))
    torch.cuda.synchronize(lib.device)
    return buf


def read(buf: torch.Tensor) -> np.ndarray:
    torch.cuda.synchronize(buf.device)
    raw = buf.cpu().numpy()
    count, capacity = (int(v) for v in raw[:8].view("<u4"))
    if count > capacity:
        print(f"warning: {count} records, buffer holds {capacity}", flush=True)
    return raw[HEADER:HEADER + min(count, capacity) * RECORD.itemsize].view(RECORD)


def launches(rec: np.ndarray) -> list[dict]:
    """Records (in the order their waits returned) cut into launches: a launch's blocks are consecutive, and
    consecutive launches differ in grid or block size (or the launch has all its blocks)."""
    out, i = [], 0
    while i < len(rec):
        sig = (int(rec["grid"][i]), int(rec["threads"][i]))
        j = i + 1
        while j < len(rec) and j - i < sig[0] and (int(rec["grid"][j]), int(rec["threads"][j])) == sig:
            j += 1
        r = rec[i:j]
        ends = r["g_end"][r["g_end"] > 0]
        marks = []
        for m in range(4):
            ok = r["c_mark"][:, m] > 0
            marks.append(float(np.median((r["c_mark"][ok, m] - r["c_released"][ok]).astype(np.int64)))
                         if ok.any() else None)
        long = (r["g_end"] > r["g_released"] + 2000) & (r["c_end"] > r["c_released"])
        cpn = float(np.median((r["c_end"][long] - r["c_released"][long]) / (r["g_end"][long] - r["g_released"][long]))) \
            if long.any() else None
        out.append({"sig": sig, "cycles_per_ns": cpn, "blocks": j - i, "release": int(r["g_released"].min()),
                    "last_release": int(r["g_released"].max()), "first_wait": int(r["g_wait"].min()),
                    "end": int(ends.max()) if len(ends) else None,
                    "block_cycles": float(np.median((r["c_end"] - r["c_released"])[r["c_end"] > 0]))
                    if len(ends) else None, "mark_cycles": marks})
        i = j
    return out


def steps_of(ls: list[dict], period: int) -> list[list[dict]]:
    return [ls[k:k + period] for k in range(0, len(ls) - period + 1, period)]


def find_period(ls: list[dict]) -> int:
    sigs = [x["sig"] for x in ls]
    for p in range(1, len(sigs) // 2 + 1):
        if all(sigs[k] == sigs[k + p] for k in range(len(sigs) - p)):
            return p
    raise SystemExit(f"no repeating step found in {len(sigs)} launches")


def describe(steps: list[list[dict]]) -> str:
    """Launches are named by their (grid, block) size: the step's order tells which is which."""
    lines = []
    period = len(steps[0])
    per_pos = []
    for pos in range(period):
        span, tail, ahead = [], [], []
        for k, st in enumerate(steps):
            nxt = st[pos + 1] if pos + 1 < period else (steps[k + 1][0] if k + 1 < len(steps) else None)
            x = st[pos]
            ahead.append(x["release"] - x["first_wait"])
            if nxt is not None:
                span.append(nxt["release"] - x["release"])
                if x["end"] is not None:
                    tail.append(nxt["release"] - x["end"])
        per_pos.append((statistics.median(span) if span else None, statistics.median(tail) if tail else None,
                        statistics.median(ahead)))
    step_ns = [steps[k + 1][0]["release"] - steps[k][0]["release"] for k in range(len(steps) - 1)]
    lines.append(f"step (release of its first launch to the next step's): median {statistics.median(step_ns) / 1e3:.1f} us "
                 f"over {len(step_ns)} steps; {period} launches a step")
    lines.append("")
    lines.append("per launch of a step (medians over the steps, us):")
    lines.append(f"  {'#':>3} {'launch':28} {'blocks':>7} {'release':>8} {'span':>7} {'tail':>6} {'ahead':>6}")
    first = steps[len(steps) // 2]
    t0 = first[0]["release"]
    for pos, x in enumerate(first):
        span, tail, ahead = per_pos[pos]
        lines.append(f"  {pos:>3} {str(x['sig']):28} {x['blocks']:>7} "
                     f"{(x['release'] - t0) / 1e3:>8.1f} {'' if span is None else f'{span / 1e3:7.2f}'} "
                     f"{'' if tail is None else f'{tail / 1e3:6.2f}'} {ahead / 1e3:6.2f}")
    lines.append("")
    lines.append("per kind of launch (medians over every launch of that kind, us; total = sum of spans a step):")
    kinds: dict = collections.defaultdict(lambda: {"span": [], "tail": [], "ahead": [], "n": 0})
    for pos, x in enumerate(first):
        k = kinds[str(x["sig"])]
        k["n"] += 1
        span, tail, ahead = per_pos[pos]
        if span is not None:
            k["span"].append(span)
        if tail is not None:
            k["tail"].append(tail)
        k["ahead"].append(ahead)
    lines.append(f"  {'launch':28} {'a step':>6} {'span':>7} {'total':>8} {'tail':>6} {'ahead':>6}")
    for name, k in sorted(kinds.items(), key=lambda kv: -sum(kv[1]["span"])):
        lines.append(f"  {name:28} {k['n']:>6} {statistics.median(k['span']) / 1e3 if k['span'] else 0:7.2f} "
                     f"{sum(k['span']) / 1e3:8.1f} "
                     f"{statistics.median(k['tail']) / 1e3 if k['tail'] else float('nan'):6.2f} "
                     f"{statistics.median(k['ahead']) / 1e3:6.2f}")
    ghz = clock_ghz(steps)
    lines.append("")
    lines.append(f"inside a block, after its wait returned (medians of the per-launch medians, us at {ghz:.2f} GHz, "
                 "the clock64 rate against %globaltimer): marks 0..3 (kernels_cu: TRACE_MARK), then its exit")
    for sig in dict.fromkeys(x["sig"] for x in first):
        name = str(sig)
        xs = [x for st in steps for x in st if x["sig"] == sig]
        cols = []
        for m in range(4):
            v = [x["mark_cycles"][m] for x in xs if x["mark_cycles"][m] is not None]
            cols.append(f"{statistics.median(v) / ghz / 1e3:6.2f}" if v else "     -")
        v = [x["block_cycles"] for x in xs if x["block_cycles"] is not None]
        if v or any(c.strip() != "-" for c in cols):
            lines.append(f"  {name:28} {' '.join(cols)}  exit {statistics.median(v) / ghz / 1e3 if v else float('nan'):6.2f}")
    return "\n".join(lines)


def clock_ghz(steps) -> float:
    """clock64 cycles per ns, from launches whose blocks ran long enough to read both clocks well."""
    r = [x["cycles_per_ns"] for st in steps for x in st if x.get("cycles_per_ns")]
    return statistics.median(r) if r else float("nan")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="1b", choices=["tiny", "1b", "8b"])
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--max-seq-len", type=int, default=2576,
                   help="the engine's context limit (it sizes decode attention's split grid; engine_bench: 2576)")
    p.add_argument("--decode-splits", type=int, default=None, help="as engine_bench's")
    p.add_argument("--decode-cluster", type=int, default=None, help="as engine_bench's")
    p.add_argument("--build-only", action="store_true", help="build kernels_cu/build-trace and stop (no GPU needed)")
    p.add_argument("--json", help="also write the launches of every traced run to this file")
    args = p.parse_args(argv)
    build_traced()
    if args.build_only:
        return 0
    import engine_bench as eb
    from engine.checkpoint import write_checkpoint
    from engine.config import EngineConfig
    from engine.engine import Engine

    eb.use_kernels(TRACE_SOURCES, TRACE_BUILD)
    model = write_checkpoint(pathlib.Path(tempfile.mkdtemp()) / args.shape, arch="llama", shape=args.shape,
                             device="cuda")
    engine = Engine(EngineConfig(model=str(model), device="cuda", max_slots=256, max_batch_size=256,
                                 max_seq_len=args.max_seq_len, max_prefill_tokens=8192, kv_cache_memory=0.5))
    lib = engine.runtime.ops.lib
    eb.tune_kernels(lib, args)
    print(f"kernels: {lib.origin}", flush=True)
    buf = attach(lib, capacity=1_000_000)
    out = {}
    for batch in args.batch:
        ids = eb.start_batch(engine, batch, 128, args.steps + engine.config.capture_after + 40)
        for _ in range(engine.config.capture_after + 4):
            engine.decode(ids)
        in_flight: collections.deque = collections.deque()
        torch.cuda.synchronize()
        buf[:4].zero_()
        for _ in range(args.steps):
            if len(in_flight) == engine.config.max_steps_in_flight:
                engine.finish(in_flight.popleft())
            in_flight.append(engine.decode_launch(ids))
        while in_flight:
            engine.finish(in_flight.popleft())
        rec = read(buf)
        engine.release(ids)
        g = np.diff(np.unique(rec["g_released"]))
        print(f"\n== {args.shape} batch {batch}: {len(rec)} records; %globaltimer's smallest step "
              f"{int(g[g > 0].min()) if len(g) else 0} ns", flush=True)
        ls = launches(rec)
        period = find_period(ls[len(ls) // 4:])
        # steps cut in phase with the reference window; the first may have started before the counter was reset
        steps = steps_of(ls[(len(ls) // 4) % period:], period)[1:]
        print(describe(steps), flush=True)
        out[f"b{batch}"] = steps
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
