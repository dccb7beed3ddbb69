"""Prefix caching end to end on CPU: greedy outputs over gRPC identical with caching on and off (multi-turn
conversations, a shared system prompt, prompts ending on a block boundary, prompts entirely cached, chunked
prompts), transformers as the oracle with caching on, cached-token counts, FlushCache while sequences run, KV
events over SubscribeKvEvents (snapshot, resume, too old), and an engine fuzz that keeps a checksum of every
cached block's KV and checks no step ever writes one."""
from __future__ import annotations

import hashlib
import pathlib
import threading

import grpc
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from conftest import engine_config, generate_via_grpc, random_prompts, start_server
from oracle import hf_greedy
from engine.api import PrefillItem, VerifyItem
from engine.engine import Engine
from engine.errors import EngineError
from engine.prefix_cache import block_hashes, extra_key
from engine.sampling import SamplingParams, StoppingCriteria
from metrale.worker.v1 import worker_pb2 as pb
from metrale.worker.v1 import worker_pb2_grpc as pb_grpc

BLOCK = 16
VOCAB = 512


@pytest.fixture(scope="module")
def servers(tiny_model):
    """The same checkpoint served with prefix caching on and off."""
    on, off = start_server(tiny_model), start_server(tiny_model, prefix_caching=False)
    yield on, off
    on.stop()
    off.stop()


def conversation(stub, system: list[int], turns: list[list[int]], new_tokens: int) -> list[list[int]]:
    """A multi-turn chat: every turn resends the whole history (system prompt, earlier messages and answers)
    plus its new message; returns each turn's answer."""
    history, answers = list(system), []
    for message in turns:
        history += message
        answer = generate_via_grpc(stub, [history], new_tokens)[0]
        answers.append(answer)
        history += answer
    return answers


def test_greedy_outputs_are_identical_with_caching_on_and_off(servers):
    on, off = servers
    system = random_prompts([3 * BLOCK + 5], VOCAB, seed=1)[0]
    turns = random_prompts([7, 20, 3, 33], VOCAB, seed=2)
    shared = [system + p for p in random_prompts([1, 9, BLOCK, 40], VOCAB, seed=3)]
    boundary = [random_prompts([4 * BLOCK], VOCAB, seed=4)[0]]  # ends exactly on a block boundary
    results = []
    for srv in (on, off):
        stub = srv.stub()
        got = [conversation(stub, system, turns, 12)]
        got.append(generate_via_grpc(stub, shared, 10))
        got.append(generate_via_grpc(stub, shared, 10))  # again: every full block of every prompt cached
        got.append(generate_via_grpc(stub, boundary, 10))
        got.append(generate_via_grpc(stub, boundary, 10))
        got.append(generate_via_grpc(stub, shared[:2], 10, chunk=BLOCK + 3))  # chunked, first chunk matched
        results.append(got)
        info = stub.Info(pb.InfoRequest())
        assert info.free_blocks == info.total_blocks and info.live_sequences == 0  # nothing leaked
    assert results[0] == results[1]
    cache = on.stub().Info(pb.InfoRequest()).prefix_cache
    assert cache.enabled and cache.hit_tokens > 0 and cache.cached_blocks > 0
    assert not off.stub().Info(pb.InfoRequest()).prefix_cache.hit_tokens


def test_prefill_reports_the_cached_tokens(servers):
    on, _ = servers
    stub = on.stub()
    prompt = random_prompts([5 * BLOCK + 3], VOCAB, seed=11)[0]
    stopping = pb.StoppingCriteria(max_new_tokens=2, ignore_eos=True)

    def first_token(tokens: list[int]) -> pb.Token:
        sid = stub.AllocSequence(pb.AllocSequenceRequest(max_total_tokens=len(tokens) + 4,
                                                         stopping=stopping)).sequence_id
        token = stub.Prefill(pb.PrefillRequest(items=[pb.PrefillItem(sequence_id=sid, token_ids=tokens)])).tokens[0]
        stub.Release(pb.ReleaseRequest(sequence_ids=[sid]))
        return token

    assert first_token(prompt).cached_tokens == 0
    assert first_token(prompt).cached_tokens == 5 * BLOCK  # every full block; the 3 last tokens are computed
    assert first_token(prompt[:5 * BLOCK]).cached_tokens == 4 * BLOCK  # the last token is always computed
    assert first_token(prompt[:2 * BLOCK + 1] + [7]).cached_tokens == 2 * BLOCK
    assert first_token([prompt[0] + 1] + prompt[1:]).cached_tokens == 0  # a different first block: nothing


