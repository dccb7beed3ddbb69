"""GraphCache policy on CPU with a fake capture backend: LRU order, admission, eviction never of a graph
whose replay is in flight, key canonicalisation, counters, capture failures."""
from __future__ import annotations

import pytest

from conftest import ExecBackend
from engine.cuda.graphs import RETRY_AFTER, GraphCache


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

    def recoverable(self, error):
        return "out of memory" in str(error)


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
    """A recoverable failure: the step runs eagerly; that key is tried again after RETRY_AFTER more
    sightings (eager meanwhile), while other keys are captured as usual."""
    backend, eager = FakeBackend(), []
    cache = GraphCache(backend, max_graphs=4, capture_after=1)
    backend.fail_next = True
    key, other = GraphCache.key_for([7]), GraphCache.key_for([8])
    assert run(cache, key, eager) is False and eager == [key]
    assert cache.stats.capture_failures == 1 and key not in cache and not cache.capture_disabled
    assert run(cache, other, eager) is True and other in cache  # other keys still capture
    assert [run(cache, key, eager) for _ in range(RETRY_AFTER - 1)] == [False] * (RETRY_AFTER - 1)
    assert eager == [key] * RETRY_AFTER and backend.captured == [1]
    assert run(cache, key, eager) is True and key in cache  # its RETRY_AFTER-th sighting since: captured
    assert eager == [key] * RETRY_AFTER and cache.stats.capture_failures == 1


def test_a_key_that_fails_again_waits_twice_as_long():
    backend, eager = FakeBackend(), []
    cache = GraphCache(backend, max_graphs=4, capture_after=2)
    key = GraphCache.key_for([3])
    run(cache, key, eager)
    backend.fail_next = True
    assert run(cache, key, eager) is False and cache.stats.capture_failures == 1  # second sighting: fails
    for _ in range(RETRY_AFTER - 1):
        run(cache, key, eager)
    backend.fail_next = True
    assert run(cache, key, eager) is False and cache.stats.capture_failures == 2  # retried, fails again
    assert [run(cache, key, eager) for _ in range(2 * RETRY_AFTER)] == [False] * (2 * RETRY_AFTER - 1) + [True]


def test_a_failing_fallback_key_runs_eagerly_without_stopping_captures():
    backend, eager = FakeBackend(), []
    cache = GraphCache(backend, max_graphs=4, capture_after=3)
    fallback = (("width", 1), lambda: (lambda: eager.append("width")), lambda: None)
    a = GraphCache.key_for([0])
    backend.fail_next = True
    assert cache.run(a, lambda: (lambda: eager.append(a)), fallback) is False and eager == ["width"]
    assert cache.run(a, lambda: (lambda: eager.append(a)), fallback) is False  # width key waits: eager
    assert eager == ["width", "width"] and not cache.capture_disabled
    assert cache.run(a, lambda: (lambda: eager.append(a)), fallback) is True  # a's third sighting: its own graph
    assert cache.stats.capture_failures == 1 and ("width", 1) not in cache


def test_captures_stop_after_max_failures():
    backend, eager = FakeBackend(), []
    cache = GraphCache(backend, max_graphs=4, capture_after=1, max_failures=3)
    for i in range(3):
        backend.fail_next = True
        assert run(cache, GraphCache.key_for([i]), eager) is False
    assert cache.capture_disabled and cache.stats.capture_failures == 3
    assert run(cache, GraphCache.key_for([9]), eager) is False and backend.captured == []


def test_fallback_key_is_captured_the_first_time_it_is_needed():
    """Keys not yet due for capture run through the fallback key, which is captured at its first use and
    replayed for every later key of its width; the key itself is captured once seen capture_after times."""
    backend, eager, staged = FakeBackend(), [], []
    cache = GraphCache(backend, max_graphs=8, capture_after=3)

    def step(slots):
        key = GraphCache.key_for(slots)
        fallback = (("width", len(slots)), lambda: (lambda: eager.append("width")), lambda: staged.append(key))
        return cache.run(key, lambda: (lambda: eager.append(key)), fallback)

    a, b = [0, 1], [2, 3]
    assert [step(a), step(b), step(a), step(b)] == [True] * 4  # width graph: captured at once, then replayed
    assert backend.captured == [1] and eager == [] and len(staged) == 4
    assert step(a) is True and backend.captured == [1, 2]  # a's third sighting: its own graph
    assert step(a) is True and len(staged) == 4  # a replays its own graph: nothing staged
    s = cache.stats
    assert (s.fallbacks, s.captures, s.hits, s.misses) == (4, 2, 4, 2)


