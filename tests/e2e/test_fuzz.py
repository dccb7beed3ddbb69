"""Stateful fuzzing through the real server: random valid and invalid Alloc/Prefill/Decode/Verify/Release
sequences (decode steps as Decode calls or on one long-lived DecodeStream). After every step: the call returned OK or the documented status for the one fault it carried;
a failed call changed nothing; free + used blocks = total; free slots match live sequences; and every
token a sequence received is the greedy token of its own history alone (a separate solo engine says)."""
from __future__ import annotations

import functools
import queue

import grpc
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from conftest import engine_config, start_server
from engine.api import PrefillItem
from engine.engine import Engine
from engine.sampling import SamplingParams, StoppingCriteria
from metrale.worker.v1 import worker_pb2 as pb
from worker.client import StepRefused

C = grpc.StatusCode
VOCAB, MAX_SLOTS, MAX_BATCH, BLOCKS, BLOCK = 512, 6, 4, 40, 16
UNKNOWN_ID = 10**9


@pytest.fixture(scope="module")
def fuzz_env(tiny_model):
    server = start_server(tiny_model, max_slots=MAX_SLOTS, max_batch_size=MAX_BATCH, num_kv_blocks=BLOCKS + 1,
                          block_size=BLOCK, max_seq_len=128, max_draft_tokens=4)
    solo = Engine(engine_config(tiny_model, max_slots=2, num_kv_blocks=40))
    yield server, solo
    server.stop()


@functools.lru_cache(maxsize=100_000)
def solo_next(solo: Engine, history: tuple[int, ...]) -> int:
    """The greedy next token after `history`, computed alone in a fresh sequence."""
    seq = solo.alloc_sequence(len(history) + 1, SamplingParams(), StoppingCriteria(ignore_eos=True))
    try:
        return solo.prefill([PrefillItem(seq.seq_id, list(history))]).tokens[0].token_id
    finally:
        solo.release([seq.seq_id])


