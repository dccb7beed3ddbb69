"""The gateway service: `vllm.grpc.engine.VllmEngine` of Shepherd Model Gateway (smg), on the worker's
port beside ModelWorker and on the same engine.

smg detects the worker by calling HealthCheck on each engine service it knows, registers it with
GetModelInfo and GetServerInfo, fetches GetTokenizer when it has no tokenizer of its own, polls GetLoads
for load-aware routing, and sends each OpenAI request as one Generate of token ids (Abort when its client
goes away). A Generate is a stream of the EngineRunner (runner.streams.start): concurrent calls share decode
steps with each other and with ModelWorker's Generate streams.

Like ModelWorkerServicer, this only translates: conversions are in worker/gateway_convert.py, engine
errors map to status codes through worker/errors.py, anything else is INTERNAL (logged with the request
id) and the worker keeps serving. Embed answers as vLLM embeds with a decoder model (Engine.embed);
StartProfile / StopProfile trace the worker with torch.profiler (worker/profiling.py).
"""
from __future__ import annotations

import asyncio
import functools
import logging
import pathlib
import time
import uuid
from typing import Callable

import grpc

from engine.engine import Engine
from engine.errors import EngineError, FailedPrecondition, InvalidArgument
from engine.kv_events import follow
from engine.tokenizer import Tokenizer
from worker import gateway_convert as convert
from worker import gateway_stream
from worker.aio import until_set
from worker.errors import Unavailable, status_of
from worker.convert import kv_event_batch
from worker.gateway_pb import SERVICE_NAME, cpb, vpb, vpb_grpc
from worker.gateway_requests import ABORTED, LiveRequest, Requests
from worker.metrics import Metrics
from worker.profiling import TraceProfiler
from worker.runner import EngineRunner
from worker.structured_output import Constraint, Grammars
from worker.tokenizer_bundle import TokenizerBundle, chunks

log = logging.getLogger(__name__)
__all__ = ["SERVICE_NAME", "VllmEngineServicer"]
def unary(method):
    """Counts the call in the metrics; maps EngineError to its status and anything else to INTERNAL."""
    name = f"VllmEngine.{method.__name__}"

    @functools.wraps(method)
    async def wrapper(self: "VllmEngineServicer", request, context: grpc.aio.ServicerContext):
        with self.metrics.rpc(name) as call:
            try:
                return await method(self, request, context)
            except EngineError as e:
                call.code = status_of(e)
                await context.abort(call.code, str(e))
            except Exception:
                call.code = grpc.StatusCode.INTERNAL
                log.exception("%s failed", name)
                await context.abort(call.code, f"internal error in {name}; see the worker log")
    return wrapper


