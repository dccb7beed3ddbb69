"""The same workload straight to the worker over gRPC and through Shepherd Model Gateway, for load.py --gateway.

Per --concurrency C, load.py's requests (make_requests: prompt and output lengths around --prompt-len and
--output-len) are served twice by one worker: first by load.py's router (AllocSequence, Prefill, --pipeline
Decodes in flight), then by C OpenAI clients through smg (`smg launch --worker-urls grpc://WORKER
--model-path CHECKPOINT`), which tokenizes and calls the worker's VllmEngine service. A client sends each
request as one streaming POST /v1/completions with max_tokens = the request's output length, ignore_eos,
temperature 0 and skip_special_tokens false, and its next request when that stream has ended; both paths
therefore generate the same number of tokens. Each path gets a warm-up of 2C of the requests, then FlushCache.

smg 1.13's /v1/completions takes text prompts only (a list of token ids is refused as invalid_type), so
each request's random ids are decoded with the checkpoint's tokenizer and encoded again; both paths send
the ids that gives, the gateway as their text, and usage.prompt_tokens shows whether smg encoded every
text back to as many tokens (prompt_token_mismatches). A checkpoint load.py wrote itself gets a word-level
tokenizer ("<unk>", "<s>", "</s>" = ids 0-2, then "w3" .. one word per id), for which text and ids map one
to one; each chunk the worker sends (one token, or the several a lagging handler had queued) streams as an
SSE event of its own (token_events).

Reported per path: output tokens/s over the level's wall time; TTFT p50/p99 (the router's Alloc to the
Prefill reply; the client's POST to the first SSE event with text); ITL p50/p99 (between a request's
consecutive tokens; through smg, between its consecutive SSE events with text: tokens that arrive together
give gaps near 0, so ITL's p50 falls where replies bunch); TPOT p50/p99 (per request, from its first token
to its last over the tokens between: bunching does not move it); and gateway / direct.

    python bench/load.py --shape tiny --gateway --concurrency 4 --requests 16 --prompt-len 24 --output-len 12
"""
from __future__ import annotations

import asyncio
import importlib.metadata
import importlib.util
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import load
from load import LevelResult, Request

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2: the unknown word, and the bos / eos of write_checkpoint
READY_TIMEOUT_S = 120


def add_arguments(p) -> None:
    p.add_argument("--gateway", action="store_true",
                   help="instead of the sweep: the sweep's workload at each --concurrency over gRPC and then through "
                        "Shepherd Model Gateway's OpenAI endpoint on the same worker (bench/load_gateway.py)")
    p.add_argument("--smg-flags", default="--policy round_robin --log-level warn",
                   help="--gateway: flags for `smg launch` besides its worker, ports and --model-path")
    p.add_argument("--gateway-rounds", type=int, default=1,
                   help="--gateway: measure each concurrency this many times, direct and gateway alternating; the row "
                        "is the round of median gateway / direct tok/s, with every round's ratio beside it")


def check_arguments(p, args) -> None:
    if not args.gateway:
        return
    if args.target and not args.model:
        p.error("--gateway with --target needs --model: the worker's checkpoint dir, for smg's tokenizer")
    if args.spec or args.soak:
        p.error("--gateway measures Decode steps at each --concurrency: leave --spec and --soak out")
    if args.gateway_rounds < 1:
        p.error(f"--gateway-rounds must be >= 1, got {args.gateway_rounds}")


# --------------------------------------------------------------------------------------------------
# The checkpoint's tokenizer

def write_word_tokenizer(directory: pathlib.Path) -> None:
    """tokenizer.json and tokenizer_config.json for a checkpoint of random weights: a word-level vocabulary of
    exactly config.json's vocab_size ids, split on whitespace, decoded with spaces between words."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    config = json.loads((directory / "config.json").read_text())
    if (config.get("bos_token_id"), config.get("eos_token_id")) != (1, 2):
        raise SystemExit(f"load.py --gateway: {directory} has bos/eos ids {config.get('bos_token_id')}/"
                         f"{config.get('eos_token_id')}; the word tokenizer needs 1/2 (engine.checkpoint's)")
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIAL_TOKENS), config["vocab_size"])})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()  # joins the words with spaces
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "model_max_length": config.get("max_position_embeddings", 2048),
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}"}))


def ensure_tokenizer(model_dir: pathlib.Path, may_write: bool) -> None:
    """smg reads the tokenizer from the checkpoint (--model-path): one load.py wrote gets a word tokenizer;
    someone else's checkpoint without tokenizer.json is refused (one line, exit 2)."""
    if (model_dir / "tokenizer.json").is_file():
        return
    if not may_write:
        print(f"load.py --gateway: {model_dir} has no tokenizer.json, which smg needs (--model-path); give a "
              f"checkpoint with its tokenizer, or leave --model out to have one written", file=sys.stderr)
        raise SystemExit(2)
    write_word_tokenizer(model_dir)


