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

The runner also decodes the Generate streams itself, batching every streaming sequence into one step, so
concurrent Generate calls share steps."""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from engine import api
from engine.engine import Engine
from engine.decode import PendingStep
from engine.errors import EngineError

log = logging.getLogger(__name__)

_STEP, _INLINE, _THREAD = "step", "inline", "thread"


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


@dataclass
class _Start:
    """A Generate stream waiting for its sequence: allocated and prefilled with the others waiting then."""

    prompt: list[int]
    alloc: Callable[[Engine], api.AllocResult]
    first: asyncio.Future  # its first TokenResult, or the exception that refused it


@dataclass
class _Stream:
    """A Generate stream's sequence, decoded by the runner itself."""

    seq_id: int
    out: asyncio.Queue  # TokenResult, then None at the end (or an exception)
    in_flight: int = 0  # launched decode steps that include it, not yet answered


class EngineRunner:
    def __init__(self, engine: Engine, thread: concurrent.futures.ThreadPoolExecutor):
        """Use EngineRunner.start(): it builds the engine on the engine thread."""
        self.engine = engine
        self._thread = thread
        self._loop = asyncio.get_running_loop()
        self._queue: collections.deque[_Work] = collections.deque()
        self._in_flight: collections.deque[_Launched] = collections.deque()  # launched, oldest first
        self._busy_since: float | None = None  # monotonic start of the call running on the engine thread
        self._streams: dict[int, _Stream] = {}
        self._starts: list[_Start] = []  # Generate streams whose prefill call is queued, not started yet
        self._stream_task: asyncio.Task | None = None
        self._waiter = _DeviceWaiter(self._loop, self._pump)
        self._closed = False
        self.steps = 0  # engine calls run (steps, short and long calls)
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

    # ------------------------------------------------------------------ Generate streams

    async def start_stream(self, prompt: list[int],
                           alloc: Callable[[Engine], api.AllocResult]) -> tuple[int, asyncio.Queue]:
        """Allocates (alloc(engine)) and prefills a sequence that the runner then decodes to its end; returns
        its id and the queue its tokens arrive on (None marks the end, an exception a failure). On failure
        nothing is left allocated.

        Streams that start while their prefill call waits in the queue (behind the steps in flight, or
        another call) share it: one engine call allocates them all and prefills them in one Engine.prefill,
        as a router batches the prompts it admits together, instead of one call (and one drain of the steps
        in flight) per stream."""
        out: asyncio.Queue = asyncio.Queue()
        start = _Start(prompt, alloc, self._loop.create_future())
        self._starts.append(start)
        if len(self._starts) == 1:  # the first since the last batch was taken: queue the call that takes them
            taken: list[list[_Start]] = []

            def take() -> tuple:  # the streams waiting now, less those whose caller went away meanwhile
                taken.append([s for s in self._starts if not s.first.done()])
                self._starts = []
                return (taken[0],)

            def answer(batch: asyncio.Future) -> None:
                starts = taken[0] if taken else take()[0]  # never started (the runner closed): fail them all
                error = batch.exception() if not batch.cancelled() else asyncio.CancelledError()
                for s, outcome in zip(starts, batch.result() if error is None else [error] * len(starts)):
                    if isinstance(outcome, BaseException):
                        if not s.first.done():
                            s.first.set_exception(outcome)
                    elif s.first.done():  # its caller went away while it started: nobody decodes it
                        self._loop.create_task(self.run(lambda e, i=outcome.seq_id: e.release([i])))
                    else:
                        s.first.set_result(outcome)

            self._submit(_THREAD, _start_streams, (), prepare=take).add_done_callback(answer)
        first = await start.first
        out.put_nowait(first)
        if first.finish_reason:
            await self.run(lambda engine: engine.release([first.seq_id]))
            out.put_nowait(None)
        else:
            self._streams[first.seq_id] = _Stream(first.seq_id, out)
            if self._stream_task is None or self._stream_task.done():
                self._stream_task = self._loop.create_task(self._decode_streams())
        return first.seq_id, out

    async def stop_stream(self, seq_id: int) -> None:
        """Ends a stream early (client gone): its sequence is released."""
        if self._streams.pop(seq_id, None) is not None:
            await self.run(lambda engine: engine.release([seq_id]) if seq_id in engine.sequences else 0)

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    async def _decode_streams(self) -> None:
        """Decode steps over every Generate stream, up to config.max_steps_in_flight of them launched at once (the
        next one queued on the device behind the running one, as a router keeps Decodes in flight). A stream
        joins the next step launched after its prefill; a step includes only sequences the steps ahead of it
        leave running by length; a step refused because one ahead ended a sequence by EOS or a stop token
        changes nothing (its sequences go into the next one). A finished stream's sequence is released."""
        engine = self.engine
        depth = engine.config.max_steps_in_flight
        pending: collections.deque[tuple[list[_Stream], asyncio.Future]] = collections.deque()
        while not self._closed and (self._streams or pending):
            while len(pending) < depth:
                streams = self._launchable()
                if not streams:
                    break
                ids = [s.seq_id for s in streams]
                for s in streams:
                    s.in_flight += 1
                pending.append((streams, self.submit_step(lambda e, ids=ids: e.decode_launch(ids))))
            if not pending:
                break
            streams, future = pending.popleft()
            try:
                result = await future
            except EngineError:  # refused: an earlier step ended one of its sequences; the others roll back
                result = None
            except Exception as e:  # noqa: BLE001 - every stream of the step fails, the worker goes on
                log.exception("decode step of %d Generate streams failed", len(streams))
                ids = [s.seq_id for s in streams]
                for s in streams:
                    if self._streams.pop(s.seq_id, None) is not None:
                        s.out.put_nowait(e)
                await self.run(lambda e_: e_.release([i for i in ids if i in e_.sequences]))
                continue
            finally:
                for s in streams:
                    s.in_flight -= 1
            finished = []
            for s, tok in zip(streams, result.tokens if result is not None else ()):
                if self._streams.get(s.seq_id) is not s:
                    continue  # stopped while the step ran (stop_stream released it)
                s.out.put_nowait(tok)
                if tok.finish_reason:
                    del self._streams[s.seq_id]
                    s.out.put_nowait(None)
                    finished.append(s.seq_id)
            if finished:
                await self.run(lambda e: e.release([i for i in finished if i in e.sequences]))
            # A step answered at once (a CPU step is done when launched) leaves every await above without a
            # suspension: yield, so the streams' handlers send their tokens and other calls get served.
            await asyncio.sleep(0)

    def _launchable(self) -> list[_Stream]:
        """The streams (at most max_batch_size) whose sequence is still running after the steps already launched
        with it: one more step will not pass its reservation or max_new_tokens."""
        engine, out = self.engine, []
        for s in self._streams.values():
            seq = engine.sequences[s.seq_id] if s.seq_id in engine.sequences else None
            if seq is None or seq.finished:
                continue
            limit = seq.capacity
            if seq.stopping.max_new_tokens:
                limit = min(limit, seq.prompt_len + seq.stopping.max_new_tokens)
            if seq.seq_len + s.in_flight < limit:
                out.append(s)
                if len(out) == engine.config.max_batch_size:
                    break
        return out

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
                self._waiter.watch(self._in_flight[0].step if self._in_flight else None)
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
            self._waiter.watch(self._in_flight[0].step)

    def _run_inline(self, work: _Work) -> None:
        self.steps += 1
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

    def _start_thread_call(self, work: _Work) -> None:
        self.steps += 1
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
        self._pump()

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
        for stream in self._streams.values():
            stream.out.put_nowait(None)
        self._streams.clear()
        if self._stream_task is not None:
            self._stream_task.cancel()
        self._waiter.stop()
        await self._loop.run_in_executor(self._thread, self.engine.close)
        self._thread.shutdown(wait=True)


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


