"""GenerateStreams: the Generate calls' sequences, which the EngineRunner decodes itself, batching every streaming
sequence into one step so that concurrent Generate calls (of ModelWorker and of the gateway service) share steps.

A stream is allocated and prefilled with the others that start while its prefill call waits in the runner's queue
(one engine call, as a router batches the prompts it admits together), then joins the next decode step; up to
config.max_steps_in_flight steps are launched at once. A stream whose caller, once reading, is behind
(MAX_UNSENT_TOKENS of its tokens untaken) sits out the steps for a while (MAX_HOLD_S), so the event loop's time goes
to sending tokens rather than to ever smaller steps of the streams that are ahead. A structured-output stream (a
constraint: its grammar's state, worker/structured_output.py) has one step in flight at most: the runner advances its
grammar by each token and sets the next token's mask before the step that samples it. The streams' token metrics
(time to first token, inter-token gaps, tokens) are recorded here, one record per step for all of them as for a
Decode, not by each call's handler per token: on the event loop that also launches the steps, a record per token of
every stream costs as much as the rest of the handler's work for that token. Event-loop only, like the runner."""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from engine import api
from engine.decode import PendingStep
from engine.engine import Engine
from engine.errors import EngineError, ResourceExhausted
from worker.errors import Unavailable

if TYPE_CHECKING:
    from worker.metrics import Metrics
    from worker.runner import EngineRunner

log = logging.getLogger(__name__)


# A stream whose caller has not yet taken this many of its tokens sits out the next steps: the host's time goes to
# sending what the running streams have (each token a message written on the event loop) rather than to steps
# that only pile up more, and the steps stay wide instead of running ever smaller batches of the streams that
# are ahead.
MAX_UNSENT_TOKENS = 4
# ... for at most this long: a caller that stops reading (without going away) must not hold its sequence's slot and
# KV blocks for good; past it the stream runs to its end, its tokens waiting in its queue.
MAX_HOLD_S = 2.0
# A start the engine has no slot or KV blocks for now, though it fits once live sequences end (ResourceExhausted
# with `busy`), waits, as vLLM's waiting requests do, instead of failing: the waiting starts are retried first, in
# arrival order, whenever a stream ends and every RETRY_WAITING_S (for sequences other callers release).
RETRY_WAITING_S = 0.05
_WAIT = object()  # _start_streams' outcome of a start that waits for room


class _TokenQueue(asyncio.Queue):
    """A stream's queue of tokens; each take tells the decode loop (a held-back stream may go on). `read`: its
    caller has begun taking (until then it is not held back: the choices of an n > 1 call are read once all have
    started, so the started ones run on and free their slots for those that wait for room)."""

    def __init__(self, on_take: Callable[[], None]):
        super().__init__()
        self._on_take = on_take
        self.read = False

    def _get(self):  # asyncio.Queue's hook for subclasses: every get() and get_nowait() takes through it
        item = super()._get()
        self.read = True
        self._on_take()
        return item


@dataclass
class _Start:
    """A Generate stream waiting for its sequence: allocated and prefilled with the others waiting then."""

    prompt: list[int]
    alloc: Callable[[Engine], api.AllocResult]
    first: asyncio.Future  # its first TokenResult, or the exception that refused it
    reserve: int = 0  # the tokens alloc reserves (0: unknown), checked against the whole KV cache behind a waiting one


@dataclass
class _Stream:
    """A Generate stream's sequence, decoded by the runner itself."""

    seq_id: int
    out: _TokenQueue  # TokenResult, then None at the end (or an exception)
    in_flight: int = 0  # launched decode steps that include it, not yet answered
    constraint: Any = None  # structured output (a worker/structured_output.Constraint): its grammar's state
    held_since: float | None = None  # monotonic time it was first held back for its caller (MAX_UNSENT_TOKENS)


def _runs_on(stream: _Stream, token: api.TokenResult) -> bool:
    """Whether the stream goes on after its new token (already on its queue): not when the token finished the
    sequence, nor when it completed a constrained stream's grammar while the sequence would run on (ignore_eos).
    A token the grammar refuses is a bug: the exception goes on the queue and the stream ends."""
    if token.finish_reason:
        return False
    if stream.constraint is None:
        return True
    if not stream.constraint.accept(token.token_id):
        stream.out.put_nowait(RuntimeError(f"sequence {stream.seq_id}: token {token.token_id} was sampled outside "
                                           f"its token mask"))
        return False
    return not stream.constraint.terminated


