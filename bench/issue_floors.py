"""Every device floor of the open issues in one run: each floor's point measured as its benchmark measures it,
beside the floor, met or not.

    python bench/issue_floors.py --model-1b DIR --model-8b DIR --out DIR   # on a GPU (gpu_session.sh floors)
    python bench/issue_floors.py --quick --out DIR                          # on CPU (CI): tiny stands in for both

The floors are the H200 figures the issues name: issue 40 (a 4,096-token prompt with 3,968 cached, >= 10x faster
than uncached), 42 (decode steps and prefills at serving shapes) and 43 (FP8 weights and KV cache). On any other
device the table is the same with a warning: its figures inform, they do not decide an issue.

One engine per configuration (shape, weight quantization, KV cache dtype), one at a time:
- decode points and prefills as scale_bench measures them (scale_bench.make_engine, measure_point: steps two in
  flight, the median interval; every sequence reading its own KV blocks; prefix caching off);
- the cached-prefix TTFT as engine_bench --prefix-ttft measures it (prefix caching on; medians of fresh prompts).
Ratio floors (FP8 over bf16) divide figures of two engines of this run. Each row of the table: issue, what,
measured, floor, met. The JSON (`floors-<stamp>-<device>.json`): meta (device, bandwidth, per configuration the
engine's dtypes, errors), `rows` (issue, what, measurement, value, floor, better: "max" (at most) or "min" (at
least), met) and `measurements` (each figure by its description: step ms, prefill tok/s, TTFT speed-up).
Checkpoints: --model-1b / --model-8b (written once beforehand: `python -m worker make-model DIR --shape 8b`), else
random-weight ones written to a temporary directory per shape."""

from __future__ import annotations

import argparse
import datetime
import pathlib
import platform
import sys
from dataclasses import dataclass, field

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.engine_bench import copy_bandwidth, engine_prefill, engine_prefix_ttft, guarded, results_path  # noqa: E402
from bench.engine_bench import write_results  # noqa: E402
from bench.scale_bench import (CAPTURE_AFTER, free_device_memory, make_engine, matmul_peak, measure_point,  # noqa: E402
                               randomize_kv)
from engine.checkpoint import write_temporary_checkpoint  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402

STEPS = 30  # measured decode steps a point (scale_bench's RESULTS runs)
TTFT_PROMPT, TTFT_CACHED = 4096, 3968


@dataclass(frozen=True)
class Setup:
    """One engine: a shape with its weights' quantization (lm_head: the LM head too, --quantize-lm-head) and KV cache
    dtype."""
    shape: str
    quantization: str = "none"
    kv: str = "auto"
    lm_head: bool = False

    @property
    def label(self) -> str:
        return (self.shape + (" FP8" if self.quantization == "fp8" else "") + (" FP8-head" if self.lm_head else "")
                + (" FP8-KV" if self.kv == "fp8" else ""))


@dataclass
class Plan:
    """What one engine measures: decode points (batch, context) and prefills (batch, length)."""
    points: list[tuple[int, int]] = field(default_factory=list)
    prefills: list[tuple[int, int]] = field(default_factory=list)


