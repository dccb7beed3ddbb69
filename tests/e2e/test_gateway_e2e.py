"""The real Shepherd Model Gateway (smg, from the test extras) in front of worker processes serving the real
default model (SmolLM2-135M-Instruct, fp32 on CPU), over real sockets on loopback; transformers' greedy
output on the same converted checkpoint and chat template is the oracle.

Three workers start at once for the module, each with --served-model-name (MODEL, which requests name): `a`
and `b` serve the gateways most tests use (round robin, and cache_aware); `c` stays idle until the failure test
kills it. The drain test ends `b`, so it runs last.
Every process listens on 127.0.0.1 only (smg's metrics too: --prometheus-host) on ports picked free, every
wait is bounded, and the fixtures' finalizers end every process they started.

What smg 1.13 does, as these tests pin it down:
- cache_aware routes gRPC workers by the KV events they stream (SubscribeKvEvents): its counter
  smg_cache_aware_policy_branch_total{branch="event_hit"} counts requests placed by them.
- A worker killed mid-request: the streams it held end with an SSE error event; smg retries a non-streaming
  request it held on another worker (the client gets 200); health probes then mark it not ready.
- A draining worker (SIGTERM) answers health false and Generate UNAVAILABLE: smg retries such a request on
  another worker and takes the draining one out of rotation; the streams it holds run to their end, and
  the worker exits then (the drain ends the KV event subscriptions smg keeps open).
- smg ignores JSON fields it does not know; fields the worker cannot honour reach it and are refused.
- Bad input: the worker's refusal (INVALID_ARGUMENT) reaches the client as HTTP 400 with the worker's
  message; a prompt longer than the context the worker reported is refused by smg itself.
"""
from __future__ import annotations

import collections.abc
import http.client
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import grpc
import pytest
import torch

from metrale.worker.v1 import worker_pb2 as pb
from metrale.worker.v1 import worker_pb2_grpc as pb_grpc
from worker.gateway_pb import cpb, vpb, vpb_grpc

pytestmark = pytest.mark.timeout(300)