class GenerateStreams:
    def __init__(self, runner: "EngineRunner"):
        self.runner = runner
        self._streams: dict[int, _Stream] = {}
        self._starts: list[_Start] = []  # streams whose prefill call is queued, not started yet
        self._waiting: collections.deque[_Start] = collections.deque()  # refused for room for now, oldest first
        self._start_queued = False  # a call that takes the starts is queued and has not taken them yet
        self._queue_soon = False  # _queue_new_starts is scheduled on the loop
        # (call, its answer) of the start calls queued whose answer has not been applied yet, oldest first
        self._unanswered: collections.deque[tuple[asyncio.Future, Callable[[], None]]] = collections.deque()
        self._retry: asyncio.TimerHandle | None = None
        self._stream_task: asyncio.Task | None = None
        self._taken = asyncio.Event()  # a caller took tokens from its queue (a held-back stream may go on)
        self.metrics: Metrics | None = None  # where the streams' tokens are recorded (set by the Worker)

    async def start(self, prompt: list[int], alloc: Callable[[Engine], api.AllocResult],
                    constraint=None, started: float | None = None, reserve: int = 0) -> tuple[int, asyncio.Queue]:
        """Allocates (alloc(engine)) and prefills a sequence that the runner then decodes to its end; returns
        its id and the queue its tokens arrive on (None marks the end, an exception a failure). On failure
        nothing is left allocated. constraint: structured output's grammar state (worker/structured_output.py)
        for a sequence allocated with sampling.token_mask, whose alloc also set the first token's mask: the
        runner advances it by each token and sets the next mask before each step (one step in flight at most).
        started: time.perf_counter() when the caller's call came, for the time-to-first-token metric (None: none).
        When the engine has no slot or KV blocks for it now but would once live sequences end, it waits (in
        arrival order with the other waiting starts; the caller's deadline or going away ends the wait).
        reserve: the max_total_tokens alloc asks for: one that no wait would fit is refused at once (the
        ResourceExhausted error) even behind waiting starts.

        Streams that start while their prefill call waits in the queue (behind the steps in flight, or
        another call) share it: one engine call allocates them all and prefills them in one Engine.prefill,
        as a router batches the prompts it admits together, instead of one call (and one drain of the steps
        in flight) per stream. Cancelling it (the caller went away) drops a waiting start and releases a
        sequence started meanwhile."""
        out = _TokenQueue(self._taken.set)
        start = _Start(prompt, alloc, self.runner.loop.create_future(), reserve)
        self._starts.append(start)
        if not self._queue_soon:  # after the loop's ready callbacks: the starts made with this one join it
            self._queue_soon = True
            self.runner.loop.call_soon(self._queue_new_starts)
        first = await start.first
        out.put_nowait(first)
        if self.metrics is not None:
            self.metrics.observe_stream_first(first, started)
        stream = _Stream(first.seq_id, out, constraint=constraint)
        if not _runs_on(stream, first):
            seq_id = first.seq_id
            self._forget([seq_id])
            # shielded: a caller that goes away now (cancelling this) must not cancel the queued release
            await asyncio.shield(self.runner.run(lambda engine: engine.release([seq_id]) if seq_id in engine.sequences
                                                 else 0))
            out.put_nowait(None)
        else:
            self._streams[first.seq_id] = stream
            self._taken.set()  # a decode loop waiting on held-back streams takes this one at once
            if self._stream_task is None or self._stream_task.done():
                self._stream_task = self.runner.loop.create_task(self._decode())
        return first.seq_id, out

    async def stop(self, seq_id: int) -> None:
        """Ends a stream early (client gone, Abort, a stop string): its queue ends (None after the tokens already
        in it) and its sequence is released."""
        stream = self._streams.pop(seq_id, None)
        if stream is not None:
            stream.out.put_nowait(None)
            self._forget([seq_id])
            self._taken.set()  # the decode loop may have been waiting on this stream's caller
            await self.runner.run(lambda engine: engine.release([seq_id]) if seq_id in engine.sequences else 0)
            self._retry_waiting()

    def __len__(self) -> int:
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        """Starts waiting for a slot or KV blocks."""
        return sum(not s.first.done() for s in self._waiting)

    def refuse_waiting(self, error: Exception) -> None:
        """Fails the starts waiting for room (the worker drains: another worker should take them)."""
        while self._waiting:
            start = self._waiting.popleft()
            if not start.first.done():
                start.first.set_exception(error)

    def _queue_new_starts(self) -> None:
        """The new starts' engine call, queued once the loop has run what was ready when the first of them came:
        starts made together (the choices of an n > 1 call, calls that came in one read of the socket) share one
        call and one prefill, even when the runner would take a call at once (it is idle)."""
        self._queue_soon = False
        self._queue_starts()

    def _queue_starts(self) -> None:
        """Queues one engine call that allocates and prefills every start there is when it begins: the waiting
        ones first, then the new ones, in arrival order."""
        if self._start_queued:
            return
        self._start_queued = True
        taken: list[list[_Start]] = []

        def take() -> tuple:  # the starts there are now, less those whose caller went away meanwhile
            while self._unanswered and self._unanswered[0][0].done():  # calls that ran before this one: their
                self._unanswered[0][1]()  # waiting starts go ahead of newer ones (their callbacks have not run yet)
            self._start_queued = False
            taken.append([s for s in (*self._waiting, *self._starts) if not s.first.done()])
            self._waiting.clear()
            self._starts = []
            return (taken[0],)

        def answer(_=None) -> None:  # once: as the call's done callback, or earlier from the next call's take()
            if pending not in self._unanswered:
                return
            self._unanswered.remove(pending)
            starts = taken[0] if taken else take()[0]  # never started (the runner closed): fail them all
            error = future.exception() if not future.cancelled() else asyncio.CancelledError()
            for s, outcome in zip(starts, future.result() if error is None else [error] * len(starts)):
                if outcome is _WAIT:
                    if not s.first.done():
                        self._waiting.append(s)
                elif isinstance(outcome, BaseException):
                    if not s.first.done():
                        s.first.set_exception(outcome)
                elif s.first.done():  # its caller went away while it started: nobody decodes it
                    self.runner.loop.create_task(self.runner.run(lambda e, i=outcome.seq_id: e.release([i])))
                else:
                    s.first.set_result(outcome)
            if self._waiting and self._retry is None and not self.runner.closed:
                self._retry = self.runner.loop.call_later(RETRY_WAITING_S, self._retry_waiting)

        future = self.runner.call_prepared(_start_streams, take)
        pending = (future, answer)
        self._unanswered.append(pending)
        future.add_done_callback(answer)

    def _retry_waiting(self) -> None:
        """The waiting starts try again (room may have come: a stream ended, or RETRY_WAITING_S passed)."""
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        if self._waiting and not self.runner.closed:
            self._queue_starts()

    def _forget(self, seq_ids: list[int]) -> None:
        """Streams that ended: the metrics drop their last token's time (a finished token already did)."""
        if self.metrics is not None:
            self.metrics.forget(seq_ids)

    async def _decode(self) -> None:
        """Decode steps over every Generate stream, up to config.max_steps_in_flight of them launched at once (the
        next one queued on the device behind the running one, as a router keeps Decodes in flight). A stream
        joins the next step launched after its prefill; a step includes only sequences the steps ahead of it
        leave running by length; a step refused because one ahead ended a sequence by EOS or a stop token
        changes nothing (its sequences go into the next one). A finished stream's sequence is released."""
        engine = self.runner.engine
        depth = engine.config.max_steps_in_flight
        pending: collections.deque[tuple[list[_Stream], asyncio.Future]] = collections.deque()
        while not self.runner.closed and (self._streams or pending):
            self._fill(pending, depth)
            if not pending:
                if not self._streams:
                    break
                self._taken.clear()  # every stream is held back: wait for a caller to take its tokens
                try:
                    await asyncio.wait_for(self._taken.wait(), MAX_HOLD_S)
                except asyncio.TimeoutError:
                    pass  # a stream held for MAX_HOLD_S goes on
                continue
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
                self._forget(ids)
                await self.runner.run(lambda e_: e_.release([i for i in ids if i in e_.sequences]))
                self._retry_waiting()
                continue
            finally:
                for s in streams:
                    s.in_flight -= 1
            # The next step goes to the device before this one's tokens go out: handing them to the streams wakes
            # every handler, and their writes would otherwise run on the loop while the device drains the step
            # left in flight. Constrained streams wait for their grammar to take the token (the top of the loop).
            if not self.runner.closed:
                self._fill(pending, depth, constrained=False)
            finished, delivered = [], []
            for s, tok in zip(streams, result.tokens if result is not None else ()):
                if self._streams.get(s.seq_id) is not s:
                    continue  # stopped while the step ran (stop() released it)
                s.out.put_nowait(tok)
                delivered.append(tok)
                if not _runs_on(s, tok):
                    del self._streams[s.seq_id]
                    s.out.put_nowait(None)
                    finished.append(s.seq_id)
            if self.metrics is not None and delivered:
                self.metrics.observe_stream_step(delivered)
            if finished:
                self._forget(finished)
                await self.runner.run(lambda e: e.release([i for i in finished if i in e.sequences]))
                self._retry_waiting()
            # A step answered at once (a CPU step is done when launched) leaves every await above without a
            # suspension: yield, so the streams' handlers send their tokens and other calls get served.
            await asyncio.sleep(0)

    def _fill(self, pending: collections.deque, depth: int, constrained: bool = True) -> None:
        """Launches steps over the launchable streams until `depth` are in flight (constrained=False: leaving out
        the streams with a grammar)."""
        while len(pending) < depth:
            streams = self._launchable(constrained)
            if not streams:
                return
            ids = [s.seq_id for s in streams]
            for s in streams:
                s.in_flight += 1
            masked = [s for s in streams if s.constraint is not None]
            pending.append((streams, self.runner.submit_step(_launch_streams, ids, masked)))

    def _launchable(self, constrained: bool = True) -> list[_Stream]:
        """The streams (at most max_batch_size) whose sequence is still running after the steps already launched
        with it: one more step will not pass its reservation or max_new_tokens."""
        engine, out = self.runner.engine, []
        for s in self._streams.values():
            if s.constraint is not None and not constrained:
                continue
            seq = engine.sequences[s.seq_id] if s.seq_id in engine.sequences else None
            if seq is None or seq.finished:
                continue
            limit = seq.capacity
            if seq.stopping.max_new_tokens:
                limit = min(limit, seq.prompt_len + seq.stopping.max_new_tokens)
            if s.constraint is not None and s.in_flight:
                continue  # its next token's mask waits for the token the step in flight samples
            if s.out.read and s.out.qsize() >= MAX_UNSENT_TOKENS:  # its caller is behind: held back until it takes ...
                now = time.monotonic()
                s.held_since = s.held_since or now
                if now - s.held_since < MAX_HOLD_S:  # ... or for MAX_HOLD_S
                    continue
            else:
                s.held_since = None
            if seq.seq_len + s.in_flight < limit:
                out.append(s)
                if len(out) == engine.config.max_batch_size:
                    break
        return out

    def close(self) -> None:
        """Ends every stream (the runner shuts down; its steps have finished)."""
        for stream in self._streams.values():
            stream.out.put_nowait(None)
        self._forget(list(self._streams))
        self._streams.clear()
        self.refuse_waiting(Unavailable("the worker is shutting down; send the request to another worker"))
        if self._retry is not None:
            self._retry.cancel()
        if self._stream_task is not None:
            self._stream_task.cancel()


