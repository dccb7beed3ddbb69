"""Router-like call patterns on an Engine and their one-at-a-time replays, shared by the CPU tests
(tests/unit/test_pipeline.py, tests/e2e/test_sampling_extras.py) and the GPU tests (tests/gpu)."""
from __future__ import annotations

import pytest

from conftest import random_prompts
from engine.api import PrefillItem, VerifyItem
from engine.engine import Engine
from engine.errors import FailedPrecondition
from engine.sampling import SamplingParams, StoppingCriteria
from engine.sequence import FinishReason

SAMPLED = SamplingParams(temperature=0.9, top_k=40, repetition_penalty=1.3, top_logprobs=2, seed=5)


def start(engine: Engine, prompts: list[list[int]], max_new: list[int], stop: dict[int, list[int]] | None = None,
          ) -> list[int]:
    ids = []
    for n, (prompt, m) in enumerate(zip(prompts, max_new)):
        stopping = StoppingCriteria(max_new_tokens=m, ignore_eos=True, stop_token_ids=(stop or {}).get(n, []))
        ids.append(engine.alloc_sequence(64, SAMPLED, stopping).seq_id)
    engine.prefill([PrefillItem(i, p) for i, p in zip(ids, prompts)])
    return ids


def token_view(result) -> list[tuple]:
    return [(t.seq_id, t.token_id, t.logprob, tuple(t.top_logprobs), t.finish_reason, t.seq_len) for t in result.tokens]


def run_router(engine: Engine, prompts, max_new, depth: int) -> tuple[list, list[list[tuple]]]:
    """A router over a churning batch: keeps `depth` steps launched, sends a sequence only while it
    still wants tokens (as bench/load.py does), releases finished ones and admits the next prompt.
    Returns the calls in the order they were made and each step's result."""
    queue, live, calls, out, steps = list(range(len(prompts))), {}, [], [], []
    while queue or live or steps:
        while len(live) < 3 and queue:
            n = queue.pop(0)
            calls.append(("start", n))
            sid, = start(engine, [prompts[n]], [max_new[n]])
            live[sid] = {"n": n, "sent": 1, "want": max_new[n]}  # the prefill sampled the first token
        while len(steps) < depth:
            ids = [sid for sid, st in live.items() if st["sent"] < st["want"]]
            if not ids:
                break
            for sid in ids:
                live[sid]["sent"] += 1
            calls.append(("decode", [live[sid]["n"] for sid in ids]))
            steps.append(engine.decode_launch(ids))
        if not steps:
            break
        result = engine.finish(steps.pop(0))
        out.append([(live[t.seq_id]["n"], *v[1:]) for t, v in zip(result.tokens, token_view(result))])
        ended = [t.seq_id for t in result.tokens if t.finish_reason]
        if ended:
            calls.append(("release", [live[sid]["n"] for sid in ended]))
            engine.release(ended)
            for sid in ended:
                del live[sid]
    return calls, out


def replay_one_at_a_time(engine: Engine, prompts, max_new, calls) -> list[list[tuple]]:
    """The same calls, each decode step waited for at once (Engine.decode)."""
    ids, out = {}, []
    for kind, arg in calls:
        if kind == "start":
            ids[arg], = start(engine, [prompts[arg]], [max_new[arg]])
        elif kind == "decode":
            result = engine.decode([ids[n] for n in arg])
            out.append([(n, *v[1:]) for n, v in zip(arg, token_view(result))])
        else:
            engine.release([ids[n] for n in arg])
    return out


def check_launched_steps_equal_one_at_a_time(make_engine, vocab: int) -> Engine:
    """Runs the churning router with two steps launched on make_engine() and the same calls one step at
    a time on a fresh make_engine(reference=True); asserts equal results and no leak. Returns the
    first engine."""
    prompts = random_prompts([5, 8, 3, 11, 7, 4, 9, 6], vocab, seed=8)
    max_new = [6, 9, 4, 12, 5, 7, 10, 3]
    engine = make_engine()
    free = engine.info().free_blocks
    calls, got = run_router(engine, prompts, max_new, depth=engine.config.max_steps_in_flight)
    assert sum(kind == "decode" for kind, _ in calls) == len(got) >= 20
    assert got == replay_one_at_a_time(make_engine(reference=True), prompts, max_new, calls)
    info = engine.info()
    assert info.live_sequences == 0 and info.free_blocks == free
    return engine