ROOT = pathlib.Path(__file__).resolve().parents[2]
MAX_SEQ_LEN = 512  # the workers' context: small, so over-long prompts are cheap to build
MAX_NEW_TOKENS = 24
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the workers' --served-model-name: what requests name
START_TIMEOUT_S = 240  # three workers loading 538 MB each on two shared cores
HTTP_TIMEOUT_S = 120
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.05):
    """predicate()'s first truthy value, polled until timeout_s; fails the test naming `what` otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            break
        time.sleep(interval_s)
    assert value, f"timed out after {timeout_s} s waiting for {what}"
    return value


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus exposition's samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)", line)
        if m and m.group(1) == name:
            have = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
            if all(have.get(k) == v for k, v in labels.items()):
                total += float(m.group(3))
    return total


def http_get(port: int, path: str) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        return conn.getresponse().read().decode()
    finally:
        conn.close()


def stop_process(proc: subprocess.Popen, grace_s: float) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def log_tail(path: pathlib.Path, chars: int = 4000) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", path.read_text(errors="replace"))[-chars:]


# ---------------------------------------------------------------------------------------------
# Worker processes


@dataclass
class WorkerProcess:
    name: str
    proc: subprocess.Popen
    port: int
    metrics_port: int
    log: pathlib.Path
    _channel: grpc.Channel | None = field(default=None, repr=False)

    @classmethod
    def start(cls, name: str, model: pathlib.Path, log_dir: pathlib.Path) -> "WorkerProcess":
        port, metrics_port = free_port(), free_port()
        log = log_dir / f"worker-{name}.log"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, "-m", "worker", "serve", "--model", str(model), "--device", "cpu",
               "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(metrics_port),
               "--max-seq-len", str(MAX_SEQ_LEN), "--num-kv-blocks", "160", "--max-slots", "16",
               "--grace-period-s", "30", "--served-model-name", MODEL]
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        return cls(name, proc, port, metrics_port, log)

    @property
    def url(self) -> str:
        return f"grpc://127.0.0.1:{self.port}"

    @property
    def channel(self) -> grpc.Channel:
        if self._channel is None:
            self._channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        return self._channel

    def info(self) -> pb.InfoResponse:
        return pb_grpc.ModelWorkerStub(self.channel).Info(pb.InfoRequest(), timeout=10)

    def vllm(self) -> vpb_grpc.VllmEngineStub:
        return vpb_grpc.VllmEngineStub(self.channel)

    def metrics(self) -> str:
        return http_get(self.metrics_port, "/metrics")

    def generates(self, code: str) -> float:
        return metric(self.metrics(), "metrale_rpc_total", method="VllmEngine.Generate", code=code)

    def wait_ready(self, deadline: float) -> None:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        health = health_pb2_grpc.HealthStub(self.channel)
        while True:
            exited = self.proc.poll()
            assert exited is None, f"worker {self.name} exited ({exited}):\n{log_tail(self.log)}"
            try:
                status = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            assert time.monotonic() < deadline, f"worker {self.name} not serving in time:\n{log_tail(self.log)}"
            time.sleep(0.2)

    def stop(self) -> None:
        if self._channel is not None:
            self._channel.close()
        stop_process(self.proc, grace_s=15)


@pytest.fixture(scope="module")
def workers(default_model, tmp_path_factory) -> dict[str, WorkerProcess]:
    log_dir = tmp_path_factory.mktemp("gateway-e2e-logs")
    started = {name: WorkerProcess.start(name, default_model, log_dir) for name in "abc"}  # load in parallel
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        for w in started.values():
            w.wait_ready(deadline)
        yield started
    finally:
        for w in started.values():
            w.stop()


# ---------------------------------------------------------------------------------------------
# The gateway


def smg_binary() -> str:
    path = shutil.which("smg", path=str(pathlib.Path(sys.executable).parent)) or shutil.which("smg")
    if path is None:
        pytest.fail("smg is not installed; it is in the test extras: pip install -e '.[test]'")
    return path


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: dict | str

    @property
    def worker(self) -> str | None:
        """The worker smg sent the request to (its last attempt's)."""
        return self.headers.get("x-smg-routed-worker-id")

    @property
    def error(self) -> dict:
        assert isinstance(self.body, dict) and "error" in self.body, self.body
        return self.body["error"]


class Stream:
    """An SSE response of smg, read event by event; close() is the client going away."""

    def __init__(self, port: int, path: str, body: dict):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=HTTP_TIMEOUT_S)
        self.conn.request("POST", path, json.dumps(dict(body, stream=True)), {"content-type": "application/json"})
        self.response = self.conn.getresponse()
        assert self.response.status == 200, self.response.read()[:2000]
        self.worker = self.response.getheader("x-smg-routed-worker-id")

    def events(self) -> collections.abc.Iterator[dict]:
        """Each `data:` event as JSON, until `data: [DONE]` or the end of the body."""
        while line := self.response.readline():
            line = line.strip()
            if line == b"data: [DONE]":
                return
            if line.startswith(b"data: "):
                yield json.loads(line[6:])

    def close(self) -> None:
        self.conn.close()


def chat_text(events: list[dict]) -> str:
    return "".join(c["delta"].get("content") or "" for e in events for c in e.get("choices", []))


