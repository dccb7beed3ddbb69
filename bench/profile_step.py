"""Where a step's time goes on the GPU: kernel time per step by kernel name (torch.profiler/CUPTI),
for eager decode at batch 1 and 32, prefill 8 x 512, and Verify of 4 drafts at batch 1; plus the host
time of each (cProfile top functions for Verify). For prefill also its timeline: wall time against
the span the GPU was busy, the idle gaps between kernels (which kernels they sit between) and the SM
clock while prefills run back to back (nvidia-smi), to tell host stalls from clock drops.

    python bench/profile_step.py --shape 1b [--only prefill]
    python bench/profile_step.py --shape 1b --only verify_replay   # the host side of a replayed Verify
    python bench/profile_step.py --shape 1b --only prefix          # a prompt whose prefix is cached, taken apart"""
from __future__ import annotations

import argparse
import collections
import cProfile
import pathlib
import pstats
import statistics
import subprocess
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from engine.api import PrefillItem, VerifyItem  # noqa: E402
from engine.checkpoint import write_temporary_checkpoint  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine import decode as decode_module  # noqa: E402
from engine import logits_processors  # noqa: E402
from engine import prefill as prefill_module  # noqa: E402
from engine import sequence_blocks  # noqa: E402
from engine import verify as verify_module  # noqa: E402
from engine.decode import PendingStep  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.sampling import SamplingParams, StoppingCriteria  # noqa: E402

GREEDY = StoppingCriteria(ignore_eos=True)


def kernel_table(prof, steps: int, title: str, top: int = 22) -> None:
    per = collections.defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0:
            name = e.name if len(e.name) < 70 else e.name[:67] + "..."
            per[name][0] += e.device_time_total
            per[name][1] += 1
    total = sum(v[0] for v in per.values()) / steps
    print(f"\n== {title}: {total:.1f} us of kernels per step, {sum(v[1] for v in per.values()) / steps:.0f} launches")
    for name, (us, n) in sorted(per.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"{us / steps:9.1f} us {n / steps:6.1f}x  {name}")


def gaps_table(prof, title: str, top: int = 8) -> None:
    """The GPU timeline of one profiled step: busy span, kernel time, and the largest idle gaps."""
    ks = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0)
    if not ks:
        return
    gaps, end, prev = [], ks[0][1], ks[0][2]
    for start, stop, name in ks[1:]:
        if start > end:
            gaps.append((start - end, prev, name))
        if stop >= end:
            end, prev = stop, name
    span = end - ks[0][0]
    busy = span - sum(g for g, _, _ in gaps)
    print(f"\n== {title}: GPU span {span:.0f} us, busy {busy:.0f} us, idle {span - busy:.0f} us in {len(gaps)} gaps")
    for g, a, b in sorted(gaps, reverse=True)[:top]:
        print(f"{g:9.1f} us idle between {a[:50]} -> {b[:50]}")


def sm_clocks(seconds_fn) -> str:
    """Runs seconds_fn() while nvidia-smi samples the SM clock and power every 100 ms."""
    try:
        mon = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                                "-lms", "100"], stdout=subprocess.PIPE, text=True)
    except OSError as e:
        seconds_fn()
        return f"no nvidia-smi ({e})"
    try:
        seconds_fn()
    finally:
        mon.terminate()
    rows = [r.split(",") for r in mon.communicate()[0].strip().splitlines() if r.count(",") == 1]
    clocks = sorted(float(a) for a, _ in rows)
    power = sorted(float(b) for _, b in rows)
    if not clocks:
        return "no samples"
    return (f"{len(clocks)} samples: SM clock min/median/max {clocks[0]:.0f}/{clocks[len(clocks) // 2]:.0f}/"
            f"{clocks[-1]:.0f} MHz, power median/max {power[len(power) // 2]:.0f}/{power[-1]:.0f} W")