def check_stop_token_refusal(make_engine, vocab: int) -> None:
    """Sequence X samples its stop token in step k, while steps k+1 (X and Y) and k+2 (Y only) are
    already launched: step k+1 is refused as decode refuses a finished sequence, and step k+2 runs
    again on Y's state as it was, giving exactly what a one-at-a-time run gives."""
    prompts = random_prompts([6, 9], vocab, seed=11)
    probe = make_engine(reference=True)
    x, y = start(probe, prompts, [40, 40])
    for _ in range(6):
        probe.decode([x, y])
    generated = probe.sequences[x].token_ids[len(prompts[0]):]  # the prefill's token, then 6 decode steps'
    k = next(i for i in range(2, 6) if generated[i + 1] not in generated[:i + 1])
    stop = {0: [generated[k + 1]]}  # X's token in decode step k (from 0), its first appearance

    ref = make_engine(reference=True)
    x, y = start(ref, prompts, [40, 40], stop)
    expected = [token_view(ref.decode([x, y])) for _ in range(k + 1)]
    assert expected[-1][0][4] == FinishReason.STOP_TOKEN
    with pytest.raises(FailedPrecondition, match="has finished"):
        ref.decode([x, y])
    expected += [token_view(ref.decode([y])) for _ in range(3)]

    engine = make_engine()
    free = engine.info().free_blocks
    x, y = start(engine, prompts, [40, 40], stop)
    got = [token_view(engine.decode([x, y])) for _ in range(k)]
    step_k = engine.decode_launch([x, y])
    behind = engine.decode_launch([x, y])  # launched before step k's stop token is known
    after = engine.decode_launch([y])  # finishes step k first (two steps at most in flight)
    assert step_k.done and not behind.done
    got.append(token_view(engine.finish(step_k)))
    with pytest.raises(FailedPrecondition, match=f"sequence {x} has finished"):
        engine.finish(behind)
    got.append(token_view(engine.finish(after)))
    got += [token_view(engine.decode([y])) for _ in range(2)]
    assert got == expected
    engine.release([x, y])
    assert engine.info().free_blocks == free



def verify_as_decoded(engine: Engine, params: SamplingParams, stopping: StoppingCriteria, prompt: list[int],
                      total: int, vocab: int, mixed: bool) -> tuple[list[int], int, int]:
    """Decodes `total` tokens of `prompt` as the reference, then replays the same sequence through Verify: four
    right drafts, then one right and one wrong (acceptance stops there and the token drawn in its place is
    decode's), then decode to `total`. `mixed` adds a second sequence with a shorter draft (the general path
    instead of the uniform step). Asserts the acceptance and the tokens; returns the reference and the two
    live sequence ids (verified, other) for the caller's own checks and release."""

    def start() -> tuple[int, list[int]]:
        sid = engine.alloc_sequence(40, params, stopping).seq_id
        return sid, [engine.prefill([PrefillItem(sid, prompt)]).tokens[0].token_id]

    sid, ref = start()
    while len(ref) < total:
        ref.append(engine.decode([sid]).tokens[0].token_id)
    engine.release([sid])

    sid, got = start()
    other = engine.alloc_sequence(40, SamplingParams(), StoppingCriteria(ignore_eos=True)).seq_id
    engine.prefill([PrefillItem(other, [7, 7])])
    wrong = list(ref[6:9])  # after 1 + 4 + 1 tokens
    wrong[1] = (wrong[1] + 1) % vocab
    accepted = []
    for drafts in (ref[1:5], wrong):  # four right; then one right, one wrong, one after it
        items = [VerifyItem(sid, drafts)] + ([VerifyItem(other, [1])] if mixed else [])
        res = engine.verify(items).results[0]
        accepted.append(res.num_accepted)
        got += [t.token_id for t in res.tokens]
    while len(got) < total:
        got.append(engine.decode([sid]).tokens[0].token_id)
    assert accepted == [4, 1]
    assert got == ref
    return ref, sid, other
