"""ModelWorker servicer: one method per RPC, each `validate -> engine call -> response`.

No model logic lives here. Engine errors map to status codes in worker/errors.py; anything else is a
bug: logged with the request id and answered INTERNAL, and the worker keeps serving."""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
import uuid

import grpc

from engine import api
from engine.engine import Engine
from engine.errors import EngineError, InvalidArgument, OutOfRange
from engine.kv_events import follow
from engine.sequence import FinishReason
from worker.aio import until_set
from engine.tokenizer import Tokenizer
from metrale.worker.v1 import worker_pb2 as pb
from metrale.worker.v1 import worker_pb2_grpc as pb_grpc
from worker import convert
from worker.errors import Unavailable, status_of
from worker.leases import Leases
from worker.metrics import Metrics
from worker.runner import EngineRunner
from worker.stop_strings import StopStringMatcher, StopTextBuffer, check_stops
from worker.structured_output import Constraint, Grammars, constraint_of

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ModelWorker"].full_name


def request_id_of(context: grpc.aio.ServicerContext, fallback: str = "") -> str:
    for key, value in context.invocation_metadata() or ():
        if key == "x-request-id":
            return value
    return fallback or uuid.uuid4().hex[:12]


STEP_TIMES_KEY = "x-step-times"  # request metadata asking Decode for its STEP_TIMES_KEY trailer (any value)


def wants_step_times(context: grpc.aio.ServicerContext) -> bool:
    return any(key == STEP_TIMES_KEY for key, _ in context.invocation_metadata() or ())


def client_of(context: grpc.aio.ServicerContext) -> str:
    """Who owns sequences for the per-client limit: x-client-id metadata, else the peer's address."""
    for key, value in context.invocation_metadata() or ():
        if key == "x-client-id":
            return value
    peer = context.peer() or ""
    return peer.rsplit(":", 1)[0] if peer.count(":") > 1 else peer


def rpc(method):
    """Maps EngineError to its status code and any other exception to INTERNAL (logged with the
    request id); records the call for the metrics (one append)."""
    name = method.__name__
    OK, CANCELLED, INTERNAL = grpc.StatusCode.OK, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL

    @functools.wraps(method)
    async def wrapper(self: "ModelWorkerServicer", request, context: grpc.aio.ServicerContext):
        started, code = time.perf_counter(), CANCELLED  # CANCELLED unless the call ends below
        try:
            if self.runner is None:
                raise Unavailable("the model is still loading; retry shortly")
            response = await method(self, request, context)
            code = OK
            return response
        except EngineError as e:
            code = status_of(e)
            await context.abort(code, str(e))
        except Exception:
            code = INTERNAL
            rid = request_id_of(context)
            log.exception("%s failed (request id %s)", name, rid)
            await context.abort(code, f"internal error in {name} (request id {rid}); see the worker log")
        finally:
            self.metrics.record_call(name, code, started)
    return wrapper


