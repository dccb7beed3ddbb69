"""metrale-worker command line: `serve` and `make-model` (same as `python -m worker ...`).

Exit codes: 0 after a clean stop (SIGTERM/SIGINT, during start-up too); 2 for a start-up problem (a bad
flag, file, port or checkpoint), reported as one line on stderr, the last one, after any log lines; 3 when a
tensor-parallel rank ended while the worker served (worker/ranks.py), also with one line."""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from engine import env
from engine.checkpoint import ARCH_CLASSES, FP8_LAYOUTS, SHAPES, write_checkpoint
from engine.config import EngineConfig
from engine.errors import ConfigError
from worker.config import WorkerConfig, config_from_args, name_the_flag, serve_parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="metrale-worker", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser(sub.add_parser("serve", help="serve a model over gRPC (the built-in default without --model)"))
    make = sub.add_parser("make-model", help="write a Hugging Face-layout checkpoint with seeded random weights")
    make.add_argument("out_dir", help="directory to write config.json and *.safetensors to")
    make.add_argument("--arch", choices=sorted(ARCH_CLASSES), default="llama")
    make.add_argument("--shape", choices=sorted(SHAPES), default="tiny",
                      help="tiny (tests), 1b (Llama-3.2-1B shape), 8b (Llama-3-8B shape)")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                      help="dtype on disk (default: float32 for tiny, bfloat16 otherwise)")
    make.add_argument("--fp8-layout", choices=sorted(FP8_LAYOUTS), default="",
                      help="write the linear weights in a published FP8 layout (engine/checkpoint.py FP8_LAYOUTS): "
                           "fp8 / fp8-32x32 / fp8-tensor-static (Hugging Face fine-grained FP8, weight_scale_inv per "
                           "block or tensor), ct-channel "
                           "/ ct-tensor-static (compressed-tensors float-quantized, weight_scale)")
    make.add_argument("--device", default="cpu", help="where to draw the random weights (cuda is faster)")
    make.add_argument("--force", action="store_true",
                      help="write into a non-empty OUT_DIR: replaces its checkpoint files (config.json, "
                           "generation_config.json, *.safetensors, the shard index); other files stay")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        env.check()  # before logging is set up from METRALE_LOG_LEVEL
    except ConfigError as e:
        print(f"metrale-worker: {e}", file=sys.stderr)
        return 2
    if argv[:1] == ["tp-rank"]:  # ranks 1..N-1 of --tensor-parallel-size N, started by the worker itself
        from worker.ranks import rank_main

        logging.basicConfig(level=env.LOG_LEVEL, format="%(asctime)s %(levelname)s %(name)s [tp rank]: %(message)s")
        return rank_main(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=env.LOG_LEVEL, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "make-model":
            print(write_checkpoint(args.out_dir, arch=args.arch, shape=args.shape, seed=args.seed, dtype=args.dtype,
                                   device=args.device, replace=args.force, fp8_layout=args.fp8_layout))
            return 0
        from worker.server import serve  # imports grpc and the generated stubs

        worker_config = config_from_args(WorkerConfig, args)
        engine_config = config_from_args(EngineConfig, args)
        asyncio.run(serve(worker_config, engine_config))
    except ConfigError as e:
        print(f"metrale-worker: {name_the_flag(' '.join(str(e).split()))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before serve's handlers are installed, or during make-model
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
