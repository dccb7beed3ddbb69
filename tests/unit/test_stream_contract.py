"""The engine's stream contract, checked on the CPU: every write into the slot state and the KV cache is queued in a
block that runs torch's work on the compute stream (StepDispatch.on_device with torch_stream, or compute_stream).

Why: on a GPU the engine's compute stream is a non-blocking stream, which does not wait for torch's default stream.
A write queued on the default stream (a host-to-device copy from pageable memory returns once staged, before it
lands) need not have landed when the compute stream's forwards read it: a score's attention once read a stale
block-table row that way when other processes kept the copy engines busy (bench/RESULTS.md, "Correctness runs on
the device"). The CPU runs everything at once, so the check is structural: a dispatch mode sees every aten op that
writes into a tensor sharing storage with the state or the cache, and records whether a compute-stream block was
open around it."""
from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import engine_config
from engine.api import PrefillItem, VerifyItem
from engine.engine import Engine
from engine.sampling import SamplingParams, StoppingCriteria


class WritesOutsideComputeStream(TorchDispatchMode):
    """Records each aten op that writes into one of `storages` while depth[0] == 0 (no compute-stream block open)."""

    def __init__(self, storages: set[int], depth: list[int]):
        super().__init__()
        self.storages, self.depth = storages, depth
        self.outside: list[str] = []
        self.inside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() in self.storages:
                if self.depth[0]:
                    self.inside += 1
                else:
                    self.outside.append(str(func))
        return func(*args, **kwargs)


def test_every_write_to_the_slot_state_and_the_kv_cache_is_queued_on_the_compute_stream(tiny_model, monkeypatch):
    engine = Engine(engine_config(tiny_model, max_prefill_tokens=16))
    rt = engine.runtime
    depth = [0]

    @contextlib.contextmanager
    def counted(inner):
        depth[0] += 1
        try:
            with inner as value:
                yield value
        finally:
            depth[0] -= 1

    on_device, compute_stream = rt.dispatch.on_device, rt.dispatch.compute_stream

    def on_device_counted(*args, torch_stream: bool = True, **kwargs):
        inner = on_device(*args, torch_stream=torch_stream, **kwargs)
        return counted(inner) if torch_stream else inner  # torch_stream=False leaves torch's stream alone

    monkeypatch.setattr(rt.dispatch, "on_device", on_device_counted)
    monkeypatch.setattr(rt.dispatch, "compute_stream", lambda: counted(compute_stream()))
    tensors = [t for t in vars(rt.state).values() if isinstance(t, torch.Tensor) and not t.is_pinned()]
    tensors += [t for t in vars(rt.kv).values() if isinstance(t, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    assert len(storages) > 20  # the state's rows and the cache's K and V
    vocab = rt.vocab_size
    tokens = [(7 * i) % vocab for i in range(1, 40)]
    mode = WritesOutsideComputeStream(storages, depth)
    try:
        with mode:
            penalized = SamplingParams(temperature=0.8, seed=3, repetition_penalty=1.2, frequency_penalty=0.5)
            a = engine.alloc_sequence(96, penalized, StoppingCriteria()).seq_id
            b = engine.alloc_sequence(96, SamplingParams(token_mask=True), StoppingCriteria(min_tokens=2)).seq_id
            engine.prefill([PrefillItem(a, tokens[:20], partial=True)])
            engine.set_token_mask(b, _all_tokens(vocab))
            engine.prefill([PrefillItem(a, tokens[20:]), PrefillItem(b, tokens[:30])])
            for _ in range(3):
                engine.set_token_mask(b, _all_tokens(vocab))
                engine.decode([a, b])
            engine.set_token_mask(b, _all_tokens(vocab))
            step = engine.decode_launch([a, b])
            engine.finish(step)
            engine.release([b])
            engine.verify([VerifyItem(a, [1, 2, 3])])
            engine.verify([VerifyItem(a, [4, 5])])
            engine.score(tokens)
            engine.prompt_logprobs(tokens, 2)
            engine.embed(tokens)
            c = engine.alloc_sequence(96, SamplingParams(), StoppingCriteria()).seq_id  # its prefix is cached
            engine.prefill([PrefillItem(c, tokens[:36])])
            engine.release([a, c])
            engine.flush_cache()
    finally:
        engine.close()
    assert mode.inside > 100  # the check saw the engine's writes
    assert not mode.outside, sorted(set(mode.outside))


def _all_tokens(vocab: int):
    import numpy as np

    return np.full(-(-vocab // 32), -1, dtype=np.int32)