class ModelWorkerServicer(pb_grpc.ModelWorkerServicer):
    def __init__(self, runner: EngineRunner | None, leases: Leases, metrics: Metrics):
        self.runner = runner
        self.leases = leases
        self.metrics = metrics
        # The checkpoint's tokenizer, for Generate's text and chat prompts and Info (set once with the
        # runner by worker/server.py; None when the checkpoint has none). Never on the token-id path.
        self.tokenizer: Tokenizer | None = None
        self.grammars: Grammars | None = None  # structured output (set with the tokenizer)
        self.draining = False
        self._background: set[asyncio.Task] = set()
        self._decode_streams: set[asyncio.Queue] = set()  # the step queue of each open DecodeStream
        self._streams_ended = asyncio.Event()  # set at the end of a drain: KV event subscriptions end

    @rpc
    async def AllocSequence(self, request: pb.AllocSequenceRequest, context) -> pb.AllocSequenceResponse:
        if self.draining:
            raise Unavailable("the worker is draining (shutting down); allocate on another worker")
        sampling = convert.sampling_params(request.sampling)
        stopping = convert.stopping_criteria(request.stopping)
        client = client_of(context)
        request_id = request.request_id or request_id_of(context)

        def alloc(engine: Engine) -> api.AllocResult:
            self.leases.check_can_add(client)
            result = engine.alloc_sequence(request.max_total_tokens, sampling, stopping, request_id)
            self.leases.add(result.seq_id, client)
            return result

        return convert.alloc_response(await self.runner.run(alloc))

    @rpc
    async def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillResponse:
        items = convert.prefill_items(request)
        started = time.perf_counter()
        result = await self.runner.call(lambda e: self._touching(e.prefill(items), [i.seq_id for i in items]))
        self.metrics.observe_step("prefill", result, started)
        return convert.prefill_response(result)

    @rpc
    async def Decode(self, request: pb.DecodeRequest, context) -> pb.DecodeResponse:
        # Where the call's time goes: CLOCK_MONOTONIC ns when it reached the handler, its step was launched,
        # the step's answer began, its result was ready, and the response was built. Exported as
        # metrale_decode_stage_seconds, and sent back to a router that asks (x-step-times request metadata).
        times = [time.monotonic_ns()]
        ids = list(request.sequence_ids)
        override = list(request.input_token_ids) or None
        result = await self.runner.step(functools.partial(self._launch_touching, ids, override), times=times)
        self.metrics.observe_step("decode", result)
        response = convert.decode_response(result)
        times.append(time.monotonic_ns())
        self.metrics.observe_decode_stages(times)
        if wants_step_times(context):
            context.set_trailing_metadata(((STEP_TIMES_KEY, ",".join(map(str, times))),))
        return response

    async def DecodeStream(self, requests, context):
        """Decode steps over one stream: each request is launched as it arrives (queued behind the steps
        before it, like a Decode call), and answered in request order; a refused step is answered with
        its status and the stream goes on."""
        with self.metrics.rpc("DecodeStream") as call:
            if self.runner is None:
                call.code = grpc.StatusCode.UNAVAILABLE
                await context.abort(call.code, "the model is still loading; retry shortly")
            steps: asyncio.Queue = asyncio.Queue()  # (stamps, result future) per request, in order; None ends
            self._decode_streams.add(steps)
            reader = asyncio.get_running_loop().create_task(self._launch_stream_steps(requests, steps))
            step_times = wants_step_times(context)
            try:
                while (item := await steps.get()) is not None:
                    yield await self._stream_step_answer(*item, step_times)
            except Exception:
                call.code = grpc.StatusCode.INTERNAL
                rid = request_id_of(context)
                log.exception("DecodeStream failed (request id %s)", rid)
                await context.abort(call.code, f"internal error in DecodeStream (request id {rid}); see the worker log")
            finally:
                self._decode_streams.discard(steps)
                reader.cancel()
                while not steps.empty():  # steps never answered (the client went away): skipped if not started
                    item = steps.get_nowait()
                    if item is not None:
                        item[1].cancel()

    async def _launch_stream_steps(self, requests, steps: asyncio.Queue) -> None:
        """A DecodeStream's reader: submits each request's step to the engine thread as it arrives."""
        try:
            async for request in requests:
                times = [time.monotonic_ns()]
                ids = list(request.sequence_ids)
                override = list(request.input_token_ids) or None
                launch = functools.partial(self._launch_touching, ids, override)
                steps.put_nowait((times, self.runner.submit_step(launch, times=times)))
        except Exception:  # noqa: BLE001 - the call broke off (the client went away): the handler ends it
            log.debug("DecodeStream's request stream ended with an error", exc_info=True)
        finally:
            steps.put_nowait(None)

    async def _stream_step_answer(self, times: list[int], result: asyncio.Future,
                                  step_times: bool) -> pb.DecodeStreamResponse:
        try:
            step = await result
        except EngineError as e:
            code = status_of(e)
            self.metrics.stream_step(code)
            return convert.step_error(code.value[0], str(e))
        self.metrics.stream_step(grpc.StatusCode.OK)
        self.metrics.observe_step("decode", step)
        response = convert.decode_stream_response(step)
        times.append(time.monotonic_ns())
        self.metrics.observe_decode_stages(times)
        if step_times:
            response.step_times_ns.extend(times)
        return response

    def end_streams(self) -> None:
        """Ends every open DecodeStream once the steps it was sent are answered, and every KV event
        subscription (the end of a drain)."""
        for steps in self._decode_streams:
            steps.put_nowait(None)
        self._streams_ended.set()

    def _launch_touching(self, ids: list[int], override: list[int] | None, engine: Engine):
        """On the engine thread: launches a decode step of ids (Decode, DecodeStream) and touches their leases."""
        return self._touching(engine.decode_launch(ids, override), ids)

    @rpc
    async def Verify(self, request: pb.VerifyRequest, context) -> pb.VerifyResponse:
        items = convert.verify_items(request)
        result = await self.runner.call(lambda e: self._touching(e.verify(items), [i.seq_id for i in items]))
        self.metrics.observe_verify(result)
        return convert.verify_response(result)

    @rpc
    async def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseResponse:
        ids = list(request.sequence_ids)

        def release(engine: Engine) -> int:
            released = engine.release(ids)
            self.leases.remove(ids)
            return released

        released = await self.runner.run(release)
        self.metrics.forget(ids)
        return pb.ReleaseResponse(released=released)

    @rpc
    async def Info(self, request: pb.InfoRequest, context) -> pb.InfoResponse:
        # Counters only: no turn in the engine's queue.
        return convert.info_response(self.runner.engine.info(), self.tokenizer)

    async def Generate(self, request: pb.GenerateRequest, context):
        """Server-streaming: the runner decodes this sequence itself, batched with other streams. A text or
        chat prompt is tokenized first (off the event loop), and each token's text piece is decoded as it
        comes (worker/convert.py: generate_prompt; engine/tokenizer.py: the incremental detokenizer)."""
        with self.metrics.rpc("Generate") as call:
            try:
                if self.runner is None:
                    raise Unavailable("the model is still loading; retry shortly")
                if self.draining:
                    raise Unavailable("the worker is draining (shutting down)")
                if request.stopping.max_new_tokens == 0:
                    raise InvalidArgument("Generate needs stopping.max_new_tokens > 0")
                stops = check_stops(list(request.stop), self.tokenizer, "stop")
                detokenizer = None
                if convert.has_text_prompt(request):
                    prompt = await asyncio.to_thread(convert.generate_prompt, request, self.tokenizer)
                    detokenizer = self.tokenizer.detokenizer()
                else:
                    prompt = list(request.prompt_token_ids)
                sampling = convert.sampling_params(request.sampling)
                stopping = convert.stopping_criteria(request.stopping)
                constraint = await self._constraint(request)
                if constraint is not None:
                    sampling = dataclasses.replace(sampling, token_mask=True)
                total = len(prompt) + request.stopping.max_new_tokens
                rid = request.request_id or request_id_of(context)
                started = time.perf_counter()

                def alloc(engine: Engine) -> api.AllocResult:
                    result = engine.alloc_sequence(min(total, engine.max_seq_len), sampling, stopping, rid)
                    if constraint is not None:  # the first token's mask, with the allocation
                        engine.set_token_mask(result.seq_id, constraint.mask())
                    return result

                seq_id, out = await self.runner.streams.start(prompt, alloc, constraint, started,
                                                              reserve=min(total, self.runner.engine.max_seq_len))
            except EngineError as e:
                call.code = status_of(e)
                await context.abort(call.code, str(e))
            matcher = StopStringMatcher(stops, self.tokenizer, True, stopping.min_tokens) if stops else None
            held = StopTextBuffer(stops) if stops and detokenizer is not None else None
            done = False
            try:
                while (item := await out.get()) is not None:
                    if isinstance(item, BaseException):
                        raise item
                    stopped = matcher is not None and matcher.feed(item.token_id)
                    text = ""
                    if detokenizer is not None:
                        text = detokenizer.step(item.token_id)
                        if item.finish_reason or stopped:
                            text += detokenizer.flush()
                    if held is not None:  # text that may begin a stop string waits; a stop string is not sent
                        text = held.stop(text, matcher.matched) if stopped else \
                            held.push(text) + (held.flush() if item.finish_reason else "")
                    if stopped:
                        await self.runner.streams.stop(seq_id)  # the steps launched behind it are dropped
                        item = dataclasses.replace(item, finish_reason=FinishReason.STOP_STRING)
                    yield convert.generate_response(item, text)
                    if stopped:
                        break
                done = True
            except Exception:
                call.code = grpc.StatusCode.INTERNAL
                log.exception("Generate stream of sequence %d failed (request id %s)", seq_id, rid)
                await context.abort(call.code, f"internal error in Generate (request id {rid})")
            finally:
                if not done:  # the client went away, or the stream failed: free the sequence
                    task = asyncio.get_running_loop().create_task(self.runner.streams.stop(seq_id))
                    self._background.add(task)
                    task.add_done_callback(self._background.discard)

    async def _constraint(self, request: pb.GenerateRequest) -> Constraint | None:
        """Generate's structured-output constraint, compiled off the event loop (None: the request has none)."""
        constraint = constraint_of(request)
        if constraint is None:
            return None
        grammar = await asyncio.to_thread(self.grammars.compile, *constraint, constraint[0])
        return Constraint(grammar, self.runner.engine.model_config.vocab_size)

    @rpc
    async def FlushCache(self, request: pb.FlushCacheRequest, context) -> pb.FlushCacheResponse:
        return pb.FlushCacheResponse(flushed_blocks=await self.runner.run(Engine.flush_cache))

    async def SubscribeKvEvents(self, request: pb.SubscribeKvEventsRequest, context):
        """The prefix cache's event batches from request.start_sequence_number (0: a snapshot first). Each
        subscriber reads the engine's bounded event log at its own pace: one that falls behind what the log
        keeps gets OUT_OF_RANGE, and one that stops reading holds nothing but its cursor. The response headers
        go out at once (an idle cache may have nothing to send for long); the end of a drain ends every
        subscription with OK, and a draining worker takes no new one (UNAVAILABLE)."""
        with self.metrics.rpc("SubscribeKvEvents") as call:
            if self.runner is None or self.draining:
                call.code = grpc.StatusCode.UNAVAILABLE
                await context.abort(call.code, "the model is still loading; retry shortly" if self.runner is None
                                    else "the worker is draining (shutting down): it publishes no more KV events")
            await context.send_initial_metadata(())
            events = self.runner.engine.blocks.events
            start = request.start_sequence_number
            try:
                if start == 0:
                    snapshot = await self.runner.run(lambda e: e.blocks.snapshot())
                    if snapshot.sequence_number:
                        yield convert.kv_event_batch(snapshot)
                    start = snapshot.sequence_number + 1
                async for batch in until_set(follow(events, start), self._streams_ended):
                    yield convert.kv_event_batch(batch)
            except OutOfRange as e:
                call.code = status_of(e)
                await context.abort(call.code, str(e))

    def _touching(self, result, seq_ids: list[int]):
        self.leases.touch(seq_ids)
        return result