class VllmEngineServicer(vpb_grpc.VllmEngineServicer):
    """health_reason() says why the worker is not serving (draining, the step watchdog), "" when it is;
    the Worker sets `runner` (attach) once the engine has loaded and `draining` when it drains."""

    def __init__(self, metrics: Metrics, health_reason: Callable[[], str], stream_interval: int = 1,
                 profile_dir: str = ""):
        self.metrics = metrics
        self.profiler = TraceProfiler(profile_dir)  # StartProfile / StopProfile (WorkerConfig.profile_dir)
        self.stream_interval = stream_interval  # tokens a streamed chunk waits for (WorkerConfig.stream_interval)
        self.health_reason = health_reason
        self.runner: EngineRunner | None = None
        self.facts: convert.ModelFacts | None = None
        self._drain_started = asyncio.Event()
        self.requests = Requests()
        self.tokenizer: TokenizerBundle | None = None
        self.text: Tokenizer | None = None
        self.grammars: Grammars | None = None
        self._started = time.time()
        self._background: set[asyncio.Task] = set()

    async def attach(self, runner: EngineRunner, text: Tokenizer | None = None) -> None:
        """Called once the engine has loaded: the service starts answering. text: the checkpoint's tokenizer
        (None: it has none), which stop strings are matched with."""
        self.text = text
        self.facts = facts = await runner.call(convert.model_facts)
        self.grammars = Grammars(facts.model_path, facts.vocab_size, facts.eos_token_ids)
        # HOOK(real model): a tokenizer directory of its own (a --tokenizer flag) would go here.
        self.tokenizer = TokenizerBundle(pathlib.Path(self.facts.model_path))
        self.profiler.attach(runner)
        self.runner = runner

    @property
    def draining(self) -> bool:
        return self._drain_started.is_set()

    @draining.setter
    def draining(self, value: bool) -> None:
        """Set by the Worker when it drains: also ends the KV event subscriptions (SubscribeKvEvents)."""
        if value:
            self._drain_started.set()
        else:
            self._drain_started.clear()

    def _check_loaded(self) -> None:
        if self.runner is None:
            raise Unavailable("the model is still loading; retry shortly")

    # ------------------------------------------------------------------ generation

    async def Generate(self, request: vpb.GenerateRequest, context: grpc.aio.ServicerContext):
        """n sequences of one prompt (n = sampling_params.n, 1 when unset), each streamed (request.stream: a
        chunk per token, then a Complete repeating its last) or answered once (a Complete with every token of
        each, once all have ended); responses name their choice by `index`. Abort, or the caller going away,
        releases them."""
        with self.metrics.rpc("VllmEngine.Generate") as call:
            rid = request.request_id or uuid.uuid4().hex
            try:
                self._check_loaded()
                if self.draining:
                    raise Unavailable("the worker is draining (shutting down); send the request to another worker")
                spec = convert.generate_spec(request, self.facts, self.text)
                grammar = await asyncio.to_thread(self.grammars.compile, *spec.constraint) if spec.constraint else None
                live = self.requests.add(rid, len(spec.prompt), spec.n)
            except EngineError as e:
                call.code = status_of(e)
                await context.abort(call.code, str(e))
            done = False
            try:
                started = time.perf_counter()
                prompt_lp = None
                if spec.prompt_logprobs is not None:
                    lp = await self.runner.call(lambda e: e.prompt_logprobs(spec.prompt, spec.prompt_logprobs))
                    prompt_lp = convert.input_logprobs(spec.prompt, lp)
                await self._start(live, spec, grammar, started)
                if live.aborted:  # Abort came while the sequences were starting
                    await self._stop(live)
                responses = gateway_stream.responses(live, spec, request.stream, prompt_lp, self.runner.streams,
                                                     self.requests, self.text, self.stream_interval)
                async for response in responses:
                    yield response
                done = True
            except EngineError as e:
                call.code = status_of(e)
                await context.abort(call.code, str(e))
            except Exception:
                call.code = grpc.StatusCode.INTERNAL
                log.exception("Generate of request %s (sequences %s) failed", rid, [c.seq_id for c in live.choices])
                await context.abort(call.code, f"internal error in Generate (request id {rid}); see the worker log")
            finally:
                self.requests.remove(live)
                for choice in live.choices:
                    if choice.seq_id is None:
                        continue  # not started (refused, or a later choice of a refused call): nothing to free
                    if not done:  # the caller went away, or the call failed: free the sequence (ended ones: no-op)
                        self._in_background(self.runner.streams.stop(choice.seq_id))

    async def _start(self, live: LiveRequest, spec: convert.GenerateSpec, grammar=None,
                     started: float | None = None) -> None:
        """Allocates and prefills every choice's sequence, all started at once so that they share one engine call
        and one prefill (GenerateStreams batches the starts queued together; each choice's first token is then on
        its queue). A choice that finds no room waits as vLLM's queued requests do; the started ones decode on
        meanwhile (their tokens queue until the call reads them, and they free their slots and blocks as they
        end), so one that waits for them does not wait for good. If a start fails, the others are still
        recorded (the caller's cleanup stops them) and the first failure is raised. A caller that goes away
        cancels the starts: a waiting start is dropped, one that started anyway is stopped. grammar: the
        compiled constraint (structured output), a Constraint of its own for each choice, whose first token's
        mask is set with the allocation. started: time.perf_counter() when the call came (time to first token)."""
        starts = []
        for choice in live.choices:
            request_id = live.request_id if spec.n == 1 else f"{live.request_id}/{choice.index}"
            choice.constraint = Constraint(grammar, self.facts.vocab_size) if grammar is not None else None

            def alloc(engine: Engine, sampling=spec.sampling_for(choice.index), request_id=request_id,
                      constraint=choice.constraint):
                result = engine.alloc_sequence(spec.max_total_tokens, sampling, spec.stopping, request_id)
                if constraint is not None:
                    engine.set_token_mask(result.seq_id, constraint.mask())
                return result

            starts.append(asyncio.ensure_future(self.runner.streams.start(spec.prompt, alloc, choice.constraint,
                                                                          started, reserve=spec.max_total_tokens)))
        try:
            await asyncio.wait(starts)
        except asyncio.CancelledError:
            for start in starts:
                start.cancel()  # a waiting start is dropped
                start.add_done_callback(self._stop_orphan)  # one that started anyway is stopped
            raise
        for choice, start in zip(live.choices, starts):
            if start.exception() is None:
                choice.seq_id, choice.out = start.result()
        failed = next((start.exception() for start in starts if start.exception() is not None), None)
        if failed is not None:
            raise failed

    def _stop_orphan(self, start: asyncio.Future) -> None:
        if not start.cancelled() and start.exception() is None:
            self._in_background(self.runner.streams.stop(start.result()[0]))

    def _in_background(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def Abort(self, request: vpb.AbortRequest, context) -> vpb.AbortResponse:
        """Ends the named calls with finish reason "abort" and frees their sequences; ids that are not
        running (finished, or never seen) are ignored, as vLLM does."""
        with self.metrics.rpc("VllmEngine.Abort"):
            for rid in request.request_ids:
                live = self.requests.get(rid)
                if live is None or live.aborted:
                    continue
                live.aborted = True
                if live.started:  # one still starting stops itself once it has
                    await self._stop(live)
            return vpb.AbortResponse()

    async def _stop(self, live: LiveRequest) -> None:
        """Stops the call's started sequences; each choice then ends with "abort" after the tokens already
        queued (one that had ended keeps its own finish reason)."""
        for choice in live.choices:
            await self.runner.streams.stop(choice.seq_id)
            choice.out.put_nowait(ABORTED)

    # ------------------------------------------------------------------ health and reports

    async def HealthCheck(self, request, context) -> vpb.HealthCheckResponse:
        """healthy=false while the worker drains and while the step watchdog sees a step running too long:
        smg takes the worker out of rotation until it is healthy again.

        While the model loads the call fails with UNAVAILABLE instead: smg registers a worker as soon as
        one of its services answers HealthCheck (healthy or not) and reads GetModelInfo once, at that
        moment, so an answer before the model is loaded would register it as model "unknown" for good.
        An error makes smg retry the detection, as it does for a vLLM whose port is not open yet."""
        if self.runner is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading; retry shortly")
        reason = self.health_reason()
        return vpb.HealthCheckResponse(healthy=not reason, message=reason or "serving")

    @unary
    async def GetModelInfo(self, request, context) -> vpb.GetModelInfoResponse:
        self._check_loaded()
        tokenizer_path = str(self.tokenizer.directory) if self.tokenizer.available else ""
        return convert.model_info(self.facts, tokenizer_path)

    @unary
    async def GetServerInfo(self, request, context) -> vpb.GetServerInfoResponse:
        self._check_loaded()
        return convert.server_info(self.facts, self.requests.num_active, self.draining,
                                   self.requests.last_receive, time.time() - self._started)

    @unary
    async def GetLoads(self, request: vpb.GetLoadsRequest, context) -> vpb.GetLoadsResponse:
        """Rank 0's load (the only rank): running and waiting requests, KV usage, throughput. The
        request's dp_rank and include filters select nothing else here."""
        self._check_loaded()
        return convert.loads(self.runner.engine.info(), self.facts, self.requests.load())

    async def GetTokenizer(self, request, context):
        """The checkpoint's tokenizer files as a zip in 64 KiB chunks, the SHA-256 on the last;
        FAILED_PRECONDITION when the checkpoint has none."""
        with self.metrics.rpc("VllmEngine.GetTokenizer") as call:
            try:
                self._check_loaded()
                if not self.tokenizer.available:
                    raise FailedPrecondition(
                        f"the checkpoint {self.facts.model_path} has no tokenizer files (tokenizer.json, "
                        "tokenizer.model, vocab.json or *.tiktoken); give the gateway one (smg --tokenizer-path)")
                data, sha256 = await self.tokenizer.archive()
            except EngineError as e:
                call.code = status_of(e)
                await context.abort(call.code, str(e))
            except Exception:
                call.code = grpc.StatusCode.INTERNAL
                log.exception("GetTokenizer failed")
                await context.abort(call.code, "internal error in GetTokenizer; see the worker log")
            for piece in chunks(data, sha256):
                yield piece

    # ------------------------------------------------------------------ the prefix cache

    @unary
    async def FlushCache(self, request: cpb.FlushCacheRequest, context) -> cpb.FlushCacheResponse:
        """Drops every cached block no live request references."""
        self._check_loaded()
        flushed = await self.runner.run(Engine.flush_cache)
        return cpb.FlushCacheResponse(success=True, message=f"dropped {flushed} cached KV blocks (blocks of live "
                                                            f"requests stay cached)")

    async def SubscribeKvEvents(self, request: cpb.SubscribeKvEventsRequest, context):
        """The prefix cache's stored / removed / cleared blocks as smg's KvEventBatch, from
        request.start_sequence_number (0: a snapshot of the cache first). A subscriber that falls behind
        what the worker keeps gets OUT_OF_RANGE and subscribes again from 0. No load records are sent
        (load_records_before_first_batch is ignored: GetLoads has them).

        The response headers go out at once: smg counts a subscription that has not answered within 2 s
        as the worker being unreachable and leaves it out of routing, and an idle cache may have no batch
        to send for a long time. A drain ends every subscription (OK) and refuses new ones (UNAVAILABLE):
        smg holds one open per worker for good, which would otherwise keep the server's stop waiting to
        the end of the drain's grace period."""
        with self.metrics.rpc("VllmEngine.SubscribeKvEvents") as call:
            try:
                self._check_loaded()
                if self.draining:
                    raise Unavailable("the worker is draining (shutting down): it publishes no more KV events")
                await context.send_initial_metadata(())
                start = request.start_sequence_number
                if start == 0:
                    snapshot = await self.runner.run(lambda e: e.blocks.snapshot())
                    if snapshot.sequence_number:
                        yield kv_event_batch(snapshot, cpb)
                    start = snapshot.sequence_number + 1
                async for batch in until_set(follow(self.runner.engine.blocks.events, start), self._drain_started):
                    yield kv_event_batch(batch, cpb)
            except EngineError as e:
                call.code = status_of(e)
                await context.abort(call.code, str(e))

    # ------------------------------------------------------------------ embeddings

    @unary
    async def Embed(self, request: vpb.EmbedRequest, context) -> vpb.EmbedResponse:
        """The prompt's embedding as vLLM gives one for a decoder model (OpenAI /v1/embeddings through smg): its
        last token's hidden state after the final norm, L2-normalized (Engine.embed)."""
        self._check_loaded()
        if self.draining:
            raise Unavailable("the worker is draining (shutting down); send the request to another worker")
        ids = list(request.tokenized.input_ids)
        if not ids:
            raise InvalidArgument("tokenized.input_ids is empty: an embedding needs at least one token")
        vector = await self.runner.call(lambda e: e.embed(ids))
        return vpb.EmbedResponse(embedding=vector.tolist(), prompt_tokens=len(ids), embedding_dim=vector.numel())

    # ------------------------------------------------------------------ profiling

    @unary
    async def StartProfile(self, request: cpb.StartProfileRequest, context) -> cpb.ProfileResponse:
        if request.profile_by_stage:
            raise InvalidArgument("profile_by_stage: not supported; a profile covers every forward step")
        message = self.profiler.start(
            request.output_dir, tuple(request.activities), with_stack=request.with_stack,
            record_shapes=request.record_shapes,
            start_step=request.start_step if request.HasField("start_step") else None,
            num_steps=request.num_steps if request.HasField("num_steps") else None)
        return cpb.ProfileResponse(success=True, message=message)

    @unary
    async def StopProfile(self, request: cpb.StopProfileRequest, context) -> cpb.ProfileResponse:
        return cpb.ProfileResponse(success=True, message=await self.profiler.stop())
