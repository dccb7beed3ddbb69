"""The gateway service's live Generate calls by request id (what Abort finds), each with its choices (the n
sequences of one prompt), and the load figures only the service knows: choices waiting for their sequence
to start, and the tokens streamed per second. Event-loop only."""
from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidArgument
from worker.gateway_convert import GatewayLoad

THROUGHPUT_WINDOW_S = 5.0  # gen_throughput: tokens streamed over this many recent seconds
BUCKET_S = 0.25  # the window's resolution (tokens are counted per bucket, not per token)
ABORTED = object()  # put on a call's token queue by Abort once its sequence is stopped: the call ends "abort"


@dataclass
class Choice:
    """One of a call's n sequences (vLLM's CompletionOutput.index)."""

    index: int
    seq_id: int | None = None  # set once the engine has started the sequence
    out: asyncio.Queue | None = None  # its tokens (GenerateStreams.start's queue)
    constraint: Any = None  # structured output: its grammar's state (worker/structured_output.Constraint)


@dataclass
class LiveRequest:
    request_id: str
    prompt_tokens: int
    choices: list[Choice] = field(default_factory=lambda: [Choice(0)])
    aborted: bool = False  # Abort came; a call not started yet stops its sequences as soon as they start

    @property
    def started(self) -> bool:
        """Every choice's sequence has started."""
        return all(c.out is not None for c in self.choices)


class Requests:
    def __init__(self):
        self._live: dict[str, LiveRequest] = {}
        self._buckets: collections.deque[list[int]] = collections.deque()  # [bucket index, tokens]
        self.last_receive = 0.0  # wall-clock time of the last Generate call

    def add(self, request_id: str, prompt_tokens: int, n: int = 1) -> LiveRequest:
        if request_id in self._live:
            raise InvalidArgument(f"request_id {request_id!r} is already running on this worker")
        self.last_receive = time.time()
        live = self._live[request_id] = LiveRequest(request_id, prompt_tokens, [Choice(i) for i in range(n)])
        return live

    def get(self, request_id: str) -> LiveRequest | None:
        return self._live.get(request_id)

    def remove(self, live: LiveRequest) -> None:
        if self._live.get(live.request_id) is live:
            del self._live[live.request_id]

    @property
    def num_active(self) -> int:
        return len(self._live)

    def count_tokens(self, n: int) -> None:
        bucket = int(time.monotonic() / BUCKET_S)
        if self._buckets and self._buckets[-1][0] == bucket:
            self._buckets[-1][1] += n
        else:
            self._buckets.append([bucket, n])

    def gen_throughput(self) -> float:
        oldest = int((time.monotonic() - THROUGHPUT_WINDOW_S) / BUCKET_S)
        while self._buckets and self._buckets[0][0] < oldest:
            self._buckets.popleft()
        return sum(n for _, n in self._buckets) / THROUGHPUT_WINDOW_S

    def load(self) -> GatewayLoad:
        """Waiting: the choices not started yet (each prefills its prompt)."""
        waiting = [(r, c) for r in self._live.values() for c in r.choices if c.seq_id is None]
        return GatewayLoad(waiting=len(waiting), waiting_prompt_tokens=sum(r.prompt_tokens for r, _ in waiting),
                           gen_throughput=self.gen_throughput())