# (issue, what, measurement key, floor, better); keys: ("step", setup, batch, context) -> ms,
# ("prefill", setup, batch, length) -> tok/s, ("ttft", shape) -> speedup, ("ratio", key_a, key_b) -> a / b.
E1, E1F = Setup("1b"), Setup("1b", "fp8")
E8, E8K, E8F, E8FK = Setup("8b"), Setup("8b", kv="fp8"), Setup("8b", "fp8"), Setup("8b", "fp8", "fp8")
E1FH, E8FH = Setup("1b", "fp8", lm_head=True), Setup("8b", "fp8", lm_head=True)
FLOORS = [
    (40, "1B TTFT, 4096 tokens with 3968 cached, speed-up over uncached", ("ttft", "1b"), 10.0, "min"),
    (40, "8B TTFT, 4096 tokens with 3968 cached, speed-up over uncached", ("ttft", "8b"), 10.0, "min"),
    (42, "1B decode b256, context 128 (ms)", ("step", E1, 256, 128), 1.25, "max"),
    (42, "1B decode b32, context 8k (ms)", ("step", E1, 32, 8192), 3.1, "max"),
    (42, "1B decode b32, context 32k (ms)", ("step", E1, 32, 32768), 10.2, "max"),
    (42, "1B decode b1, context 32k (ms)", ("step", E1, 1, 32768), 1.0, "max"),
    (42, "8B decode b128, context 128 (ms)", ("step", E8, 128, 128), 5.2, "max"),
    (42, "8B decode b8, context 8k (ms)", ("step", E8, 8, 8192), 6.8, "max"),
    (42, "8B decode b1, context 32k (ms)", ("step", E8, 1, 32768), 5.6, "max"),
    (42, "1B prefill 1 x 32768 (tok/s)", ("prefill", E1, 1, 32768), 110e3, "min"),
    (42, "8B prefill 1 x 32768 (tok/s)", ("prefill", E8, 1, 32768), 24e3, "min"),
    (42, "1B prefill 8 x 512 (tok/s)", ("prefill", E1, 8, 512), 300e3, "min"),
    (43, "8B FP8 decode b1, context 128 (ms)", ("step", E8F, 1, 128), 2.3, "max"),
    (43, "8B FP8 decode b32, context 128 (ms)", ("step", E8F, 32, 128), 3.2, "max"),
    (43, "1B FP8 decode b1, context 128 (ms)", ("step", E1F, 1, 128), 0.60, "max"),
    # The LM head is optional in issue 43 ("its effect is measured"): the b1 floors again with it quantized.
    (43, "8B FP8 decode b1, context 128, LM head FP8 too (ms)", ("step", E8FH, 1, 128), 2.3, "max"),
    (43, "1B FP8 decode b1, context 128, LM head FP8 too (ms)", ("step", E1FH, 1, 128), 0.60, "max"),
    (43, "8B prefill 8 x 512, FP8 over bf16", ("ratio", ("prefill", E8F, 8, 512), ("prefill", E8, 8, 512)), 1.4, "min"),
    (43, "8B b8 context 8k, bf16 weights: bf16 KV step / FP8 KV step",
     ("ratio", ("step", E8, 8, 8192), ("step", E8K, 8, 8192)), 1.5, "min"),
    (43, "8B b8 context 8k, FP8 weights: bf16 KV step / FP8 KV step",
     ("ratio", ("step", E8F, 8, 8192), ("step", E8FK, 8, 8192)), 1.5, "min"),
    (43, "8B b8 context 8k: bf16 weights and KV / FP8 weights and KV",
     ("ratio", ("step", E8, 8, 8192), ("step", E8FK, 8, 8192)), 1.5, "min"),
]
# --quick (CPU): the tiny shape stands in for both, every size scaled down (the floors then mean nothing).
QUICK_BATCH = {256: 4, 128: 4, 32: 2, 8: 2, 1: 1}
QUICK_LENGTH = {128: 64, 512: 32, 8192: 128, 32768: 256}  # decode contexts and prompt lengths
QUICK_TTFT = (320, 256)


def measurement_keys(floors: list[tuple]) -> list[tuple]:
    keys = []
    for _, _, key, _, _ in floors:
        keys.extend(key[1:] if key[0] == "ratio" else [key])
    return keys


def sized(key: tuple, quick: bool) -> tuple:
    """A measurement key with its batches and lengths as --quick scales them."""
    if key[0] == "ratio":
        return key[0], sized(key[1], quick), sized(key[2], quick)
    if not quick or key[0] not in ("step", "prefill"):
        return key
    return key[0], key[1], QUICK_BATCH[key[2]], QUICK_LENGTH[key[3]]


def plans(keys: list[tuple], quick: bool) -> dict[Setup, Plan]:
    """The decode points and prefills each engine measures."""
    out: dict[Setup, Plan] = {}
    for key in keys:
        if key[0] in ("step", "prefill"):
            plan = out.setdefault(key[1], Plan())
            entry = sized(key, quick)[2:]
            target = plan.points if key[0] == "step" else plan.prefills
            if entry not in target:
                target.append(entry)
    return out