class Shadow:
    """What the test believes about one sequence."""

    def __init__(self, capacity: int, max_new: int):
        self.capacity, self.max_new = capacity, max_new
        self.tokens: list[int] = []
        self.prompt_len = 0
        self.finished = False

    @property
    def blocks(self) -> int:
        return -(-self.capacity // BLOCK)


def tokens_st(min_size=1, max_size=12):
    return st.lists(st.integers(0, VOCAB - 1), min_size=min_size, max_size=max_size)


class WorkerMachine(RuleBasedStateMachine):
    env = None  # (server, solo), set by the test

    @initialize()
    def setup(self):
        self.server, self.solo = self.env
        self.stub = self.server.stub()
        self.live: dict[int, Shadow] = {}
        self.stream_requests: queue.SimpleQueue = queue.SimpleQueue()
        self.stream = self.stub.DecodeStream(iter(self.stream_requests.get, None), timeout=600)

    def teardown(self):
        if self.live:
            self.stub.Release(pb.ReleaseRequest(sequence_ids=list(self.live)))
        self.stream_requests.put(None)
        assert list(self.stream) == []  # every step was answered; the stream ends with OK

    def stream_decode(self, request: pb.DecodeRequest, timeout: float) -> pb.DecodeResponse:
        """A decode step on the machine's DecodeStream, answered as a Decode call would be."""
        self.stream_requests.put(request)
        resp = next(self.stream)
        if resp.HasField("error"):
            raise StepRefused(resp.error)
        return resp.step

    # ---------------------------------------------------------------------------------------- helpers

    def snapshot(self):
        def read(e):
            return (e.blocks.num_free_blocks, e.slots.num_free_slots,
                    {s.seq_id: (tuple(s.token_ids), s.num_cached, s.finish_reason) for s in e.sequences.values()})
        return self.server.engine_call(read)

    def call(self, expected: grpc.StatusCode | None, fn, request):
        """Calls; checks the status; on an expected failure checks nothing changed."""
        before = self.snapshot() if expected else None
        name = getattr(fn, "_method", getattr(fn, "__name__", fn))
        try:
            resp = fn(request, timeout=30)
        except (grpc.RpcError, StepRefused) as e:
            assert e.code() == expected, f"{name}: got {e.code()} ({e.details()}), expected {expected}"
            assert self.snapshot() == before, f"{name} failed with {e.code()} but changed state"
            return None
        assert expected is None, f"{name} succeeded, expected {expected}"
        return resp

    def check_token(self, shadow: Shadow, tok: pb.Token) -> None:
        assert tok.token_id == solo_next(self.solo, tuple(shadow.tokens)), "token differs from the solo greedy one"
        shadow.tokens.append(tok.token_id)
        assert tok.seq_len == len(shadow.tokens)
        generated = len(shadow.tokens) - shadow.prompt_len
        length_done = generated >= shadow.max_new or len(shadow.tokens) >= shadow.capacity
        assert (tok.finish_reason == pb.FINISH_REASON_LENGTH) == length_done
        shadow.finished = length_done

    def running(self):
        return [i for i, s in self.live.items() if s.prompt_len and not s.finished]

    # ---------------------------------------------------------------------------------------- rules

    @rule(capacity=st.integers(-1, 70), max_new=st.integers(1, 12), bad_temp=st.booleans())
    def alloc(self, capacity, max_new, bad_temp):
        blocks_used = sum(s.blocks for s in self.live.values())
        needed = -(-max(capacity, 0) // BLOCK)
        if capacity < 2 or bad_temp:
            expected = C.INVALID_ARGUMENT
        elif len(self.live) >= MAX_SLOTS or blocks_used + needed > BLOCKS:
            expected = C.RESOURCE_EXHAUSTED
        else:
            expected = None
        req = pb.AllocSequenceRequest(max_total_tokens=max(capacity, 0), stopping=pb.StoppingCriteria(
            max_new_tokens=max_new, ignore_eos=True), sampling=pb.SamplingParams(temperature=-1.0 if bad_temp else 0))
        resp = self.call(expected, self.stub.AllocSequence, req)
        if resp is not None:
            self.live[resp.sequence_id] = Shadow(capacity, max_new)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), fault=st.sampled_from([None, "token", "unknown", "dup", "too_long", "done"]))
    def prefill(self, data, fault):
        pending = [i for i, s in self.live.items() if not s.prompt_len]
        ids = data.draw(st.lists(st.sampled_from(pending), min_size=1, max_size=MAX_BATCH, unique=True)) \
            if pending else []
        items, expected = [], None
        for i in ids:
            s = self.live[i]
            room = s.capacity - 1 - len(s.tokens)
            toks = data.draw(tokens_st(0 if s.tokens else 1, max(0 if s.tokens else 1, min(room, 10))))
            partial = data.draw(st.booleans()) and len(s.tokens) + len(toks) < room
            items.append((i, toks, partial))
        if fault == "token" and items:
            items[0] = (items[0][0], items[0][1] + [VOCAB + 3], items[0][2])
            expected = C.INVALID_ARGUMENT
        elif fault == "unknown":
            items.append((UNKNOWN_ID, [1], False))
            expected = C.NOT_FOUND
        elif fault == "dup" and items:
            items.append(items[0])
            expected = C.INVALID_ARGUMENT
        elif fault == "too_long" and items:
            s = self.live[items[0][0]]
            items[0] = (items[0][0], [1] * (s.capacity - len(s.tokens)), False)
            expected = C.INVALID_ARGUMENT
        elif fault == "done" and len(items) < MAX_BATCH:
            done = [i for i, s in self.live.items() if s.prompt_len]
            if not done:
                return
            items.append((done[0], [1], False))
            expected = C.FAILED_PRECONDITION
        if not items:
            return
        if len(items) > MAX_BATCH:
            return
        req = pb.PrefillRequest(items=[pb.PrefillItem(sequence_id=i, token_ids=t, partial=p) for i, t, p in items])
        resp = self.call(expected, self.stub.Prefill, req)
        if resp is None:
            return
        completed = [i for i, _, p in items if not p]
        assert [t.sequence_id for t in resp.tokens] == completed
        for i, toks, partial in items:
            self.live[i].tokens += toks
        for tok in resp.tokens:
            s = self.live[tok.sequence_id]
            s.prompt_len = len(s.tokens)
            self.check_token(s, tok)

    @precondition(lambda self: self.running())
    @rule(data=st.data(), fault=st.sampled_from([None, None, "unknown", "override_len", "not_ready"]),
          on_stream=st.booleans())
    def decode(self, data, fault, on_stream):
        ids = data.draw(st.lists(st.sampled_from(self.running()), min_size=1, max_size=MAX_BATCH, unique=True))
        override = data.draw(st.one_of(st.none(), st.lists(st.integers(0, VOCAB - 1), min_size=len(ids),
                                                           max_size=len(ids))))
        expected = None
        if fault == "unknown" and len(ids) < MAX_BATCH:
            ids = ids + [UNKNOWN_ID]
            override = None
            expected = C.NOT_FOUND
        elif fault == "override_len":
            override = [1] * (len(ids) + 1)
            expected = C.INVALID_ARGUMENT
        elif fault == "not_ready" and len(ids) < MAX_BATCH:
            others = [i for i, s in self.live.items() if not s.prompt_len or s.finished]
            if others:
                ids, override, expected = ids + [others[0]], None, C.FAILED_PRECONDITION
        resp = self.call(expected, self.stream_decode if on_stream else self.stub.Decode,
                         pb.DecodeRequest(sequence_ids=ids, input_token_ids=override or []))
        if resp is None:
            return
        for n, (i, tok) in enumerate(zip(ids, resp.tokens)):
            if override:
                self.live[i].tokens[-1] = override[n]
            self.check_token(self.live[i], tok)

    @precondition(lambda self: self.running())
    @rule(data=st.data(), wrong_at=st.integers(0, 4), too_many=st.booleans())
    def verify(self, data, wrong_at, too_many):
        sid = data.draw(st.sampled_from(self.running()))
        s = self.live[sid]
        room = s.capacity - len(s.tokens)
        k = data.draw(st.integers(0, 4))
        history, drafts = list(s.tokens), []
        for _ in range(k):
            nxt = solo_next(self.solo, tuple(history))
            drafts.append((nxt + 1) % VOCAB if len(drafts) == wrong_at else nxt)
            history.append(drafts[-1])
        expected = None
        if too_many:
            drafts = [1] * 5
            expected = C.INVALID_ARGUMENT
        elif k > room:
            expected = C.INVALID_ARGUMENT
        resp = self.call(expected, self.stub.Verify, pb.VerifyRequest(items=[pb.VerifyItem(sequence_id=sid,
                                                                                          draft_token_ids=drafts)]))
        if resp is None:
            return
        res = resp.results[0]
        assert res.num_accepted == min(k, wrong_at)
        for tok in res.tokens:
            assert not s.finished
            self.check_token(s, tok)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), unknown=st.booleans())
    def release(self, data, unknown):
        ids = data.draw(st.lists(st.sampled_from(list(self.live)), min_size=1, max_size=3, unique=True))
        if unknown:
            self.call(C.NOT_FOUND, self.stub.Release, pb.ReleaseRequest(sequence_ids=ids + [UNKNOWN_ID]))
            return
        resp = self.call(None, self.stub.Release, pb.ReleaseRequest(sequence_ids=ids))
        assert resp.released == len(ids)
        for i in ids:
            del self.live[i]

    # ---------------------------------------------------------------------------------------- invariants

    @invariant()
    def accounting(self):
        if not hasattr(self, "live"):
            return
        free_blocks, free_slots, seqs = self.snapshot()
        assert set(seqs) == set(self.live)
        assert free_blocks + sum(s.blocks for s in self.live.values()) == BLOCKS
        assert free_slots == MAX_SLOTS - len(self.live)
        for i, s in self.live.items():
            assert list(seqs[i][0]) == s.tokens


def test_stateful_fuzz(fuzz_env):
    from hypothesis.stateful import run_state_machine_as_test

    WorkerMachine.env = fuzz_env
    run_state_machine_as_test(WorkerMachine, settings=settings(
        max_examples=300, stateful_step_count=12, deadline=None, suppress_health_check=list(HealthCheck)))