def _launch_streams(engine: Engine, ids: list[int], masked: list[_Stream]) -> PendingStep:
    """A decode step of the Generate streams `ids`; the constrained ones (`masked`) get their next token's mask."""
    for s in masked:
        engine.set_token_mask(s.seq_id, s.constraint.mask())
    return engine.decode_launch(ids)


def _start_streams(engine: Engine, starts: list[_Start]) -> list:
    """On the engine thread: allocates each start's sequence and prefills them together, max_batch_size to an
    Engine.prefill. Returns one outcome per start, its first TokenResult, the exception that refused it (a
    refused start leaves nothing allocated), or _WAIT from the first start the engine has no room for now on.
    Engine.prefill checks every item before it changes anything, so when one prompt is refused the others of its
    call are prefilled one by one and only that one fails."""
    outcomes: list = [None] * len(starts)
    allocated: list[tuple[int, int]] = []  # (index into starts, sequence id)
    waiting = False  # a start found no room: the later ones that wait queue behind it, in order
    for i, s in enumerate(starts):
        if waiting:
            try:
                engine.check_fits(s.reserve)
                outcomes[i] = _WAIT
            except ResourceExhausted as e:  # no wait would fit it
                outcomes[i] = e
            continue
        try:
            allocated.append((i, s.alloc(engine).seq_id))
        except ResourceExhausted as e:
            waiting = waiting or e.busy
            outcomes[i] = _WAIT if e.busy else e
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