class Measurer:
    """Runs each engine once, keeping every figure by its measurement key."""

    def __init__(self, args, device: torch.device):
        self.args, self.device, self.quick = args, device, args.quick
        self.steps = 4 if args.quick else STEPS  # measured decode steps a point
        self.bandwidth, self.peak = copy_bandwidth(device), matmul_peak(device, 256 if args.quick else 8192,
                                                                        torch.bfloat16 if device.type == "cuda"
                                                                        else torch.float32)
        self.values: dict[tuple, float] = {}
        self.engines: dict[str, dict] = {}
        self.log: dict = {}
        self._models: dict[str, str] = {}

    def model(self, shape: str) -> str:
        """The shape's checkpoint: the one given, else one written once (removed at exit)."""
        if shape not in self._models:
            given = None if self.quick else getattr(self.args, f"model_{shape}")
            self._models[shape] = given or str(write_temporary_checkpoint("tiny" if self.quick else shape,
                                                                         device=str(self.device)))
            free_device_memory(self.device)  # written from device memory
        return self._models[shape]

    def run_engine(self, setup: Setup, plan: Plan) -> None:
        steps = self.steps
        room = CAPTURE_AFTER + 3 + steps + 8
        args = argparse.Namespace(batches=[b for b, _ in plan.points] or [1], prefill=plan.prefills,
                                  max_prefill_tokens=EngineConfig.max_prefill_tokens, kv_memory_gib=None,
                                  quantization=setup.quantization, quantize_lm_head=setup.lm_head,
                                  fp8_activation_scheme=EngineConfig.fp8_activation_scheme, kv_cache_dtype=setup.kv)
        max_seq_len = max([c + room for _, c in plan.points] + [n + 2 for _, n in plan.prefills])
        free_device_memory(self.device)
        engine = make_engine(self.model(setup.shape), self.device, args, max_seq_len)
        info = engine.info()
        self.engines[setup.label] = {name: getattr(info, name) for name in (
            "dtype", "kv_cache_dtype", "kernel_backend", "quantization", "quantized_lm_head")}
        try:
            randomize_kv(engine)
            for b, n in plan.prefills:
                r = guarded(self.log, f"{setup.label} prefill {b}x{n}", engine_prefill, engine, b, n, 3)
                if "tokens_per_s" in r:
                    self.record(("prefill", setup, b, n), r["tokens_per_s"])
            if plan.prefills:  # whether the prefills that could replay graphs did (a failed capture runs eager)
                g = engine.info().graph_cache
                self.engines[setup.label]["prefill_graphs"] = {
                    "reach_tokens": engine.prefiller.staging.max_tokens, "captures": g.captures,
                    "capture_failures": g.capture_failures, "hits": g.hits}
                print(f"  {setup.label} prefill graphs: {self.engines[setup.label]['prefill_graphs']}", flush=True)
            for b, c in sorted(plan.points, key=lambda p: (p[1], p[0])):
                p = guarded(self.log, f"{setup.label} b{b} c{c}", measure_point, engine, b, c, steps, room,
                            self.bandwidth, self.peak)
                if "step_ms" in p:
                    self.record(("step", setup, b, c), p["step_ms"])
        finally:
            engine.close()

    def run_ttft(self, shape: str) -> None:
        prompt, cached = QUICK_TTFT if self.quick else (TTFT_PROMPT, TTFT_CACHED)
        free_device_memory(self.device)
        engine = Engine(EngineConfig(model=self.model(shape), device=self.device.type, max_seq_len=prompt + 104,
                                     max_prefill_tokens=8192))
        try:
            r = guarded(self.log, f"{shape} prefix ttft", engine_prefix_ttft, engine, prompt, cached,
                        3 if self.quick else 10)
            if "speedup" in r:
                self.record(("ttft", shape), r["speedup"])
        finally:
            engine.close()

    def record(self, key: tuple, value: float) -> None:
        """Keeps a figure and prints it at once: a call cut short by its time limit still shows what it measured."""
        self.values[key] = value
        print(f"  {describe(key)}: {value:.4g}", flush=True)

    def value(self, key: tuple) -> float | None:
        """key's figure (scaled with --quick), None where it was not measured."""
        if key[0] == "ratio":
            a, b = self.value(key[1]), self.value(key[2])
            return a / b if a and b else None
        return self.values.get(sized(key, self.quick))