def profile_prefill(engine: Engine, vocab: int, g: torch.Generator, batch: int = 8, length: int = 512) -> None:
    def run(profiled=False):
        ids = [engine.alloc_sequence(length + 8, SamplingParams(), GREEDY).seq_id for _ in range(batch)]
        items = [PrefillItem(i, torch.randint(0, vocab, (length,), generator=g).tolist()) for i in ids]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if profiled:
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                engine.prefill(items)
                torch.cuda.synchronize()
        else:
            engine.prefill(items)
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        engine.release(ids)
        return (prof if profiled else None), wall

    for _ in range(2):
        run()
    walls = []
    clocks = sm_clocks(lambda: walls.extend(run()[1] * 1e3 for _ in range(12)))
    print(f"\n== prefill {batch}x{length} back to back: wall ms {[round(w, 1) for w in walls]}; {clocks}")
    cp = cProfile.Profile()
    cp.enable()
    for _ in range(3):
        run()
    cp.disable()
    print(f"\n== prefill {batch}x{length} host profile (3 calls, by own time)")
    pstats.Stats(cp).sort_stats("tottime").print_stats(14)
    time.sleep(2.0)  # let the clock recover
    prof, wall = run(profiled=True)
    kernel_table(prof, 1, f"prefill {batch}x{length} (wall {wall * 1e3:.1f} ms, profiled)")
    gaps_table(prof, f"prefill {batch}x{length} timeline")


def timed(spent: collections.Counter, obj, name: str, label: str, began: dict | None = None) -> None:
    """Replaces obj.name with a wrapper that adds each call's wall time (ns) to spent[label] (~0.3 us a call);
    began: where the first call's perf_counter_ns at entry is kept, under label."""
    fn = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter_ns()
        if began is not None:
            began.setdefault(label, t)
        try:
            return fn(*args, **kwargs)
        finally:
            spent[label] += time.perf_counter_ns() - t
    setattr(obj, name, wrapper)


def profile_replay_host(path, steps: int = 400) -> None:
    """The host side of a replayed decode step (CUDA graphs on), one step at a time as engine_bench
    times it, at batch 1 and 32: wall vs device time per step, and the medians of where the host's
    time goes (perf_counter_ns around the engine's own methods; each wrapper adds ~0.3 us)."""
    engine = Engine(EngineConfig(model=str(path), num_kv_blocks=4096, max_seq_len=4096, prefix_caching=False))
    vocab = engine.model_config.vocab_size
    spent: collections.Counter = collections.Counter()

    timed(spent, engine.decoder, "_launch", "launch: DecodePipeline._launch")
    timed(spent, engine.runtime.dispatch.graphs, "run", "launch: graph run (replay)")
    timed(spent, engine.runtime.outputs, "copy_top_to_host", "launch: copy_top_to_host")
    timed(spent, decode_module, "commit_tokens", "finish: commit_tokens")
    timed(spent, engine.runtime.outputs, "step_values", "finish: step_values")
    wait_device = PendingStep.wait_device

    def timed_wait(step) -> None:
        t = time.perf_counter_ns()
        wait_device(step)
        spent["finish: wait_device"] += time.perf_counter_ns() - t
    PendingStep.wait_device = timed_wait
    try:
        for batch in (1, 32):
            ids = [engine.alloc_sequence(128 + steps + 40, SamplingParams(), GREEDY).seq_id for _ in range(batch)]
            engine.prefill([PrefillItem(i, torch.randint(0, vocab, (128,)).tolist()) for i in ids])
            for _ in range(10):
                engine.decode(ids)
            torch.cuda.synchronize()
            rows: dict[str, list[float]] = collections.defaultdict(list)
            t_prev = None
            for _ in range(steps):
                spent.clear()
                t0 = time.perf_counter_ns()
                step = engine.decode_launch(ids)
                t1 = time.perf_counter_ns()
                result = engine.finish(step)
                t2 = time.perf_counter_ns()
                if t_prev is not None:
                    rows["wall (step start to next step start)"].append((t0 - t_prev) / 1e3)
                t_prev = t0
                rows["device (forward_ns)"].append(result.forward_ns / 1e3)
                rows["decode_launch"].append((t1 - t0) / 1e3)
                rows["finish"].append((t2 - t1) / 1e3)
                for label, ns in spent.items():
                    rows[label].append(ns / 1e3)
            engine.release(ids)
            print(f"\n== replayed decode b{batch}, one step at a time: medians over {steps} steps, us")
            for label, us in rows.items():
                print(f"{statistics.median(us):9.1f}  {label}")
    finally:
        PendingStep.wait_device = wait_device
    engine.close()


