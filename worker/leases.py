"""Leases: which client holds which sequences and when a call last touched them.

Enforces the per-client limit on live sequences and finds sequences idle past the timeout, so a
router that crashed cannot exhaust the worker. Used from the engine thread only."""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

from engine.errors import ResourceExhausted


@dataclass
class _Lease:
    client: str
    touched: float


class Leases:
    def __init__(self, max_per_client: int = 0, idle_timeout_s: float = 0.0, clock=time.monotonic):
        self.max_per_client = max_per_client
        self.idle_timeout_s = idle_timeout_s
        self._clock = clock
        self._leases: dict[int, _Lease] = {}
        self._per_client: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._leases)

    def check_can_add(self, client: str) -> None:
        if self.max_per_client and self._per_client[client] >= self.max_per_client:
            raise ResourceExhausted(f"client {client!r} holds {self._per_client[client]} live sequences, the limit "
                                    f"(max_live_sequences_per_client={self.max_per_client}); release some first")

    def add(self, seq_id: int, client: str) -> None:
        self._leases[seq_id] = _Lease(client, self._clock())
        self._per_client[client] += 1

    def touch(self, seq_ids: list[int]) -> None:
        now, get = self._clock(), self._leases.get
        for i in seq_ids:  # (every step: one lookup each)
            lease = get(i)
            if lease is not None:
                lease.touched = now

    def remove(self, seq_ids: list[int]) -> None:
        for i in seq_ids:
            lease = self._leases.pop(i, None)
            if lease is not None:
                self._per_client[lease.client] -= 1
                if not self._per_client[lease.client]:
                    del self._per_client[lease.client]

    def expired(self) -> list[int]:
        """Sequences no call touched for idle_timeout_s (none when the timeout is off)."""
        if not self.idle_timeout_s:
            return []
        limit = self._clock() - self.idle_timeout_s
        return [i for i, lease in self._leases.items() if lease.touched < limit]