def _start_streams(engine: Engine, starts: list[_Start]) -> list:
    """On the engine thread: allocates each start's sequence and prefills them together, max_batch_size to an
    Engine.prefill. Returns one outcome per start, its first TokenResult or the exception that refused it (a
    refused start leaves nothing allocated). Engine.prefill checks every item before it changes anything, so
    when one prompt is refused the others of its call are prefilled one by one and only that one fails."""
    outcomes: list = [None] * len(starts)
    allocated: list[tuple[int, int]] = []  # (index into starts, sequence id)
    for i, s in enumerate(starts):
        try:
            allocated.append((i, s.alloc(engine).seq_id))
        except Exception as e:  # noqa: BLE001 - answered to that stream's caller
            outcomes[i] = e
    width = engine.config.max_batch_size  # the most sequences one Engine.prefill takes
    for group in (allocated[g:g + width] for g in range(0, len(allocated), width)):
        try:
            tokens = engine.prefill([api.PrefillItem(seq, starts[i].prompt) for i, seq in group]).tokens
        except EngineError:  # one prompt refused the call before it changed anything: each alone
            for i, seq in group:
                outcomes[i] = _start_one(engine, seq, starts[i].prompt)
            continue
        except Exception as e:  # noqa: BLE001 - a broken forward: this group's streams fail, nothing is left held
            engine.release([seq for _, seq in group if seq in engine.sequences])
            for i, _ in group:
                outcomes[i] = e
            continue
        for (i, _), token in zip(group, tokens):
            outcomes[i] = token
    return outcomes


def _start_one(engine: Engine, seq_id: int, prompt: list[int]):
    """One stream's prefill alone: its first TokenResult, or the exception (its sequence released)."""
    try:
        return engine.prefill([api.PrefillItem(seq_id, prompt)]).tokens[0]
    except Exception as e:  # noqa: BLE001 - answered to that stream's caller
        engine.release([seq_id])
        return e
