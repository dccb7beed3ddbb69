"""Where a step's time goes on the GPU: kernel time per step by kernel name (torch.profiler/CUPTI),
for eager decode at batch 1 and 32, prefill 8 x 512, and Verify of 4 drafts at batch 1; plus the host
time of each (cProfile top functions for Verify).

    python bench/profile_step.py --shape 1b"""
from __future__ import annotations

import argparse
import collections
import cProfile
import pathlib
import pstats
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from engine.api import PrefillItem, VerifyItem  # noqa: E402
from engine.checkpoint import write_checkpoint  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="1b")
    p.add_argument("--model")
    args = p.parse_args()
    path = args.model or write_checkpoint(pathlib.Path(tempfile.mkdtemp()) / "m", shape=args.shape, device="cuda")
    engine = Engine(EngineConfig(model=str(path), num_kv_blocks=8192, max_seq_len=4096, cuda_graphs=False))
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)

    def batch(b, n=128):
        ids = [engine.alloc_sequence(n + 300, SamplingParams(), GREEDY).seq_id for _ in range(b)]
        engine.prefill([PrefillItem(i, torch.randint(0, vocab, (n,), generator=g).tolist()) for i in ids])
        return ids

    for b in (1, 32):
        ids = batch(b)
        for _ in range(5):
            engine.decode(ids)
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                engine.decode(ids)
        kernel_table(prof, 10, f"eager decode b{b}")
        engine.release(ids)

    ids = [engine.alloc_sequence(600, SamplingParams(), GREEDY).seq_id for _ in range(8)]
    items = [PrefillItem(i, torch.randint(0, vocab, (512,), generator=g).tolist()) for i in ids]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.prefill(items)
    kernel_table(prof, 1, "prefill 8x512")
    engine.release(ids)

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
