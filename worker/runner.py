"""EngineRunner: owns the engine for the gRPC layer, on the server's event loop.

Every engine call goes through one FIFO queue, and exactly one runs at a time:
- a decode step (`await runner.step(fn)` or `runner.submit_step(fn)`, fn returning Engine.decode_launch's
  step) is launched on the event loop's own thread, with no hop to another thread. The runner finishes
  (commits) each step as soon as its device work has ended, whether or not its caller still waits, and
  answers its future; meanwhile it takes the next calls, so a router that keeps several Decodes in flight
  has the next step queued on the device while the host commits, replies to and receives the steps around
  it. Up to config.max_steps_in_flight steps are queued; a step beyond that waits (the loop stays free) for
  the oldest one's device work, which a helper thread watches and reports to the loop;
- a short call (`await runner.run(fn)`: alloc, release, a stream's stop) runs inline on the loop;
- a long call (`await runner.call(fn)`: prefill, verify, warm-up, anything that may take a while) runs on
  the engine thread while the loop keeps answering health checks and queueing calls behind it.
A call cancelled before it starts (its deadline passed, the client went away) is skipped entirely; one that
has started runs to its end (its result is dropped).
After a call that completed prompts, the runner queues Engine.register_prompts behind the calls already waiting,
from a later loop callback than the one that answers the call: the prompts' blocks are hashed and cached (and their
KV events go out) once the reply is on its way, instead of before it, REGISTER_BLOCKS_PER_CALL blocks a call.

The runner also decodes the Generate streams itself (`runner.streams`, worker/generate_streams.py), batching
every streaming sequence into one step, so concurrent Generate calls share steps."""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from engine import api, env
from engine.engine import Engine
from engine.decode import PendingStep
from worker.generate_streams import GenerateStreams

log = logging.getLogger(__name__)

_STEP, _INLINE, _THREAD = "step", "inline", "thread"
# Blocks a queued Engine.register_prompts call registers at most (~1 ms of host time on the dev box); a longer
# prompt's rest goes in later calls, between the steps.
REGISTER_BLOCKS_PER_CALL = 256


@dataclass
class _Work:
    kind: str  # _STEP, _INLINE or _THREAD
    fn: Callable
    args: tuple
    future: asyncio.Future
    times: list | None = None  # a step's CLOCK_MONOTONIC stamps (see step())
    prepare: Callable[[], tuple] | None = None  # makes args on the loop's thread just before the call starts


@dataclass
class _Launched:
    future: asyncio.Future
    step: PendingStep
    started: float  # monotonic time of its launch
    times: list | None


