"""Prefix-sharing workloads for bench/load.py (--prefix), each run with the worker's prefix cache on and off.

multiturn: C users each hold a conversation of --turns turns. A turn's prompt is the whole history so far
(one system prompt of --system-len tokens that every user shares, the user's earlier messages and the
model's answers) plus a new user message of --message-len tokens; its answer is --output-len tokens
(ignore_eos), and the user's next turn is sent once that answer has finished. C x turns requests.
sysprompt: every request is one common system prompt of --system-len tokens plus a unique suffix of
--message-len tokens, answered with --output-len tokens; --requests of them (default max(4C, 32)).

One run spawns a worker with --prefix-caching, serves every workload at every --concurrency through
load.py's router, stops it, then does the same with a second worker started with --no-prefix-caching.
Each level is preceded by a warm-up of the same shapes with other tokens and then FlushCache, so it
starts from an empty cache. Per level and setting: load.py's level summary (TTFT p50/p99, output
tokens/s, ITL, ...), the worker's hit rate over the level (the change of Info.prefix_cache.hit_tokens
over that of query_tokens), for multiturn the TTFT p50 of each turn; then per level the ratios on/off.

    python bench/load.py --shape tiny --prefix multiturn sysprompt --concurrency 4 --turns 4 \\
        --system-len 64 --message-len 16 --output-len 16
"""
from __future__ import annotations

import collections
import json
import time
from dataclasses import dataclass

import numpy as np

import load
from load import Request

WARM_UP_SEED = 1_000_003  # added to a level's seed: the warm-up's tokens are none of the level's


def add_arguments(p) -> None:
    p.add_argument("--prefix", nargs="+", choices=["multiturn", "sysprompt"], default=[],
                   help="instead of the sweep: these prefix-sharing workloads at each --concurrency, each with the "
                        "prefix cache on and then off (two spawned workers, one after the other; bench/load_prefix.py)")
    p.add_argument("--turns", type=int, default=8, help="--prefix multiturn: turns per conversation")
    p.add_argument("--system-len", type=int, default=512, help="--prefix: tokens of the shared system prompt")
    p.add_argument("--message-len", type=int, default=64,
                   help="--prefix: tokens of each new user message (multiturn) or unique suffix (sysprompt); "
                        "--output-len is then every answer's length")


def check_arguments(p, args) -> None:
    if not args.prefix:
        return
    if args.target:
        p.error("--prefix starts its own workers (prefix caching on, then off); it cannot use --target")
    if "--no-prefix-caching" in args.engine_flags.split():
        p.error("--prefix runs every workload with prefix caching on and off; leave --no-prefix-caching out")
    if args.spec or args.soak:
        p.error("--prefix measures Decode steps at each --concurrency: leave --spec and --soak out")
    if min(args.turns, args.system_len, args.message_len, args.output_len) < 1:
        p.error("--prefix needs --turns, --system-len, --message-len and --output-len of at least 1")


@dataclass(frozen=True)
class Turn(Request):
    user: int = 0
    turn: int = 1  # 1 .. turns


class Conversations:
    """The multiturn workload as a request source (load.RequestList's contract): every user's first turn is
    ready at once; a user's next turn becomes ready when the sequence of its last one finishes, its prompt
    that sequence's tokens (prompt + answer) followed by the user's next message."""

    def __init__(self, users: int, turns: int, system_len: int, message_len: int, output_len: int, vocab: int,
                 seed: int):
        rng = np.random.default_rng(seed)
        system = tuple(int(t) for t in rng.integers(0, vocab, system_len))
        # Every message is drawn up front, so that a run sends the same ones whatever order the turns end in.
        self.messages = [[tuple(int(t) for t in rng.integers(0, vocab, message_len)) for _ in range(turns)]
                         for _ in range(users)]
        self.turns, self.output_len = turns, output_len
        self.waiting = collections.deque(Turn(system + self.messages[u][0], output_len, u, 1) for u in range(users))

    def ready(self) -> bool:
        return bool(self.waiting)

    def take(self) -> Turn:
        return self.waiting.popleft()

    def finished(self, request: Turn, history: list[int]) -> None:
        if request.turn < self.turns:
            message = self.messages[request.user][request.turn]
            self.waiting.append(Turn(tuple(history) + message, self.output_len, request.user, request.turn + 1))


def shared_prefix_requests(n: int, system_len: int, suffix_len: int, output_len: int, vocab: int,
                           seed: int) -> list[Request]:
    """n requests: one system prompt of system_len random tokens, each followed by suffix_len of its own."""
    rng = np.random.default_rng(seed)
    system = tuple(int(t) for t in rng.integers(0, vocab, system_len))
    return [Request(system + tuple(int(t) for t in rng.integers(0, vocab, suffix_len)), output_len) for _ in range(n)]


