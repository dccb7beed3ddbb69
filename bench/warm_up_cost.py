"""What the worker's start-up warm-up (engine/warm_up.py) costs and buys, under this process's environment: its wall
time, the CUDA graphs it leaves held (of --max-graphs) and their pool's bytes, then prefill tokens/s at a few shapes.
Run it once per setting to compare, e.g. the prefill graphs' reach (METRALE_PREFILL_GRAPH_TOKENS, engine/env.py):

    METRALE_PREFILL_GRAPH_TOKENS=1024 python bench/warm_up_cost.py --model DIR

One JSON line at the end (also written under --out): the reach in effect (prefill_graph_tokens: the setting, or the
model's own, engine/prefill.py prefill_graph_tokens), warm_up_s, graphs_held, captures, evictions, pool_bytes,
prefill rows (engine_bench's measurement)."""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.warm_up import warm_up  # noqa: E402
from engine_bench import engine_prefill  # noqa: E402
from scale_bench import prefill_shape  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a checkpoint directory (python -m worker make-model)")
    p.add_argument("--max-graphs", type=int, default=EngineConfig.max_graphs)
    p.add_argument("--max-batch-size", type=int, default=EngineConfig.max_batch_size)
    p.add_argument("--max-seq-len", type=int, default=8192)
    p.add_argument("--prefill", nargs="*", type=prefill_shape, default=[(8, 512), (4, 1024)], metavar="BxN")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = p.parse_args(argv)
    if not (pathlib.Path(args.model) / "config.json").is_file():
        print(f"warm_up_cost: no config.json in {args.model}", file=sys.stderr)
        return 2
    engine = Engine(EngineConfig(model=args.model, max_graphs=args.max_graphs, max_batch_size=args.max_batch_size,
                                 max_seq_len=args.max_seq_len))
    try:
        t0 = time.perf_counter()
        warm_up(engine)
        warm_s = time.perf_counter() - t0
        graphs = engine.info().graph_cache
        reach = engine.prefiller.staging.max_tokens
        rows = [engine_prefill(engine, b, n, args.repeats) for b, n in args.prefill]
    finally:
        engine.close()
    result = {"prefill_graph_tokens": reach, "max_graphs": args.max_graphs,
              "device": str(engine.device), "warm_up_s": round(warm_s, 2), "graphs_held": graphs.graphs_held,
              "captures": graphs.captures, "evictions": graphs.evictions, "pool_bytes": graphs.pool_bytes,
              "prefill": rows}
    for r in rows:
        print(f"prefill {r['batch']} x {r['length']}: {r['tokens_per_s'] / 1e3:.1f}k tok/s")
    print(f"warm-up {warm_s:.1f}s: {graphs.graphs_held} graphs held of {args.max_graphs} ({graphs.captures} captured, "
          f"{graphs.evictions} evicted), pool {graphs.pool_bytes / 2 ** 20:.0f} MiB")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"warm-up-cost-{reach}-{time.strftime('%Y%m%dT%H%M%S')}.json").write_text(
        json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
