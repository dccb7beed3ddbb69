"""Per-request state (Sequence) and the free list of slots (SlotTable)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.errors import ResourceExhausted
from engine.sampling import SamplingParams, StoppingCriteria


class FinishReason(enum.IntEnum):  # values match the proto's FinishReason
    NONE = 0
    LENGTH = 1
    EOS = 2
    STOP_TOKEN = 3


@dataclass
class Sequence:
    """A live sequence. token_ids holds the prompt and every generated token; the KV cache holds the
    first num_cached of them. Once the prompt is complete, exactly the last token is not cached: it
    is the next step's input."""

    seq_id: int
    slot: int
    capacity: int  # most tokens the sequence may hold (its reservation)
    block_ids: list[int]
    sampling: SamplingParams
    stopping: StoppingCriteria
    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    num_cached: int = 0
    prompt_len: int = 0  # set when the prompt completes
    finish_reason: FinishReason = FinishReason.NONE

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