class Gateway:
    """`smg launch` on loopback in front of `workers`, its log under log_dir."""

    def __init__(self, workers: list[WorkerProcess] | None, policy: str, log_dir: pathlib.Path, *extra: str):
        self.port, self.metrics_port = free_port(), free_port()
        self.log = log_dir / f"smg-{policy}-{self.port}.log"
        urls = ["--worker-urls", *[w.url for w in workers]] if workers else []
        cmd = [smg_binary(), "launch", *urls, "--host", "127.0.0.1", "--port", str(self.port),
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port), "--policy", policy,
               # probe every second and mark a worker not ready after two failures (defaults: 60 s, 3)
               "--health-check-interval-secs", "1", "--health-failure-threshold", "2",
               "--shutdown-grace-period-secs", "5", "--log-level", "info", *extra]
        env = {**os.environ, "TMPDIR": str(log_dir)}  # smg leaves a copy of its start-up log in the temp dir
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)

    def post(self, path: str, body: dict, timeout: float = HTTP_TIMEOUT_S) -> Reply:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("POST", path, json.dumps(body), {"content-type": "application/json"})
            r = conn.getresponse()
            raw = r.read().decode()
            try:
                parsed = json.loads(raw)
            except ValueError:
                parsed = raw
            return Reply(r.status, {k.lower(): v for k, v in r.getheaders()}, parsed)
        finally:
            conn.close()

    def stream(self, path: str, body: dict) -> Stream:
        return Stream(self.port, path, body)

    def workers(self) -> dict[str, dict]:
        return {w["url"]: w for w in json.loads(http_get(self.port, "/workers"))["workers"]}

    def models(self) -> list[str]:
        return [m["id"] for m in json.loads(http_get(self.port, "/v1/models"))["data"]]

    def metrics(self) -> str:
        return http_get(self.metrics_port, "/metrics")

    def wait_ready(self, urls: list[str], model: str) -> None:
        """Until the workers are registered and healthy and the model's tokenizer is loaded (smg loads it in
        the background after registration and answers 503 tokenizer_not_ready until then)."""
        def ready():
            assert self.proc.poll() is None, f"smg exited ({self.proc.returncode}):\n{log_tail(self.log)}"
            try:
                seen = self.workers()
                return (model in self.models() and all(seen.get(u, {}).get("is_healthy") for u in urls)
                        and self.post("/v1/tokenize", {"model": model, "prompt": "hi"}, timeout=10).status == 200)
            except (OSError, ValueError, KeyError):
                return False
        try:
            wait_for(ready, 60, f"smg to register {urls}", interval_s=0.2)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{log_tail(self.log)}") from None

    def stop(self) -> None:
        stop_process(self.proc, grace_s=15)


@pytest.fixture(scope="module")
def start_gateway(workers, tmp_path_factory):
    """start_gateway(worker_names, policy, *flags) -> a ready Gateway, stopped when the module ends."""
    log_dir = tmp_path_factory.mktemp("smg-logs")
    started: list[Gateway] = []

    def start(names: str, policy: str, *extra: str) -> Gateway:
        chosen = [workers[n] for n in names]
        gw = Gateway(chosen, policy, log_dir, *extra)
        started.append(gw)
        gw.wait_ready([w.url for w in chosen], MODEL)
        return gw

    yield start
    for gw in started:
        gw.stop()


@pytest.fixture(scope="module")
def rr(start_gateway) -> Gateway:
    """Round robin over a and b: requests alternate, which the spread and failure tests rely on."""
    return start_gateway("ab", "round_robin")


@pytest.fixture(scope="module")
def cache_aware(start_gateway) -> Gateway:
    # Warm-up slices off: they send a share of cache misses, and one cache hit in eight, to a worker whose
    # index is thin, which would move a conversation on purpose.
    return start_gateway("ab", "cache_aware", "--worker-warmup-secs", "0", "--worker-warmup-divert-every", "0")


# ---------------------------------------------------------------------------------------------
# The oracle


class Oracle:
    """transformers in fp32 on the converted checkpoint the workers serve, with its tokenizer and chat template."""

    def __init__(self, model_dir: pathlib.Path):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                          attn_implementation="eager").eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.eos = self.tokenizer.eos_token_id

    def chat_ids(self, messages: list[dict]) -> list[int]:
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if isinstance(out, collections.abc.Mapping) else out)

    def text_ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=True)["input_ids"]

    @torch.no_grad()
    def greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        """Greedy tokens up to and including EOS, at most max_new_tokens."""
        out = self.model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                  max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=self.eos,
                                  pad_token_id=self.eos)
        answer = out[0, len(prompt):].tolist()
        return answer[:answer.index(self.eos) + 1] if self.eos in answer else answer

    def text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)