def test_transformers_oracle_with_caching_on(servers, checkpoints):
    """A prompt served twice (the second time from the cache but its last block) gives transformers' greedy
    tokens both times."""
    on, _ = servers
    prompt = random_prompts([3 * BLOCK + 7], VOCAB, seed=21)[0]
    want = hf_greedy(checkpoints["llama-gqa"], prompt, 16)
    stub = on.stub()
    assert generate_via_grpc(stub, [prompt], 16) == [want]
    assert generate_via_grpc(stub, [prompt], 16) == [want]
    assert generate_via_grpc(stub, [prompt + want[:5]], 11) == [want[5:]]  # a second turn: prompt + answer cached


def test_flush_while_sequences_run_keeps_them_whole(tiny_model):
    srv = start_server(tiny_model)
    try:
        stub = srv.stub()
        prompt = random_prompts([4 * BLOCK], VOCAB, seed=31)[0]
        expected = generate_via_grpc(stub, [prompt], 20)[0]  # leaves the prompt's blocks cached
        stopping = pb.StoppingCriteria(max_new_tokens=20, ignore_eos=True)
        sid = stub.AllocSequence(pb.AllocSequenceRequest(max_total_tokens=200, stopping=stopping)).sequence_id
        got = [t.token_id for t in stub.Prefill(pb.PrefillRequest(
            items=[pb.PrefillItem(sequence_id=sid, token_ids=prompt)])).tokens]
        assert stub.Info(pb.InfoRequest()).prefix_cache.cached_blocks > 0
        stub.FlushCache(pb.FlushCacheRequest())  # the running sequence holds its shared blocks: they stay
        for _ in range(19):
            got.append(stub.Decode(pb.DecodeRequest(sequence_ids=[sid])).tokens[0].token_id)
            stub.FlushCache(pb.FlushCacheRequest())
        assert got == expected
        stub.Release(pb.ReleaseRequest(sequence_ids=[sid]))
        assert stub.FlushCache(pb.FlushCacheRequest()).flushed_blocks > 0
        info = stub.Info(pb.InfoRequest())
        assert info.prefix_cache.cached_blocks == 0 and info.free_blocks == info.total_blocks
    finally:
        srv.stop()


def test_eviction_under_memory_pressure_keeps_live_sequences_whole(tiny_model):
    """A cache too small for every prompt: new prompts evict old cached blocks (least recently used first),
    never a block a live sequence holds, and every output equals the uncached server's."""
    on = start_server(tiny_model, num_kv_blocks=25)
    off = start_server(tiny_model, num_kv_blocks=25, prefix_caching=False)
    try:
        system = random_prompts([2 * BLOCK], VOCAB, seed=41)[0]
        prompts = [system + p for p in random_prompts([40, 70, 55, 90, 33, 61], VOCAB, seed=42)]
        outs = []
        for srv in (on, off):
            stub = srv.stub()
            outs.append([generate_via_grpc(stub, prompts[i:i + 2], 20) for i in range(0, len(prompts), 2)] +
                        [generate_via_grpc(stub, prompts[:2], 20)])
        assert outs[0] == outs[1]
        assert on.stub().Info(pb.InfoRequest()).prefix_cache.evicted_blocks > 0
    finally:
        on.stop()
        off.stop()


def read_batches(stub, start: int, n: int) -> list[pb.KvEventBatch]:
    call = stub.SubscribeKvEvents(pb.SubscribeKvEventsRequest(start_sequence_number=start), timeout=10)
    try:
        return [next(call) for _ in range(n)]
    finally:
        call.cancel()


def stored_hashes(batches) -> set[int]:
    """The cached set a subscriber rebuilds by replaying batches."""
    cached: set[int] = set()
    for b in batches:
        for e in b.events:
            kind = e.WhichOneof("data")
            if kind == "stored":
                cached |= {blk.block_hash for blk in e.stored.blocks}
            elif kind == "removed":
                cached -= set(e.removed.block_hashes)
            else:
                cached.clear()
    return cached