class EngineRunner:
    def __init__(self, engine: Engine, thread: concurrent.futures.ThreadPoolExecutor):
        """Use EngineRunner.start(): it builds the engine on the engine thread."""
        self.engine = engine
        self._thread = thread
        self._loop = asyncio.get_running_loop()
        self._queue: collections.deque[_Work] = collections.deque()
        self._in_flight: collections.deque[_Launched] = collections.deque()  # launched, oldest first
        self._busy_since: float | None = None  # monotonic start of the call running on the engine thread
        self._waiter = _DeviceWaiter(self._loop, self._pump)
        self._poll_steps = env.STEP_WAIT == "poll" and engine.device.type == "cuda"  # (a CPU step ends at launch)
        self._polling = False
        self._closed = False
        self._registration_queued = False  # an Engine.register_prompts call is on its way into the queue
        self.steps = 0  # engine calls run (steps, short and long calls)
        self.forward_steps = 0  # decode steps and long calls (prefill, verify, ...) started: what a profile counts
        self.step_listeners: list[Callable[[], None]] = []  # called on the loop as each of those starts
        self.streams = GenerateStreams(self)  # the Generate calls' sequences, decoded by the runner itself
        engine.runtime.dispatch.bind_thread()  # driver calls (graph replays) from the loop's thread need the context

    @classmethod
    async def start(cls, make_engine: Callable[[], Engine]) -> "EngineRunner":
        """Builds the engine on a new engine thread (the event loop keeps serving meanwhile)."""
        thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine")
        try:
            engine = await asyncio.get_running_loop().run_in_executor(thread, make_engine)
        except BaseException:
            thread.shutdown(wait=False)
            raise
        return cls(engine, thread)

    # ------------------------------------------------------------------ calls

    async def step(self, fn: Callable[..., PendingStep], *args, times: list | None = None) -> api.StepResult:
        """Launches a decode step (fn(engine, *args) returns Engine.decode_launch's step) and returns its result
        once the runner has finished it. With a `times` list, appends time.monotonic_ns() when the step was
        launched, when its answer began and when its result was ready."""
        return await self.submit_step(fn, *args, times=times)

    def submit_step(self, fn: Callable[..., PendingStep], *args, times: list | None = None) -> asyncio.Future:
        """step() without awaiting it: steps submitted one after another launch in that order (call it on the
        event loop)."""
        return self._submit(_STEP, fn, args, times)

    async def run(self, fn: Callable[..., Any], *args) -> Any:
        """fn(engine, *args) on the event loop, in its turn: for short calls only (it holds the loop)."""
        return await self._submit(_INLINE, fn, args)

    async def call(self, fn: Callable[..., Any], *args) -> Any:
        """fn(engine, *args) on the engine thread, in its turn (the loop keeps serving meanwhile)."""
        return await self._submit(_THREAD, fn, args)

    def call_prepared(self, fn: Callable[..., Any], prepare: Callable[[], tuple]) -> asyncio.Future:
        """call(), with fn's arguments made by prepare() on the loop just before it starts (what has gathered in
        the queue meanwhile)."""
        return self._submit(_THREAD, fn, (), prepare=prepare)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    @property
    def closed(self) -> bool:
        """shutdown() has begun: no call is taken any more."""
        return self._closed

    def _submit(self, kind: str, fn: Callable, args: tuple, times: list | None = None,
                prepare: Callable[[], tuple] | None = None) -> asyncio.Future:
        future = self._loop.create_future()
        if self._closed:
            future.set_exception(RuntimeError("the engine runner has shut down"))
            return future
        self._queue.append(_Work(kind, fn, args, future, times, prepare))
        if self._busy_since is None:
            self._pump()
        return future

    @property
    def busy_since(self) -> float | None:
        """Monotonic start of the call running on the engine thread, else the launch of the oldest step in
        flight; None when idle (the step watchdog)."""
        if self._busy_since is not None:
            return self._busy_since
        return self._in_flight[0].started if self._in_flight else None

    # ------------------------------------------------------------------ the queue

    def _pump(self) -> None:
        """Runs on the loop whenever something changed (a call came, a call on the engine thread ended, a
        step's device work ended): answers the finished steps, then starts queued calls in order until one
        must wait (the engine thread is busy, or the steps in flight are at their limit)."""
        if self._busy_since is not None:
            return
        engine = self.engine
        self._answer_steps()
        while self._queue:
            work = self._queue[0]
            if work.future.done():  # cancelled before it started: skipped entirely
                self._queue.popleft()
                continue
            if work.kind == _STEP and engine.num_in_flight >= engine.config.max_steps_in_flight:
                self._watch(self._in_flight[0].step if self._in_flight else None)
                return
            self._queue.popleft()
            if work.prepare is not None:
                work.args = work.prepare()
            if work.kind == _THREAD:
                self._start_thread_call(work)
                return
            self._run_inline(work)
            self._answer_steps()
        if self._in_flight:
            self._watch(self._in_flight[0].step)

    def _watch(self, step: PendingStep | None) -> None:
        """Has _pump run again once step's device work has ended: through the waiter thread, or
        (METRALE_STEP_WAIT=poll) by querying it from the loop between the loop's other callbacks."""
        if not self._poll_steps:
            self._waiter.watch(step)
        elif step is not None and not self._polling:
            self._polling = True
            self._loop.call_soon(self._poll)

    def _forward_started(self) -> None:
        self.forward_steps += 1
        for listener in self.step_listeners:
            listener()

    def _poll(self) -> None:
        self._polling = False
        if self._closed or (self._in_flight and not self.engine.step_ready(self._in_flight[0].step)):
            if not self._closed:
                self._polling = True
                self._loop.call_soon(self._poll)  # the loop runs its ready I/O (select, timeout 0) in between
            return
        self._pump()

    def _run_inline(self, work: _Work) -> None:
        self.steps += 1
        if work.kind == _STEP:
            self._forward_started()
        started = time.monotonic()
        try:
            result = work.fn(self.engine, *work.args)
        except BaseException as e:  # noqa: BLE001 - answered to its caller
            self._answer_steps()  # steps the call finished first answer first
            work.future.set_exception(e)
            return
        if work.kind == _STEP:
            if work.times is not None:
                work.times.append(time.monotonic_ns())
            self._in_flight.append(_Launched(work.future, result, started, work.times))
        else:
            work.future.set_result(result)
            self._register_later()

    def _start_thread_call(self, work: _Work) -> None:
        self.steps += 1
        self._forward_started()
        self._busy_since = time.monotonic()
        done = self._thread.submit(work.fn, self.engine, *work.args)

        def finished(_: concurrent.futures.Future) -> None:
            self._loop.call_soon_threadsafe(self._thread_call_done, work, done)

        done.add_done_callback(finished)

    def _thread_call_done(self, work: _Work, done: concurrent.futures.Future) -> None:
        self._busy_since = None
        self._answer_steps()  # steps the call finished (prefill and verify finish every step first)
        if not work.future.done():
            if done.exception() is not None:
                work.future.set_exception(done.exception())
            else:
                work.future.set_result(done.result())
        self._register_later()
        self._pump()

    def _register_later(self) -> None:
        """Queues Engine.register_prompts when a call left completed prompts unregistered, from the next loop
        callback: the caller's reply (its future's callbacks, scheduled when it was answered) goes first."""
        if self.engine.prefiller.num_unregistered and not self._registration_queued and not self._closed:
            self._registration_queued = True
            self._loop.call_soon(self._queue_registration)

    def _queue_registration(self) -> None:
        self._registration_queued = False
        if self._closed or not self.engine.prefiller.num_unregistered:
            return
        self._submit(_INLINE, Engine.register_prompts, (REGISTER_BLOCKS_PER_CALL,)).add_done_callback(_log_failure)

    def _answer_steps(self) -> None:
        """Finishes the launched steps whose device work has ended, oldest first, and answers them."""
        engine = self.engine
        while self._in_flight:
            launched = self._in_flight[0]
            if not engine.step_ready(launched.step):
                return
            self._in_flight.popleft()
            times = launched.times
            if times is not None:
                times.append(time.monotonic_ns())
            try:
                result = engine.finish(launched.step)
            except BaseException as e:  # noqa: BLE001 - refused (EngineError) or broken: answered to its caller
                if not launched.future.done():
                    launched.future.set_exception(e)
                continue
            if times is not None:
                times.append(time.monotonic_ns())
            if not launched.future.done():
                launched.future.set_result(result)

    # ------------------------------------------------------------------ shutdown

    async def shutdown(self) -> None:
        """Finishes the steps in flight, ends the Generate streams, closes the engine on its thread."""
        self._closed = True
        while self._busy_since is not None:
            await asyncio.sleep(0.01)
        for work in self._queue:
            if not work.future.done():
                work.future.set_exception(RuntimeError("the worker is shutting down"))
        self._queue.clear()
        while self._in_flight:
            self._in_flight[0].step.wait_device()
            self._answer_steps()
        self.streams.close()
        self._waiter.stop()
        await self._loop.run_in_executor(self._thread, self.engine.close)
        self._thread.shutdown(wait=True)


