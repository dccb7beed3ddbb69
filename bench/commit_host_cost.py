"""The host time a decode step's commit costs at a big batch: committing the sampled tokens
(engine.tokens.commit_tokens) and registering the KV blocks they filled in the prefix cache
(DecodePipeline._register_full_blocks: one sha256, one fingerprint and one cache entry a block). With steps in flight
the host does this while the GPU runs the next step, so at a batch of 256 it must stay well under a step (1B: ~2.2 ms
on an H100).

Runs the engine on the CPU (a random-weight tiny checkpoint by default, or --model; the forward is not what is
timed): --batch sequences start together (their blocks fill at the same step, the worst case) and decode --steps
steps. Prints one JSON line: per step, the median and max of the registration and of the token commit (ms), the
registration's us a block, the blocks the tokens filled and those the cache took (the same: distinct random
prompts).

    python bench/commit_host_cost.py --batch 256 --steps 64
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import engine.decode as decode_module  # noqa: E402
from engine.api import PrefillItem  # noqa: E402
from engine.checkpoint import write_checkpoint  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.sampling import SamplingParams, StoppingCriteria  # noqa: E402


class Timed:
    """Wraps a callable, collecting each call's wall time (s)."""

    def __init__(self, fn):
        self.fn, self.times = fn, []

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        out = self.fn(*args, **kwargs)
        self.times.append(time.perf_counter() - t)
        return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a checkpoint directory (default: a random-weight tiny one, written here)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=8)
    args = p.parse_args()
    if args.model and not (pathlib.Path(args.model) / "config.json").is_file():
        print(f"commit_host_cost: no config.json in {args.model}", file=sys.stderr)
        return 2
    model = args.model or str(write_checkpoint(pathlib.Path(tempfile.mkdtemp()) / "tiny", arch="llama", shape="tiny",
                                               seed=1))
    B = args.batch
    engine = Engine(EngineConfig(model=model, device="cpu", max_seq_len=args.prompt_len + args.steps + 8,
                                 num_kv_blocks=B * (-(-(args.prompt_len + args.steps + 8) // 16) + 1) + 16,
                                 max_slots=B, max_batch_size=B))
    block_size = engine.runtime.block_size
    ids = [engine.alloc_sequence(args.prompt_len + args.steps + 1, SamplingParams(),
                                 StoppingCriteria(ignore_eos=True)).seq_id for _ in range(B)]
    g = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    engine.prefill([PrefillItem(i, torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist()) for i in ids])
    pipeline = engine.decoder
    register = Timed(pipeline._register_full_blocks)
    commit = Timed(decode_module.commit_tokens)
    pipeline._register_full_blocks = register
    decode_module.commit_tokens = commit
    stored = engine.blocks.stats.stored_blocks
    for _ in range(args.steps):
        engine.decode(ids)
    registered = engine.blocks.stats.stored_blocks - stored
    # After the prefill's token and `steps` more, positions below prompt_len + steps hold their final KV.
    filled = B * ((args.prompt_len + args.steps) // block_size - args.prompt_len // block_size)
    ms = [t * 1e3 for t in register.times]
    out = {
        "batch": B, "steps": args.steps, "block_size": block_size, "blocks_filled": filled,
        "blocks_registered": registered,
        "register_ms_median": statistics.median(ms), "register_ms_max": max(ms),
        "register_us_per_block": sum(register.times) * 1e6 / max(filled, 1),
        "commit_ms_median": statistics.median(commit.times) * 1e3, "commit_ms_max": max(commit.times) * 1e3,
    }
    print(json.dumps(out))
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
