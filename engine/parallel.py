"""Tensor parallelism over the processes of one host: the process group, the model's collectives, and the
mirroring of engine calls from rank 0 to the other ranks.

Every rank builds the same Engine over its shard of the weights (engine/shard.py). Rank 0 (the worker: gRPC
and scheduling) runs the engine as usual; each call that changes engine state or runs a forward is one of
the Engine methods marked @mirrored, and rank 0 broadcasts it (method name and arguments, pickled, on a gloo
group even where the model's collectives use NCCL) before running it. Ranks 1..N-1 loop in follow(): receive
a call, run it on their own engine. The engine is deterministic in its calls (sequence ids, block ids, slots,
graph keys and sampling seeds all follow from the calls, and every rank samples the same token from the same
all-gathered logits), so every rank's engine stays in the same state and runs the same forwards, hence the
same collectives in the same order. Results are used on rank 0 only.

A launched decode step (engine/decode.py PendingStep) crosses as StepRef(serial): each rank numbers its
launches alike, and a follower keeps its own steps by number until rank 0 finishes them.

The model's collectives (Collectives): the row-parallel projections' all-reduce (SUM) before the residual
add, and the vocab-parallel LM head's all-gather, which gives every rank the full logits, so sampling runs
unchanged and alike everywhere (a reduced sampling that gathers only each rank's top candidates could come
later). The embedding is replicated."""
from __future__ import annotations

import datetime
import functools
import logging
import os
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# A follower waits for rank 0's next call for as long as the worker idles: no timeout on the control group.
CONTROL_TIMEOUT = datetime.timedelta(days=365)
# The model's collectives run only inside a call every rank makes: a rank missing for this long is stuck.
DATA_TIMEOUT = datetime.timedelta(minutes=10)
STOP = "__stop__"


@dataclass(frozen=True)
class StepRef:
    """A launched decode step, named across ranks by its launch number."""

    serial: int


