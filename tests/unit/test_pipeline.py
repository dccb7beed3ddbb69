"""Decode steps queued behind the running one (Engine.decode_launch / finish), on CPU: the same tokens as
one step at a time, and the cases where a queued step must wait or be refused."""
from __future__ import annotations

import pytest

from conftest import ExecBackend, engine_config, random_prompts
from engine.api import PrefillItem
from engine.engine import Engine
from engine.errors import FailedPrecondition, NotFound
from engine.sampling import StoppingCriteria
from engine.sequence import FinishReason
from engine.warm_up import warm_up_decode
from pipeline_checks import SAMPLED, check_launched_steps_equal_one_at_a_time, check_stop_token_refusal, start, token_view


@pytest.mark.parametrize("graphs", [False, True])
def test_steps_launched_behind_the_running_one_equal_one_at_a_time(tiny_model, graphs):
    """Over a churning batch with sampling, repetition penalty and top log-probs, a router that keeps
    two steps launched gets exactly what the same calls give one step at a time (tokens, log-probs,
    top log-probs, finish reasons, lengths), also through width-fallback graphs (slot vectors staged
    through one pinned buffer per step in flight). Nothing leaks."""
    from engine.cuda.graphs import GraphCache

    def make_engine(reference: bool = False) -> Engine:
        engine = Engine(engine_config(tiny_model, fallback_graphs=graphs))
        if graphs and not reference:
            engine.runtime.dispatch.graphs = GraphCache(ExecBackend(), max_graphs=8, capture_after=3)
        return engine

    engine = check_launched_steps_equal_one_at_a_time(make_engine, 512)
    if graphs:
        stats = engine.info().graph_cache
        assert stats.fallbacks > 0 and stats.hits > 0


def test_a_stop_token_refuses_the_step_behind_and_reruns_the_one_after(tiny_model):
    check_stop_token_refusal(lambda reference=False: Engine(engine_config(tiny_model)), 512)


def test_a_step_that_would_follow_a_length_finish_is_refused_at_launch(tiny_model):
    """A sequence whose launched step ends it by length is known finished: the next launch with it
    finishes the steps in flight, then is refused; the step before it answers normally."""
    engine = Engine(engine_config(tiny_model))
    sid, = start(engine, random_prompts([5], 512, seed=2), [3])  # token 1 from the prefill
    second = engine.decode_launch([sid])
    third = engine.decode_launch([sid])  # it is the last token: launched behind the second
    with pytest.raises(FailedPrecondition, match="has finished \\(LENGTH\\)"):
        engine.decode_launch([sid])
    assert second.done and third.done
    assert engine.finish(third).tokens[0].finish_reason == FinishReason.LENGTH
    assert engine.finish(second).tokens[0].finish_reason == FinishReason.NONE


def test_release_and_input_tokens_wait_for_the_steps_in_flight(tiny_model):
    """Releasing a sequence of a launched step finishes that step first (its slot is freed after it);
    a step with input_token_ids finishes the steps before it, since it rewrites the token history."""
    prompts = random_prompts([7, 4], 512, seed=3)
    ref = Engine(engine_config(tiny_model))
    a, b = start(ref, prompts, [30, 30])
    expected = [token_view(ref.decode([a, b])), token_view(ref.decode([a, b], input_token_ids=[17, 23])),
                token_view(ref.decode([a]))]

    engine = Engine(engine_config(tiny_model))
    free = engine.info().free_blocks
    a, b = start(engine, prompts, [30, 30])
    first = engine.decode_launch([a, b])
    second = engine.decode_launch([a, b], input_token_ids=[17, 23])
    assert first.done  # finished before the override was written
    third = engine.decode_launch([a])
    engine.release([b])  # in the second step: finishes the steps in flight
    assert second.done and third.done
    assert [token_view(engine.finish(s)) for s in (first, second, third)] == expected
    engine.release([a])
    assert engine.info().free_blocks == free


