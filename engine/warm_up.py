"""Warm-up before serving: one real step, then every prefill shape and decode batch width the engine will run,
so that no request pays a shape's first call (cuBLAS picks its kernels per new GEMM shape, ~6 ms of host time
per prefill forward at 1B; cuDNN's attention plans each new shape, ~45 ms) or a width's CUDA-graph capture (~5-10
ms). Scratch sequences, released after."""
from __future__ import annotations

import logging
import time

from engine import api
from engine.errors import ResourceExhausted
from engine.sampling import SamplingParams, StoppingCriteria

log = logging.getLogger(__name__)


def warm_up(engine) -> None:
    """One real prefill and decode step (the device answered a real forward before the worker says SERVING),
    then warm_up_prefill and warm_up_decode."""
    seq = engine.alloc_sequence(4, SamplingParams(), StoppingCriteria(max_new_tokens=2, ignore_eos=True),
                                prefix_caching=False)
    try:
        engine.prefill([api.PrefillItem(seq.seq_id, [0, 0])])
        engine.decode([seq.seq_id])
    finally:
        engine.release([seq.seq_id])
    t0 = time.perf_counter()
    forwards = warm_up_prefill(engine)
    rt = engine.runtime
    shapes = rt.ops.warm_up_prefill_attention(rt.shard.num_heads, rt.shard.num_kv_heads, engine.model_config.head_dim,
                                              rt.dtype, engine.config.max_prefill_tokens, engine.max_seq_len)
    if forwards or shapes:
        log.info("warmed up %d prefill sizes and %d long-prompt attention shapes in %.1fs", forwards, shapes,
                 time.perf_counter() - t0)
    t0 = time.perf_counter()
    widths = warm_up_decode(engine)
    if widths:
        log.info("captured the decode graphs of %d batch widths in %.1fs", widths, time.perf_counter() - t0)


def warm_up_prefill(engine) -> int:
    """One prefill forward at each padded token count the backend runs prompts at (Prefiller.buckets); sizes
    that replay graphs run twice, so each shape's graph is captured here. Stops at the first size the KV cache
    cannot hold. Returns the forwards run."""
    limit = min(engine.config.max_prefill_tokens, engine.max_seq_len - 1)
    done = 0
    for _, lengths, graphed in engine.prefiller.buckets(limit):
        for _ in range(2 if graphed else 1):
            seq_ids = []
            try:
                for m in lengths:
                    seq_ids.append(engine.alloc_sequence(m + 1, SamplingParams(), StoppingCriteria(max_new_tokens=1),
                                                         prefix_caching=False).seq_id)
                engine.prefill([api.PrefillItem(i, [0] * m) for i, m in zip(seq_ids, lengths)])
            except ResourceExhausted:
                return done
            finally:
                if seq_ids:
                    engine.release(seq_ids)
        done += 1
    return done


def warm_up_decode(engine, widths: list[int] | None = None) -> int:
    """Captures the decode graph of each batch width (default 1..config.warm_up_widths, -1: up to
    max_batch_size), the graph every batch of that width replays until its own slot vector has one, for steps
    without top logprobs. Widest first: the narrower captures then reuse the graph pool's blocks instead of
    growing it. One width at a time; a width the slots or the KV cache cannot hold is skipped. Returns the
    widths run (0 without CUDA graphs or fallback graphs, or with capture_after 1, where every batch captures
    its own)."""
    config = engine.config
    if engine.runtime.dispatch.graphs is None or not config.fallback_graphs or config.capture_after <= 1:
        return 0
    if widths is None:
        top = config.warm_up_widths
        widths = list(range(1, (config.max_batch_size if top < 0 else top) + 1))
    done = 0
    for width in sorted({w for w in widths if 1 <= w <= config.max_batch_size}, reverse=True):
        seq_ids = []
        try:
            for _ in range(width):
                seq_ids.append(engine.alloc_sequence(3, SamplingParams(), StoppingCriteria(max_new_tokens=2, ignore_eos=True),
                                                     prefix_caching=False).seq_id)
            engine.prefill([api.PrefillItem(i, [0]) for i in seq_ids])
            engine.decode(seq_ids)
            done += 1
        except ResourceExhausted:
            pass
        finally:
            if seq_ids:
                engine.release(seq_ids)
    return done
