"""Router-like load on a worker over real gRPC, and the same workload on the engine in-process.

A router keeps up to C sequences in flight: it admits new ones as others finish (AllocSequence +
Prefill), decodes the running batch with one Decode RPC per step (or, with --decode stream, one message
per step on a DecodeStream; or, with --spec K, drafts up to K tokens per sequence by prompt lookup and
sends one Verify RPC for the batch), and releases finished ones. Requests are (prompt_len, output_len) pairs from a seeded distribution or a trace file.

Decode needs no tokens from the router (each sequence's input is the token it sampled last, kept on
the worker), so the router keeps --pipeline D Decode calls in flight (default 3): steps n+1 .. n+D-1
are sent before step n's reply arrives, and the worker queues a Decode behind the step running on the
GPU, so the round trip and the worker's host work overlap the device step instead of adding to it. A sequence is never sent past its max_new_tokens,
so no step is wasted. With --spec (drafts need the last tokens) and --pipeline 1 a step is sent only
after the previous reply.

Reported per concurrency level: output tokens/s; time to first token p50/p99 (Alloc+Prefill call to
the first token); inter-token latency p50/p99 (between a sequence's consecutive steps); RPC overhead
per step: how long the router waited for the step, from when it was sent or the previous step's
reply arrived (the later of the two), minus the worker's forward_ns; steps that waited while a
Prefill call was in flight (or whose wait a Prefill reply ended in) are left out, and counted. With one call in flight this is the call's wall time minus
forward_ns. Also the median forward_ns itself (the step's device time on a GPU, its host time on CPU).
The in-process run drives the same scheduler against Engine directly, with the deepest --pipeline
(the engine queues a Decode's step behind the running one, as the worker does), so gRPC's share is
the difference.

    python bench/load.py --shape tiny --concurrency 1 4 16 64 128             # spawns a worker
    python bench/load.py --target localhost:50051 --concurrency 32              # an existing worker
    python bench/load.py --shape tiny --soak 60                                 # memory/blocks over time

Instead of the sweep, two comparisons in one run each (their own modules; the same JSON with one more list):
    python bench/load.py --shape tiny --prefix multiturn sysprompt --concurrency 32   # prefix cache on vs off,
        # prefix-sharing workloads (bench/load_prefix.py; the JSON's "prefix")
    python bench/load.py --shape tiny --gateway --concurrency 32   # direct gRPC vs through Shepherd Model
        # Gateway's OpenAI endpoint on the same worker (bench/load_gateway.py; the JSON's "gateway")

Writes bench/results/load-[soak-|prefix-|gateway-]<date>-<device>.json and PNG plots beside it (--out to change)."""
from __future__ import annotations

import argparse
import collections
import datetime
import gc
import json
import os
import pathlib
import platform
import queue
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
if not (ROOT / "metrale" / "worker" / "v1" / "worker_pb2.py").exists():
    import runpy
    runpy.run_path(str(ROOT / "protos" / "generate.py"))["generate"]()

import numpy as np  # noqa: E402

from metrale.worker.v1 import worker_pb2 as pb  # noqa: E402


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    output_len: int


class RequestList:
    """A level's requests in order, cycled until `duration` seconds have passed when duration > 0.

    A request source, as run_level takes them: ready() says whether a request can be taken now, take()
    takes it, finished(request, history) hears that its sequence ended with `history` (prompt + output
    tokens). A source whose next requests depend on earlier answers (bench/load_prefix.py's
    conversations) has none ready while it waits for them; the level ends when nothing is in flight and
    none is ready."""

    def __init__(self, requests: list[Request], duration: float = 0.0):
        self.requests, self.duration, self.taken = list(requests), duration, 0
        self.started = time.perf_counter()

    def ready(self) -> bool:
        return self.taken < len(self.requests) or bool(
            self.duration and time.perf_counter() - self.started < self.duration)

    def take(self) -> Request:
        request = self.requests[self.taken % len(self.requests)]
        self.taken += 1
        return request

    def finished(self, request: Request, history: list[int]) -> None:
        pass


