"""Does the queued decode step's time depend on where the batch lives? One process, one batch size (default 32),
five layouts in turn: the first slots and KV blocks; high slot rows over low blocks (96 one-block sequences hold
the first slots); low slots over high blocks (20 long sequences hold the first 2560 blocks); both high; the first
slots again. Each layout is timed queued (bench/engine_bench.py's engine_decode_queued: two steps in flight) and
one step at a time (engine_decode, with its device time), and prints one JSON line.
docs/decode-step-budget.md, "Open questions" (the queued batch-32 step reads 1.216-1.226 ms in some processes and
1.270-1.277 in others, with the same one-at-a-time device time; not the layout, this script found).

    python bench/queued_layout.py [--shape 1b] [--batch 32] [--steps 200]      (GPU; --shape tiny runs on CPU)"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

import engine_bench as eb  # noqa: E402
from engine.api import PrefillItem  # noqa: E402
from engine.checkpoint import write_checkpoint  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.sampling import SamplingParams, StoppingCriteria  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="1b", choices=["tiny", "1b", "8b"])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = write_checkpoint(pathlib.Path(tempfile.mkdtemp()) / args.shape, arch="llama", shape=args.shape, device=dev)
    engine = Engine(EngineConfig(model=str(model), device=dev, max_slots=256, max_batch_size=256, max_seq_len=2576,
                                 max_prefill_tokens=8192, kv_cache_memory=0.5 if dev == "cuda" else 0.9,
                                 prefix_caching=False))
    stop = StoppingCriteria(max_new_tokens=1, ignore_eos=True)

    def hold(n: int, tokens: int) -> list[int]:
        """n sequences holding the slots and KV blocks of `tokens` tokens each (a one-token prompt takes the whole
        reservation), never decoded."""
        ids = [engine.alloc_sequence(tokens, SamplingParams(), stop, prefix_caching=False).seq_id for _ in range(n)]
        engine.prefill([PrefillItem(i, [0]) for i in ids])
        return ids

    def phase(name: str) -> None:
        q = eb.engine_decode_queued(engine, args.batch, args.steps)
        s = eb.engine_decode(engine, args.batch, args.steps)
        print(json.dumps({"phase": name, "queued_ms": round(q["step_ms"], 4),
                          "queued_median_ms": round(q["interval_ms_median"], 4),
                          "finish_ms": round(q["finish_ms_median"], 4), "layout": q["layout"],
                          "one_at_a_time_ms": round(s["step_ms"], 4), "device_ms": round(s["device_ms"], 4)}),
              flush=True)

    phase("first slots, first blocks")
    held = hold(96, 16)
    phase("high slots, low blocks")
    engine.release(held)
    held = hold(20, 2048)
    phase("low slots, high blocks")
    engine.release(held)
    held = hold(96, 16) + hold(20, 2048)
    phase("high slots, high blocks")
    engine.release(held)
    phase("first slots again")
    return 0


if __name__ == "__main__":
    sys.exit(main())
