"""Where steps write their results for the host to read: a decode step's tokens per slot and position in
pinned memory, static device buffers (outside any CUDA-graph pool, so a replayed graph writes where the
host reads) for the rest, the slot-vector staging of the batch-width fallback graphs, and the pinned host
mirrors they go through."""
from __future__ import annotations

import contextlib

import torch

from engine.sampling import SampleOutput


class StepOutputs:
    """Where a step's results go for the host to read.

    A decode step's tokens and logprobs are kept per slot and position: slot_tokens / slot_logprobs
    [max_slots, R] at [slot, p % R], p the slot's num_cached before the step and R = `rings`, the steps that
    may be in flight. On a GPU both are pinned host memory that the commit kernel writes through unified
    addressing, so nothing is copied on the compute stream between one step and the next, and the host
    reads a step's results as soon as its event has completed. An entry is written again only by the step
    that commits position p + R of the same slot: one launched at least R steps later, when fewer than R
    steps are in flight, so after the step that wrote it was finished (read). A slot is freed only after
    every step that wrote it was finished (Engine.release), so a new sequence in it overwrites nothing
    unread.

    Prefill's first tokens and every top-logprob candidate go through static device buffers (outside any
    graph pool, so a replayed graph writes where the host reads) and one copy into pinned memory: for the
    candidates one set of pinned buffers per step in flight (`ring`), since a step copies its candidates
    out while the host still reads the previous step's. The prefill tokens (int64) and their logprobs
    (float32) share one allocation, tokens first: they come back in one copy of 8 * max_batch + 4 * n bytes
    (one driver call on a GPU)."""

    def __init__(self, max_batch: int, max_top: int, max_slots: int, device: torch.device, rings: int = 1):
        pin = device.type == "cuda"
        self.max_batch = max_batch
        self.slot_tokens = torch.zeros(max_slots, rings, dtype=torch.int64, pin_memory=pin)
        self.slot_logprobs = torch.zeros(max_slots, rings, dtype=torch.float32, pin_memory=pin)
        # numpy views of the same (pinned) memory: reading a few values back costs ~1 us through numpy, ~5 through torch
        self._slot_np = (self.slot_tokens.numpy().reshape(-1), self.slot_logprobs.numpy().reshape(-1))
        self.packed = torch.zeros(3 * max_batch, dtype=torch.int32, device=device)
        self.tokens, self.logprobs = _unpack(self.packed, max_batch)
        self.top_ids = torch.zeros(max_batch, max(max_top, 1), dtype=torch.int64, device=device)
        self.top_logprobs = torch.zeros(max_batch, max(max_top, 1), dtype=torch.float32, device=device)
        self.packed_host = torch.zeros(3 * max_batch, dtype=torch.int32, pin_memory=pin)
        self._packed_np = tuple(t.numpy() for t in _unpack(self.packed_host, max_batch))
        self.top_hosts = [tuple(torch.zeros(t.shape, dtype=t.dtype, pin_memory=pin)
                                for t in (self.top_ids, self.top_logprobs)) for _ in range(rings)]
        self._top_np = [tuple(t.numpy() for t in host) for host in self.top_hosts]

    def drop_top_hosts(self) -> None:
        """Drops the candidates' pinned buffers (torch's pinned allocator recorded its events for their copies
        on the compute stream: they go before the stream does)."""
        self.top_hosts.clear()
        self._top_np.clear()

    @property
    def rings(self) -> int:
        return self.slot_tokens.shape[1]

    def entries(self, seqs) -> list[int]:
        """The flat indices of slot_tokens / slot_logprobs that a decode step over `seqs` (Sequences, in the
        step's slot order, their num_cached not yet counting the step) writes."""
        r = self.rings
        return [s.slot * r + s.num_cached % r for s in seqs]

    def write(self, out: SampleOutput, num_top: int) -> None:
        """A prefill's sampled rows into the static device buffers."""
        n = out.token_ids.shape[0]
        self.tokens[:n].copy_(out.token_ids)
        self.logprobs[:n].copy_(out.logprobs)
        self.write_top(out, n, num_top)

    def write_top(self, out: SampleOutput, n: int, num_top: int) -> None:
        """The top-logprob candidates of the first n rows, if asked for."""
        if num_top:
            self.top_ids[:n, :num_top].copy_(out.top_ids)
            self.top_logprobs[:n, :num_top].copy_(out.top_logprobs)

    def read(self, n: int, num_top: int, streams) -> tuple[list[int], list[float], list | None, list | None]:
        """Copies a prefill's first n results to the host and waits for them (the stream): no step may
        be in flight (the candidates go through ring 0)."""
        if streams is not None:
            streams.to_host(self.packed_host, self.packed, 8 * self.max_batch + 4 * n)
        else:
            self.packed_host.copy_(self.packed)
        self.copy_top_to_host(n, num_top, 0, streams)
        if streams is not None:
            streams.compute.synchronize()
        tokens, logprobs = self._packed_np
        return tokens[:n].tolist(), logprobs[:n].tolist(), *self._top_values(n, num_top, 0)

    def copy_top_to_host(self, n: int, num_top: int, ring: int, streams) -> None:
        """Queues the copy of the first n rows' top-logprob candidates into pinned set `ring` (no host wait;
        nothing when none was asked for): on the compute stream with `streams`, else (CPU) at once."""
        if not num_top:
            return
        top_ids, top_lps = self.top_hosts[ring]
        with streams.compute_context() if streams is not None else contextlib.nullcontext():
            top_ids[:n, :num_top].copy_(self.top_ids[:n, :num_top], non_blocking=True)
            top_lps[:n, :num_top].copy_(self.top_logprobs[:n, :num_top], non_blocking=True)

    def step_values(self, entries: list[int], num_top: int, ring: int
                    ) -> tuple[list[int], list[float], list | None, list | None]:
        """A finished decode step's results: tokens and logprobs at `entries` (entries()), the candidates of
        its rows from pinned set `ring`."""
        tokens, logprobs = self._slot_np
        return tokens[entries].tolist(), logprobs[entries].tolist(), *self._top_values(len(entries), num_top, ring)

    def _top_values(self, n: int, num_top: int, ring: int) -> tuple[list | None, list | None]:
        if not num_top:
            return None, None
        top_ids, top_lps = self._top_np[ring]
        return top_ids[:n, :num_top].tolist(), top_lps[:n, :num_top].tolist()