def test_kv_events_follow_the_cache_and_resume(tiny_model):
    srv = start_server(tiny_model)
    try:
        stub = srv.stub()
        dtype = stub.Info(pb.InfoRequest()).dtype
        prompts = random_prompts([3 * BLOCK + 2, 2 * BLOCK + 9], VOCAB, seed=51)
        generate_via_grpc(stub, [prompts[0]], 2)
        snapshot = read_batches(stub, 0, 1)[0]
        assert snapshot.HasField("snapshot")
        want = set(block_hashes(prompts[0][:3 * BLOCK], BLOCK, extra_key(kv_dtype=dtype)))
        assert stored_hashes([snapshot]) == want  # a router computes the same hashes from the prompt
        # A subscriber from the snapshot's number + 1 sees the next prompt's blocks stored.
        reader = stub.SubscribeKvEvents(pb.SubscribeKvEventsRequest(
            start_sequence_number=snapshot.sequence_number + 1), timeout=20)
        generate_via_grpc(stub, [prompts[1]], 2)
        batch = next(reader)
        reader.cancel()
        assert stored_hashes([batch]) == set(block_hashes(prompts[1][:2 * BLOCK], BLOCK, extra_key(kv_dtype=dtype)))
        stub.FlushCache(pb.FlushCacheRequest())
        history = read_batches(stub, 1, batch.sequence_number + 1)  # every batch from the first, resumed
        assert [b.sequence_number for b in history] == list(range(1, batch.sequence_number + 2))
        assert stored_hashes(history) == set()  # after the flush the replayed cache is empty
        with pytest.raises(grpc.RpcError) as e:
            read_batches(stub, 10_000, 1)  # ahead of the log: a cursor from another process
        assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE
    finally:
        srv.stop()


def test_a_prefill_reply_does_not_wait_for_its_blocks_registration(tiny_model, monkeypatch):
    """Engine: a completed prompt's blocks are registered by the engine's next call (or register_prompts, in parts
    if asked), not before Prefill returns; a prompt that shares the prefix still finds them (prefill registers the
    earlier prompts first), and so does one after a release. Worker: the runner registers them right after the
    reply, a part a call, so the KV events and Info show them with no further call from the router."""
    engine = Engine(engine_config(tiny_model))
    try:
        prompt = random_prompts([3 * BLOCK + 5], VOCAB, seed=61)[0]

        def prefill(tokens: list[int]) -> tuple[int, int]:
            sid = engine.alloc_sequence(len(tokens) + 4, SamplingParams(), StoppingCriteria(max_new_tokens=2)).seq_id
            return sid, engine.prefill([PrefillItem(sid, tokens)]).tokens[0].cached_tokens

        stored = engine.blocks.stats.stored_blocks
        first, cached = prefill(prompt)
        assert cached == 0 and engine.blocks.stats.stored_blocks == stored  # not yet registered
        assert engine.prefiller.num_unregistered == 1
        assert engine.register_prompts(max_blocks=2) == 2  # a part of it now (the worker's runner: 256 a call) ...
        assert engine.prefiller.num_unregistered == 1 and engine.blocks.stats.stored_blocks == stored + 2
        second, cached = prefill(prompt[:3 * BLOCK] + [7, 8])  # ... the rest first thing in this call
        assert cached == 3 * BLOCK and engine.blocks.stats.stored_blocks == stored + 3
        assert engine.register_prompts() == 0  # the second prompt's one full block is the first's: nothing new
        engine.release([first, second])
        engine.flush_cache()
        third, _ = prefill(prompt)
        engine.release([third])  # a release registers what its sequence computed
        _, cached = prefill(prompt)
        assert cached == 3 * BLOCK
    finally:
        engine.close()

    monkeypatch.setattr("worker.runner.REGISTER_BLOCKS_PER_CALL", 1)  # the prompt's 3 blocks in 3 runner calls
    srv = start_server(tiny_model)
    try:
        stub = srv.stub()
        before = stub.Info(pb.InfoRequest()).prefix_cache.stored_blocks
        want = set(block_hashes(prompt[:3 * BLOCK], BLOCK, extra_key(kv_dtype=stub.Info(pb.InfoRequest()).dtype)))
        sid = stub.AllocSequence(pb.AllocSequenceRequest(max_total_tokens=len(prompt) + 4)).sequence_id
        stub.Prefill(pb.PrefillRequest(items=[pb.PrefillItem(sequence_id=sid, token_ids=prompt)]))
        # No further call: the runner registered the prompt once it had replied, and a subscriber sees it.
        reader = stub.SubscribeKvEvents(pb.SubscribeKvEventsRequest(start_sequence_number=0), timeout=10)
        seen = []
        for batch in reader:
            seen.append(batch)
            if stored_hashes(seen) == want:
                break
        reader.cancel()
        assert stub.Info(pb.InfoRequest()).prefix_cache.stored_blocks == before + 3
        stub.Release(pb.ReleaseRequest(sequence_ids=[sid]))
    finally:
        srv.stop()


