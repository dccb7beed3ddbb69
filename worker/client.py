"""A typed Python client for the ModelWorker service, sync (WorkerClient) and asyncio (AsyncWorkerClient).

    with WorkerClient("localhost:50051") as client:
        with client.session(max_total_tokens=256, max_new_tokens=64) as seq:   # released on exit
            first = seq.prefill(prompt_ids)
            while not seq.finished:
                token = seq.decode()
        for token in client.generate(prompt_ids, max_new_tokens=64):         # streamed
            ...

Every call carries a deadline (the client's `timeout` unless one is given). Only calls that are safe
to repeat are retried, on UNAVAILABLE, with backoff: Info, health checks, and Release (a retried
Release that finds its sequences already gone counts as done). AllocSequence, Prefill, Decode and
Verify change state and are never retried: a lost reply could otherwise double a step; a sequence
whose Alloc reply was lost is reclaimed by the worker's idle lease (--sequence-idle-timeout-s).

Pipelined decoding: a Decode needs nothing from the previous step's reply (each sequence's input is
the token it sampled last, kept on the worker), and the worker runs calls one at a time as they
reach it. So a router can send steps n+1 and n+2 (`future("Decode", ...)`, or more tasks with
AsyncWorkerClient) before step n's reply comes back: the worker queues a Decode behind the step
running on the GPU (--max-steps-in-flight), so the round trip and the worker's own host work overlap
the device (three in flight keep the GPU busy most of the time: bench/RESULTS.md). Send a sequence only while
it still has tokens to make (its max_new_tokens is known); a sequence that stops early (EOS, a stop token) makes a step already in flight with it fail
with FAILED_PRECONDITION, which changes nothing, so resend that step without it. gRPC does not order
calls in flight together, so two steps may run (or be answered) in either order: place each token by
its seq_len. bench/load.py's router does all this (--pipeline).

Decode streams: `decode_stream()` opens one DecodeStream call, over which each `send()` is a step and
`recv()` returns the answers in the order the steps were sent; a step the worker refuses raises
StepRefused from its recv() (its code and message, as the Decode call would have failed), and the
stream goes on. A step sent on a stream skips a call's set-up on both sides (bench/RESULTS.md has the
figures), and the answers come in order.
`bench/load.py --decode stream` routes its steps this way."""
from __future__ import annotations

import asyncio
import queue
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator, Sequence as Seq

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from metrale.worker.v1 import worker_pb2 as pb
from metrale.worker.v1 import worker_pb2_grpc as pb_grpc

RETRY_CODES = (grpc.StatusCode.UNAVAILABLE,)
_CODES = {code.value[0]: code for code in grpc.StatusCode}


class StepRefused(Exception):
    """A step of a decode stream that the worker refused; code() and details() as a grpc.RpcError's.
    The step changed nothing and the stream goes on."""

    def __init__(self, error: pb.StepError):
        super().__init__(f"{_CODES.get(error.code, error.code)}: {error.message}")
        self._code = _CODES.get(error.code, grpc.StatusCode.UNKNOWN)
        self._details = error.message

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def _step_of(resp: pb.DecodeStreamResponse) -> pb.DecodeResponse:
    if resp.HasField("error"):
        raise StepRefused(resp.error)
    return resp.step


@dataclass
class Sampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    top_logprobs: int = 0

    def to_pb(self) -> pb.SamplingParams:
        msg = pb.SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                                repetition_penalty=self.repetition_penalty, top_logprobs=self.top_logprobs)
        if self.seed is not None:
            msg.seed = self.seed
        return msg


@dataclass
class Stopping:
    max_new_tokens: int = 0
    stop_token_ids: Seq[int] = field(default_factory=tuple)
    ignore_eos: bool = False

    def to_pb(self) -> pb.StoppingCriteria:
        return pb.StoppingCriteria(max_new_tokens=self.max_new_tokens, stop_token_ids=list(self.stop_token_ids),
                                   ignore_eos=self.ignore_eos)


def _metadata(token: str | None, client_id: str | None, request_id: str | None = None):
    md = []
    if token:
        md.append(("authorization", f"Bearer {token}"))
    if client_id:
        md.append(("x-client-id", client_id))
    if request_id:
        md.append(("x-request-id", request_id))
    return md