def _unpack(packed: torch.Tensor, max_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The int64 tokens and float32 logprobs views of a packed [3 * max_batch] int32 buffer."""
    return packed[:2 * max_batch].view(torch.int64), packed[2 * max_batch:].view(torch.float32)


class SlotStaging:
    """The slot vector a batch-width fallback graph reads (device), written through pinned memory, one
    pinned buffer per step in flight (`ring`): a step rewrites its ring's buffer only after the step
    that last used it has finished, so the copy that step queued has run."""

    def __init__(self, max_batch: int, device: torch.device, rings: int = 1):
        self.device = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.host = [torch.zeros(max_batch, dtype=torch.int64, pin_memory=device.type == "cuda") for _ in range(rings)]
        self.host_np = [h.numpy() for h in self.host]


class VerifyOutputs:
    """Static buffers of the uniform Verify step: the drafts it reads (written before each step, through
    pinned memory) and its results, plus pinned host mirrors of the results. As in StepOutputs, the
    results the host always reads (accepted counts, next tokens, logprobs) share one allocation, read
    back in one copy: accepted int64 [max_batch], tokens int64 [max_batch], logprobs float32
    [max_batch, max_drafts + 1]."""

    def __init__(self, max_batch: int, max_drafts: int, max_top: int, device: torch.device):
        pin, n = device.type == "cuda", max_drafts + 1
        self.max_batch, self.n = max_batch, n
        self.drafts = torch.zeros(max_batch, max_drafts, dtype=torch.int64, device=device)
        self.packed = torch.zeros(4 * max_batch + max_batch * n, dtype=torch.int32, device=device)
        self.accepted, self.tokens, self.logprobs = self._views(self.packed)
        self.top_ids = torch.zeros(max_batch * n, max(max_top, 1), dtype=torch.int64, device=device)
        self.top_logprobs = torch.zeros(max_batch * n, max(max_top, 1), dtype=torch.float32, device=device)
        packed = torch.zeros(self.packed.shape, dtype=torch.int32, pin_memory=pin)
        self.host = [packed, torch.zeros(self.drafts.shape, dtype=torch.int64, pin_memory=pin),
                     *(torch.zeros(t.shape, dtype=t.dtype, pin_memory=pin) for t in (self.top_ids, self.top_logprobs))]
        self.host_np = [t.numpy() for t in (*self._views(packed), self.host[1])]  # accepted, tokens, logprobs, drafts

    def drop_hosts(self) -> None:
        """Drops the pinned mirrors (before the compute stream they were copied on goes)."""
        self.host.clear()
        self.host_np.clear()

    def _views(self, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mb = self.max_batch
        return (packed[:2 * mb].view(torch.int64), packed[2 * mb:4 * mb].view(torch.int64),
                packed[4 * mb:].view(torch.float32).view(mb, self.n))

    def write_top(self, out, rows: int, num_top: int) -> None:
        """The top-logprob candidates of the step's `rows` sampled rows (out: a SampleOutput), if asked for."""
        if num_top:
            self.top_ids[:rows, :num_top].copy_(out.top_ids)
            self.top_logprobs[:rows, :num_top].copy_(out.top_logprobs)

    def write_drafts(self, drafts: list[list[int]], k: int, streams) -> None:
        """drafts[b][:k] into rows [:len(drafts)] of the device buffer: through its pinned mirror on the
        compute stream (GPU; the mirror is free again once the previous Verify's read returned), else a
        copy."""
        b = len(drafts)
        if streams is None:
            self.drafts[:b, :k].copy_(torch.tensor(drafts, dtype=torch.int64))
            return
        self.host_np[3][:b, :k] = drafts
        streams.to_device(self.drafts, self.host[1], b * self.drafts.shape[1] * 8)

    def read(self, batch: int, n: int, num_top: int, streams):
        """Copies the first `batch` results to the host and waits for them (no step may be in flight)."""
        packed, _, top_ids, top_lps = self.host
        if streams is not None:
            streams.to_host(packed, self.packed, 16 * self.max_batch + 4 * batch * self.n)
        else:
            packed.copy_(self.packed)
        if num_top:
            with streams.compute_context() if streams is not None else contextlib.nullcontext():
                top_ids[:batch * n, :num_top].copy_(self.top_ids[:batch * n, :num_top], non_blocking=True)
                top_lps[:batch * n, :num_top].copy_(self.top_logprobs[:batch * n, :num_top], non_blocking=True)
        if streams is not None:
            streams.compute.synchronize()
        accepted, tokens, logprobs, _ = self.host_np
        return (accepted[:batch].tolist(), tokens[:batch].tolist(), logprobs[:batch, :n].tolist(),
                top_ids[:batch * n, :num_top].tolist() if num_top else None,
                top_lps[:batch * n, :num_top].tolist() if num_top else None)