def test_admission_counts_remember_only_the_last_max_seen_keys():
    """A churning batch makes new keys without end: the admission counts stay bounded, forgetting the
    least recently seen key first."""
    backend, eager = FakeBackend(), []
    cache = GraphCache(backend, max_graphs=4, capture_after=2, max_seen=3)
    keys = [GraphCache.key_for([i]) for i in range(10)]
    for k in keys:
        run(cache, k, eager)
    assert len(cache._seen) == 3 and backend.captured == []
    run(cache, keys[0], eager)  # forgotten: a first sighting again, so no capture
    assert backend.captured == []
    run(cache, keys[9], eager)  # still remembered: its second sighting captures it
    assert backend.captured == [1]


def test_an_unrecoverable_capture_failure_stops_captures_but_not_replays():
    backend, eager = FakeBackend(), []
    cache = GraphCache(backend, max_graphs=4, capture_after=1)
    a, b, c = (GraphCache.key_for([i]) for i in range(3))
    assert run(cache, a, eager) is True
    backend.capture = lambda step: (_ for _ in ()).throw(RuntimeError("operation not permitted when stream is capturing"))
    assert run(cache, b, eager) is False and eager == [b] and cache.capture_disabled
    del backend.capture  # captures would work again, but the cache no longer tries
    assert run(cache, c, eager) is False and eager == [b, c] and c not in cache
    assert run(cache, a, eager) is True  # the graph held before still replays
    assert cache.stats.capture_failures == 1


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
    with pytest.raises(ValueError):
        GraphCache(FakeBackend(), max_graphs=1, capture_after=1, max_seen=0)
    with pytest.raises(ValueError):
        GraphCache(FakeBackend(), max_graphs=1, capture_after=1, max_failures=0)


def test_engine_info_reports_the_graph_cache_counters(tiny_model):
    """Info (and so the Info RPC and the Prometheus gauges built from it) carries the engine's graph
    cache counters; decode through the cache gives the tokens decode without it gives."""
    from conftest import engine_config, random_prompts
    from engine.api import PrefillItem
    from engine.engine import Engine
    from engine.sampling import SamplingParams, StoppingCriteria

    prompts = random_prompts([6, 9], 512, seed=2)
    tokens = []
    for graphs in (False, True):
        engine = Engine(engine_config(tiny_model, fallback_graphs=False))
        if graphs:
            engine.runtime.dispatch.graphs = GraphCache(ExecBackend(), max_graphs=4, capture_after=2)
        ids = [engine.alloc_sequence(32, SamplingParams(), StoppingCriteria(ignore_eos=True)).seq_id
               for _ in prompts]
        engine.prefill([PrefillItem(i, p) for i, p in zip(ids, prompts)])
        tokens.append([[t.token_id for t in engine.decode(ids).tokens] for _ in range(4)]
                      + [[t.token_id for t in engine.decode(ids[:1]).tokens]])
        info = engine.info().graph_cache
        if graphs:  # the prefill's shape, first run: miss (eager); decode key (both slots): miss, miss +
            # capture, hit, hit; then one slot: miss
            assert (info.hits, info.misses, info.captures, info.graphs_held, info.pool_bytes) == (2, 4, 1, 1, 4096)
            engine.decode(ids)
            assert engine.info().graph_cache.hits == 3 and info.hits == 2  # a snapshot, not a live view
        else:
            assert info.hits == info.misses == info.graphs_held == 0
    assert tokens[0] == tokens[1]