def profile_prefix(path, prompt_len: int = 4096, cached: int = 3968, calls: int = 10, device: str = "auto") -> None:
    """Time to first token of a prompt_len-token prompt whose first `cached` tokens are in the prefix cache, as
    engine_bench --prefix-ttft times it (CUDA graphs and prefix caching on, as the worker runs): wall medians,
    the medians of the engine's host parts (perf_counter_ns wrappers), the GPU timeline of one call (kernel
    table, idle gaps: host stalls between kernels) and cProfile's top functions by own time."""
    engine = Engine(EngineConfig(model=str(path), num_kv_blocks=8192, max_seq_len=prompt_len + 104,
                                 max_prefill_tokens=8192, device=device))
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(1)
    prefiller, state = engine.prefiller, engine.runtime.state
    spent: collections.Counter = collections.Counter()
    began: dict[str, int] = {}  # each part's first entry in the call (perf_counter_ns)
    parts = [(engine.prefiller, "check", "check (token ids, reservation)"),
             (engine.prefiller, "register_prompts", "register blocks (earlier prompts' only: its own wait)"),
             (prefiller, "_extend", "extend: match + slot rows + blocks"),
             (sequence_blocks.SequenceBlocks, "match", "  extend: SequenceBlocks.match"),
             (state, "start_row", "  extend: SlotState.start_row"),
             (prefiller, "_forward", "forward (launch, sample, read back)"),
             (prefill_module, "build_staged_prefill_batch", "  forward: staging (build_staged_prefill_batch)"),
             (engine.runtime.dispatch, "run_shape", "  forward: run_shape (graph or eager)"),
             (prefiller, "_write_sampling_rows", "  forward: sampling rows (SlotState.assign_sampling)"),
             (logits_processors, "sample", "  forward: sampling launches"),
             (engine.runtime.outputs, "read", "  forward: outputs.read (waits for the GPU)"),
             (engine.blocks.events, "publish", "KV events publish"),
             (sequence_blocks, "block_hashes", "block_hashes (match and register)")]
    for obj, name, label in parts:
        timed(spent, obj, name, label, began)
    # The GPU's side: an event before the forward's launch and one after it (the GPU is idle until the first:
    # its time is when the host queued it), against one queued at the call's start.
    run_shape, marks = engine.runtime.dispatch.run_shape, []

    def marked_run_shape(*args, **kwargs):
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record()
        try:
            return run_shape(*args, **kwargs)
        finally:
            after.record()
            marks.append((before, after))
    if engine.runtime.device.type == "cuda":
        engine.runtime.dispatch.run_shape = marked_run_shape

    def call(prompt: list[int], profiled: bool = False):
        sid = engine.alloc_sequence(len(prompt) + 2, SamplingParams(), GREEDY).seq_id
        engine.runtime.dispatch.synchronize()
        spent.clear()
        began.clear()
        marks.clear()
        start_event = torch.cuda.Event(enable_timing=True) if engine.runtime.device.type == "cuda" else None
        prof = None
        t0 = time.perf_counter()
        t0_ns = time.perf_counter_ns()
        if start_event is not None:
            start_event.record()
        if profiled:
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                token = engine.prefill([PrefillItem(sid, prompt)]).tokens[0]
                engine.runtime.dispatch.synchronize()
        else:
            token = engine.prefill([PrefillItem(sid, prompt)]).tokens[0]
            engine.runtime.dispatch.synchronize()
        wall = time.perf_counter() - t0
        parts = dict(spent)  # the prefill call's own (a release registers what is still unregistered)
        parts.update({f"at {label}": ns - t0_ns for label, ns in began.items()})
        if start_event is not None and marks:
            parts["GPU: forward queued, from the call's start"] = start_event.elapsed_time(marks[0][0]) * 1e6
            parts["GPU: forward (graph) device time"] = sum(b.elapsed_time(a) for b, a in marks) * 1e6
            parts["GPU: forward's end to the call's end"] = wall * 1e9 - start_event.elapsed_time(marks[-1][1]) * 1e6
        engine.release([sid])
        return wall, token.cached_tokens, parts, prof

    def pair(profiled: bool = False):
        prefix = torch.randint(0, vocab, (cached,), generator=g).tolist()
        tails = [torch.randint(0, vocab, (prompt_len - cached,), generator=g).tolist() for _ in range(2)]
        engine.flush_cache()
        uncached = call(prefix + tails[0])
        hit = call(prefix + tails[1], profiled)
        assert hit[1] == cached, f"{hit[1]} tokens came from the cache, not {cached}"
        return uncached, hit

    for _ in range(3):  # shapes, graphs
        pair()
    rows: dict[str, list[float]] = collections.defaultdict(list)
    uncached_ms = []
    for _ in range(calls):
        uncached, hit = pair()
        uncached_ms.append(uncached[0] * 1e3)
        rows["wall"].append(hit[0] * 1e6)
        for label, ns in hit[2].items():
            rows[label].append(ns / 1e3)
    print(f"\n== TTFT, {prompt_len} tokens with {cached} cached: {statistics.median(rows['wall']) / 1e3:.2f} ms "
          f"(uncached {statistics.median(uncached_ms):.2f} ms); host parts, medians over {calls} calls, us")
    for label, us in rows.items():
        if not label.startswith("at "):
            print(f"{statistics.median(us):9.1f}  {label}")
    print("\n== the cached call's critical path: when each part first began, us from the call's start (medians)")
    for label, us in sorted(((k, v) for k, v in rows.items() if k.startswith("at ")),
                            key=lambda kv: statistics.median(kv[1])):
        print(f"{statistics.median(us):9.1f}  {label[3:]}")
    cp = cProfile.Profile()
    cp.enable()
    for _ in range(3):
        pair()
    cp.disable()
    print("\n== host profile (3 uncached + 3 cached calls, by own time)")
    pstats.Stats(cp).sort_stats("tottime").print_stats(18)
    _, hit = pair(profiled=True)
    kernel_table(hit[3], 1, f"cached-prefix prefill (wall {hit[0] * 1e3:.2f} ms, profiled)")
    gaps_table(hit[3], "cached-prefix prefill timeline", top=12)
    engine.close()


