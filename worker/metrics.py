"""Prometheus metrics, served on their own HTTP port (--metrics-port).

Each Worker has its own registry, so several workers can live in one process (tests).

Off the per-call path: a call appends one record (a tuple with its time stamps) to a queue and returns; the
records become observations when /metrics is scraped (on the HTTP server's thread), or on the event loop
once RECORDS_BEFORE_APPLY of them wait (without a scraper, so the queue stays bounded). Observations are
per call and per step, not per token: a step's tokens share one time stamp, so the inter-token gaps of a
step are observed as one weighted observation per distinct gap."""
from __future__ import annotations

import bisect
import collections
import contextlib
import threading
import time

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.utils import floatToGoString

from engine import api

LATENCY_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
STAGE_BUCKETS = (0.000025, 0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 2)
DECODE_STAGES = ("queued", "device", "reply")  # see Metrics.observe_decode_stages
RECORDS_BEFORE_APPLY = 4096  # records kept waiting for a scrape before the recording thread applies them


class StreamCall:
    """A streaming RPC's status code, set by its handler (Metrics.rpc)."""

    __slots__ = ("code",)

    def __init__(self):
        self.code = grpc.StatusCode.OK


class WeightedHistogram:
    """A Prometheus histogram (no labels) that takes n equal observations in one call."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...], registry: CollectorRegistry):
        self.name, self.documentation = name, documentation
        self._bounds = [*buckets, float("inf")]
        self._counts = [0] * len(self._bounds)  # per bucket, not cumulative
        self._sum = 0.0
        self._lock = threading.Lock()
        registry.register(self)

    def observe(self, value: float, n: int = 1) -> None:
        i = bisect.bisect_left(self._bounds, value)  # the first bound >= value (`le` is inclusive)
        with self._lock:
            self._counts[i] += n
            self._sum += value * n

    def collect(self):
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, buckets = 0, []
        for bound, count in zip(self._bounds, counts):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        family = HistogramMetricFamily(self.name, self.documentation)
        family.add_metric([], buckets, total)
        yield family


class _EngineCollector:
    """Gauges read at scrape time from engine.info(), which only reads counters (free-list lengths,
    graph statistics): no engine-thread round trip, so a scrape never waits behind a step; a value
    may be from the middle of a step."""

    def __init__(self):
        self.engine = None

    def collect(self):
        if self.engine is None:
            return
        info = self.engine.info()
        weights = GaugeMetricFamily("metrale_weights_info", "always 1: how the model's weights are held (dtype of "
                                    "activations and unquantized weights; quantization of the projections: none or "
                                    "fp8; whether the LM head is quantized too; the fp8 scale blocks: channel or "
                                    "RxC, empty without fp8; the fp8 activation scheme: dynamic (W8A8 above 8 "
                                    "rows) or none (weight-only W8A16), empty without fp8; the decoder layers "
                                    "whose projections stay unquantized, comma-separated, empty for none)",
                                    labels=["model", "dtype", "quantization", "lm_head_quantized", "fp8_weight_block",
                                            "fp8_activation_scheme", "fp8_skipped_layers"])
        weights.add_metric([info.model_id, info.dtype, info.quantization, str(info.quantized_lm_head).lower(),
                            info.fp8_weight_block, info.fp8_activation_scheme,
                            ",".join(map(str, info.fp8_skipped_layers))], 1)
        yield weights
        yield GaugeMetricFamily("metrale_tensor_parallel_size", "processes (GPUs) the model is split over",
                                value=info.tensor_parallel_size)
        used = info.total_blocks - info.free_blocks
        yield GaugeMetricFamily("metrale_kv_blocks_used", "KV-cache blocks reserved by live sequences", value=used)
        yield GaugeMetricFamily("metrale_kv_blocks_free", "KV-cache blocks free", value=info.free_blocks)
        yield GaugeMetricFamily("metrale_live_sequences", "sequences allocated and not released",
                                value=info.live_sequences)
        yield GaugeMetricFamily("metrale_free_slots", "sequence slots free", value=info.free_slots)
        yield GaugeMetricFamily("metrale_decode_steps_in_flight", "decode steps queued on the device, not yet finished",
                                value=info.steps_in_flight)
        yield CounterMetricFamily("metrale_decode_steps_refused",
                                  "launched decode steps refused (FAILED_PRECONDITION) because an earlier step ended "
                                  "one of their sequences (EOS or a stop token); their slot state was rolled back",
                                  value=info.refused_steps)
        s = info.steps
        for name, value, doc in (
                ("decode_steps", s.decode_steps, "decode steps finished, of every caller (Decode, DecodeStream, Generate "
                                                 "streams of both services)"),
                ("decode_step_sequences", s.decode_sequences, "sequences of those steps, summed (over decode_steps: "
                                                              "the mean batch)"),
                ("decode_device_seconds", s.decode_device_ns / 1e9, "device time of those steps, summed"),
                ("prefill_calls", s.prefill_calls, "prefill engine calls"),
                ("prefill_tokens", s.prefill_tokens, "prompt tokens computed (not those taken from the prefix cache)"),
                ("prefill_device_seconds", s.prefill_device_ns / 1e9, "device time of the prefill calls, summed")):
            yield CounterMetricFamily(f"metrale_{name}", doc, value=value)
        g = info.graph_cache
        for name, value, doc in (("hits", g.hits, "decode steps replayed from a CUDA graph"),
                                 ("misses", g.misses, "decode steps run eagerly (no graph held for their key)"),
                                 ("captures", g.captures, "CUDA graphs captured"),
                                 ("evictions", g.evictions, "CUDA graphs evicted (LRU)"),
                                 ("capture_failures", g.capture_failures, "CUDA graph captures that failed"),
                                 ("fallbacks", g.fallbacks, "decode steps run through their batch width's graph")):
            yield CounterMetricFamily(f"metrale_graph_{name}", doc, value=value)
        yield CounterMetricFamily("metrale_graph_capture_seconds", "time spent capturing graphs",
                                  value=g.capture_seconds)
        c = info.prefix_cache
        yield GaugeMetricFamily("metrale_prefix_cache_blocks", "KV blocks in the prefix cache (referenced or evictable)",
                                value=c.cached_blocks)
        yield GaugeMetricFamily("metrale_prefix_cache_evictable_blocks",
                                "cached KV blocks no live sequence references (evicted LRU first when memory is needed)",
                                value=c.evictable_blocks)
        for name, value, doc in (("queries", c.queries, "prompts looked up in the prefix cache"),
                                 ("query_tokens", c.query_tokens, "prompt tokens looked up in the prefix cache"),
                                 ("hit_tokens", c.hit_tokens, "prompt tokens whose KV came from the prefix cache "
                                                              "(hit rate: hit_tokens / query_tokens)"),
                                 ("stored_blocks", c.stored_blocks, "KV blocks registered in the prefix cache"),
                                 ("evicted_blocks", c.evicted_blocks, "cached KV blocks evicted for memory (LRU)"),
                                 ("flushed_blocks", c.flushed_blocks, "cached KV blocks dropped by FlushCache")):
            yield CounterMetricFamily(f"metrale_prefix_cache_{name}", doc, value=value)
        yield GaugeMetricFamily("metrale_graphs_held", "CUDA graphs held", value=g.graphs_held)
        yield GaugeMetricFamily("metrale_graph_pool_bytes", "bytes in the graph memory pool", value=g.pool_bytes)


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        r.register(_Applier(self))  # first: the waiting records become observations before any metric is read
        self.calls = Counter("metrale_rpc", "RPCs by method and status code", ["method", "code"], registry=r)
        self.latency = Histogram("metrale_rpc_seconds", "RPC latency by method", ["method"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = WeightedHistogram("metrale_time_to_first_token_seconds",
                                      "Prefill call (or Generate start) to the sequence's first token",
                                      LATENCY_BUCKETS, r)
        self.itl = WeightedHistogram("metrale_inter_token_seconds", "time between a sequence's consecutive tokens",
                                     LATENCY_BUCKETS, r)
        self.batch = Histogram("metrale_step_batch_size", "sequences per step", ["kind"], buckets=BATCH_BUCKETS,
                               registry=r)
        self.forward = Histogram("metrale_forward_seconds", "forward + sampling time per step", ["kind"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.tokens = Counter("metrale_generated_tokens", "tokens generated", registry=r)
        self.stages = Histogram("metrale_decode_stage_seconds",
                                "where a Decode call's time went in the worker: queued (handler to launch: waiting "
                                "behind other calls and the steps in flight), device (launch to result ready: the "
                                "steps ahead of it and its own), reply (result ready to response built: the event "
                                "loop's lag)", ["stage"], buckets=STAGE_BUCKETS, registry=r)
        self._stage_children = [self.stages.labels(stage) for stage in DECODE_STAGES]  # queued, device, reply
        self.stream_steps = Counter("metrale_decode_stream_steps", "DecodeStream steps by status code (OK: the step "
                                    "ran; else the code it was refused with)", ["code"], registry=r)
        self.engine = _EngineCollector()
        r.register(self.engine)
        self._children: dict[tuple, object] = {}  # labelled children, looked up once
        self._last_token: dict[int, float] = {}
        self._records: collections.deque = collections.deque()  # (what, *values), appended by the calls
        self._apply_lock = threading.Lock()
        self._http = None

    def _child(self, metric, *labels):
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        self._http = server
        return server.server_address[1]

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

    # ------------------------------------------------------------------ recording (per call: one append)

    def _record(self, *record) -> None:
        records = self._records
        records.append(record)
        if len(records) > RECORDS_BEFORE_APPLY:
            self.apply_pending()

    def record_call(self, method: str, code: grpc.StatusCode, started: float) -> None:
        """A finished RPC: its method, status code and time.perf_counter() at its start."""
        self._record(self._call, method, code.name, time.perf_counter() - started)

    @contextlib.contextmanager
    def rpc(self, method: str):
        """`with metrics.rpc(name) as call:` around a streaming RPC's handler; call.code is its status code
        (CANCELLED when the handler is interrupted with the code still OK)."""
        call, started = StreamCall(), time.perf_counter()
        try:
            yield call
        except BaseException:
            if call.code == grpc.StatusCode.OK:
                call.code = grpc.StatusCode.CANCELLED
            raise
        finally:
            self.record_call(method, call.code, started)

    def observe_step(self, kind: str, result: api.StepResult, started: float | None = None) -> None:
        """A step's batch, forward time and tokens; a prefill's `started` (perf_counter) times its first tokens."""
        self._record(self._step, kind, result, started, time.perf_counter())

    def stream_step(self, code: grpc.StatusCode) -> None:
        self._record(self._stream_step, code.name)

    def observe_decode_stages(self, times: list[int]) -> None:
        """times: a Decode's CLOCK_MONOTONIC ns at the handler, launch, answer begun, result ready and response
        built (the x-step-times stamps)."""
        self._record(self._decode_stages, times)

    def observe_verify(self, result: api.VerifyStepResult) -> None:
        self._record(self._verify, result, time.perf_counter())

    def observe_stream_first(self, token: api.TokenResult, started: float | None) -> None:
        """A Generate stream's first token (its prompt's); started: time.perf_counter() when its call came (None:
        no time to first token)."""
        self._record(self._stream_first, token, started, time.perf_counter())

    def observe_stream_step(self, tokens: list[api.TokenResult]) -> None:
        """The tokens one decode step gave the Generate streams, one record for them all (per step, as a Decode's)."""
        self._record(self._tokens, tokens, time.perf_counter(), False)

    def forget(self, seq_ids: list[int]) -> None:
        self._record(self._forget, list(seq_ids))

    # ------------------------------------------------------------------ applying (at scrape time)

    def apply_pending(self) -> None:
        """Turns the waiting records into observations, in the order they were made (any thread)."""
        records = self._records
        with self._apply_lock:
            while records:
                apply, *values = records.popleft()
                apply(*values)

    def _call(self, method: str, code: str, seconds: float) -> None:
        self._child(self.calls, method, code).inc()
        self._child(self.latency, method).observe(seconds)

    def _tokens(self, tokens: list[api.TokenResult], now: float, first: bool) -> None:
        """Inter-token gaps (none for a sequence's first token), grouped by the previous token's time."""
        last_token = self._last_token
        ids = [t.seq_id for t in tokens]
        if not first:
            unique = dict.fromkeys(ids)
            previous = collections.Counter(map(last_token.get, unique))
            previous.pop(None, None)
            if len(unique) < len(ids):  # a Verify's later tokens of a sequence: a gap of 0 after the one before
                previous[now] += len(ids) - len(unique)
            for last, n in previous.items():
                self.itl.observe(now - last, n)
        last_token.update(dict.fromkeys(ids, now))
        for t in tokens:
            if t.finish_reason:
                last_token.pop(t.seq_id, None)
        self.tokens.inc(len(tokens))

    def _step(self, kind: str, result: api.StepResult, started: float | None, now: float) -> None:
        self._child(self.batch, kind).observe(len(result.tokens))
        self._child(self.forward, kind).observe(result.forward_ns / 1e9)
        if kind == "prefill" and started is not None and result.tokens:
            self.ttft.observe(now - started, len(result.tokens))
        self._tokens(result.tokens, now, first=kind == "prefill")

    def _stream_step(self, code: str) -> None:
        self._child(self.stream_steps, code).inc()

    def _decode_stages(self, times: list[int]) -> None:
        handler, launched, _, result, response = times
        queued, device, reply = self._stage_children
        queued.observe((launched - handler) / 1e9)
        device.observe((result - launched) / 1e9)
        reply.observe((response - result) / 1e9)

    def _verify(self, result: api.VerifyStepResult, now: float) -> None:
        self._child(self.batch, "verify").observe(len(result.results))
        self._child(self.forward, "verify").observe(result.forward_ns / 1e9)
        self._tokens([t for r in result.results for t in r.tokens], now, first=False)

    def _stream_first(self, token: api.TokenResult, started: float | None, now: float) -> None:
        if started is not None:
            self.ttft.observe(now - started)
        self._tokens([token], now, first=True)

    def _forget(self, seq_ids: list[int]) -> None:
        for i in seq_ids:
            self._last_token.pop(i, None)


class _Applier:
    """Registered first in a Metrics registry: applies the waiting records when the registry is collected."""

    def __init__(self, metrics: Metrics):
        self._metrics = metrics

    def collect(self):
        self._metrics.apply_pending()
        return []