class Collectives:
    """The model's communication: all_reduce for row-parallel outputs, gather_vocab for the logits."""

    def __init__(self, size: int, vocab_widths: tuple[int, ...], group=None):
        self.size = size
        self.vocab_widths = vocab_widths
        self.group = group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over ranks, in place (a row-parallel projection's partial products)."""
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[N, this rank's vocab rows] -> [N, vocab]: every rank's slice, in rank order. Slices differ by one
        column at most; the narrower ones are padded for the gather and the pads dropped after."""
        width = max(self.vocab_widths)
        local = logits if logits.shape[1] == width else torch.nn.functional.pad(logits, (0, width - logits.shape[1]))
        parts = torch.empty((self.size, *local.shape), dtype=local.dtype, device=local.device)
        if local.is_cuda:
            dist.all_gather_into_tensor(parts, local.contiguous(), group=self.group)
        else:
            dist.all_gather(list(parts.unbind(0)), local.contiguous(), group=self.group)
        return torch.cat([parts[r, :, :w] for r, w in enumerate(self.vocab_widths)], dim=1)


class ParallelGroup:
    """This process's place in the tensor-parallel group: its rank, the size, the control group (gloo) and the
    model's collectives (gloo on CPU, NCCL on a GPU)."""

    def __init__(self, rank: int, size: int, control=None):
        self.rank = rank
        self.size = size
        self.control = control
        self.collectives: Collectives | None = None  # set once the shard plan is known (Runtime.create)
        self.depth = 0  # mirrored calls running on this rank (nested ones are not broadcast)
        self.steps: dict[int, object] = {}  # a follower's launched decode steps by serial
        self.launches = 0  # decode steps launched (their serials)
        self.stopping = False
        self.processes = None  # rank 0: worker.ranks.RankProcesses, stopped by close()

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @classmethod
    def init(cls, rank: int, size: int, store_port: int, device: torch.device,
             store: "dist.TCPStore | None" = None) -> "ParallelGroup":
        """Joins the group over the TCP store on 127.0.0.1:store_port (rank 0 passes the store it created)."""
        if store is None:
            store = dist.TCPStore("127.0.0.1", store_port, size, is_master=False,
                                  timeout=datetime.timedelta(seconds=300))
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=DATA_TIMEOUT, **kwargs)
        control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        if device.type == "cuda":  # NCCL communicators are made lazily: before any graph capture, here
            dist.all_reduce(torch.zeros(1, device=device))
            torch.cuda.synchronize(device)
        return cls(rank, size, control)

    def min_int(self, value: int) -> int:
        """The smallest of every rank's value (e.g. the KV blocks each rank's memory holds)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    # ------------------------------------------------------------------ mirroring

    def broadcast(self, call: tuple) -> None:
        """Rank 0: sends a call (name, args, kwargs) to every other rank."""
        dist.broadcast_object_list([call], src=0, group=self.control)

    def receive(self) -> tuple:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def stop_followers(self) -> None:
        """Rank 0: tells the followers to close their engines and exit."""
        if self.leader and not self.stopping:
            self.stopping = True
            self.broadcast((STOP, (), {}))

    def close(self) -> None:
        """After the engine closed: rank 0 waits for the other ranks to exit; every rank leaves the group."""
        if self.processes is not None:
            self.processes.stop()
        if dist.is_initialized():
            dist.destroy_process_group()


def mirrored(method):
    """Marks an Engine method that rank 0 broadcasts to the other ranks before running it (see the module doc).
    The engine's `parallel` is None without tensor parallelism: the method runs as it is."""
    name = method.__name__

    @functools.wraps(method)
    def call(engine, *args, **kwargs):
        group: ParallelGroup | None = engine.parallel
        if group is None:
            return method(engine, *args, **kwargs)
        if group.leader and group.depth == 0:
            group.broadcast((name, _to_refs(args), _to_refs(kwargs)))
        group.depth += 1
        try:
            result = method(engine, *args, **kwargs)
        finally:
            group.depth -= 1
        if name == "decode_launch":
            result.serial = group.launches
            group.launches += 1
        return result

    call.mirrored = True
    return call


def _to_refs(value):
    from engine.decode import PendingStep

    if isinstance(value, PendingStep):
        return StepRef(value.serial)
    if isinstance(value, (list, tuple)):
        return type(value)(_to_refs(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_refs(v) for k, v in value.items()}
    return value


def _from_refs(value, steps: dict):
    if isinstance(value, StepRef):
        return steps.pop(value.serial)
    if isinstance(value, (list, tuple)):
        return type(value)(_from_refs(v, steps) for v in value)
    if isinstance(value, dict):
        return {k: _from_refs(v, steps) for k, v in value.items()}
    return value


def follow(engine) -> None:
    """Ranks 1..N-1: runs rank 0's engine calls until it says stop (or goes away: the receive raises). A call
    refused with an EngineError was refused on rank 0 alike (the engine checks before it changes anything);
    any other error ends the rank, which rank 0 notices."""
    from engine.errors import EngineError

    group: ParallelGroup = engine.parallel
    while True:
        name, args, kwargs = group.receive()
        if name == STOP:
            return
        method = getattr(type(engine), name)
        if not getattr(method, "mirrored", False):
            raise RuntimeError(f"rank 0 sent {name!r}, which is no mirrored engine call")
        try:
            result = method(engine, *_from_refs(args, group.steps), **_from_refs(kwargs, group.steps))
        except EngineError as e:
            log.debug("rank %d: %s refused as on rank 0: %s", group.rank, name, e)
            continue
        if name == "decode_launch":
            group.steps[result.serial] = result
            for serial in [s for s, step in group.steps.items() if s < result.serial - 1024 and step.done]:
                del group.steps[serial]  # finished inside another call and never named again


def watch_parent(interval_s: float = 0.5) -> None:
    """A follower exits when the process that started it (rank 0) is gone, wherever it is blocked."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent:
                log.error("rank 0 (pid %d) is gone: exiting", parent)
                os._exit(1)

    threading.Thread(target=watch, name="watch-rank-0", daemon=True).start()
