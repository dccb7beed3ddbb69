"""Tensor-parallel ranks on one host: rank 0 (the worker process) starts ranks 1..N-1 as child processes
(`python -m worker tp-rank ...`), joins them in one torch.distributed group over a TCP store on 127.0.0.1, and
watches them. Every rank builds the same Engine over its shard; ranks 1..N-1 then run rank 0's engine calls
(engine/parallel.py follow) until rank 0 closes its engine.

Faults: a rank that exits while rank 0 has not closed its engine is fatal: the watcher thread calls
on_rank_exit (the worker turns health NOT_SERVING and exits non-zero with one line saying which rank ended and
how), whatever rank 0 is doing, a collective included. A rank 1..N-1 whose rank 0 is gone exits by itself
(engine.parallel.watch_parent)."""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import signal
import subprocess
import sys
import threading
import time
from typing import Callable

import torch

from engine.config import EngineConfig, ModelConfig
from engine.default_model import resolve_model_dir
from engine.device import gpu_count, select_device
from engine.errors import ConfigError
from engine.shard import check_tensor_parallel

log = logging.getLogger(__name__)
# How long rank 0 waits for the other ranks to exit after it told them to stop, before it kills them.
STOP_TIMEOUT_S = 10.0
# A rank that ends during start-up most often failed as rank 0 is about to (the same config on every rank): rank
# 0's own error is the one reported, unless it has not failed this long after the rank ended.
START_GRACE_S = 3.0


def check(config: EngineConfig) -> None:
    """A ConfigError (one line, exit 2) unless the model splits over config.tensor_parallel_size ranks and, on
    CUDA, there are that many GPUs. Reads config.json only."""
    size = config.tensor_parallel_size
    if size == 1:
        return
    if config.model:
        check_tensor_parallel(ModelConfig.from_dir(config.model), size)
    if config.device != "cpu":
        gpus = gpu_count() if config.device == "cuda" or torch.cuda.is_available() else 0
        if gpus and size > gpus:
            raise ConfigError(f"--tensor-parallel-size {size} needs {size} GPUs; this host has {gpus}")


class RankProcesses:
    """Ranks 1..N-1 as child processes, each watched by a thread."""

    def __init__(self, config: EngineConfig, store_port: int, on_rank_exit: Callable[[str], None]):
        self.stopping = False
        self.started = False  # set once rank 0's engine is built
        self._on_rank_exit = on_rank_exit
        spec = json.dumps(dataclasses.asdict(config))
        self.procs = [subprocess.Popen([sys.executable, "-m", "worker", "tp-rank", "--rank", str(rank),
                                        "--world-size", str(config.tensor_parallel_size),
                                        "--store-port", str(store_port), "--config", spec])
                      for rank in range(1, config.tensor_parallel_size)]
        for rank, proc in enumerate(self.procs, start=1):
            threading.Thread(target=self._watch, args=(rank, proc), name=f"watch-rank-{rank}", daemon=True).start()

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if not self.started:
            time.sleep(START_GRACE_S)
        if self.stopping:
            return
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        self._on_rank_exit(f"tensor-parallel rank {rank} (pid {proc.pid}) {how}; the model cannot run without it")

    def stop(self) -> None:
        """After rank 0 told them to stop: waits for every rank, kills those still running after STOP_TIMEOUT_S."""
        self.stopping = True
        for proc in self.procs:
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel rank pid %d did not stop: killing it", proc.pid)
                proc.kill()
                proc.wait()

    def kill(self) -> None:
        self.stopping = True
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def start_engine(config: EngineConfig, on_rank_exit: Callable[[str], None]):
    """Rank 0: starts ranks 1..N-1, joins the group and builds this rank's Engine (config.tensor_parallel_size 1:
    a plain Engine). on_rank_exit(message) runs on a watcher thread when a rank ends before the engine closed."""
    import torch.distributed as dist

    from engine.engine import Engine
    from engine.parallel import ParallelGroup

    if config.tensor_parallel_size == 1:
        return Engine(config)
    # The default model's fetch or a .gguf's conversion happens once, here, before the other ranks start.
    config = config.replace(model=str(resolve_model_dir(config.model)))
    check(config)
    device = select_device(config)
    store = dist.TCPStore("127.0.0.1", 0, config.tensor_parallel_size, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=300))
    ranks = RankProcesses(config, store.port, on_rank_exit)
    try:
        group = ParallelGroup.init(0, config.tensor_parallel_size, store.port, device, store)
        group.processes = ranks
        engine = Engine(config, group)
        ranks.started = True
        return engine
    except BaseException:
        ranks.kill()
        raise


def rank_main(argv: list[str]) -> int:
    """`python -m worker tp-rank`: ranks 1..N-1 (started by rank 0, not by hand)."""
    parser = argparse.ArgumentParser(prog="metrale-worker tp-rank")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--store-port", type=int, required=True)
    parser.add_argument("--config", required=True, help="EngineConfig as JSON")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: rank 0 stops us

    from engine.engine import Engine
    from engine.parallel import ParallelGroup, follow, watch_parent

    watch_parent()
    config = EngineConfig(**json.loads(args.config))
    try:
        if config.device != "cpu" and torch.cuda.is_available() and gpu_count() > 0:
            torch.cuda.set_device(args.rank)  # one GPU per rank: select_device takes the current one
        device = select_device(config)
        group = ParallelGroup.init(args.rank, args.world_size, args.store_port, device)
        engine = Engine(config, group)
    except ConfigError as e:
        # One write, newline included: rank 0 may kill this process at any moment once it has its own error, and
        # print's separate write of the newline would leave rank 0's line glued to this one.
        sys.stderr.write(f"metrale-worker: tensor-parallel rank {args.rank}: {' '.join(str(e).split())}\n")
        sys.stderr.flush()
        return 2
    follow(engine)
    engine.close()
    return 0