@pytest.fixture(scope="module")
def oracle(default_model) -> Oracle:
    pytest.importorskip("transformers")
    return Oracle(default_model)


def chat_request(model: str, messages: list[dict], max_tokens: int = MAX_NEW_TOKENS, **more) -> dict:
    return dict(model=model, messages=messages, max_tokens=max_tokens, temperature=0, **more)


# ---------------------------------------------------------------------------------------------
# Tests (in this order: the last two end workers c and b)


def test_idle_worker_answers_the_kv_event_subscription_at_once(workers):
    """smg counts a SubscribeKvEvents that has not answered within 2 s as the worker being unreachable and
    leaves it out of routing; an idle worker has no batch to send, so its response headers must go out at
    once. (c has served nothing yet.)"""
    c = workers["c"]
    assert c.info().prefix_cache.last_event_batch == 0, "c has published events: the check means nothing"
    call = c.vllm().SubscribeKvEvents(cpb.SubscribeKvEventsRequest(start_sequence_number=0), timeout=30)
    try:
        started = time.monotonic()
        call.initial_metadata()  # blocks until the headers arrive
        assert time.monotonic() - started < 1.0
    finally:
        call.cancel()


def test_models_and_workers(rr, workers):
    assert rr.models() == [MODEL]
    seen = rr.workers()
    assert set(seen) == {workers["a"].url, workers["b"].url}
    for w in seen.values():
        assert (w["connection_mode"], w["runtime_type"], w["is_healthy"]) == ("grpc", "vllm", True)
        assert w["models"][0]["context_length"] == MAX_SEQ_LEN  # from the worker's GetModelInfo


