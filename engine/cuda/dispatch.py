"""StepDispatch: where a step's device work runs, how it is timed, and whether it replays a CUDA graph.

On a GPU every step runs on the engine's compute stream (EngineStreams) and is timed by a pair of events;
decode and uniform verify steps replay the CUDA graph of their slot vector when the GraphCache holds one,
else (fallback_graphs) the graph of their batch width, which reads the slot vector from a staging buffer
written just before, else they run eagerly; short prefill forwards replay the graph of their padded shape.
On the CPU (no streams, no graphs) the same calls run the work at once and time it on the host.

All the dispatch of a step to a graph lives here, beside the GraphCache (graphs.py) that decides when to
capture and what to evict. Importing this module needs neither a GPU nor cuda-python."""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Hashable

import torch

from engine.outputs import SlotStaging


class StepDispatch:
    def __init__(self, device: torch.device, streams, graphs, max_batch: int, rings: int, fallback_graphs: bool):
        """streams: EngineStreams (GPU) or None (CPU, or the reference ops on a GPU); graphs: a GraphCache or
        None; rings: the steps that may be in flight (one slot-vector staging buffer and timer each)."""
        self.device = device
        self.streams = streams
        self.graphs = graphs
        self.fallback_graphs = fallback_graphs
        self._slot_staging = SlotStaging(max_batch, device, rings)

    @contextlib.contextmanager
    def on_device(self, timer: int = 0, torch_stream: bool = True):
        """Runs device work on the compute stream (GPU) and times it: yields a timer whose elapsed_ns() is
        the device time of the work in the block. timer: which of the streams' timers (0 for work the host
        waits for at once, 1 + ring for a launched decode step). torch_stream=False leaves torch's current
        stream alone (switching it costs ~10 us of host time each way): for a block whose work is driver
        calls on the compute stream, or wrapped in compute_stream() itself."""
        if self.streams is None:
            timer = HostTimer()
            yield timer
            timer.stop()
            return
        if not torch_stream:
            with self.streams.timed(timer) as timing:
                yield timing
            return
        with self.streams.compute_context(), self.streams.timed(timer) as timing:
            yield timing

    def compute_stream(self):
        """`with dispatch.compute_stream():` torch ops and kernel launches in the block go to the compute
        stream (GPU), or run at once (CPU)."""
        return self.streams.compute_context() if self.streams is not None else contextlib.nullcontext()

    def bind_thread(self) -> None:
        """Lets the calling thread run steps (a GPU needs its context current there; nothing on CPU)."""
        if self.streams is not None:
            self.streams.bind_thread()

    def mark(self):
        """A DeviceMark of the work queued so far (any thread may wait on it), or None where the work ran at
        once (CPU)."""
        return self.streams.mark() if self.streams is not None else None

    def run_slots(self, kind: str, slots: list[int], shape: tuple,
                  make_step: Callable[[torch.Tensor], Callable[[], None]], ring: int = 0,
                  key: tuple | None = None) -> None:
        """Runs the device work of a decode or uniform verify step over `slots` (ascending); make_step(the
        slot vector on the device) returns that work. Replayed from the CUDA graph of the slot vector when
        one is held; else, with fallback graphs, from the graph of the batch width (and `shape`), which
        reads the slot vector from a staging buffer written just before; else run eagerly. The GraphCache
        decides when to capture either. ring: which pinned staging buffer the slot vector goes through (one
        per step in flight). key: the graph key, when the caller holds it already
        ((kind, *GraphCache.key_for(slots, *shape))).

        Only a replay may run outside torch's compute stream context (it is driver calls on the compute
        stream): every step function is built and run inside it."""
        def on_compute(step: Callable[[], None]) -> Callable[[], None]:
            def run() -> None:
                with self.compute_stream():
                    step()
            return run

        def prepare():
            with self.compute_stream():  # a captured graph keeps this tensor
                return on_compute(make_step(torch.tensor(slots, device=self.device)))

        if self.graphs is None:
            with self.compute_stream():
                make_step(torch.tensor(slots, device=self.device))()
            return
        fallback = None
        if self.fallback_graphs:
            width, staged = len(slots), self._slot_staging

            def stage():
                staged.host_np[ring][:width] = slots
                if self.streams is not None:
                    self.streams.to_device(staged.device, staged.host[ring], 8 * width)
                else:  # the CPU tests' fake graphs
                    staged.device[:width].copy_(staged.host[ring][:width])

            fallback = ((kind, "width", width, *shape), lambda: on_compute(make_step(staged.device[:width])), stage)
        from engine.cuda.graphs import GraphCache

        self.graphs.run(key or (kind, *GraphCache.key_for(slots, *shape)), prepare, fallback)

    def run_shape(self, key: Hashable, step: Callable[[], None], capture_after: int) -> bool:
        """Runs `step` (work of a fixed padded shape, e.g. a short prefill forward) as the CUDA graph of
        `key` once it has been seen capture_after times, else eagerly; True when a graph ran. Call it inside
        compute_stream()."""
        if self.graphs is None:
            step()
            return False
        return self.graphs.run(key, lambda: step, capture_after=capture_after)

    def synchronize(self) -> None:
        """Waits for every piece of device work queued so far (nothing on CPU)."""
        if self.streams is not None:
            self.streams.synchronize()

    def close(self, outputs) -> None:
        """Waits for the device, drops every graph, then the pinned buffers torch copied into on the compute
        stream (outputs: the StepOutputs), then closes the streams (their events destroyed, the streams retired)."""
        self.synchronize()
        if self.graphs is not None:
            self.graphs.clear()
        if self.streams is not None:
            outputs.drop_top_hosts()  # pinned buffers torch copied into on the stream go before the stream
            self._slot_staging = None
            self.streams.close()


class HostTimer:
    """The CPU's stand-in for a device Timing: the work ran when the block did."""

    def __init__(self):
        self._t0, self._ns = time.perf_counter_ns(), None

    def stop(self) -> None:
        self._ns = time.perf_counter_ns() - self._t0

    def elapsed_ns(self) -> int:
        return self._ns if self._ns is not None else time.perf_counter_ns() - self._t0