def profile_verify_host(path, calls: int = 300) -> None:
    """The host side of a replayed uniform Verify of 4 drafts at batch 1 (CUDA graphs on), as
    engine_bench times it: wall vs device time per call, the medians of the engine's own parts
    (perf_counter_ns wrappers, ~0.3 us each), then cProfile's top functions by own time."""
    engine = Engine(EngineConfig(model=str(path), num_kv_blocks=4096, max_seq_len=4096, prefix_caching=False))
    vocab = engine.model_config.vocab_size
    spent: collections.Counter = collections.Counter()

    for obj, name in ((engine.sequences, "check_ids"), (engine.decoder, "finish_all"), (engine.verifier, "_uniform"),
                      (engine.runtime.dispatch, "run_slots"), (engine.runtime.dispatch.graphs, "run"),
                      (engine.verifier.outputs, "write_drafts"), (engine.verifier.outputs, "read"),
                      (verify_module, "token_result")):
        timed(spent, obj, name, f"{type(obj).__name__}.{name}")
    seq = engine.alloc_sequence(128 + 8 * calls, SamplingParams(), GREEDY).seq_id
    engine.prefill([PrefillItem(seq, torch.randint(0, vocab, (128,)).tolist())])
    drafts = [VerifyItem(seq, [7, 8, 9, 10])]
    for _ in range(10):
        engine.verify(drafts)
    torch.cuda.synchronize()
    rows: dict[str, list[float]] = collections.defaultdict(list)
    for _ in range(calls):
        spent.clear()
        t0 = time.perf_counter_ns()
        result = engine.verify(drafts)
        rows["wall"].append((time.perf_counter_ns() - t0) / 1e3)
        rows["device (forward_ns)"].append(result.forward_ns / 1e3)
        for label, ns in spent.items():
            rows[label].append(ns / 1e3)
    print(f"\n== replayed Verify of 4 drafts b1, one call at a time: medians over {calls} calls, us")
    for label, us in rows.items():
        print(f"{statistics.median(us):9.1f}  {label}")
    cp = cProfile.Profile()
    cp.enable()
    for _ in range(100):
        engine.verify(drafts)
    cp.disable()
    print("\n== verify host profile (100 calls, by own time)")
    pstats.Stats(cp).sort_stats("tottime").print_stats(16)
    engine.close()