@pytest.mark.parametrize("chat", range(len(CHATS)))
def test_chat_completions_answer_as_transformers_greedy(rr, oracle, chat):
    messages = CHATS[chat]
    prompt = oracle.chat_ids(messages)
    answer = oracle.greedy(prompt, MAX_NEW_TOKENS)
    want, reason = oracle.text(answer), "stop" if answer[-1] == oracle.eos else "length"

    reply = rr.post("/v1/chat/completions", chat_request(MODEL, messages))
    assert reply.status == 200, reply.body
    choice = reply.body["choices"][0]
    assert choice["message"]["content"] == want
    assert choice["finish_reason"] == reason
    assert reply.body["usage"]["prompt_tokens"] == len(prompt)  # smg rendered the same chat template
    assert reply.body["usage"]["completion_tokens"] == len(answer)

    stream = rr.stream("/v1/chat/completions", chat_request(MODEL, messages,
                                                            stream_options={"include_usage": True}))
    events = list(stream.events())
    stream.close()
    assert chat_text(events) == want
    assert [c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")] == [reason]
    usage = [e["usage"] for e in events if e.get("usage")]
    assert usage and usage[-1]["completion_tokens"] == len(answer)


def test_completions_answer_as_transformers_greedy(rr, oracle):
    text = "The capital of France is"
    prompt = oracle.text_ids(text)
    answer = oracle.greedy(prompt, 12)
    request = dict(model=MODEL, prompt=text, max_tokens=12, temperature=0)
    reply = rr.post("/v1/completions", request)
    assert reply.status == 200, reply.body
    assert reply.body["choices"][0]["text"] == oracle.text(answer)
    usage = reply.body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(prompt), len(answer))
    stream = rr.stream("/v1/completions", request)
    streamed = "".join(c["text"] for e in stream.events() for c in e.get("choices", []))
    stream.close()
    assert streamed == oracle.text(answer)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_end_the_completion_where_its_text_has_one(rr, workers, oracle, stream):
    """OpenAI `stop` strings: the worker ends the sequence at the token whose text completes one (so
    completion_tokens counts up to it), smg trims the text before the string, finish_reason "stop"."""
    text = "The capital of France is"
    answer = oracle.greedy(oracle.text_ids(text), MAX_NEW_TOKENS)
    full = oracle.text(answer)
    words = full.split()
    stop = next(w for w in words[2:] if full.count(w) == 1)  # a word of the answer's middle, there once
    k = next(k for k in range(1, len(answer) + 1) if stop in oracle.text(answer[:k]))  # the completing token
    assert k < len(answer)
    request = dict(model=MODEL, prompt=text, max_tokens=MAX_NEW_TOKENS, temperature=0,
                   stop=["a string never said", stop])
    if stream:
        sse = rr.stream("/v1/completions", dict(request, stream_options={"include_usage": True}))
        events = list(sse.events())
        sse.close()
        got = "".join(c["text"] for e in events for c in e.get("choices", []))
        reasons = [c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")]
        usage = [e["usage"] for e in events if e.get("usage")][-1]
    else:
        reply = rr.post("/v1/completions", request)
        assert reply.status == 200, reply.body
        choice = reply.body["choices"][0]
        got, reasons, usage = choice["text"], [choice["finish_reason"]], reply.body["usage"]
    assert got == full[:full.index(stop)]
    assert reasons == ["stop"]
    assert usage["completion_tokens"] == k
    assert all(w.info().live_sequences == 0 for w in (workers["a"], workers["b"]))


def test_json_schema_response_format(rr, workers):
    """OpenAI structured output (response_format json_schema) through smg: the reply is JSON of the schema
    (tests/e2e/test_structured_output.py holds the worker's constrained tokens against transformers')."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
              "required": ["city", "country"], "additionalProperties": False}
    messages = [{"role": "user", "content": "Name a big city in Japan as JSON."}]
    reply = rr.post("/v1/chat/completions", chat_request(MODEL, messages, max_tokens=64, response_format={
        "type": "json_schema", "json_schema": {"name": "place", "schema": schema}}))
    assert reply.status == 200, reply.body
    choice = reply.body["choices"][0]
    value = json.loads(choice["message"]["content"])
    assert set(value) == {"city", "country"} and all(isinstance(v, str) for v in value.values())
    assert choice["finish_reason"] == "stop"
    assert all(w.info().live_sequences == 0 for w in (workers["a"], workers["b"]))


def test_embeddings_are_the_last_tokens_final_hidden_state_normalized(rr, oracle):
    """/v1/embeddings: smg tokenizes the input and calls a worker's Embed; the vector is transformers' final
    hidden state of the input's last token (after the model's norm), L2-normalized, as vLLM embeds with a decoder
    model. (smg 1.13 answers a list of inputs with one item: one input a request here.)"""
    for text in ["The capital of France is Paris.", "Embeddings of a decoder model pool its last token."]:
        r = rr.post("/v1/embeddings", {"model": MODEL, "input": text})
        assert r.status == 200, r.body
        ids = oracle.text_ids(text)
        with torch.no_grad():
            hidden = oracle.model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, -1]
        want = torch.nn.functional.normalize(hidden.float(), dim=0)
        got = torch.tensor(r.body["data"][0]["embedding"])
        assert got.numel() == want.numel() and (got - want).abs().max().item() <= 1e-4, text
        assert r.body["usage"]["prompt_tokens"] == len(ids)


def test_requests_are_spread_over_both_workers(rr, workers):
    pair = [workers["a"], workers["b"]]
    before = [(w.generates("OK"), w.info().prefix_cache.queries) for w in pair]
    routed = []
    for i in range(4):
        reply = rr.post("/v1/chat/completions", chat_request(
            MODEL, [{"role": "user", "content": f"Give me a word that starts with {'PQRS'[i]}."}],
            max_tokens=4))
        assert reply.status == 200, reply.body
        routed.append(reply.worker)
    assert sorted(routed) == sorted([pair[0].url, pair[1].url] * 2)
    for w, (generates, queries) in zip(pair, before):
        assert w.generates("OK") - generates == 2  # each worker's own count of Generate calls it answered
        assert w.info().prefix_cache.queries - queries == 2  # and of prompts it prefilled


def test_cache_aware_keeps_a_conversation_on_the_worker_holding_its_prefix(cache_aware, workers):
    """Each turn resends the whole conversation: the worker that served the last turn holds its KV blocks,
    learns that to smg through its KV events, and gets the next turn; only its prefix-cache hits grow."""
    pair = {w.url: w for w in (workers["a"], workers["b"])}
    hits = lambda: {url: w.info().prefix_cache.hit_tokens for url, w in pair.items()}  # noqa: E731
    event_hits = lambda: metric(cache_aware.metrics(), "smg_cache_aware_policy_branch_total",  # noqa: E731
                                branch="event_hit")
    messages = [{"role": "system", "content": "You are a terse assistant for a lighthouse keeper on Skerryvore."},
                {"role": "user", "content": "Name a colour."}]
    first_hits, first_event_hits = hits(), event_hits()
    holder, turns = None, 4
    for turn in range(turns):
        before = hits()
        reply = cache_aware.post("/v1/chat/completions", chat_request(MODEL, messages, max_tokens=12))
        assert reply.status == 200, reply.body
        holder = holder or reply.worker
        assert reply.worker == holder, f"turn {turn} went to {reply.worker}, the conversation is on {holder}"
        after = hits()
        if turn:
            assert after[holder] > before[holder] and reply.body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        messages += [{"role": "assistant", "content": reply.body["choices"][0]["message"]["content"]},
                     {"role": "user", "content": f"And another one, number {turn + 2}?"}]
    other = next(url for url in pair if url != holder)
    assert hits()[other] == first_hits[other], "the other worker served part of the conversation"
    assert event_hits() - first_event_hits == turns - 1  # placed by the workers' KV events, not guessed


def test_client_disconnect_aborts_the_stream_and_frees_its_sequence(rr, workers):
    """smg turns the client going away into an Abort of the worker's Generate, which frees the sequence long
    before its max_tokens."""
    by_url = {w.url: w for w in workers.values()}
    max_tokens = 400
    before = {url: (metric(w.metrics(), "metrale_generated_tokens_total"),
                    metric(w.metrics(), "metrale_rpc_total", method="VllmEngine.Abort", code="OK"))
              for url, w in by_url.items()}
    stream = rr.stream("/v1/chat/completions", chat_request(
        MODEL, [{"role": "user", "content": "Tell me a very long story."}], max_tokens=max_tokens,
        ignore_eos=True))
    worker = by_url[stream.worker]
    events = stream.events()
    for _ in range(4):  # the role, then three tokens
        next(events)
    assert worker.info().live_sequences == 1
    stream.close()  # the client goes away mid-stream
    wait_for(lambda: worker.info().live_sequences == 0, 15, "the aborted sequence to be released")
    tokens, aborts = before[worker.url]
    assert metric(worker.metrics(), "metrale_rpc_total", method="VllmEngine.Abort", code="OK") - aborts == 1
    generated = metric(worker.metrics(), "metrale_generated_tokens_total") - tokens
    assert 3 <= generated < max_tokens / 2, generated


def test_bad_input_is_a_4xx_with_the_workers_message_and_the_worker_keeps_serving(rr, workers, oracle):
    pair = [workers["a"], workers["b"]]
    refused_before = sum(w.generates("INVALID_ARGUMENT") for w in pair)
    model = MODEL
    at_context = "hello" + " hello" * (MAX_SEQ_LEN - 1)
    assert len(oracle.text_ids(at_context)) == MAX_SEQ_LEN
    hello = [{"role": "user", "content": "Hello"}]
    refused_by_worker = {  # what the worker says, as smg passes it on
        "leaves no room for a new token in this worker's context length of 512":
            ("/v1/completions", dict(model=model, prompt=at_context)),
        f"max_tokens (600) need {len(oracle.chat_ids(hello)) + 600} tokens; this worker's context length is 512":
            ("/v1/chat/completions", chat_request(model, hello, max_tokens=600)),
        'sampling_params.json_schema cannot be compiled: Unsupported type "colour"':
            ("/v1/chat/completions", chat_request(model, hello, response_format={
                "type": "json_schema", "json_schema": {"name": "colour", "schema": {"type": "colour"}}})),
    }
    for words, (path, body) in refused_by_worker.items():
        reply = rr.post(path, body)
        assert reply.status == 400, (words, reply.body)
        assert reply.error["type"] == "invalid_request_error" and words in reply.error["message"], reply.body
    assert sum(w.generates("INVALID_ARGUMENT") for w in pair) - refused_before == len(refused_by_worker)

    # Longer than the context the worker reported (GetModelInfo): smg refuses it without calling a worker.
    reply = rr.post("/v1/completions", dict(model=model, prompt=at_context + " hello", max_tokens=1))
    assert reply.status == 400 and reply.error["code"] == "context_length_exceeded", reply.body
    assert f"maximum context length is {MAX_SEQ_LEN} tokens" in reply.error["message"]
    assert sum(w.generates("INVALID_ARGUMENT") for w in pair) - refused_before == len(refused_by_worker)

    for _ in pair:  # both workers still serve (round robin: one request each)
        reply = rr.post("/v1/chat/completions", chat_request(model, hello, max_tokens=4))
        assert reply.status == 200, reply.body
    assert all(w.info().live_sequences == 0 for w in pair)


def test_discovered_address_registers_as_a_grpc_worker(workers, tmp_path):
    """Discovery hands smg a bare ip:port (Kubernetes: the pod's IP and --service-discovery-port); smg
    probes HTTP and gRPC and registers the worker as gRPC (vLLM protocol). Shown with the file provider,
    which feeds the same reconciler as the Kubernetes one."""
    manifest = tmp_path / "workers.json"
    manifest.write_text(json.dumps({"version": 1, "workers": [{"url": f"127.0.0.1:{workers['a'].port}"}]}))
    gw = Gateway(None, "round_robin", tmp_path, "--discovery-provider", "file", "--discovery-file", str(manifest))
    try:
        gw.wait_ready([workers["a"].url], MODEL)
        registered = gw.workers()[workers["a"].url]
        assert (registered["connection_mode"], registered["runtime_type"]) == ("grpc", "vllm")
        reply = gw.post("/v1/chat/completions", chat_request(MODEL, CHATS[0], max_tokens=4))
        assert reply.status == 200 and reply.worker == workers["a"].url, reply.body
    finally:
        gw.stop()


def test_sigkill_fails_only_the_requests_the_worker_held(start_gateway, workers):
    a, c = workers["a"], workers["c"]
    gw = start_gateway("ac", "round_robin")
    model = MODEL
    # The streams must outlive the landing of both non-streaming requests below on a loaded two-core box:
    # at 48 tokens the survivor's stream could end first, and its worker never held two sequences.
    stream_tokens = 256
    streamed = {}
    for topic in ("cats", "the sea"):  # round robin: one stream on each worker
        s = gw.stream("/v1/chat/completions", chat_request(
            model, [{"role": "user", "content": f"A story about {topic}."}], max_tokens=stream_tokens, ignore_eos=True,
            stream_options={"include_usage": True}))
        streamed[s.worker] = s
    assert set(streamed) == {a.url, c.url}
    by_url = {a.url: a, c.url: c}
    events = {url: s.events() for url, s in streamed.items()}
    firsts = {url: [next(events[url]), next(events[url])] for url in streamed}

    replies: dict[int, Reply] = {}

    def blocking(i: int) -> None:
        replies[i] = gw.post("/v1/chat/completions", chat_request(
            model, [{"role": "user", "content": "Count to twenty."}], max_tokens=24, ignore_eos=True))

    threads = []
    for i, url in enumerate(streamed):  # round robin again, in the same order: one non-streaming request on each
        holder = by_url[url]
        threads.append(threading.Thread(target=blocking, args=(i,)))
        threads[-1].start()
        wait_for(lambda: holder.info().live_sequences == 2, 30, f"worker {holder.name} to hold two sequences")

    os.kill(c.proc.pid, signal.SIGKILL)
    c.proc.wait(10)
    rest = {url: list(events[url]) for url in streamed}
    for s in streamed.values():
        s.close()
    for t in threads:
        t.join(HTTP_TIMEOUT_S)

    # The stream on the killed worker ends with an error event, short of its tokens.
    killed = firsts[c.url] + rest[c.url]
    assert any("error" in e for e in killed), killed[-3:]
    assert not any(e.get("usage") for e in killed)
    # The stream on the survivor is whole.
    survived = firsts[a.url] + rest[a.url]
    assert not any("error" in e for e in survived)
    assert [e["usage"]["completion_tokens"] for e in survived if e.get("usage")] == [stream_tokens]
    # Non-streaming requests: smg retried the one the killed worker held on the survivor.
    assert [(r.status, r.worker, r.body["usage"]["completion_tokens"]) for r in replies.values()] == \
        [(200, a.url, 24)] * 2, [r.body for r in replies.values()]
    # smg takes the killed worker out of rotation, and later requests succeed on the survivor.
    wait_for(lambda: not gw.workers()[c.url]["is_healthy"], 20, "smg to mark the killed worker unhealthy")
    for _ in range(3):
        reply = gw.post("/v1/chat/completions", chat_request(model, CHATS[0], max_tokens=4))
        assert (reply.status, reply.worker) == (200, a.url), reply.body
    assert a.info().live_sequences == 0


def test_draining_worker_leaves_rotation_and_finishes_its_streams(rr, workers):
    """SIGTERM starts the worker's drain: health false at once, new Generate calls UNAVAILABLE, live
    sequences run to their end, then the process exits. Runs last: it ends worker b."""
    a, b = workers["a"], workers["b"]
    model = MODEL
    streams = [rr.stream("/v1/chat/completions", chat_request(
        model, [{"role": "user", "content": "Describe a storm at sea."}], max_tokens=96, ignore_eos=True,
        stream_options={"include_usage": True})) for _ in range(2)]
    held = next(s for s in streams if s.worker == b.url)  # round robin: one of the two is on b
    events = held.events()
    first = [next(events)]

    b.proc.send_signal(signal.SIGTERM)
    health = b.vllm()
    resp = wait_for(lambda: (r := health.HealthCheck(vpb.HealthCheckRequest(), timeout=5)).healthy is False and r,
                    10, "the draining worker to answer health false")
    assert "draining" in resp.message
    for _ in range(4):  # round robin would give b half of these
        reply = rr.post("/v1/chat/completions", chat_request(model, CHATS[0], max_tokens=4))
        assert (reply.status, reply.worker) == (200, a.url), reply.body
    wait_for(lambda: not rr.workers()[b.url]["is_healthy"], 20, "smg to take the draining worker out of rotation")

    rest = first + list(events)
    assert not any("error" in e for e in rest)
    assert [e["usage"]["completion_tokens"] for e in rest if e.get("usage")] == [96]
    # With its last sequence done the worker stops at once: the KV event subscriptions the gateways hold
    # open end with the drain, so they do not keep it to the end of its 30 s grace.
    assert b.proc.wait(10) == 0, log_tail(b.log)
    for s in streams:
        if s is not held:
            list(s.events())
        s.close()
