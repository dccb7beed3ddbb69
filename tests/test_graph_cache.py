"""GraphCache policy on CPU with a fake capture backend: LRU order, admission, eviction never of a graph
whose replay is in flight, key canonicalisation, counters, capture failures."""
from __future__ import annotations

import pytest

from engine.cuda.graphs import GraphCache


class FakeBackend:
    def __init__(self):
        self.captured, self.replays, self.destroyed = [], [], []
        self.in_flight: set[int] = set()  # replay markers the "device" has not finished
        self.fail_next = False
        self._n = 0

    def capture(self, step):
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("out of memory")
        self._n += 1
        self.captured.append(self._n)
        return self._n

    def replay(self, graph):
        self.replays.append(graph)
        marker = (graph, len(self.replays))
        self.in_flight.add(marker)
        return marker

    def is_done(self, marker):
        return marker not in self.in_flight

    def finish_all(self):
        self.in_flight.clear()

    def destroy(self, graph):
        self.destroyed.append(graph)

    def pool_bytes(self):
        return 1000 * (len(self.captured) - len(self.destroyed))


def run(cache, key, log):
    return cache.run(key, lambda: (lambda: log.append(key)))


def test_key_is_the_sorted_slot_vector_plus_extras():
    assert GraphCache.key_for([5, 1, 3], 0) == GraphCache.key_for([3, 5, 1], 0) == ((1, 3, 5), 0)
    assert GraphCache.key_for([1, 3], 0) != GraphCache.key_for([1, 3], 2)


def test_admission_after_capture_after_sightings():
    backend, eager = FakeBackend(), []
    cache = GraphCache(backend, max_graphs=4, capture_after=3)
    key = GraphCache.key_for([0, 1])
    assert [run(cache, key, eager) for _ in range(5)] == [False, False, True, True, True]
    assert eager == [key, key]  # two eager steps, then captured (and replayed) on the third
    assert backend.captured == [1] and backend.replays == [1, 1, 1]
    s = cache.stats
    assert (s.hits, s.misses, s.captures, s.graphs_held) == (2, 3, 1, 1)


def test_lru_eviction_order_and_in_flight_protection():
    backend, eager = FakeBackend(), []
    cache = GraphCache(backend, max_graphs=2, capture_after=1)
    a, b, c = (GraphCache.key_for([i]) for i in range(3))
    run(cache, a, eager)
    run(cache, b, eager)
    run(cache, a, eager)  # a is now the most recently used
    run(cache, c, eager)  # evicts b, the least recently used
    assert b not in cache and a in cache and c in cache
    assert cache.stats.evictions == 1
    assert backend.destroyed == []  # b's replay is still in flight: not destroyed yet
    assert cache.num_retired == 1
    backend.finish_all()
    run(cache, a, eager)  # any later step reaps finished retirees
    assert backend.destroyed == [2] and cache.num_retired == 0


def test_cycling_over_more_keys_than_graphs_stays_bounded():
    backend, eager = FakeBackend(), []
    cache = GraphCache(backend, max_graphs=2, capture_after=1)
    keys = [GraphCache.key_for([i, i + 1]) for i in range(5)]
    for step in range(100):
        run(cache, keys[step % 5], eager)
        backend.finish_all()
    assert len(cache) == 2 and cache.stats.graphs_held == 2
    assert cache.stats.evictions == cache.stats.captures - 2
    assert len(backend.destroyed) >= cache.stats.evictions - 1
    assert cache.stats.pool_bytes <= 3000


def test_capture_failure_runs_eagerly_and_is_counted():
    backend, eager = FakeBackend(), []
    cache = GraphCache(backend, max_graphs=2, capture_after=1)
    backend.fail_next = True
    key = GraphCache.key_for([7])
    assert run(cache, key, eager) is False and eager == [key]
    assert cache.stats.capture_failures == 1 and key not in cache
    assert run(cache, key, eager) is True  # tried again later, and it works


def test_clear_destroys_everything():
    backend, eager = FakeBackend(), []
    cache = GraphCache(backend, max_graphs=3, capture_after=1)
    for i in range(3):
        run(cache, GraphCache.key_for([i]), eager)
    cache.clear()
    assert sorted(backend.destroyed) == [1, 2, 3] and len(cache) == 0


def test_bad_limits_rejected():
    with pytest.raises(ValueError):
        GraphCache(FakeBackend(), max_graphs=0, capture_after=1)