def host_call_costs(reps: int = 2000) -> None:
    """Host time of the CUDA calls a decode step makes, through torch and through cuda-python's driver
    bindings (median us per call, the stream drained between calls where the call queues work)."""
    from cuda.bindings import driver

    from engine.cuda.streams import EngineStreams

    dev = torch.device("cuda")
    streams = EngineStreams(dev, timers=1)
    handle = streams.compute.cuda_stream
    src = torch.zeros(512, dtype=torch.int64, device=dev)
    pinned = torch.zeros(512, dtype=torch.int64, pin_memory=True)
    _, ev = driver.cuEventCreate(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING)
    with torch.cuda.stream(streams.compute):
        graph = torch.cuda.CUDAGraph()
        x = torch.zeros(16, device=dev)
        x.add_(1)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=streams.compute):
            x.add_(1)
    exec_handle = graph.raw_cuda_graph_exec() if hasattr(graph, "raw_cuda_graph_exec") else None

    def cost(fn, drain: bool = True) -> float:
        out = []
        for _ in range(reps):
            if drain:
                streams.compute.synchronize()
            t = time.perf_counter_ns()
            fn()
            out.append(time.perf_counter_ns() - t)
        return statistics.median(out) / 1e3

    def torch_stream_context():
        with torch.cuda.stream(streams.compute):
            pass

    def set_stream_pair():
        prev = torch.cuda.current_stream()
        torch.cuda.set_stream(streams.compute)
        torch.cuda.set_stream(prev)

    def torch_event():
        torch.cuda.Event().record(streams.compute)

    cases = [
        ("with torch.cuda.stream(compute): pass", torch_stream_context, False),
        ("torch.cuda.current_stream() + set_stream x2", set_stream_pair, False),
        ("torch.cuda.Event().record(stream)", torch_event, True),
        ("EngineStreams.mark()", streams.mark, True),
        ("driver cuEventRecord", lambda: driver.cuEventRecord(ev, handle), True),
        ("driver cuEventQuery", lambda: driver.cuEventQuery(ev), False),
        ("pinned[:32].copy_(dev[:32], non_blocking=True)", lambda: pinned[:32].copy_(src[:32], non_blocking=True), True),
        ("driver cuMemcpyDtoHAsync 256 B", lambda: driver.cuMemcpyDtoHAsync(pinned.data_ptr(), src.data_ptr(), 256, handle),
         True),
        ("pinned[:32].tolist()", lambda: pinned[:32].tolist(), False),
        ("CUDAGraph.replay() (one kernel)", lambda: graph.replay(), True),
    ]
    if exec_handle is not None:
        cases.append(("driver cuGraphLaunch (one kernel)", lambda: driver.cuGraphLaunch(exec_handle, handle), True))
    print(f"\n== host cost of CUDA calls, median of {reps} (us)")
    for name, fn, drain in cases:
        print(f"{cost(fn, drain):9.2f}  {name}")
    # Does a thread waiting in the driver's cuEventSynchronize let other Python threads run?
    spins = [0]
    done = threading.Event()

    def spin():
        while not done.is_set():
            spins[0] += 1
    with torch.cuda.stream(streams.compute):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU clock cycles
    mark = streams.mark()
    spinner = threading.Thread(target=spin)
    spinner.start()
    t = time.perf_counter()
    mark.synchronize()
    waited = time.perf_counter() - t
    done.set()
    spinner.join()
    print(f"a Python thread ran {spins[0]} loop turns while the main thread waited {waited * 1e3:.0f} ms in "
          f"DeviceMark.synchronize (0 would mean the GIL was held)")
    torch.cuda.synchronize()
    graph.reset()
    driver.cuEventDestroy(ev)
    streams.close()