def test_a_subscriber_that_falls_behind_gets_out_of_range(tiny_model):
    """The event log keeps a bounded number of batches whoever subscribes (a subscriber that never reads holds
    only its cursor), and resuming from a batch no longer kept is OUT_OF_RANGE: subscribe again from 0."""
    srv = start_server(tiny_model)
    try:
        stub = srv.stub()
        stalled = stub.SubscribeKvEvents(pb.SubscribeKvEventsRequest(start_sequence_number=1), timeout=60)
        events = srv.engine.blocks.events
        events.max_batches = 4  # a small log, to fall behind quickly
        for p in random_prompts([BLOCK + 1] * 8, VOCAB, seed=61):
            generate_via_grpc(stub, [p], 2)
        first = events.first_sequence_number
        assert first > 1 and len(events.read(first)) <= 4
        with pytest.raises(grpc.RpcError) as e:
            read_batches(stub, 1, 1)
        assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE and "subscribe again from 0" in e.value.details()
        assert read_batches(stub, 0, 1)[0].HasField("snapshot")  # from 0 it starts over
        stalled.cancel()
        assert stub.Info(pb.InfoRequest()).live_sequences == 0
    finally:
        srv.stop()


# ---------------------------------------------------------------------------------------------
# Engine fuzz: random calls on a small engine with prefix caching; after every one, every cached block's
# KV equals what it held when first seen cached, and the pool's counts balance.

PREFIXES = random_prompts([3 * BLOCK + 4, 2 * BLOCK, 5 * BLOCK + 1], VOCAB, seed=71)


def block_checksum(engine: Engine, block: int) -> str:
    kv = engine.runtime.kv
    return hashlib.sha256(kv.k[:, block].numpy().tobytes() + kv.v[:, block].numpy().tobytes()).hexdigest()


class PrefixCacheFuzz(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.engine = Engine(engine_config(TINY_MODEL[0], num_kv_blocks=40, max_seq_len=256, max_slots=8))
        self.seqs: list[int] = []
        self.checksums: dict[tuple[int, int], str] = {}  # (block, hash) -> its KV when first seen cached

    @precondition(lambda self: len(self.seqs) < 6)
    @rule(prefix=st.integers(0, len(PREFIXES) - 1), extra=st.integers(0, 40), new=st.integers(1, 24),
          chunk=st.sampled_from([0, 5, BLOCK]))
    def start(self, prefix, extra, new, chunk):
        prompt = PREFIXES[prefix][:BLOCK * (prefix + 1) + extra % 7] + [(extra * 13 + i) % VOCAB for i in range(extra)]
        try:
            sid = self.engine.alloc_sequence(len(prompt) + new + 8, SamplingParams(),
                                             StoppingCriteria(max_new_tokens=new, ignore_eos=True)).seq_id
        except EngineError:
            return
        self.seqs.append(sid)
        for at in range(0, len(prompt), chunk or len(prompt)):
            piece = prompt[at:at + (chunk or len(prompt))]
            self.engine.prefill([PrefillItem(sid, piece, partial=at + len(piece) < len(prompt))])

    @precondition(lambda self: self.seqs)
    @rule(steps=st.integers(1, 5))
    def decode(self, steps):
        for _ in range(steps):
            running = [i for i in self.seqs if not self.engine.sequences[i].finished]
            if not running:
                return
            self.engine.decode(running)

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 5), drafts=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=5))
    def verify(self, index, drafts):
        sid = self.seqs[index % len(self.seqs)]
        seq = self.engine.sequences[sid]
        if seq.finished or seq.seq_len + len(drafts) > seq.capacity:
            return
        self.engine.verify([VerifyItem(sid, drafts)])  # random drafts: most rejected, their KV rolled back

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 5))
    def release(self, index):
        self.engine.release([self.seqs.pop(index % len(self.seqs))])

    @rule()
    def flush(self):
        self.engine.flush_cache()

    @invariant()
    def cached_blocks_are_never_written(self):
        """A block keeps its KV bytes while it stays cached. (Once evicted or flushed it may be taken, written
        and cached again under the same hash, with KV computed in other chunks: its checksum starts anew.)"""
        pool = self.engine.blocks
        cached = {(b, pool.block_hash(b)) for b in range(1, pool.num_blocks) if pool.block_hash(b) is not None}
        self.checksums = {key: digest for key, digest in self.checksums.items() if key in cached}
        for key in cached:
            digest = block_checksum(self.engine, key[0])
            assert self.checksums.setdefault(key, digest) == digest, f"cached block {key[0]} was written"

    @invariant()
    def counts_balance(self):
        pool = self.engine.blocks
        assert pool.num_free_blocks + pool.num_used_blocks == pool.num_usable_blocks
        assert pool.num_referenced_blocks + pool.num_evictable_blocks <= pool.num_usable_blocks
        if not self.seqs:
            assert pool.num_free_blocks == pool.num_usable_blocks and pool.num_referenced_blocks == 0

    def teardown(self):
        if self.seqs:
            self.engine.release(self.seqs)
        assert self.engine.blocks.num_free_blocks == self.engine.blocks.num_usable_blocks