def make_requests(n: int, seed: int, vocab: int, prompt_mean: int, output_mean: int,
                  trace: str | None) -> list[Request]:
    rng = np.random.default_rng(seed)
    if trace:
        pairs = [tuple(int(x) for x in line.replace(",", " ").split()[:2])
                 for line in pathlib.Path(trace).read_text().splitlines() if line.strip() and not line.startswith("#")]
        pairs = [pairs[i % len(pairs)] for i in range(n)]
    else:  # lengths ~ lognormal around the means, like chat traffic
        prompts = np.clip(rng.lognormal(np.log(prompt_mean), 0.6, n), 1, 8 * prompt_mean).astype(int)
        outputs = np.clip(rng.lognormal(np.log(output_mean), 0.5, n), 1, 8 * output_mean).astype(int)
        pairs = list(zip(prompts.tolist(), outputs.tolist()))
    # Prompts repeat short n-grams so prompt-lookup drafting has something to find.
    return [Request(tuple(int(t) for t in np.tile(rng.integers(0, vocab, 8), p // 8 + 1)[:p]), o) for p, o in pairs]


def quantiles_ms(xs: list[float], n: int = 1000) -> list[float]:
    """The distribution in at most n evenly spaced quantiles (enough for a CDF plot), in ms."""
    if not xs:
        return []
    qs = np.linspace(0, 100, min(n, len(xs)))
    return [round(1e3 * float(v), 4) for v in np.percentile(xs, qs)]


def percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def prompt_lookup(history: list[int], k: int, ngram: int = 2) -> list[int]:
    """Drafts: what followed the last occurrence of the history's final n-gram."""
    if len(history) <= ngram:
        return []
    tail = history[-ngram:]
    for start in range(len(history) - ngram - 1, -1, -1):
        if history[start:start + ngram] == tail:
            return history[start + ngram:start + ngram + k]
    return []


# --------------------------------------------------------------------------------------------------
# Backends: the same calls over gRPC or in-process. A call never blocks the router: its reply comes
# back as an event (kind, tag, reply) on `events`, in the order the replies arrive.

class GrpcBackend:
    """The router's calls through the sync client, each started without waiting (`WorkerClient.future`);
    a reply's callback posts it to the router's event queue. With decode_stream, decode steps go over one
    DecodeStream instead of a Decode call each: a thread reads the answers (in the order the steps were
    sent) and posts them the same way."""

    def __init__(self, target: str, step_times: bool = False, decode_stream: bool = False):
        """step_times: ask each Decode for the worker's step times (a call's x-step-times trailer, a stream's
        step_times_ns); a decode reply is then (tokens, forward_ns, [the worker's five CLOCK_MONOTONIC ns,
        this callback's])."""
        from worker.client import WorkerClient
        self.client = WorkerClient(target, timeout=120)
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.step_times = step_times
        self.stream = None
        if decode_stream:
            self.stream = self.client.decode_stream(metadata=(("x-step-times", "1"),) if step_times else ())
        self._stream_tags: collections.deque = collections.deque()  # the tags of the steps sent on it, oldest first
        if self.stream is not None:
            threading.Thread(target=self._read_stream, name="decode-stream", daemon=True).start()

    @staticmethod
    def _tokens(tokens) -> list:
        return [(t.sequence_id, [t.token_id], t.finish_reason != 0, t.seq_len) for t in tokens]

    def _read_stream(self) -> None:
        import grpc
        from worker.client import StepRefused
        while True:
            try:
                full = self.stream.recv_full()
                at = time.perf_counter_ns()  # CLOCK_MONOTONIC, the worker's clock
                if full.HasField("error"):
                    raise StepRefused(full.error)
                r = full.step
                reply = (self._tokens(r.tokens), r.forward_ns)
                if self.step_times:
                    reply += ([*full.step_times_ns, at],)
            except StopIteration:
                return
            except StepRefused as e:
                reply = e
            except grpc.RpcError as e:  # the stream failed (or close() cancelled it)
                if self._stream_tags:
                    self.events.put(("decode", self._stream_tags.popleft(), e))
                return
            self.events.put(("decode", self._stream_tags.popleft(), reply))

    def _start(self, kind: str, tag, method: str, request, parse, metadata=()) -> None:
        def done(call):
            try:
                self.events.put((kind, tag, parse(call)))
            except Exception as e:  # noqa: BLE001 - the router raises it
                self.events.put((kind, tag, e))
        self.client.future(method, request, metadata=metadata).add_done_callback(done)

    def alloc(self, tag, total: int, max_new: int) -> None:
        from worker.client import Stopping
        req = self.client.alloc_request(total, stopping=Stopping(max_new_tokens=max_new, ignore_eos=True))
        self._start("alloc", tag, "AllocSequence", req, lambda c: c.result().sequence_id)

    def prefill(self, tag, items) -> None:
        req = pb.PrefillRequest(items=[pb.PrefillItem(sequence_id=i, token_ids=t) for i, t in items])
        def parse(call):  # (tokens, forward_ns, {sequence: prompt tokens that came from the prefix cache})
            r = call.result()
            return (self._tokens(r.tokens), r.forward_ns, {t.sequence_id: t.cached_tokens for t in r.tokens})
        self._start("prefill", tag, "Prefill", req, parse)

    def decode(self, tag, ids) -> None:
        if self.stream is not None:
            self._stream_tags.append(tag)  # before the send: the reader may see its answer at once
            self.stream.send(ids)
            return

        def parse(call):
            r = call.result()
            tokens = self._tokens(r.tokens)
            if not self.step_times:
                return tokens, r.forward_ns
            at = time.perf_counter_ns()  # CLOCK_MONOTONIC, the worker's clock
            times = next((v for k, v in call.trailing_metadata() or () if k == "x-step-times"), "")
            return tokens, r.forward_ns, [int(t) for t in times.split(",") if t] + [at]
        self._start("decode", tag, "Decode", pb.DecodeRequest(sequence_ids=ids), parse,
                    (("x-step-times", "1"),) if self.step_times else ())

    def verify(self, tag, items) -> None:
        req = pb.VerifyRequest(items=[pb.VerifyItem(sequence_id=i, draft_token_ids=d) for i, d in items])
        def parse(call):
            r = call.result()
            return [(v.sequence_id, [t.token_id for t in v.tokens], v.tokens[-1].finish_reason != 0,
                     v.tokens[-1].seq_len) for v in r.results], r.forward_ns
        self._start("verify", tag, "Verify", req, parse)

    def release(self, tag, ids) -> None:
        self._start("release", tag, "Release", pb.ReleaseRequest(sequence_ids=ids), lambda c: c.result().released)

    def graph_counters(self) -> tuple:
        return graph_counters(self.client.info().graph_cache)

    def prefix_counters(self) -> tuple:
        return prefix_counters(self.client.info().prefix_cache)

    def flush_cache(self) -> int:
        """Drops the worker's unreferenced prefix-cache blocks (between a warm-up and its level, so that the
        level's prompts find none of the warm-up's KV)."""
        return self.client.stub.FlushCache(pb.FlushCacheRequest(), timeout=60).flushed_blocks

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
            self.stream.cancel()
        self.client.close()


class EngineBackend:
    """The same calls on Engine in this process: each runs at once and posts its reply, except Decode,
    which launches its step (Engine.decode_launch) the way the worker does; a step's reply is posted
    when the router waits for it or a later call has finished it."""

    def __init__(self, engine):
        self.engine = engine
        self.events = self  # the router calls events.get()
        self._replies: collections.deque = collections.deque()
        self._steps: collections.deque = collections.deque()  # (tag, launched step), oldest first

    def get(self):
        """The next reply; with none waiting, the oldest launched step's (waiting for it)."""
        self._post_steps(wait=not self._replies)
        return self._replies.popleft()

    def _post_steps(self, wait: bool = False) -> None:
        while self._steps and (wait or self._steps[0][1].done):
            tag, step = self._steps.popleft()
            wait = False
            try:
                r = self.engine.finish(step)
                reply = [(t.seq_id, [t.token_id], bool(t.finish_reason), t.seq_len) for t in r.tokens], r.forward_ns
            except Exception as e:  # noqa: BLE001 - the router raises it
                reply = e
            self._replies.append(("decode", tag, reply))

    def _post(self, kind: str, tag, fn) -> None:
        try:
            reply = fn()
        except Exception as e:  # noqa: BLE001 - the router raises it
            reply = e
        self._post_steps()  # steps the call finished first
        self._replies.append((kind, tag, reply))

    def alloc(self, tag, total: int, max_new: int) -> None:
        from engine.sampling import SamplingParams, StoppingCriteria
        self._post("alloc", tag, lambda: self.engine.alloc_sequence(
            total, SamplingParams(), StoppingCriteria(max_new, ignore_eos=True)).seq_id)

    def prefill(self, tag, items) -> None:
        from engine.api import PrefillItem

        def run():
            r = self.engine.prefill([PrefillItem(i, list(t)) for i, t in items])
            return ([(t.seq_id, [t.token_id], bool(t.finish_reason), t.seq_len) for t in r.tokens], r.forward_ns,
                    {t.seq_id: t.cached_tokens for t in r.tokens})
        self._post("prefill", tag, run)

    def decode(self, tag, ids) -> None:
        try:
            self._steps.append((tag, self.engine.decode_launch(ids)))
        except Exception as e:  # noqa: BLE001 - the router raises it
            self._post_steps()
            self._replies.append(("decode", tag, e))

    def verify(self, tag, items) -> None:
        from engine.api import VerifyItem

        def run():
            r = self.engine.verify([VerifyItem(i, d) for i, d in items])
            return ([(v.seq_id, [t.token_id for t in v.tokens], bool(v.tokens[-1].finish_reason), v.tokens[-1].seq_len)
                     for v in r.results], r.forward_ns)
        self._post("verify", tag, run)

    def release(self, tag, ids) -> None:
        self._post("release", tag, lambda: self.engine.release(ids))

    def graph_counters(self) -> tuple:
        return graph_counters(self.engine.info().graph_cache)

    def prefix_counters(self) -> tuple:
        return prefix_counters(self.engine.info().prefix_cache)

    def flush_cache(self) -> int:
        return self.engine.flush_cache()

    def close(self) -> None:
        pass


def graph_counters(g) -> tuple:
    """The graph cache counters a level reports the change of (GraphCacheInfo or GraphStats)."""
    return g.hits, g.misses, g.captures, g.fallbacks, g.capture_seconds, g.graphs_held, g.pool_bytes


def prefix_counters(p) -> tuple:
    """The prefix cache's (query_tokens, hit_tokens) (PrefixCacheInfo or PrefixCacheStats): a level's hit
    rate is the change of the second over the change of the first."""
    return p.query_tokens, p.hit_tokens


# --------------------------------------------------------------------------------------------------
# The router loop.

OUTLIER_US = 500  # a step whose RPC overhead is above this is an outlier (#5's p99 floor)

@dataclass
class LevelResult:
    concurrency: int
    pipeline: int = 1
    output_tokens: int = 0
    seconds: float = 0.0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    # Per request of more than one output token: (last token - first token) / (output tokens - 1), its mean time
    # per token after the first, whatever way its tokens were bunched on their way.
    tpot: list[float] = field(default_factory=list)
    overhead_us: list[float] = field(default_factory=list)
    overhead_left_out: int = 0  # steps that waited while a prefill was in flight
    outliers: list = field(default_factory=list)  # (overhead us, an Alloc/Release reply in the wait, sent late)
    # Per step: (ms since the level started, wait us, forward us, batch, left out, Alloc/Release replies in the
    # wait, sent late); written with --step-log. Over gRPC also, in us after the router sent the step: the
    # worker's handler got it, launched it, began its answer, had its result, built the response; the router's
    # callback got the reply; the router's loop took it (STEP_TIMES).
    step_log: list = field(default_factory=list)
    forward_us: list[float] = field(default_factory=list)  # the worker's forward_ns of each decode/verify step
    steps: int = 0
    out_of_order: int = 0  # tokens replied before an earlier token of their sequence (steps answered out of order)
    accepted_drafts: int = 0
    proposed_drafts: int = 0
    prefill_us: float = 0.0  # the worker's forward_ns summed over the level's prefill calls
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (the Prefill replies' cached_tokens)
    first_tokens: list = field(default_factory=list)  # per request: (Request, TTFT seconds, its cached_tokens)
    graphs: tuple = (0, 0, 0, 0, 0.0, 0, 0)  # graph cache: hits, misses, captures, fallbacks, capture seconds in the
    # level; graphs held and pool bytes at its end

    def summary(self) -> dict:
        return {
            "concurrency": self.concurrency, "pipeline": self.pipeline, "output_tokens": self.output_tokens,
            "seconds": round(self.seconds, 3),
            "tokens_per_s": round(self.output_tokens / self.seconds, 1) if self.seconds else 0.0,
            "ttft_p50_ms": round(1e3 * percentile(self.ttft, 50), 3), "ttft_p99_ms": round(1e3 * percentile(self.ttft, 99), 3),
            "itl_p50_ms": round(1e3 * percentile(self.itl, 50), 3), "itl_p99_ms": round(1e3 * percentile(self.itl, 99), 3),
            "tpot_p50_ms": round(1e3 * percentile(self.tpot, 50), 3),
            "tpot_p99_ms": round(1e3 * percentile(self.tpot, 99), 3),
            "rpc_overhead_p50_us": round(percentile(self.overhead_us, 50), 1),
            "rpc_overhead_p99_us": round(percentile(self.overhead_us, 99), 1),
            "rpc_overhead_left_out": self.overhead_left_out,
            # Steps over OUTLIER_US: how many waited while an Alloc or Release was answered, and how many
            # were sent only after the previous step's reply (the router, not the worker, was late).
            "rpc_overhead_outliers": {"over_us": OUTLIER_US, "steps": len(self.outliers),
                                      "alloc_or_release_in_wait": sum(o[1] for o in self.outliers),
                                      "sent_late": sum(o[2] for o in self.outliers)},
            "forward_p50_us": round(percentile(self.forward_us, 50), 1),
            "steps": self.steps, "out_of_order": self.out_of_order,
            # The engine's share of the wall time: decode/verify and prefill forwards summed over seconds.
            "engine_busy": round((sum(self.forward_us) + self.prefill_us) / 1e6 / self.seconds, 3) if self.seconds else None,
            "prefill_busy": round(self.prefill_us / 1e6 / self.seconds, 3) if self.seconds else None,
            "prompt_tokens": self.prompt_tokens, "cached_prompt_tokens": self.cached_tokens,
            "graph_hits": self.graphs[0], "graph_misses": self.graphs[1], "graph_captures": self.graphs[2],
            "graph_fallbacks": self.graphs[3], "graph_capture_s": round(self.graphs[4], 3),
            "graphs_held": self.graphs[5], "graph_pool_mib": round(self.graphs[6] / 2**20, 1),
            "draft_acceptance": round(self.accepted_drafts / self.proposed_drafts, 3) if self.proposed_drafts else None,
            **({"step_times": step_time_summary(self.step_log)} if any(len(r) > 7 for r in self.step_log) else {}),
        }


# The stamps of a gRPC step in the step log (indices 7..13), and the segments between consecutive ones.
STEP_TIMES = ("handler", "launched", "answering", "result", "response", "callback", "router")
STEP_SEGMENTS = ("sent>handler", "handler>launched", "launched>answering", "answering>result", "result>response",
                 "response>callback", "callback>router")


def step_time_summary(step_log: list) -> dict:
    """Where the steps' time went, from the worker's and the router's clock stamps (--step-log over gRPC):
    the median of each segment over the counted steps and over the outliers (overhead > OUTLIER_US), and
    how bunched the replies are at each stage: the median change between consecutive steps' intervals
    at the worker's result, its response, the router's callback and the router's loop (a steady stream
    has ~0; replies that arrive in pairs have about half the step time)."""
    rows = [r for r in step_log if len(r) >= 7 + len(STEP_TIMES)]
    counted = [r for r in rows if not r[4]]
    outliers = [r for r in counted if r[1] - r[2] > OUTLIER_US]

    def segments(sel: list) -> dict:
        out = {}
        for i, name in enumerate(STEP_SEGMENTS):
            vals = [r[7 + i] - (r[6 + i] if i else 0) for r in sel]
            out[name] = round(percentile(vals, 50), 1) if vals else None
        return out

    def bunching(index: int) -> float | None:
        at = [r[0] * 1e3 - r[-1] + r[index] for r in rows]  # us since the level started
        gaps = [b - a for a, b in zip(at, at[1:])]
        changes = [abs(b - a) for a, b in zip(gaps, gaps[1:])]
        return round(percentile(changes, 50), 1) if changes else None

    return {"counted": len(counted), "median_us": segments(counted), "outliers": len(outliers),
            "outlier_median_us": segments(outliers),
            "interval_change_median_us": {name: bunching(7 + STEP_TIMES.index(name))
                                          for name in ("result", "response", "callback", "router")}}


def run_level(backend, requests, concurrency: int, spec: int, duration: float = 0.0,
              on_tick=None, pipeline: int = 1) -> LevelResult:
    """Serves `requests` (a list, cycled until `duration` seconds when duration > 0; or a request source,
    RequestList's contract) at `concurrency`.

    Event-driven, like a router: a finished sequence's place is refilled at once (Alloc, then one
    Prefill call at a time for whatever has been allocated), while up to `pipeline` decode steps stay
    in flight (1 with spec: drafting needs the last step's tokens). Nothing waits for anything but
    the next reply."""
    pipeline = 1 if spec else max(1, pipeline)
    res = LevelResult(concurrency, pipeline)
    graphs_before = backend.graph_counters()
    source = requests if hasattr(requests, "take") else RequestList(requests, duration)
    running: dict[int, dict] = {}  # per sequence: its request, history, last token time, steps sent / wanted
    allocating = 0
    allocated: list[tuple[int, Request, float]] = []  # waiting for a prefill call
    prefilling: list[tuple[int, Request, float]] = []  # in the prefill call in flight
    steps: list[tuple[list[int], float]] = []  # decode/verify steps in flight: (ids, sent at), also their tags
    releasing = 0
    t_start = time.perf_counter()
    last_step_reply = last_prefill_reply = t_start
    other_replies: collections.deque = collections.deque(maxlen=256)  # when Alloc and Release replies arrived

    def take_tokens(outs, now: float, first: bool = False) -> None:
        """Appends replied tokens in sequence order: a token whose seq_len is not the next one (its
        step ran or was answered before an earlier one) waits in `early` until the gap is filled."""
        finished = []
        for sid, tokens, fin, seq_len in outs:
            state = running[sid]
            if seq_len != len(state["history"]) + len(tokens):
                res.out_of_order += 1
                state["early"][seq_len] = (tokens, fin)
                continue
            while True:
                if not first:
                    res.itl.append((now - state["last"]) / len(tokens))
                state["last"] = now
                state["history"] += tokens
                res.output_tokens += len(tokens)
                if fin:
                    finished.append(sid)
                nxt = state["early"].pop(len(state["history"]) + 1, None)
                if nxt is None:
                    break
                tokens, fin = nxt
        retire(finished, now)

    def retire(done: list[int], now: float) -> None:
        nonlocal releasing
        for sid in done:
            state = running.pop(sid)
            output_len = len(state["history"]) - len(state["request"].prompt)
            if output_len > 1:
                res.tpot.append((now - state["first"]) / (output_len - 1))
            source.finished(state["request"], state["history"])
        if done:
            releasing += 1
            backend.release(None, done)

    while True:
        # Refill free places: one Alloc per sequence, then one Prefill for all allocated ones.
        while len(running) + allocating + len(allocated) + len(prefilling) < concurrency and source.ready():
            r = source.take()
            allocating += 1
            backend.alloc((r, time.perf_counter()), len(r.prompt) + r.output_len + spec + 1, r.output_len)
        if allocated and not prefilling:
            prefilling, allocated = allocated, []
            backend.prefill(None, [(sid, r.prompt) for sid, r, _ in prefilling])
        # Keep `pipeline` steps in flight; a sequence is sent only while it still wants tokens.
        while len(steps) < pipeline:
            ids = list(running) if spec else [sid for sid, st in running.items() if st["sent"] < st["want"]]
            if not ids:
                break
            step = (ids, time.perf_counter())
            steps.append(step)
            if spec:
                drafts = [(i, prompt_lookup(running[i]["history"], spec)) for i in ids]
                res.proposed_drafts += sum(len(d) for _, d in drafts)
                backend.verify(step, drafts)
            else:
                for i in ids:
                    running[i]["sent"] += 1
                backend.decode(step, ids)
        if not (running or allocating or allocated or prefilling or releasing or source.ready()):
            break
        kind, tag, reply = backend.events.get()
        now = time.perf_counter()
        if isinstance(reply, Exception):
            raise reply
        if kind == "alloc":
            allocating -= 1
            allocated.append((reply, *tag))
        elif kind == "prefill":
            last_prefill_reply = now
            started = {sid: (r, t0) for sid, r, t0 in prefilling}
            res.prefill_us += reply[1] / 1e3
            cached = reply[2] if len(reply) > 2 else {}
            prefilling = []
            for sid, _, _, _ in reply[0]:
                r, t0 = started[sid]
                res.ttft.append(now - t0)
                res.prompt_tokens += len(r.prompt)
                res.cached_tokens += cached.get(sid, 0)
                res.first_tokens.append((r, now - t0, cached.get(sid, 0)))
                running[sid] = {"request": r, "history": list(r.prompt), "first": now, "last": now, "sent": 0,
                                "want": r.output_len - 1, "early": {}}
            take_tokens(reply[0], now, first=True)
        elif kind == "release":
            releasing -= 1
        if kind in ("alloc", "release"):
            other_replies.append(now)
        if kind not in ("alloc", "prefill", "release"):  # a decode or verify step
            steps = [st for st in steps if st is not tag]
            _, sent = tag
            outs, forward_ns = reply[:2]
            times = reply[2] if len(reply) > 2 else ()  # GrpcBackend(step_times=True): the step's clock stamps
            waited_from = max(sent, last_step_reply)
            last_step_reply_before, last_step_reply = last_step_reply, now
            # A prefill the worker may have run during this wait (one in flight, or answered since) is not
            # this step's RPC cost: such steps are left out.
            left_out = bool(prefilling or last_prefill_reply > waited_from)
            others = sum(t > waited_from for t in other_replies)  # Alloc/Release replies during the wait
            sent_late = sent > last_step_reply_before
            res.step_log.append((round((now - t_start) * 1e3, 3), round((now - waited_from) * 1e6),
                                 round(forward_ns / 1e3), len(outs), int(left_out), others, int(sent_late),
                                 *(round((t / 1e9 - sent) * 1e6) for t in (*times, now * 1e9) if times)))
            if left_out:
                res.overhead_left_out += 1
            else:
                overhead = ((now - waited_from) - forward_ns / 1e9) * 1e6
                res.overhead_us.append(overhead)
                if overhead > OUTLIER_US:
                    res.outliers.append((overhead, others > 0, sent_late))
            res.steps += 1
            res.forward_us.append(forward_ns / 1e3)
            res.accepted_drafts += sum(len(t) - 1 for _, t, _, _ in outs)
            take_tokens(outs, now)
            if on_tick:
                on_tick(res)
    res.seconds = time.perf_counter() - t_start
    after = backend.graph_counters()
    res.graphs = (*(b - a for a, b in zip(graphs_before[:5], after[:5])), *after[5:])
    return res


# --------------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_worker(model: str, engine_flags: list[str], env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """Starts `metrale-worker serve` on a free port (env: extra environment variables); returns it once
    healthy. Its log goes to a file (proc.log_path), never to a pipe nobody reads: a worker that logs
    more than a pipe holds would block on it."""
    port = free_port()
    log_file = tempfile.NamedTemporaryFile("w+", prefix="metrale-worker-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "worker", "serve", "--model", model, "--host", "127.0.0.1",
                             "--port", str(port), *engine_flags], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=log_file, text=True, env={**os.environ, **(env or {})})
    proc.log_path = log_file.name
    log_file.close()
    from worker.client import WorkerClient
    client = WorkerClient(f"127.0.0.1:{port}", timeout=5)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited: {pathlib.Path(proc.log_path).read_text()[-2000:]}")
        try:
            if client.health() == 1:
                return proc, f"127.0.0.1:{port}"
        except Exception:
            pass
        time.sleep(0.2)
    raise TimeoutError("worker did not become healthy")


def rss_mb(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def gpu_name() -> str | None:
    """The local GPU's model name (the spawned worker's device), when this machine has one."""
    if not _has_cuda():
        return None
    import torch
    return torch.cuda.get_device_name(0)


def device_name(engine) -> str:
    if engine.device.type == "cuda":
        import torch
        return torch.cuda.get_device_name(engine.device)
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def main(argv=None) -> int:
    sys.modules.setdefault("load", sys.modules[__name__])  # the sibling modules import this one as `load`
    import load_gateway
    import load_prefix

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="an existing worker host:port (default: spawn one)")
    p.add_argument("--model", help="checkpoint dir (default: make one of --shape); 'default': the worker's built-in "
                                   "model (SmolLM2, engine/default_model.py)")
    p.add_argument("--shape", default="tiny", choices=["tiny", "1b", "8b"])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64, 128])
    p.add_argument("--requests", type=int, default=0, help="requests per level (default: max(4C, 32))")
    p.add_argument("--prompt-len", type=int, default=128, help="mean prompt length")
    p.add_argument("--output-len", type=int, default=64, help="mean output length")
    p.add_argument("--trace", help="file of 'prompt_len output_len' lines")
    p.add_argument("--spec", type=int, default=0, help="draft tokens per step by prompt lookup (Verify); 0: Decode")
    p.add_argument("--pipeline", type=int, nargs="+", default=[3],
                   help="Decode calls kept in flight over gRPC; several values run the gRPC level once each (the "
                        "in-process run uses the largest)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-in-process", action="store_true", help="skip the in-process comparison")
    p.add_argument("--soak", type=float, default=0.0, help="run C=16 for this many seconds; report memory/blocks")
    p.add_argument("--engine-flags", default="", help="extra flags for the spawned worker, e.g. '--max-slots 256'")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--decode", nargs="+", choices=["call", "stream"], default=["call"],
                   help="how the router sends its decode steps: one Decode call each, and/or over one DecodeStream; "
                        "several values run each gRPC level once per value, alternating")
    p.add_argument("--step-log", action="store_true", help="keep every gRPC step's timing in the JSON (raw_grpc)")
    load_prefix.add_arguments(p)
    load_gateway.add_arguments(p)
    args = p.parse_args(argv)
    load_prefix.check_arguments(p, args)
    load_gateway.check_arguments(p, args)
    if args.prefix and args.gateway:
        p.error("--prefix and --gateway are separate runs")

    from engine.checkpoint import write_temporary_checkpoint
    from engine.config import EngineConfig
    from engine.engine import Engine

    model, written_here = args.model, not args.model
    if model == "default":
        from engine.default_model import default_model_dir
        model = str(default_model_dir())
    elif not model:
        model = str(write_temporary_checkpoint(args.shape, device="cuda" if _has_cuda() else "cpu"))
    max_c = max(args.concurrency + ([16] if args.soak else []))
    engine_flags = ["--max-slots", str(max(256, 2 * max_c)), "--max-batch-size", str(max(256, 2 * max_c)),
                    *args.engine_flags.split()]
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.prefix:
        return load_prefix.run(args, model, engine_flags, out_dir)
    if args.gateway:
        load_gateway.ensure_tokenizer(pathlib.Path(model), may_write=written_here)
    t_spawn = time.perf_counter()
    proc, target = (None, args.target) if args.target else spawn_worker(model, engine_flags)
    args.worker_ready_s = round(time.perf_counter() - t_spawn, 2) if proc is not None else None
    try:
        if args.gateway:
            return load_gateway.run(args, model, target, proc, engine_flags, out_dir)
        return _run(args, model, target, proc, engine_flags, out_dir, Engine, EngineConfig)
    finally:
        if proc is not None:
            stop_worker(proc)


def stop_worker(proc: subprocess.Popen) -> None:
    """Stops a spawned worker and prints how many warnings and errors its log holds (the first five)."""
    proc.terminate()
    proc.wait(30)
    warnings = [line for line in pathlib.Path(proc.log_path).read_text().splitlines()
                if " WARNING " in line or " ERROR " in line]
    print(f"worker log {proc.log_path}: {len(warnings)} warnings/errors" +
          "".join(f"\n  {line[:300]}" for line in warnings[:5]))


def _has_cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


def _run(args, model, target, proc, engine_flags, out_dir, Engine, EngineConfig) -> int:
    from worker.config import config_from_args, serve_parser

    backends = {how: GrpcBackend(target, step_times=args.step_log, decode_stream=how == "stream")
                for how in args.decode}
    grpc_backend = backends[args.decode[0]]
    info = grpc_backend.client.info()
    vocab = info.vocab_size
    engine_cfg = config_from_args(EngineConfig, serve_parser().parse_args(["--model", model, *engine_flags]))
    engine = None
    if not args.no_in_process or args.soak:
        engine = Engine(engine_cfg) if not args.no_in_process else None
    gc.freeze()  # as the worker does after start-up: no full collection pauses the router over torch's objects
    meta = run_meta(args, info, model, engine_flags,
                    device_name(engine) if engine is not None else (gpu_name() if proc is not None else None))
    results: dict = {"meta": meta, "grpc": [], "in_process": [], "raw_grpc": []}

    if args.soak:
        reqs = make_requests(256, args.seed, vocab, args.prompt_len, args.output_len, args.trace)
        samples = []

        def tick(res: LevelResult):
            if res.steps % 50 == 0 and proc is not None:
                samples.append((round(time.perf_counter() - t0, 2), rss_mb(proc.pid)))
        t0 = time.perf_counter()
        warm = run_level(grpc_backend, reqs[:32], 16, args.spec, pipeline=args.pipeline[0])
        start = {"rss_mb": rss_mb(proc.pid) if proc else None, "free_blocks": grpc_backend.client.info().free_blocks}
        level = run_level(grpc_backend, reqs, 16, args.spec, duration=args.soak, on_tick=tick,
                                pipeline=args.pipeline[0])
        end = {"rss_mb": rss_mb(proc.pid) if proc else None, "free_blocks": grpc_backend.client.info().free_blocks,
               "live_sequences": grpc_backend.client.info().live_sequences}
        results["soak"] = {"seconds": args.soak, "start": start, "end": end, "rss_samples": samples,
                           "level": level.summary(), "warmup": warm.summary()}
        print(json.dumps(results["soak"], indent=2))
    else:
        for c in args.concurrency:
            n = args.requests or max(4 * c, 32)
            reqs = make_requests(n, args.seed + c, vocab, args.prompt_len, args.output_len, args.trace)
            ref = None
            if engine is not None:
                eb = EngineBackend(engine)
                depth = max(args.pipeline)  # the engine queues a step behind the running one as the worker does
                run_level(eb, reqs[:min(n, 2 * c)], c, args.spec, pipeline=depth)  # warm-up
                eb.flush_cache()  # the level's prompts begin as the warm-up's did: none may find its KV cached
                ref = (run_level(eb, reqs, c, args.spec, pipeline=depth)).summary()
                results["in_process"].append(ref)
            for depth, how in ((d, h) for d in args.pipeline for h in args.decode):
                backend = backends[how]
                run_level(backend, reqs[:min(n, 2 * c)], c, args.spec, pipeline=depth)  # warm-up
                backend.flush_cache()
                level = run_level(backend, reqs, c, args.spec, pipeline=depth)
                line = {**level.summary(), "decode": how}
                results["grpc"].append(line)
                results["raw_grpc"].append({"concurrency": c, "pipeline": line["pipeline"], "decode": how,
                                            "ttft_ms": quantiles_ms(level.ttft), "itl_ms": quantiles_ms(level.itl),
                                            **({"steps": level.step_log} if args.step_log else {})})
                if ref is not None:
                    line = {**line, "in_process_tokens_per_s": ref["tokens_per_s"],
                            "grpc_vs_in_process": round(line["tokens_per_s"] / ref["tokens_per_s"], 3)}
                print(json.dumps(line))
    for backend in backends.values():
        backend.close()
    write_results(results, out_dir, "soak" if args.soak else "", plots=not args.soak and not args.no_plots)
    return 0


def run_meta(args, info, model: str, engine_flags: list[str], device: str | None) -> dict:
    """The run's description at the top of its JSON (info: the worker's Info); printed in part."""
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": device or info.device, "model": model,
            "architecture": info.architecture, "dtype": info.dtype, "kernel_backend": info.kernel_backend,
            "worker_version": info.version, "python": platform.python_version(), "spec": args.spec,
            "prompt_len_mean": args.prompt_len, "output_len_mean": args.output_len, "seed": args.seed,
            "engine_flags": engine_flags, "worker_ready_s": getattr(args, "worker_ready_s", None)}
    try:
        import torch
        import grpc as grpc_mod
        meta.update(torch=torch.__version__, grpcio=grpc_mod.__version__)
    except Exception:
        pass
    print(json.dumps({k: meta[k] for k in ("device", "engine_flags", "worker_ready_s")}))
    return meta


def write_results(results: dict, out_dir: pathlib.Path, kind: str = "", plots: bool = False) -> pathlib.Path:
    """Writes the run's JSON as out_dir/load-[KIND-]<UTC time>-<device>.json (and with plots, the PNGs beside it)."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
    device = results["meta"]["device"]
    dev = "".join(ch if ch.isalnum() else "-" for ch in device.split("(")[0].strip().lower()) or "device"
    path = out_dir / f"load-{kind + '-' if kind else ''}{stamp}-{dev}.json"
    if plots:
        from load_plots import plot
        results["plots"] = plot(results, path.with_suffix(".png"))
    path.write_text(json.dumps(results, indent=1))
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    sys.exit(main())