def as_text(requests: list[Request], model_dir: pathlib.Path) -> tuple[list[Request], list[str]]:
    """The requests as the gateway gets them: each prompt decoded to text (special tokens kept, as words the
    tokenizer knows), and the requests with the ids that text encodes to, which the direct path sends."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    texts = [tok.decode(list(r.prompt), skip_special_tokens=False) for r in requests]
    ids = [tok.encode(text).ids for text in texts]
    return [Request(tuple(i), r.output_len) for i, r in zip(ids, requests)], texts


# --------------------------------------------------------------------------------------------------
# smg

class Gateway:
    """`smg launch` in front of one worker, its HTTP and metrics ports on loopback, its log in a file."""

    def __init__(self, worker_target: str, model_dir: pathlib.Path, flags: list[str]):
        if importlib.util.find_spec("smg") is None:
            print("load.py --gateway: smg is not installed (pip install smg==1.13.0; it is in the [test] extra)",
                  file=sys.stderr)
            raise SystemExit(2)
        self.version = importlib.metadata.version("smg")
        self.port, metrics_port = load.free_port(), load.free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.command = [sys.executable, "-m", "smg", "launch", "--worker-urls", f"grpc://{worker_target}",
                        "--host", "127.0.0.1", "--port", str(self.port), "--prometheus-host", "127.0.0.1",
                        "--prometheus-port", str(metrics_port), "--model-path", str(model_dir), *flags]
        log = tempfile.NamedTemporaryFile("w", prefix="smg-", suffix=".log", delete=False)
        self.log_path = log.name
        self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        t0 = time.perf_counter()
        self.model_id = self._wait_ready()
        self.ready_s = round(time.perf_counter() - t0, 2)

    def _log_tail(self) -> str:
        return pathlib.Path(self.log_path).read_text(errors="replace")[-3000:]

    def _wait_ready(self) -> str:
        """The served model's id, once smg lists it and answers a one-token completion."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"smg exited with status {self.proc.returncode}:\n{self._log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.base}/v1/models", timeout=5) as r:
                    models = [m["id"] for m in json.loads(r.read())["data"]]
                body = json.dumps({"model": models[0], "prompt": "w3", "max_tokens": 1}).encode()
                request = urllib.request.Request(f"{self.base}/v1/completions", data=body,
                                                 headers={"content-type": "application/json"})
                with urllib.request.urlopen(request, timeout=30) as r:
                    if r.status == 200:
                        return models[0]
            except (OSError, ValueError, KeyError, IndexError):  # not listening yet, no worker yet, ...
                pass
            time.sleep(0.2)
        raise TimeoutError(f"smg did not serve a completion in {READY_TIMEOUT_S} s:\n{self._log_tail()}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        lines = pathlib.Path(self.log_path).read_text(errors="replace").splitlines()
        bad = [line for line in lines if " WARN " in line or " ERROR " in line]
        print(f"smg log {self.log_path}: {len(bad)} warnings/errors" + "".join(f"\n  {x[:300]}" for x in bad[:5]))


class GatewayError(RuntimeError):
    def __init__(self, status: int, body: str):
        super().__init__(f"smg answered HTTP {status}: {body[:500]}")


class Connection:
    """One keep-alive HTTP/1.1 connection to smg, as one OpenAI client holds it: a POST, then its streamed
    (chunked) reply read as server-sent events as they arrive."""

    def __init__(self, port: int):
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def stream(self, path: str, payload: dict):
        """POSTs payload; yields (perf_counter when its bytes arrived, the event's JSON) for every `data:` event
        but [DONE], and reads the reply to its end (the connection then serves the next request). A status
        other than 200 raises GatewayError with the reply's body."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        body = json.dumps(payload).encode()
        self.writer.write(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
                          b"Accept: text/event-stream\r\nContent-Length: %d\r\n\r\n%s"
                          % (path.encode(), self.port, len(body), body))
        status_line = await self.reader.readline()
        status = int(status_line.split()[1])
        headers = {}
        while (line := await self.reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip().lower()
        if status != 200:
            raise GatewayError(status, b"".join([part async for part in self._body(headers)]).decode(errors="replace"))
        pending = b""
        async for data in self._body(headers):
            at = time.perf_counter()
            pending += data.replace(b"\r\n", b"\n")
            *events, pending = pending.split(b"\n\n")
            for event in events:
                for line in event.split(b"\n"):
                    if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                        yield at, json.loads(line[5:])
        if headers.get("connection") == "close":
            await self.close()

    async def _body(self, headers: dict):
        """The reply's body as it arrives: chunked, or Content-Length bytes, or up to the connection's end."""
        if headers.get("transfer-encoding") == "chunked":
            while size := int((await self.reader.readline()).split(b";")[0], 16):
                yield (await self.reader.readexactly(size + 2))[:-2]
            while (await self.reader.readline()) not in (b"\r\n", b"\n", b""):  # trailers
                pass
        elif "content-length" in headers:
            yield await self.reader.readexactly(int(headers["content-length"]))
        else:
            yield await self.reader.read()
            headers["connection"] = "close"

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except OSError:
                pass
            self.reader = self.writer = None


async def gateway_level(gateway: Gateway, requests: list[Request], texts: list[str], concurrency: int) -> dict:
    """Serves the requests through smg with `concurrency` clients, each sending its next request when its
    last one's stream has ended; the level's figures, named as load.LevelResult.summary names them."""
    res = LevelResult(concurrency)
    token_events = mismatches = 0
    queue = iter(range(len(requests)))

    async def client() -> None:
        nonlocal token_events, mismatches
        conn = Connection(gateway.port)
        try:
            for i in queue:
                request = requests[i]
                payload = {"model": gateway.model_id, "prompt": texts[i], "max_tokens": request.output_len,
                           "temperature": 0, "ignore_eos": True, "stream": True,
                           "stream_options": {"include_usage": True},
                           "skip_special_tokens": False}  # a special token streams as text too, as its own event
                sent = time.perf_counter()
                first = last = None
                events, usage = 0, None
                async for at, event in conn.stream("/v1/completions", payload):
                    usage = event.get("usage") or usage
                    choices = event.get("choices") or ()
                    if choices and choices[0].get("text"):
                        if last is None:
                            first = at
                            res.ttft.append(at - sent)
                        else:
                            res.itl.append(at - last)
                        last, events = at, events + 1
                token_events += events
                tokens = usage["completion_tokens"] if usage else events
                if tokens > 1 and first is not None:
                    res.tpot.append((last - first) / (tokens - 1))
                res.output_tokens += tokens
                res.prompt_tokens += usage["prompt_tokens"] if usage else 0
                mismatches += usage is None or usage["prompt_tokens"] != len(request.prompt)
        finally:
            await conn.close()

    t0, cpu0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    res.seconds = time.perf_counter() - t0
    # The clients' own CPU time over the wall time: near 1, the clients (one Python thread) are what limits the level.
    client_cpu = (time.process_time() - cpu0) / res.seconds
    full = res.summary()
    return {**{k: full[k] for k in ("concurrency", "output_tokens", "seconds", "tokens_per_s", "ttft_p50_ms",
                                    "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "tpot_p50_ms", "tpot_p99_ms",
                                    "prompt_tokens")},
            "requests": len(requests), "token_events": token_events, "prompt_token_mismatches": mismatches,
            "client_cpu_share": round(client_cpu, 3)}


# --------------------------------------------------------------------------------------------------

def worker_work(before, after, seconds: float) -> dict:
    """What the worker did over a level, from two Infos' step counters: decode steps per second, their mean batch,
    the device's busy share in decode and in prefill. Fewer steps at the same batch: the worker's host side paced
    them; smaller batches: the requests came in slower."""
    a, b = before.steps, after.steps
    steps = b.decode_steps - a.decode_steps
    return {"decode_steps_per_s": round(steps / seconds, 1) if seconds else None,
            "mean_batch": round((b.decode_sequences - a.decode_sequences) / steps, 2) if steps else None,
            "decode_busy": round((b.decode_device_ns - a.decode_device_ns) / 1e9 / seconds, 3) if seconds else None,
            "prefill_busy": round((b.prefill_device_ns - a.prefill_device_ns) / 1e9 / seconds, 3) if seconds else None,
            "prefill_tokens": b.prefill_tokens - a.prefill_tokens}


def compare(concurrency: int, direct: dict, gateway: dict) -> dict:
    """A level's row: both paths' figures and gateway / direct."""
    ratios = {key: round(gateway[key] / direct[key], 3) if direct[key] else None
              for key in ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "tpot_p50_ms",
                          "tpot_p99_ms")}
    print(f"C={concurrency}: tokens/s direct {direct['tokens_per_s']:,.0f}, gateway {gateway['tokens_per_s']:,.0f} "
          f"({ratios['tokens_per_s']}); TTFT p50 {direct['ttft_p50_ms']:.2f} / {gateway['ttft_p50_ms']:.2f} ms; "
          f"ITL p50 {direct['itl_p50_ms']:.2f} / {gateway['itl_p50_ms']:.2f} ms; "
          f"TPOT p50 {direct['tpot_p50_ms']:.2f} / {gateway['tpot_p50_ms']:.2f} ms; output tokens "
          f"{direct['output_tokens']} / {gateway['output_tokens']}")
    for name, level in (("direct", direct), ("gateway", gateway)):
        w = level.get("worker") or {}
        print(f"  {name}: {w.get('decode_steps_per_s')} decode steps/s, mean batch {w.get('mean_batch')}, device busy "
              f"{w.get('decode_busy')} decode + {w.get('prefill_busy')} prefill")
    return {"concurrency": concurrency, "requests": gateway["requests"], "direct": direct, "gateway": gateway,
            "gateway_over_direct": ratios}


def median_round(rounds: list[dict]) -> dict:
    """The round of median gateway / direct tok/s (the lower middle one of an even count), with every round's
    ratio (`round_ratios`, in run order) and their median (`median_ratio`)."""
    ratios = [r["gateway_over_direct"]["tokens_per_s"] for r in rounds]
    order = sorted(range(len(rounds)), key=lambda i: ratios[i])
    row = dict(rounds[order[(len(rounds) - 1) // 2]])
    row["round_ratios"] = ratios
    row["median_ratio"] = statistics.median(ratios)
    if len(rounds) > 1:
        print(f"C={row['concurrency']}: gateway / direct tok/s over {len(rounds)} rounds {ratios}, median "
              f"{row['median_ratio']:.3f}")
    return row


def run(args, model: str, target: str, proc, engine_flags: list[str], out_dir: pathlib.Path) -> int:
    """load.py --gateway on a spawned (or --target) worker; writes load-gateway-*.json."""
    model_dir = pathlib.Path(model)
    backend = load.GrpcBackend(target, decode_stream=args.decode[0] == "stream")
    info = backend.client.info()
    meta = load.run_meta(args, info, model, engine_flags, load.gpu_name() if proc is not None else None)
    gateway = None
    rows = []
    try:
        gateway = Gateway(target, model_dir, args.smg_flags.split())
        meta["smg"] = {"version": gateway.version, "command": gateway.command[2:], "ready_s": gateway.ready_s,
                       "model_id": gateway.model_id, "log": gateway.log_path}
        depth = args.pipeline[0]
        for c in args.concurrency:
            n = args.requests or max(4 * c, 32)
            drawn = load.make_requests(n, args.seed + c, info.vocab_size, args.prompt_len, args.output_len, args.trace)
            requests, texts = as_text(drawn, model_dir)
            warm = min(n, 2 * c)
            load.run_level(backend, requests[:warm], c, 0, pipeline=depth)
            asyncio.run(gateway_level(gateway, requests[:warm], texts[:warm], c))
            rounds = []
            for _ in range(args.gateway_rounds):
                backend.flush_cache()
                before = backend.client.info()
                level = load.run_level(backend, requests, c, 0, pipeline=depth)
                direct = {**level.summary(), "requests": len(level.first_tokens)}
                direct["worker"] = worker_work(before, backend.client.info(), direct["seconds"])
                backend.flush_cache()
                before = backend.client.info()
                through = asyncio.run(gateway_level(gateway, requests, texts, c))
                through["worker"] = worker_work(before, backend.client.info(), through["seconds"])
                rounds.append(compare(c, direct, through))
            rows.append(median_round(rounds))
    finally:
        if gateway is not None:
            gateway.stop()
        backend.close()
    results = {"meta": meta, "grpc": [], "in_process": [], "raw_grpc": [], "gateway": rows}
    load.write_results(results, out_dir, "gateway")
    return 0