def test_verify_and_prefill_finish_the_steps_in_flight(tiny_model):
    """Verify checks lengths on committed state, so it finishes launched steps first; so does
    Prefill. Their answers then match a one-at-a-time run."""
    from engine.api import VerifyItem

    prompts = random_prompts([7, 4, 6], 512, seed=4)
    ref = Engine(engine_config(tiny_model))
    a, b = start(ref, prompts[:2], [30, 30])
    expected = [token_view(ref.decode([a, b]))]
    verify_ref = ref.verify([VerifyItem(a, [1, 2]), VerifyItem(b, [3, 4])])
    expected.append(token_view(ref.decode([a, b])))
    c, = start(ref, prompts[2:], [30])
    expected.append(token_view(ref.decode([a, b, c])))

    engine = Engine(engine_config(tiny_model))
    a, b = start(engine, prompts[:2], [30, 30])
    step = engine.decode_launch([a, b])
    got_verify = engine.verify([VerifyItem(a, [1, 2]), VerifyItem(b, [3, 4])])
    assert step.done
    got = [token_view(engine.finish(step))]
    assert [[(t.token_id, t.logprob) for t in r.tokens] for r in got_verify.results] == \
           [[(t.token_id, t.logprob) for t in r.tokens] for r in verify_ref.results]
    pending = engine.decode_launch([a, b])
    c, = start(engine, prompts[2:], [30])  # its prefill finishes the step
    assert pending.done
    got.append(token_view(engine.finish(pending)))
    got.append(token_view(engine.decode([a, b, c])))
    assert got == expected


def test_one_step_in_flight_waits_for_each_step(tiny_model):
    """max_steps_in_flight = 1: a launch finishes the step before it (the behaviour without overlap)."""
    engine = Engine(engine_config(tiny_model, max_steps_in_flight=1))
    sid, = start(engine, random_prompts([5], 512, seed=2), [10])
    first = engine.decode_launch([sid])
    second = engine.decode_launch([sid])
    assert first.done
    assert engine.finish(second).tokens[0].seq_len == engine.finish(first).tokens[0].seq_len + 1