def test_batch_width_fallback_graph_serves_a_churning_batch_exactly(tiny_model):
    """With fallback_graphs, a batch whose own graph is not captured yet runs through the graph of its
    width, which reads the slot vector staged just before: over a batch whose members join, finish
    and are replaced (slots reused), every step gives the tokens of the engine without graphs, and
    most steps replay a graph."""
    from conftest import engine_config, random_prompts
    from engine.api import PrefillItem
    from engine.engine import Engine
    from engine.sampling import SamplingParams, StoppingCriteria

    prompts = random_prompts([5, 8, 3, 11, 7, 4, 9, 6, 5, 10, 2, 7, 8, 3], 512, seed=8)
    sampled = SamplingParams(temperature=0.9, top_k=40, seed=5)

    def churn(engine: Engine) -> list[list[tuple[int, int]]]:
        live, queue, out = {}, list(enumerate(prompts)), []
        step = 0
        while live or queue:
            while len(live) < 4 and queue:  # refill to 4 sequences, one join at a time
                n, prompt = queue.pop(0)
                sid = engine.alloc_sequence(64, sampled, StoppingCriteria(max_new_tokens=3 + n % 4, ignore_eos=True)).seq_id
                engine.prefill([PrefillItem(sid, prompt)])
                live[sid] = n
                if step % 3:
                    break
            ids = list(live)
            tokens = engine.decode(ids).tokens
            out.append([(live[t.seq_id], t.token_id) for t in tokens])
            for t in tokens:
                if t.finish_reason:
                    engine.release([t.seq_id])
                    del live[t.seq_id]
            step += 1
        return out

    eager = churn(Engine(engine_config(tiny_model)))
    stats = {}
    for fallback in (False, True):
        engine = Engine(engine_config(tiny_model, fallback_graphs=fallback))
        engine.runtime.dispatch.graphs = GraphCache(ExecBackend(), max_graphs=8, capture_after=3)
        assert churn(engine) == eager
        stats[fallback] = s = engine.info().graph_cache
        assert s.hits + s.misses == len(eager) + len(prompts)  # every decode step and prefill forward
    assert stats[False].fallbacks == 0 < stats[True].fallbacks
    assert stats[True].hits > stats[False].hits, stats  # more of the churning steps replay a graph


def test_width_fallback_graph_serves_churning_verify_steps_exactly(tiny_model):
    """Uniform Verify steps use the batch-width fallback too (keyed by width and draft count): over a
    churning batch, every step accepts and emits what the engine without graphs does."""
    from conftest import engine_config, random_prompts
    from engine.api import PrefillItem, VerifyItem
    from engine.engine import Engine
    from engine.sampling import SamplingParams, StoppingCriteria

    prompts = random_prompts([5, 8, 3, 11, 7, 4, 9, 6, 5, 10], 512, seed=9)
    sampled = SamplingParams(temperature=0.8, top_k=50, seed=3)

    def churn(engine: Engine) -> list:
        live, queue, out = {}, list(enumerate(prompts)), []
        while live or queue:
            while len(live) < 3 and queue:
                n, prompt = queue.pop(0)
                sid = engine.alloc_sequence(96, sampled, StoppingCriteria(max_new_tokens=4 + n % 5, ignore_eos=True)).seq_id
                first = engine.prefill([PrefillItem(sid, prompt)]).tokens[0].token_id
                live[sid] = (n, [first])
            # Drafts: the sequence's own last two tokens (some get accepted, some not), two per sequence.
            items = [VerifyItem(sid, (hist * 2)[-2:]) for sid, (_, hist) in live.items()]
            results = engine.verify(items).results
            out.append([(live[r.seq_id][0], r.num_accepted, [t.token_id for t in r.tokens]) for r in results])
            for r in results:
                live[r.seq_id][1].extend(t.token_id for t in r.tokens)
                if r.tokens[-1].finish_reason:
                    engine.release([r.seq_id])
                    del live[r.seq_id]
        return out

    eager = churn(Engine(engine_config(tiny_model)))
    assert any(step for step in eager)
    engine = Engine(engine_config(tiny_model, fallback_graphs=True))
    engine.runtime.dispatch.graphs = GraphCache(ExecBackend(), max_graphs=8, capture_after=4)
    assert churn(engine) == eager
    s = engine.info().graph_cache
    assert s.fallbacks > 0 and s.hits + s.misses == len(eager) + len(prompts)  # verify steps and prefills
    assert s.hits > s.misses, s  # the width graphs are replayed for most steps