def _channel_args(max_message_bytes: int):
    return [("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes)]


class _Base:
    def __init__(self, target: str, *, credentials: grpc.ChannelCredentials | None = None, token: str | None = None,
                 client_id: str | None = None, timeout: float = 30.0, retries: int = 3,
                 max_message_bytes: int = 64 << 20):
        self.target, self.timeout, self.retries = target, timeout, retries
        self._md = _metadata(token, client_id)
        self._credentials, self._args = credentials, _channel_args(max_message_bytes)

    def _backoff(self, attempt: int) -> float:
        return min(0.05 * 2 ** attempt, 1.0)

    @staticmethod
    def alloc_request(max_total_tokens: int, sampling: Sampling | None = None, stopping: Stopping | None = None,
                      request_id: str = "") -> pb.AllocSequenceRequest:
        return pb.AllocSequenceRequest(max_total_tokens=max_total_tokens, sampling=(sampling or Sampling()).to_pb(),
                                       stopping=(stopping or Stopping()).to_pb(), request_id=request_id)

    def _generate_call(self, prompt_ids, max_new_tokens, sampling, stop_token_ids, ignore_eos, timeout, request_id):
        """The Generate call; its default deadline grows with the number of tokens asked for."""
        req = pb.GenerateRequest(prompt_token_ids=prompt_ids, sampling=(sampling or Sampling()).to_pb(),
                                 stopping=Stopping(max_new_tokens, stop_token_ids, ignore_eos).to_pb(),
                                 request_id=request_id)
        return self.stub.Generate(req, timeout=timeout or self.timeout * max(1, max_new_tokens / 8),
                                  metadata=self._md)


class Session:
    """One sequence: prefill, then decode/verify, then release (also on leaving a `with` block)."""

    def __init__(self, client: "WorkerClient", alloc: pb.AllocSequenceResponse):
        self.client, self.seq_id, self.slot = client, alloc.sequence_id, alloc.slot
        self.reserved_tokens = alloc.reserved_tokens
        self.tokens: list[pb.Token] = []
        self.released = False

    @property
    def finished(self) -> bool:
        return bool(self.tokens) and self.tokens[-1].finish_reason != pb.FINISH_REASON_NONE

    def prefill(self, token_ids: Seq[int], partial: bool = False) -> pb.Token | None:
        resp = self.client.prefill([pb.PrefillItem(sequence_id=self.seq_id, token_ids=token_ids, partial=partial)])
        self.tokens += resp.tokens
        return resp.tokens[0] if resp.tokens else None

    def decode(self, input_token_id: int | None = None) -> pb.Token:
        resp = self.client.decode([self.seq_id], None if input_token_id is None else [input_token_id])
        self.tokens.append(resp.tokens[0])
        return resp.tokens[0]

    def verify(self, draft_token_ids: Seq[int], draft_probs: Seq[float] = ()) -> pb.VerifyResult:
        res = self.client.verify([pb.VerifyItem(sequence_id=self.seq_id, draft_token_ids=draft_token_ids,
                                                draft_probs=draft_probs)]).results[0]
        self.tokens += res.tokens
        return res

    def release(self) -> None:
        if not self.released:
            self.client.release([self.seq_id])
            self.released = True

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class DecodeStream:
    """One DecodeStream call (WorkerClient.decode_stream): send() queues a step without waiting; recv()
    waits for the next answer, in the order the steps were sent. close() ends the stream once the answers
    sent for are read; leaving a `with` block closes it and cancels what is left."""

    _END = object()

    def __init__(self, stub: pb_grpc.ModelWorkerStub, timeout: float | None, metadata):
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        # grpc's sync stub reads the request iterator on a thread of its own.
        self._call = stub.DecodeStream(iter(self._requests.get, self._END), timeout=timeout, metadata=metadata)

    def send(self, seq_ids: Seq[int], input_token_ids: Seq[int] | None = None) -> None:
        self._requests.put(pb.DecodeRequest(sequence_ids=seq_ids, input_token_ids=input_token_ids or []))

    def recv(self) -> pb.DecodeResponse:
        """The next step's answer; raises StepRefused for a refused step, grpc.RpcError if the stream
        failed, StopIteration once it ended after close()."""
        return _step_of(next(self._call))

    def recv_full(self) -> pb.DecodeStreamResponse:
        """The next answer as it came (the step or its error, and step_times_ns when asked for)."""
        return next(self._call)

    def close(self) -> None:
        self._requests.put(self._END)

    def cancel(self) -> None:
        self._call.cancel()

    def __enter__(self) -> "DecodeStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
        self.cancel()


class WorkerClient(_Base):
    """Synchronous client."""

    def __init__(self, target: str, **kwargs):
        super().__init__(target, **kwargs)
        self.channel = (grpc.secure_channel(target, self._credentials, self._args) if self._credentials
                        else grpc.insecure_channel(target, self._args))
        self.stub = pb_grpc.ModelWorkerStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "WorkerClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, method, request, timeout: float | None, retry: bool):
        for attempt in range(self.retries + 1 if retry else 1):
            try:
                return method(request, timeout=timeout or self.timeout, metadata=self._md)
            except grpc.RpcError as e:
                if not retry or e.code() not in RETRY_CODES or attempt == self.retries:
                    raise
                time.sleep(self._backoff(attempt))

    def health(self, service: str = "", timeout: float | None = None) -> int:
        return self._call(self.health_stub.Check, health_pb2.HealthCheckRequest(service=service), timeout, True).status

    def info(self, timeout: float | None = None) -> pb.InfoResponse:
        return self._call(self.stub.Info, pb.InfoRequest(), timeout, True)

    def alloc(self, max_total_tokens: int, sampling: Sampling | None = None, stopping: Stopping | None = None,
              request_id: str = "", timeout: float | None = None) -> pb.AllocSequenceResponse:
        req = self.alloc_request(max_total_tokens, sampling, stopping, request_id)
        return self._call(self.stub.AllocSequence, req, timeout, False)

    def session(self, max_total_tokens: int, max_new_tokens: int = 0, sampling: Sampling | None = None,
                stopping: Stopping | None = None, **kwargs) -> Session:
        stopping = stopping or Stopping(max_new_tokens=max_new_tokens)
        return Session(self, self.alloc(max_total_tokens, sampling, stopping, **kwargs))

    def prefill(self, items: Seq[pb.PrefillItem], timeout: float | None = None) -> pb.PrefillResponse:
        return self._call(self.stub.Prefill, pb.PrefillRequest(items=items), timeout, False)

    def decode(self, seq_ids: Seq[int], input_token_ids: Seq[int] | None = None,
               timeout: float | None = None) -> pb.DecodeResponse:
        req = pb.DecodeRequest(sequence_ids=seq_ids, input_token_ids=input_token_ids or [])
        return self._call(self.stub.Decode, req, timeout, False)

    def decode_stream(self, timeout: float | None = None, metadata: Seq[tuple[str, str]] = ()) -> DecodeStream:
        """Opens a DecodeStream (module docstring). timeout: a deadline for the whole stream (default none:
        a stream lives as long as its router decodes). `metadata` is sent with the client's own (e.g.
        ("x-step-times", "1"): each answer then carries the step's times, `recv_full()`)."""
        return DecodeStream(self.stub, timeout, (*self._md, *metadata))

    def future(self, method: str, request, timeout: float | None = None, metadata: Seq[tuple[str, str]] = ()) \
            -> grpc.Future:
        """Any ModelWorker RPC (by name, e.g. "Decode") without waiting: returns the call's future
        (`.result()` is the reply or raises its RpcError; `.add_done_callback(fn)`). Never retried.
        A router keeps its calls in flight this way, e.g. the next Decode of a batch before the
        previous step's reply (see the module docstring). `metadata` is sent with the client's own
        (e.g. ("x-step-times", "1"): Decode then returns its step times in a trailer)."""
        return getattr(self.stub, method).future(request, timeout=timeout or self.timeout,
                                                 metadata=(*self._md, *metadata) if metadata else self._md)

    def verify(self, items: Seq[pb.VerifyItem], timeout: float | None = None) -> pb.VerifyResponse:
        return self._call(self.stub.Verify, pb.VerifyRequest(items=items), timeout, False)

    def release(self, seq_ids: Seq[int], timeout: float | None = None) -> int:
        for attempt in range(self.retries + 1):
            try:
                return self.stub.Release(pb.ReleaseRequest(sequence_ids=seq_ids), timeout=timeout or self.timeout,
                                         metadata=self._md).released
            except grpc.RpcError as e:
                if attempt and e.code() == grpc.StatusCode.NOT_FOUND:
                    return 0  # an earlier attempt released them and its reply was lost
                if e.code() not in RETRY_CODES or attempt == self.retries:
                    raise
                time.sleep(self._backoff(attempt))
        return 0

    def generate(self, prompt_ids: Seq[int], max_new_tokens: int, sampling: Sampling | None = None,
                 stop_token_ids: Seq[int] = (), ignore_eos: bool = False, timeout: float | None = None,
                 request_id: str = "") -> Iterator[pb.Token]:
        """Streams the tokens of one sequence (the Generate RPC). Breaking out early cancels the call
        and the worker frees the sequence."""
        call = self._generate_call(prompt_ids, max_new_tokens, sampling, stop_token_ids, ignore_eos, timeout,
                                   request_id)
        try:
            for resp in call:
                yield resp.token
        finally:
            call.cancel()


class AsyncDecodeStream:
    """DecodeStream for AsyncWorkerClient: `await send(...)`, `await recv()` (answers in the order the
    steps were sent; StepRefused for a refused step), `await close()`."""

    def __init__(self, stub: pb_grpc.ModelWorkerStub, timeout: float | None, metadata):
        self._call = stub.DecodeStream(timeout=timeout, metadata=metadata)

    async def send(self, seq_ids: Seq[int], input_token_ids: Seq[int] | None = None) -> None:
        await self._call.write(pb.DecodeRequest(sequence_ids=seq_ids, input_token_ids=input_token_ids or []))

    async def recv(self) -> pb.DecodeResponse:
        """The next step's answer; raises StopAsyncIteration once the stream ended after close()."""
        resp = await self._call.read()
        if resp is grpc.aio.EOF:
            raise StopAsyncIteration
        return _step_of(resp)

    async def close(self) -> None:
        await self._call.done_writing()

    def cancel(self) -> None:
        self._call.cancel()


class AsyncWorkerClient(_Base):
    """asyncio client: the same calls, awaitable; `generate` is an async iterator."""

    def __init__(self, target: str, **kwargs):
        super().__init__(target, **kwargs)
        self.channel = (grpc.aio.secure_channel(target, self._credentials, self._args) if self._credentials
                        else grpc.aio.insecure_channel(target, self._args))
        self.stub = pb_grpc.ModelWorkerStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> "AsyncWorkerClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _call(self, method, request, timeout: float | None, retry: bool):
        for attempt in range(self.retries + 1 if retry else 1):
            try:
                return await method(request, timeout=timeout or self.timeout, metadata=self._md)
            except grpc.RpcError as e:
                if not retry or e.code() not in RETRY_CODES or attempt == self.retries:
                    raise
                await asyncio.sleep(self._backoff(attempt))

    async def health(self, service: str = "", timeout: float | None = None) -> int:
        req = health_pb2.HealthCheckRequest(service=service)
        return (await self._call(self.health_stub.Check, req, timeout, True)).status

    async def info(self, timeout: float | None = None) -> pb.InfoResponse:
        return await self._call(self.stub.Info, pb.InfoRequest(), timeout, True)

    async def alloc(self, max_total_tokens: int, sampling: Sampling | None = None, stopping: Stopping | None = None,
                    request_id: str = "", timeout: float | None = None) -> pb.AllocSequenceResponse:
        req = self.alloc_request(max_total_tokens, sampling, stopping, request_id)
        return await self._call(self.stub.AllocSequence, req, timeout, False)

    async def prefill(self, items: Seq[pb.PrefillItem], timeout: float | None = None) -> pb.PrefillResponse:
        return await self._call(self.stub.Prefill, pb.PrefillRequest(items=items), timeout, False)

    async def decode(self, seq_ids: Seq[int], input_token_ids: Seq[int] | None = None,
                     timeout: float | None = None) -> pb.DecodeResponse:
        req = pb.DecodeRequest(sequence_ids=seq_ids, input_token_ids=input_token_ids or [])
        return await self._call(self.stub.Decode, req, timeout, False)

    def decode_stream(self, timeout: float | None = None) -> AsyncDecodeStream:
        return AsyncDecodeStream(self.stub, timeout, self._md)

    async def verify(self, items: Seq[pb.VerifyItem], timeout: float | None = None) -> pb.VerifyResponse:
        return await self._call(self.stub.Verify, pb.VerifyRequest(items=items), timeout, False)

    async def release(self, seq_ids: Seq[int], timeout: float | None = None) -> int:
        for attempt in range(self.retries + 1):
            try:
                resp = await self.stub.Release(pb.ReleaseRequest(sequence_ids=seq_ids),
                                               timeout=timeout or self.timeout, metadata=self._md)
                return resp.released
            except grpc.RpcError as e:
                if attempt and e.code() == grpc.StatusCode.NOT_FOUND:
                    return 0
                if e.code() not in RETRY_CODES or attempt == self.retries:
                    raise
                await asyncio.sleep(self._backoff(attempt))
        return 0

    async def generate(self, prompt_ids: Seq[int], max_new_tokens: int, sampling: Sampling | None = None,
                       stop_token_ids: Seq[int] = (), ignore_eos: bool = False, timeout: float | None = None,
                       request_id: str = "") -> AsyncIterator[pb.Token]:
        call = self._generate_call(prompt_ids, max_new_tokens, sampling, stop_token_ids, ignore_eos, timeout,
                                   request_id)
        try:
            async for resp in call:
                yield resp.token
        finally:
            call.cancel()