TINY_MODEL: list[pathlib.Path] = []


def test_engine_fuzz_never_writes_a_cached_block(tiny_model):
    TINY_MODEL[:] = [tiny_model]
    PrefixCacheFuzz.TestCase.settings = settings(max_examples=25, stateful_step_count=25, deadline=None)
    PrefixCacheFuzz.TestCase().runTest()


def test_concurrent_generate_streams_share_a_cached_system_prompt(tiny_model):
    """Generate streams with one system prompt: the later ones reuse its blocks, and every stream gets the
    tokens a server without caching gives."""
    srv_on, srv_off = start_server(tiny_model), start_server(tiny_model, prefix_caching=False)
    try:
        system = random_prompts([4 * BLOCK], VOCAB, seed=81)[0]
        prompts = [system + p for p in random_prompts([3, 8, 12, 5], VOCAB, seed=82)]

        def run(srv) -> list[list[int]]:
            stub = srv.stub()
            first = list(stub.Generate(pb.GenerateRequest(prompt_token_ids=prompts[0], stopping=pb.StoppingCriteria(
                max_new_tokens=8, ignore_eos=True))))
            out = [[r.token.token_id for r in first]]
            results: dict[int, list[int]] = {}

            def one(i):
                responses = list(srv.stub().Generate(pb.GenerateRequest(
                    prompt_token_ids=prompts[i], stopping=pb.StoppingCriteria(max_new_tokens=8, ignore_eos=True))))
                results[i] = [r.token.token_id for r in responses]
                if srv is srv_on:
                    assert responses[0].token.cached_tokens == 4 * BLOCK
            threads = [threading.Thread(target=one, args=(i,)) for i in range(1, len(prompts))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return out + [results[i] for i in range(1, len(prompts))]

        assert run(srv_on) == run(srv_off)
    finally:
        srv_on.stop()
        srv_off.stop()


def test_gateway_flush_and_kv_events(tiny_model):
    """The VllmEngine service relays the same cache: FlushCache drops it, SubscribeKvEvents streams smg's
    KvEventBatch with the hashes a router computes."""
    from worker.gateway_pb import cpb, vpb_grpc

    srv = start_server(tiny_model)
    try:
        stub = srv.stub()
        vllm = vpb_grpc.VllmEngineStub(grpc.insecure_channel(srv.address))
        prompt = random_prompts([2 * BLOCK + 1], VOCAB, seed=91)[0]
        generate_via_grpc(stub, [prompt], 2)
        call = vllm.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(start_sequence_number=0), timeout=10)
        snapshot = next(call)
        call.cancel()
        dtype = stub.Info(pb.InfoRequest()).dtype
        assert stored_hashes([snapshot]) == set(block_hashes(prompt[:2 * BLOCK], BLOCK, extra_key(kv_dtype=dtype)))
        flushed = vllm.FlushCache(cpb.FlushCacheRequest(), timeout=10)
        assert flushed.success and "dropped 2 cached KV blocks" in flushed.message
    finally:
        srv.stop()


assert pb_grpc  # the service stubs are generated (conftest)


def test_a_drain_ends_kv_event_subscriptions(tiny_model):
    """An open SubscribeKvEvents (a router holds one for good) neither delays the drain nor outlives it: it
    ends with OK once the drain is done, and a draining worker takes no new subscription."""
    import time

    srv = start_server(tiny_model, {"grace_period_s": 20.0})
    stub = srv.stub()
    ended: list = []

    def subscribe():
        try:
            for _ in stub.SubscribeKvEvents(pb.SubscribeKvEventsRequest(start_sequence_number=1), timeout=30):
                pass
            ended.append("ok")
        except grpc.RpcError as e:
            ended.append(e.code())

    reader = threading.Thread(target=subscribe)
    reader.start()
    time.sleep(0.5)
    started = time.monotonic()
    srv.run(srv.worker.drain(), timeout=30)
    assert time.monotonic() - started < 5, "the subscription held the drain to its grace period"
    reader.join(10)
    assert ended and ended[0] in ("ok", grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE), ended
    srv.loop.call_soon_threadsafe(srv.loop.stop)
    srv.thread.join(10)