def test_replayed_prefill_graphs_equal_eager_prefill(tiny_model):
    """Short prefill forwards replay the graph of their padded shape (tokens, sequence rows), reading
    inputs staged in static buffers: prompts of the same padded shape in later calls, chunked prompts
    continuing a cached prefix, and pad rows change nothing: the same first tokens, log-probs, KV cache
    and seen tokens as eager prefill, and the same decode after."""
    import torch

    from conftest import engine_config, random_prompts
    from engine.api import PrefillItem
    from engine.engine import Engine
    from engine.sampling import SamplingParams, StoppingCriteria

    rounds = [random_prompts([5, 17, 9], 512, seed=3), random_prompts([7, 12, 11], 512, seed=4),
              random_prompts([20], 512, seed=5)]
    runs = []
    for graphs in (False, True):
        engine = Engine(engine_config(tiny_model))
        engine.runtime.ops.prefill_tokens = lambda n: -(-n // 16) * 16  # bucketed like CudaOps, so shapes recur
        if graphs:
            engine.runtime.dispatch.graphs = GraphCache(ExecBackend(), max_graphs=16, capture_after=2)
        greedy, stop = SamplingParams(), StoppingCriteria(max_new_tokens=4, ignore_eos=True)
        firsts, steps = [], []
        for prompts in rounds:
            ids = [engine.alloc_sequence(48, greedy, stop).seq_id for _ in prompts]
            engine.prefill([PrefillItem(ids[0], prompts[0][:3], partial=True)])  # a chunk, then the rest
            firsts += [(t.token_id, t.logprob) for t in engine.prefill(
                [PrefillItem(ids[0], prompts[0][3:])] + [PrefillItem(i, p) for i, p in zip(ids[1:], prompts[1:])]).tokens]
            steps += [[t.token_id for t in engine.decode(ids).tokens] for _ in range(2)]
            engine.release(ids)
        runs.append((firsts, steps, engine.runtime.kv.k[0].clone(), engine.runtime.kv.v[-1].clone(), engine.runtime.state.seen.clone(),
                     engine.info().graph_cache))
    (first0, steps0, k0, v0, seen0, _), (first1, steps1, k1, v1, seen1, stats) = runs
    assert [t for t, _ in first0] == [t for t, _ in first1] and steps0 == steps1
    assert [lp for _, lp in first0] == pytest.approx([lp for _, lp in first1], abs=1e-5)
    assert torch.equal(k0, k1) and torch.equal(v0, v1) and torch.equal(seen0, seen1)
    # Prefill shapes: (16 tokens, 1 row) for each 3-token chunk and for the last round's 17 remaining
    # tokens is (32, 1); the three-prompt calls are (32 or 48 tokens, 4 rows). Later rounds replay.
    assert stats.captures >= 3 and stats.hits >= 2, stats


def test_top_logprob_counts_share_one_graph_per_width_and_each_sequence_gets_its_own(tiny_model):
    """Steps whose sequences ask for 1, 2, 3 or 5 top-logprob candidates compute max_top_logprobs of them
    (one graph key per width for all such counts, besides the key without any); each sequence gets back
    exactly its own count, the highest-ranked first, and the same candidates the graph-less engine gives."""
    from conftest import engine_config, random_prompts
    from engine.api import PrefillItem
    from engine.engine import Engine
    from engine.sampling import SamplingParams, StoppingCriteria

    prompts = random_prompts([5, 8, 3], 512, seed=4)

    def run(engine: Engine) -> list:
        out = []
        for counts in ((1, 3, 0), (2, 5, 0), (0, 0, 0), (5, 1, 2)):
            ids = [engine.alloc_sequence(16, SamplingParams(top_logprobs=c), StoppingCriteria(ignore_eos=True)).seq_id
                   for c in counts]
            engine.prefill([PrefillItem(i, p) for i, p in zip(ids, prompts)])
            for _ in range(3):
                for c, t in zip(counts, engine.decode(ids).tokens):
                    assert len(t.top_logprobs) == c
                    lps = [lp for _, lp in t.top_logprobs]
                    assert lps == sorted(lps, reverse=True)
                    out.append((t.token_id, tuple(t.top_logprobs)))
            engine.release(ids)
        return out

    eager = run(Engine(engine_config(tiny_model, fallback_graphs=False)))
    engine = Engine(engine_config(tiny_model, fallback_graphs=False))
    engine.runtime.dispatch.graphs = GraphCache(ExecBackend(), max_graphs=16, capture_after=1)
    assert run(engine) == eager
    decode_keys = [k for k in engine.runtime.dispatch.graphs._graphs if k[0] == "decode"]
    assert sorted(k[-1] for k in decode_keys) == [0, engine.config.max_top_logprobs]  # one slot vector