def workload(name: str, args, concurrency: int, vocab: int, warm_up: bool = False):
    """A level's request source; the warm-up's has the same shapes (fewer turns or requests), other tokens."""
    seed = args.seed + concurrency + (WARM_UP_SEED if warm_up else 0)
    if name == "multiturn":
        turns = min(args.turns, 2) if warm_up else args.turns
        return Conversations(concurrency, turns, args.system_len, args.message_len, args.output_len, vocab, seed)
    n = concurrency if warm_up else (args.requests or max(4 * concurrency, 32))
    return load.RequestList(shared_prefix_requests(n, args.system_len, args.message_len, args.output_len, vocab, seed))


def measure(backend, name: str, args, concurrency: int, vocab: int) -> dict:
    """One level: warm-up, FlushCache, the level; its summary with the worker's hit rate over the level."""
    depth = args.pipeline[0]
    load.run_level(backend, workload(name, args, concurrency, vocab, warm_up=True), concurrency, 0, pipeline=depth)
    backend.flush_cache()
    before = backend.prefix_counters()
    level = load.run_level(backend, workload(name, args, concurrency, vocab), concurrency, 0, pipeline=depth)
    query_tokens, hit_tokens = (b - a for a, b in zip(before, backend.prefix_counters()))
    out = {**level.summary(), "requests": len(level.first_tokens), "query_tokens": query_tokens,
           "hit_tokens": hit_tokens, "hit_rate": round(hit_tokens / query_tokens, 4) if query_tokens else 0.0}
    if name == "multiturn":
        by_turn = collections.defaultdict(list)
        for request, ttft, _ in level.first_tokens:
            by_turn[request.turn].append(ttft)
        out["ttft_p50_ms_by_turn"] = [round(1e3 * load.percentile(by_turn[t], 50), 3) for t in sorted(by_turn)]
    return out


def compare(name: str, concurrency: int, on: dict, off: dict, args) -> dict:
    """A level's row: both settings' figures and the ratios on / off (TTFT below 1 is the cache's gain)."""
    def ratio(key: str) -> float | None:
        return round(on[key] / off[key], 3) if off[key] else None

    row = {"workload": name, "concurrency": concurrency, "requests": on["requests"],
           **({"turns": args.turns} if name == "multiturn" else {}), "system_len": args.system_len,
           "message_len": args.message_len, "output_len": args.output_len, "on": on, "off": off,
           "ttft_p50_on_over_off": ratio("ttft_p50_ms"), "ttft_p99_on_over_off": ratio("ttft_p99_ms"),
           "tokens_per_s_on_over_off": ratio("tokens_per_s")}
    print(f"{name} C={concurrency}: TTFT p50 on/off {on['ttft_p50_ms']:.2f}/{off['ttft_p50_ms']:.2f} ms "
          f"(on/off {row['ttft_p50_on_over_off']}), p99 {on['ttft_p99_ms']:.2f}/{off['ttft_p99_ms']:.2f} ms; "
          f"tokens/s {on['tokens_per_s']:,.0f}/{off['tokens_per_s']:,.0f}; "
          f"hit rate {on['hit_rate']:.3f}/{off['hit_rate']:.3f}")
    return row


def run(args, model: str, engine_flags: list[str], out_dir) -> int:
    """load.py --prefix: both settings, one worker each, one after the other; writes load-prefix-*.json."""
    settings = {"on": [*engine_flags, "--prefix-caching"], "off": [*engine_flags, "--no-prefix-caching"]}
    measured: dict[tuple, dict] = {}
    meta: dict = {}
    for setting, flags in settings.items():
        t_spawn = time.perf_counter()
        proc, target = load.spawn_worker(model, flags)
        ready_s = round(time.perf_counter() - t_spawn, 2)
        backend = None
        try:
            backend = load.GrpcBackend(target, decode_stream=args.decode[0] == "stream")
            info = backend.client.info()
            if not meta:
                args.worker_ready_s = ready_s
                meta = load.run_meta(args, info, model, engine_flags, load.gpu_name())
            meta.setdefault("prefix_caching", {})[setting] = {"enabled": info.prefix_cache.enabled,
                                                             "engine_flags": flags, "worker_ready_s": ready_s}
            for name in args.prefix:
                for c in args.concurrency:
                    level = measured[setting, name, c] = measure(backend, name, args, c, info.vocab_size)
                    print(json.dumps({"prefix_caching": setting, "workload": name, "concurrency": c,
                                      **{k: level[k] for k in ("requests", "tokens_per_s", "ttft_p50_ms",
                                                               "ttft_p99_ms", "itl_p50_ms", "hit_rate")}}))
        finally:
            if backend is not None:
                backend.close()
            load.stop_worker(proc)
    rows = [compare(name, c, measured["on", name, c], measured["off", name, c], args)
            for name in args.prefix for c in args.concurrency]
    results = {"meta": meta, "grpc": [], "in_process": [], "raw_grpc": [], "prefix": rows}
    load.write_results(results, out_dir, "prefix")
    return 0