@pytest.mark.parametrize("seed", range(8))
def test_random_pipelined_calls_equal_the_same_calls_one_at_a_time(tiny_model, seed):
    """A random router: admits and releases sequences, launches Decodes over random subsets with up to
    three in flight, finishes them in order, and its sequences stop on frequent stop tokens, so steps
    launched behind a stopping one are refused and the ones after them run again. Every Decode's
    outcome (its tokens, or the error that refused it) equals what the same calls give when each runs
    at once, in launch order. Nothing leaks."""
    import random

    rng = random.Random(seed)
    prompts = random_prompts([rng.randint(2, 12) for _ in range(12)], 512, seed=seed)
    stop = sorted(rng.sample(range(512), 40))  # ~8% of the vocabulary: stops are frequent
    max_new = [rng.randint(3, 14) for _ in prompts]

    def admit(engine, n):
        stopping = StoppingCriteria(max_new_tokens=max_new[n], ignore_eos=True, stop_token_ids=stop)
        sid = engine.alloc_sequence(64, SAMPLED, stopping).seq_id
        first = engine.prefill([PrefillItem(sid, prompts[n])]).tokens[0]
        return sid, first.finish_reason != FinishReason.NONE

    def outcome(fn):
        try:
            return token_view(fn())
        except FailedPrecondition as e:
            return f"refused: {e}"

    engine = Engine(engine_config(tiny_model, max_steps_in_flight=3))
    free = engine.info().free_blocks
    calls, got, steps = [], [], []
    live: dict[int, dict] = {}  # sid -> {"n", "sent", "ended"}
    next_prompt = 0

    def finish_oldest():
        index, step = steps.pop(0)
        try:
            result = engine.finish(step)
        except FailedPrecondition as e:
            got[index] = f"refused: {e}"
            return
        got[index] = token_view(result)
        for t in result.tokens:
            if t.finish_reason:
                live[t.seq_id]["ended"] = True

    while next_prompt < len(prompts) or live or steps:
        action = rng.random()
        if action < 0.2 and next_prompt < len(prompts) and len(live) < 5:
            calls.append(("start", next_prompt))
            sid, ended = admit(engine, next_prompt)
            live[sid] = {"n": next_prompt, "sent": 1, "ended": ended}
            next_prompt += 1
        elif action < 0.6 and len(steps) < 3:
            wanting = [sid for sid, st in live.items() if not st["ended"] and st["sent"] < max_new[st["n"]]]
            if not wanting:
                if steps:
                    finish_oldest()
                continue
            ids = rng.sample(wanting, rng.randint(1, len(wanting)))
            calls.append(("decode", [live[sid]["n"] for sid in ids]))
            got.append(None)
            for sid in ids:
                live[sid]["sent"] += 1
            try:
                steps.append((len(got) - 1, engine.decode_launch(ids)))
            except FailedPrecondition as e:
                got[-1] = f"refused: {e}"
        elif steps:
            finish_oldest()
        else:
            done = [sid for sid, st in live.items() if st["ended"] or st["sent"] >= max_new[st["n"]]]
            if not done and next_prompt >= len(prompts):
                done = list(live)
            if done:
                calls.append(("release", [live[sid]["n"] for sid in done]))
                engine.release(done)
                for sid in done:
                    del live[sid]
    assert None not in got
    refused_after_launch = engine.info().refused_steps
    print(f"seed {seed}: {len(got)} decodes, {sum(isinstance(g, str) for g in got)} refused, "
          f"{refused_after_launch} of them after launch")
    assert 0 < refused_after_launch <= sum(isinstance(g, str) for g in got)

    ref = Engine(engine_config(tiny_model, max_steps_in_flight=1))
    ids, expected = {}, []
    for kind, arg in calls:
        if kind == "start":
            ids[arg], _ = admit(ref, arg)
        elif kind == "decode":
            expected.append(outcome(lambda: ref.decode([ids[n] for n in arg])))
        else:
            ref.release([ids[n] for n in arg])
    # Sequence ids are the same in both engines (allocated in the same order).
    assert got == expected
    info = engine.info()
    assert info.live_sequences == 0 and info.free_blocks == free


def test_decode_width_warm_up_is_a_no_op_without_cuda_graphs(tiny_model):
    """On the CPU (no CUDA graphs) warm_up_decode runs nothing and leaves nothing allocated; the GPU
    test test_warm_up_captures_each_decode_width_so_requests_do_not covers the captures."""
    engine = Engine(engine_config(tiny_model, warm_up_widths=4))
    assert warm_up_decode(engine) == 0
    assert not engine.sequences


def test_the_last_batch_plan_serves_the_same_batch_and_release_drops_it(tiny_model):
    """decode_launch keeps the last batch's checked sequences and slot order (BatchPlan): a repeated batch
    reuses it, a batch in another order gets its own (results still in request order), and a released
    sequence is unknown at once even though the plan held it."""
    engine = Engine(engine_config(tiny_model))
    prompts = random_prompts([6, 5, 7], engine.model_config.vocab_size, seed=11)
    a, b, c = start(engine, prompts, [20, 20, 20])
    first = engine.decode([a, b, c])
    plan = engine.decoder._last_plan
    engine.decode([a, b, c])
    assert engine.decoder._last_plan is plan and plan.in_slot_order
    reordered = engine.decode([c, a, b])
    assert engine.decoder._last_plan is not plan and not engine.decoder._last_plan.in_slot_order
    assert [t.seq_id for t in reordered.tokens] == [c, a, b]
    assert [t.seq_len for t in reordered.tokens] == [t.seq_len + 2 for t in (first.tokens[2], first.tokens[0],
                                                                              first.tokens[1])]
    engine.release([b])
    assert engine.decoder._last_plan is None
    with pytest.raises(NotFound):
        engine.decode([c, a, b])
    assert [t.seq_id for t in engine.decode([c, a]).tokens] == [c, a]
    engine.close()
