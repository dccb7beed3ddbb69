"""EngineRunner: the one thread that owns the engine.

RPC handlers hand it closures (`await runner.call(fn)`); it runs them one at a time, in arrival order.
A Decode is a launch (`await runner.step(fn)`, fn returning Engine.decode_launch's step): the runner
answers it once the engine finished the step, and meanwhile takes the next calls, so a router that
keeps several Decodes in flight has the next step queued on the device while the host commits, replies
to and receives the steps around it. While no call waits and a step is queued behind the oldest, the
runner waits for the oldest itself; with one step in flight it sleeps on its queue (a Decode that comes
is launched at once) and a helper thread waits for that step's device work and wakes it.

Between calls it also runs the worker's own decode steps for Generate streams, batching every
streaming sequence into one Decode, so concurrent Generate calls share steps.

A call is either run fully or not at all: one cancelled before it starts is skipped, and one that has
started runs to the end (its result is dropped)."""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from engine import api
from engine.engine import Engine, PendingStep

_WAKE = object()  # put on the work queue when a step's device work has ended

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    """A Generate stream's sequence, decoded by the runner itself."""

    seq_id: int
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue  # TokenResult, then None at the end (or an exception)


class EngineRunner:
    def __init__(self, make_engine: Callable[[], Engine]):
        self._work: queue.Queue = queue.Queue()
        self._streams: dict[int, _Stream] = {}
        # Launched steps, oldest first: (future, step, monotonic start of its launch, its times list or None).
        self._in_flight: collections.deque[tuple[concurrent.futures.Future, PendingStep, float, list | None]] = \
            collections.deque()
        self._waiter = _DeviceWaiter(self._work)
        self._stopping = False
        self.step_started: float | None = None  # monotonic start of the call now running, None when idle
        self.steps = 0
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._main, args=(make_engine, ready), name="engine", daemon=True)
        self._thread.start()
        try:
            self.engine: Engine = ready.result()
        except BaseException:
            self._waiter.stop()
            raise

    # ------------------------------------------------------------------ event-loop side

    async def call(self, fn: Callable[..., Any], *args) -> Any:
        """Runs fn(engine, *args) on the engine thread and returns its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._work.put((fut, fn, args, False, None))
        return await asyncio.wrap_future(fut)

    async def step(self, fn: Callable[..., PendingStep], *args, times: list | None = None) -> api.StepResult:
        """Runs fn(engine, *args), which launches a decode step, on the engine thread, and returns the
        step's result once the engine has finished it (other calls run in between). With a `times`
        list, the engine thread appends time.monotonic_ns() when the step was launched, when its
        answer began (Engine.finish called) and when the result was ready."""
        return await self.submit_step(fn, *args, times=times)

    def submit_step(self, fn: Callable[..., PendingStep], *args, times: list | None = None) -> asyncio.Future:
        """step() without awaiting it: the step is queued for the engine thread now, so steps submitted
        one after another launch in that order; the returned future (of the running event loop) is the
        step's result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._work.put((fut, fn, args, True, times))
        return asyncio.wrap_future(fut)

    @property
    def busy_since(self) -> float | None:
        """Monotonic start of the call running now, else of the oldest step in flight; None when idle."""
        started = self.step_started
        if started is None and self._in_flight:
            started = self._in_flight[0][2]
        return started

    async def start_stream(self, prompt: list[int],
                           alloc: Callable[[Engine], api.AllocResult]) -> tuple[int, asyncio.Queue]:
        """Allocates (alloc(engine)) and prefills a sequence that the runner then decodes to its end;
        returns its id and the queue its tokens arrive on (None marks the end, an exception a failure).
        On failure nothing is left allocated."""
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()

        def begin(engine: Engine) -> int:
            seq_id = alloc(engine).seq_id
            try:
                first = engine.prefill([api.PrefillItem(seq_id, prompt)]).tokens[0]
            except BaseException:
                engine.release([seq_id])
                raise
            loop.call_soon_threadsafe(out.put_nowait, first)
            if first.finish_reason:
                engine.release([seq_id])
                loop.call_soon_threadsafe(out.put_nowait, None)
            else:
                self._streams[seq_id] = _Stream(seq_id, loop, out)
            return seq_id

        return await self.call(begin), out

    async def stop_stream(self, seq_id: int) -> None:
        """Ends a stream early (client gone): its sequence is released."""
        def stop(engine: Engine) -> None:
            if self._streams.pop(seq_id, None) is not None:
                engine.release([seq_id])
        await self.call(stop)

    def shutdown(self) -> None:
        self._stopping = True
        self._work.put(None)
        self._thread.join(timeout=30)
        self._waiter.stop()

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    # ------------------------------------------------------------------ engine thread

    def _main(self, make_engine: Callable[[], Engine], ready: concurrent.futures.Future) -> None:
        try:
            engine = make_engine()
        except BaseException as e:  # start-up failure: reported to the constructor's caller
            ready.set_exception(e)
            return
        ready.set_result(engine)
        while not self._stopping:
            # Run every call waiting now (in order), answer the steps that have finished, then one decode
            # step of the Generate streams; with no stream, sleep until a call comes or a step ends.
            if len(self._in_flight) > 1 and self._work.empty() and not self._streams:
                # A step is queued on the device behind the oldest: waiting for the oldest here leaves
                # the device busy, and answers it without the waiter thread's hop.
                self._answer_steps(engine, wait_for=1)
                continue
            if self._in_flight and not self._streams:
                self._waiter.watch(self._in_flight[0][1])
            pending = max(1, self._work.qsize()) if not self._streams else self._work.qsize()
            for _ in range(pending):
                item = self._work.get()
                if item is None:
                    self._stopping = True
                    break
                if item is not _WAKE:
                    self._run(engine, *item)
            self._answer_steps(engine)
            if self._streams and not self._stopping:
                self._stream_step(engine)
                self._answer_steps(engine)
        self._answer_steps(engine, wait_for=len(self._in_flight))
        for stream in self._streams.values():
            stream.loop.call_soon_threadsafe(stream.out.put_nowait, None)
        engine.close()

    def _run(self, engine: Engine, fut: concurrent.futures.Future, fn: Callable, args: tuple, step: bool,
             times: list | None) -> None:
        if not fut.set_running_or_notify_cancel():
            return  # cancelled before it started: skipped entirely
        self.step_started = time.monotonic()
        try:
            result = fn(engine, *args)
        except BaseException as e:
            self._answer_steps(engine)  # steps the call finished first answer first
            fut.set_exception(e)
        else:
            if step:
                if times is not None:
                    times.append(time.monotonic_ns())
                self._in_flight.append((fut, result, self.step_started, times))
            self._answer_steps(engine)  # steps the call finished (a launch may finish the oldest) answer now
            if not step:
                fut.set_result(result)
        finally:
            self.step_started = None
            self.steps += 1

    def _answer_steps(self, engine: Engine, wait_for: int = 0) -> None:
        """Answers the launched steps that are done or whose device work has ended, oldest first; the
        oldest `wait_for` of them are waited for."""
        while self._in_flight:
            fut, step, _, times = self._in_flight[0]
            if wait_for <= 0 and not engine.step_ready(step):
                return
            wait_for -= 1
            self._in_flight.popleft()
            try:
                if times is not None:
                    times.append(time.monotonic_ns())
                result = engine.finish(step)
                if times is not None:
                    times.append(time.monotonic_ns())
                fut.set_result(result)
            except BaseException as e:
                fut.set_exception(e)

    def _stream_step(self, engine: Engine) -> None:
        """One decode step over every Generate stream; finished ones are released."""
        streams = list(self._streams.values())[:engine.config.max_batch_size]
        self.step_started = time.monotonic()
        try:
            result = engine.decode([s.seq_id for s in streams])
        except BaseException as e:
            log.exception("decode step of %d Generate streams failed", len(streams))
            for s in streams:
                self._streams.pop(s.seq_id, None)
                s.loop.call_soon_threadsafe(s.out.put_nowait, e)
            engine.release([s.seq_id for s in streams if s.seq_id in engine.sequences])
            return
        finally:
            self.step_started = None
            self.steps += 1
        for s, tok in zip(streams, result.tokens):
            s.loop.call_soon_threadsafe(s.out.put_nowait, tok)
            if tok.finish_reason:
                del self._streams[s.seq_id]
                engine.release([s.seq_id])
                s.loop.call_soon_threadsafe(s.out.put_nowait, None)


class _DeviceWaiter:
    """A helper thread that waits (the GIL released) for the device work of a step the runner watches,
    on an event of that launch alone (PendingStep.wait_device), then wakes the runner through its work
    queue. A stale wake-up is harmless: the runner only looks at which steps are ready."""

    def __init__(self, work: queue.Queue):
        self._work = work
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._watched = None
        self._thread = threading.Thread(target=self._main, name="engine-waiter", daemon=True)
        self._thread.start()

    def watch(self, step: PendingStep) -> None:
        """Wakes the runner when step's current device work ends (once per launch of it)."""
        launch = step.done_event if step.done_event is not None else step.timer  # one object per launch
        if step.done or launch is self._watched:
            return
        self._watched = launch
        self._jobs.put(step)

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5)

    def _main(self) -> None:
        while (step := self._jobs.get()) is not None:
            try:
                step.wait_device()
            except Exception:  # noqa: BLE001 - the engine reports device errors when it finishes the step
                log.debug("waiting for a step's device work failed", exc_info=True)
            self._work.put(_WAKE)