def profile_ttft(path, n: int = 24) -> None:
    """Latency of one short prompt's prefill (what time to first token is made of), with CUDA graphs
    on as the worker runs: n lengths around 128, each the first time a length is seen ("cold") and
    again ("warm"), with the caching allocator's cudaMalloc count of each pass; then n new lengths
    after one prefill of max_prefill_tokens tokens (the engine's start-up warm-up, when it has one);
    the host profile of cold calls, the GPU timeline of a warm one, and paged vs fused attention."""
    engine = Engine(EngineConfig(model=str(path), num_kv_blocks=8192, max_seq_len=4096, prefix_caching=False))
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(1)

    def run(length: int, profiled: cProfile.Profile | None = None, batch: int = 1) -> float:
        ids = [engine.alloc_sequence(length + 8, SamplingParams(), GREEDY).seq_id for _ in range(batch)]
        items = [PrefillItem(i, torch.randint(0, vocab, (length,), generator=g).tolist()) for i in ids]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if profiled is not None:
            profiled.enable()
        engine.prefill(items)
        if profiled is not None:
            profiled.disable()
        wall = time.perf_counter() - t0
        engine.release(ids)
        return wall * 1e3

    def mallocs() -> int:
        return torch.cuda.memory_stats().get("segment.all.allocated", 0)

    def timed_pass(lengths: list[int]) -> tuple[list[float], int]:
        before = mallocs()
        walls = [run(n_) for n_ in lengths]
        return walls, mallocs() - before

    run(64)
    lengths = [96 + 7 * i for i in range(n)]
    cold, cold_mallocs = timed_pass(lengths)
    warm, warm_mallocs = timed_pass(lengths)
    print("\n== prefill of one prompt, wall ms (cold = first time at that length, warm = again)")
    for n_, c, w in zip(lengths, cold, warm):
        print(f"  len {n_:5d}  cold {c:7.2f}  warm {w:7.2f}")
    print(f"  median cold {sorted(cold)[n // 2]:.2f} ms ({cold_mallocs} cudaMalloc), "
          f"warm {sorted(warm)[n // 2]:.2f} ms ({warm_mallocs} cudaMalloc)")
    budget = engine.config.max_prefill_tokens
    run(budget // 4, batch=4)
    fresh, fresh_mallocs = timed_pass([300 + 7 * i for i in range(n)])
    print(f"  after one {budget}-token prefill, {n} new lengths 300..: median {sorted(fresh)[n // 2]:.2f} ms "
          f"({fresh_mallocs} cudaMalloc)")
    cp = cProfile.Profile()
    for i in range(4):
        run(500 + 13 * i, cp)
    print("\n== host profile of 4 prefills at new lengths (by own time)")
    pstats.Stats(cp).sort_stats("tottime").print_stats(16)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        wall = run(lengths[0])
        torch.cuda.synchronize()
    kernel_table(prof, 1, f"warm prefill of {lengths[0]} tokens (wall {wall:.2f} ms, profiled)", top=12)
    gaps_table(prof, f"warm prefill of {lengths[0]} tokens timeline")

    # Where FlashAttention (gathered keys) pays off against the paged kernel: warm wall time of each on the
    # same prompts; CudaOps.fused_min_tokens picks between them.
    ops = engine.runtime.ops
    if not hasattr(ops, "fused_min_tokens"):
        return
    default = ops.fused_min_tokens
    graphs = engine.runtime.dispatch.graphs
    paths = (("graph", 1 << 30, graphs), ("paged", 1 << 30, None), ("flash", 0, None))
    print(f"\n== prefill wall ms (warm, median of 5): the CUDA graph of the padded shape (paged kernel; forwards "
          f"of up to {engine.prefiller.staging.max_tokens} tokens), the paged kernel eagerly, and FlashAttention's "
          f"varlen entry on gathered keys; fused_min_tokens now {default}")
    for batch, length in ((1, 128), (1, 512), (1, 1024), (1, 2048), (4, 256), (8, 512), (4, 2048)):
        walls = {}
        for name, threshold, engine.runtime.dispatch.graphs in paths:
            ops.fused_min_tokens = threshold
            walls[name] = sorted(run(length, batch=batch) for _ in range(6))[2]
        print(f"  {batch}x{length:<5d} " + "  ".join(f"{k} {v:7.2f}" for k, v in walls.items()))
    engine.runtime.dispatch.graphs = graphs
    ops.fused_min_tokens = 0
    walls = [run(2048 + 129 * i) for i in range(4)]
    print("\n== prefill wall ms at new lengths >= fused_min_tokens (cold shapes for FlashAttention): "
          + ", ".join(f"{w:.1f}" for w in walls))
    ops.fused_min_tokens = default

    # cuBLAS's per-shape cost: the host time of a GEMM call the first time its M is seen, and again.
    w = engine.runtime.model.w.layers[0].gate_up
    firsts, agains = [], []
    for m in range(301, 333):
        x = torch.randn(m, w.shape[1], dtype=w.dtype, device=w.device)
        torch.cuda.synchronize()
        for out in (firsts, agains):
            t0 = time.perf_counter()
            torch.nn.functional.linear(x, w)
            out.append((time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize()
    print(f"\n== torch.linear host time, M = 301..332 x {tuple(w.shape)}: first call at an M median "
          f"{sorted(firsts)[16]:.0f} us, second call {sorted(agains)[16]:.0f} us")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="1b")
    p.add_argument("--model")
    p.add_argument("--only", choices=["decode", "prefill", "verify", "replay", "verify_replay", "ttft", "prefix"],
                   help="one section (default: all but replay and verify_replay)")
    p.add_argument("--quantization", default="none", choices=["none", "fp8"],
                   help="the decode and prefill sections' engine (fp8: W8A8 prompts, FP8 skinny decode)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    args = p.parse_args()
    path = args.model or write_temporary_checkpoint(args.shape, device="cuda")
    if args.only in ("replay", "verify_replay", "ttft", "prefix"):
        if args.only == "replay":
            host_call_costs()
        {"replay": profile_replay_host, "verify_replay": profile_verify_host, "ttft": profile_ttft,
         "prefix": profile_prefix}[args.only](path)
        return
    engine = Engine(EngineConfig(model=str(path), num_kv_blocks=8192, max_seq_len=4096, cuda_graphs=False,
                                 prefix_caching=False, quantization=args.quantization,
                                 kv_cache_dtype=args.kv_cache_dtype))
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)

    def batch(b, n=128):
        ids = [engine.alloc_sequence(n + 300, SamplingParams(), GREEDY).seq_id for _ in range(b)]
        engine.prefill([PrefillItem(i, torch.randint(0, vocab, (n,), generator=g).tolist()) for i in ids])
        return ids

    def want(section: str) -> bool:
        return args.only in (None, section)

    for b in (1, 32) if want("decode") else ():
        ids = batch(b)
        for _ in range(5):
            engine.decode(ids)
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                engine.decode(ids)
        kernel_table(prof, 10, f"eager decode b{b}")
        engine.release(ids)

    if want("prefill"):
        profile_prefill(engine, vocab, g)
    if not want("verify"):
        return
    ids = batch(1)
    for _ in range(3):
        engine.verify([VerifyItem(ids[0], [7, 8, 9, 10])])
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            engine.verify([VerifyItem(ids[0], [7, 8, 9, 10])])
    kernel_table(prof, 5, "verify 4 drafts b1")
    cp = cProfile.Profile()
    cp.enable()
    for _ in range(20):
        engine.verify([VerifyItem(ids[0], [7, 8, 9, 10])])
    cp.disable()
    print("\n== verify host profile (20 calls)")
    pstats.Stats(cp).sort_stats("cumulative").print_stats(18)


if __name__ == "__main__":
    main()