def describe(key: tuple) -> str:
    """A measurement key as text: 'step 8b FP8 b8 c8192', 'prefill 1b 8x512', 'ttft 1b', 'ratio (a) / (b)'."""
    if key[0] == "ratio":
        return f"ratio ({describe(key[1])}) / ({describe(key[2])})"
    if key[0] == "step":
        return f"step {key[1].label} b{key[2]} c{key[3]}"
    if key[0] == "prefill":
        return f"prefill {key[1].label} {key[2]}x{key[3]}"
    return f"ttft {key[1]}"


def rows(m: Measurer, floors: list[tuple]) -> list[dict]:
    """One per floor; met None where nothing was measured, or with --quick (stand-ins: no floor applies)."""
    out = []
    for issue, what, key, floor, better in floors:
        v = m.value(key)
        met = None if v is None or m.quick else (v <= floor if better == "max" else v >= floor)
        out.append({"issue": issue, "what": what, "measurement": describe(sized(key, m.quick)), "value": v,
                    "floor": floor, "better": better, "met": met})
    return out


def table(result: dict) -> str:
    meta = result["meta"]
    lines = [f"== issue floors on {meta['device']} ({meta['copy_bandwidth_TBps']:.3g} TB/s copy)"]
    if meta["quick"]:
        lines.append("   (--quick: the tiny shape at scaled-down sizes stands in for every point; no floor applies)")
    elif not meta["device"].startswith("NVIDIA H200"):
        lines.append("   (the floors are H200 figures: on this device they inform, they do not decide)")
    lines.append(f"{'issue':>5}  {'what':<66} {'measured':>10} {'floor':>10}  met")
    for r in result["rows"]:
        v = "—" if r["value"] is None else f"{r['value']:.4g}"
        sign = "<=" if r["better"] == "max" else ">="
        met = "—" if r["met"] is None else ("yes" if r["met"] else "no")
        lines.append(f"{r['issue']:>5}  {r['what']:<66} {v:>10} {sign}{r['floor']:>8.4g}  {met}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-1b", help="a 1B-shaped checkpoint (default: a random-weight one, written here)")
    p.add_argument("--model-8b", help="an 8B-shaped checkpoint (default: a random-weight one, written here)")
    p.add_argument("--issues", type=int, nargs="+", help="only these issues' floors")
    p.add_argument("--quick", action="store_true", help="CPU / CI: the tiny shape for both, every size scaled down")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = p.parse_args(argv)
    for flag in ("model_1b", "model_8b"):
        d = getattr(args, flag)
        if d and not (pathlib.Path(d) / "config.json").is_file():
            p.error(f"--{flag.replace('_', '-')} {d}: no config.json there (a checkpoint directory)")
    floors = [f for f in FLOORS if not args.issues or f[0] in args.issues]
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    m = Measurer(args, device)
    keys = measurement_keys(floors)
    for setup, plan in plans(keys, args.quick).items():
        m.run_engine(setup, plan)
    for shape in dict.fromkeys(k[1] for k in keys if k[0] == "ttft"):
        m.run_ttft(shape)
    result = {"meta": {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.machine()})",
        "torch": torch.__version__, "argv": sys.argv[1:], "quick": args.quick, "steps": m.steps,
        "copy_bandwidth_TBps": m.bandwidth / 1e12, "matmul_TFLOPs": m.peak / 1e12, "engines": m.engines,
        "errors": {k: v["error"] for k, v in m.log.items() if isinstance(v, dict) and "error" in v}},
        "rows": rows(m, floors), "measurements": {describe(k): v for k, v in m.values.items()}}
    print(table(result), flush=True)
    return write_results(result, args, results_path(result, args.out, "floors"))


if __name__ == "__main__":
    sys.exit(main())
