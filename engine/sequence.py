"""Per-request state (Sequence), the live sequences by id with the checks every call makes on them
(SequenceTable), and the free list of slots (SlotTable)."""
from __future__ import annotations

import array
import enum
from dataclasses import dataclass, field

import numpy as np

from engine.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from engine.sampling import SamplingParams, StoppingCriteria
from engine.sequence_blocks import SequenceBlocks


PACKED_CHECK_MIN = 64  # token lists longer than this are range-checked as a packed array


class FinishReason(enum.IntEnum):  # values match the proto's FinishReason
    NONE = 0
    LENGTH = 1
    EOS = 2
    STOP_TOKEN = 3
    STOP_STRING = 4  # set by the worker's Generate (worker/stop_strings.py), never by the engine


@dataclass
class Sequence:
    """A live sequence. token_ids holds the prompt and every generated token; the KV cache holds the
    first num_cached of them. Once the prompt is complete, exactly the last token is not cached: it
    is the next step's input."""

    seq_id: int
    slot: int
    capacity: int  # most tokens the sequence may hold (its reservation)
    blocks: SequenceBlocks  # its reservation, shared and own KV blocks
    sampling: SamplingParams
    stopping: StoppingCriteria
    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    num_cached: int = 0
    prompt_len: int = 0  # set when the prompt completes
    cached_prompt_tokens: int = 0  # leading prompt tokens whose KV came from the prefix cache
    finish_reason: FinishReason = FinishReason.NONE
    mask_ready: bool = False  # a token mask was set for its next sampled token (sampling.token_mask)

    @property
    def prompt_done(self) -> bool:
        return self.prompt_len > 0

    @property
    def finished(self) -> bool:
        return self.finish_reason != FinishReason.NONE

    @property
    def seq_len(self) -> int:
        return len(self.token_ids)

    @property
    def num_final(self) -> int:
        """Positions whose KV is final once the steps that wrote them completed: every cached one once the
        prompt is complete, all but the last while it is not (an empty final chunk recomputes it)."""
        return self.num_cached if self.prompt_done else self.num_cached - 1

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len if self.prompt_done else 0

    def append(self, token_id: int, eos_token_ids: frozenset[int]) -> FinishReason:
        """Adds a generated token and decides whether it finishes the sequence."""
        tokens, stopping = self.token_ids, self.stopping  # (run for every token: locals, no properties)
        tokens.append(token_id)
        max_new = stopping.max_new_tokens
        if token_id in stopping.stop_token_ids:
            self.finish_reason = FinishReason.STOP_TOKEN
        elif token_id in eos_token_ids and not stopping.ignore_eos:
            self.finish_reason = FinishReason.EOS
        elif len(tokens) >= self.capacity or (max_new and self.prompt_len and len(tokens) - self.prompt_len >= max_new):
            self.finish_reason = FinishReason.LENGTH
        return self.finish_reason


class SlotTable:
    """Free list of slots: the row of the device-side per-sequence state a sequence owns."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def can_allocate(self) -> bool:
        return bool(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise ResourceExhausted(f"all {self.num_slots} sequence slots are in use")
        return self._free.pop()

    def free(self, slot: int) -> None:
        self._free.append(slot)


class SequenceTable:
    """The live sequences by id, and the checks a call makes on the ids and tokens it is given (each raises
    the EngineError the call answers with, before anything changes)."""

    def __init__(self, vocab_size: int, max_batch_size: int):
        self.vocab_size = vocab_size
        self.max_batch_size = max_batch_size
        self._by_id: dict[int, Sequence] = {}
        self._next_id = 1

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._by_id

    def __getitem__(self, seq_id: int) -> Sequence:
        return self._by_id[seq_id]

    def values(self):
        return self._by_id.values()

    def new_id(self) -> int:
        seq_id, self._next_id = self._next_id, self._next_id + 1
        return seq_id

    def add(self, seq: Sequence) -> None:
        self._by_id[seq.seq_id] = seq

    def remove(self, seq_id: int) -> Sequence:
        return self._by_id.pop(seq_id)

    def clear(self) -> None:
        self._by_id.clear()

    def check_ids(self, seq_ids: list[int], limit: bool = True) -> list[Sequence]:
        """The sequences of a batch: not empty, at most max_batch_size (with limit), no duplicates, all known."""
        if not seq_ids:
            raise InvalidArgument("the batch is empty")
        if limit and len(seq_ids) > self.max_batch_size:
            raise ResourceExhausted(f"batch of {len(seq_ids)} sequences exceeds max_batch_size="
                                    f"{self.max_batch_size}")
        if len(set(seq_ids)) != len(seq_ids):
            dups = sorted({i for i in seq_ids if seq_ids.count(i) > 1})
            raise InvalidArgument(f"duplicate sequence ids in one batch: {dups[:8]}")
        unknown = [i for i in seq_ids if i not in self._by_id]
        if unknown:
            raise NotFound(f"unknown sequence ids: {unknown[:8]}")
        return [self._by_id[i] for i in seq_ids]

    @staticmethod
    def check_masks(seqs: list[Sequence]) -> None:
        """Every sequence that samples under a token mask has had one set for the token it samples next."""
        for seq in seqs:
            if seq.sampling.token_mask and not seq.mask_ready:
                raise FailedPrecondition(f"sequence {seq.seq_id} samples under a token mask (structured output): "
                                         f"set its mask for the next token before each step (Engine.set_token_mask)")

    @staticmethod
    def check_running(seqs: list[Sequence]) -> None:
        """Every sequence has a complete prompt and has not finished (what a decode or verify step needs)."""
        if all(seq.prompt_len and not seq.finish_reason for seq in seqs):  # every step: the common case first
            return
        for seq in seqs:
            if not seq.prompt_done:
                raise FailedPrecondition(f"sequence {seq.seq_id}: the prompt is not complete (prefill first)")
            if seq.finished:
                raise FailedPrecondition(f"sequence {seq.seq_id} has finished ({seq.finish_reason.name}); "
                                         f"release it")

    def check_tokens(self, token_ids: list[int], what: str) -> np.ndarray | None:
        """Every id is inside the vocabulary. Returns the ids as uint32 where it packed them to check them (more
        than PACKED_CHECK_MIN ids), else None."""
        vocab = self.vocab_size
        if len(token_ids) > PACKED_CHECK_MIN:  # packed in C: a 4k-token prompt's check takes ~35 us, not ~100
            try:
                packed = np.frombuffer(array.array("I", token_ids), dtype=np.uint32)
                if packed.max() < vocab:
                    return packed
            except (OverflowError, TypeError):  # an id outside [0, 2**32), or not an integer: named below
                pass
        elif not token_ids or (min(token_ids) >= 0 and max(token_ids) < vocab):
            return None
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidArgument(f"{what}: token ids {bad[:8]} are outside the vocabulary (size {vocab})")