def _log_failure(future: asyncio.Future) -> None:
    """Done callback of a call nobody awaits: its failure is logged (and so retrieved)."""
    if not future.cancelled() and future.exception() is not None:
        log.error("engine call failed", exc_info=future.exception())


class _DeviceWaiter:
    """A helper thread that waits (the GIL released) for the device work of the step the runner watches, on an
    event of that launch alone (PendingStep.wait_device), then runs `wake` on the event loop. A stale wake-up
    is harmless: the runner only looks at which steps are ready."""

    def __init__(self, loop: asyncio.AbstractEventLoop, wake: Callable[[], None]):
        self._loop, self._wake = loop, wake
        self._jobs: collections.deque = collections.deque()
        self._ready = threading.Condition()
        self._watched = None
        self._stopped = False
        self._thread = threading.Thread(target=self._main, name="engine-waiter", daemon=True)
        self._thread.start()

    def watch(self, step: PendingStep | None) -> None:
        """Wakes the loop when step's current device work ends (once per launch of it)."""
        if step is None or step.done:
            return
        launch = step.done_event if step.done_event is not None else step.timer  # one object per launch
        if launch is self._watched:
            return
        self._watched = launch
        with self._ready:
            self._jobs.append(step)
            self._ready.notify()

    def stop(self) -> None:
        with self._ready:
            self._stopped = True
            self._ready.notify()
        self._thread.join(timeout=5)

    def _main(self) -> None:
        while True:
            with self._ready:
                while not self._jobs and not self._stopped:
                    self._ready.wait()
                if self._stopped:
                    return
                step = self._jobs.popleft()
            try:
                step.wait_device()
            except Exception:  # noqa: BLE001 - the engine reports device errors when it finishes the step
                log.debug("waiting for a step's device work failed", exc_info=True)
            try:
                self._loop.call_soon_threadsafe(self._wake)
            except RuntimeError:  # the loop closed
                return
