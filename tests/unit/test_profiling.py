"""worker/profiling.py's TraceProfiler on its own (a stand-in runner that counts forward steps): the profile's
states (off, idle, armed, running, bounded) under every order of start, step and stop calls."""
from __future__ import annotations

import asyncio
import json
import pathlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.errors import FailedPrecondition, InvalidArgument
from worker.profiling import TraceProfiler


class Runner:
    """What TraceProfiler reads of an EngineRunner: forward_steps and step_listeners."""

    def __init__(self):
        self.forward_steps = 0
        self.step_listeners = []

    def step(self) -> None:
        self.forward_steps += 1
        torch.mm(torch.ones(4, 4), torch.ones(4, 4))  # an op for the trace
        for listener in self.step_listeners:
            listener()


def traces(root: pathlib.Path) -> list[pathlib.Path]:
    return sorted(root.rglob("*.json"))


def test_off_without_a_profile_dir():
    with pytest.raises(FailedPrecondition, match="--profile-dir"):
        TraceProfiler("").start()


def test_bounded_profile_writes_itself_after_its_steps(tmp_path):
    async def run():
        runner, prof = Runner(), TraceProfiler(str(tmp_path))
        prof.attach(runner)
        runner.step()
        assert "from forward step 1 for 2 forward steps" in prof.start(num_steps=2, activities=("cpu",))
        runner.step()
        runner.step()
        assert not traces(tmp_path)
        runner.step()  # the step after the last: the profile ends and its trace is written
        await asyncio.sleep(0)
        message = await prof.stop() if prof._finishing is not None else None
        return runner, prof, message

    runner, prof, message = asyncio.run(run())
    assert len(traces(tmp_path)) == 1 and prof.last_trace == traces(tmp_path)[0]
    assert message is None or str(prof.last_trace) in message
    names = {e.get("name", "") for e in json.loads(prof.last_trace.read_text())["traceEvents"]}
    assert "aten::mm" in names
    with pytest.raises(FailedPrecondition, match=str(prof.last_trace)):
        asyncio.run(prof.stop())


def test_armed_profile_starts_at_its_step_and_can_be_dropped(tmp_path):
    runner, prof = Runner(), TraceProfiler(str(tmp_path))
    prof.attach(runner)
    assert "from forward step 3 (now 0)" in prof.start(start_step=3)
    with pytest.raises(FailedPrecondition):
        prof.start()
    assert "dropped before it began" in asyncio.run(prof.stop())
    prof.start(start_step=2, activities=("cpu",))
    runner.step()
    assert prof._profile is None
    runner.step()
    assert prof._profile is not None
    assert "trace written to" in asyncio.run(prof.stop())


@pytest.mark.parametrize("kwargs, named", [
    (dict(output_dir="../x"), "output_dir"), (dict(output_dir="/"), "output_dir"),
    (dict(activities=("npu",)), "activities"), (dict(num_steps=0), "num_steps"), (dict(start_step=-2), "start_step")])
def test_bad_requests_are_refused_by_name_and_leave_it_idle(tmp_path, kwargs, named):
    prof = TraceProfiler(str(tmp_path))
    with pytest.raises(InvalidArgument, match=named):
        prof.start(**kwargs)
    prof.start(output_dir="inside/deeper", activities=("cpu",))  # idle still, and a directory inside is fine
    assert str(tmp_path / "inside" / "deeper") in asyncio.run(prof.stop())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.sampled_from(["start", "start_bounded", "start_armed", "step", "stop"]), max_size=14))
def test_any_order_of_calls_keeps_one_profile_and_one_trace_per_profile(tmp_path_factory, ops):
    """Whatever the order: at most one profile runs, StartProfile is refused exactly while one runs or is armed,
    StopProfile exactly while none does, and every profile that began leaves one trace once it has ended."""
    root = tmp_path_factory.mktemp("prof")

    async def run():
        runner, prof = Runner(), TraceProfiler(str(root))
        prof.attach(runner)
        began = 0
        for op in ops:
            busy = prof._armed is not None or prof._profile is not None or prof._finishing is not None
            if op.startswith("start"):
                kwargs = {"start": {}, "start_bounded": {"num_steps": 2},
                          "start_armed": {"start_step": runner.forward_steps + 2}}[op]
                if busy:
                    with pytest.raises(FailedPrecondition):
                        prof.start(activities=("cpu",), **kwargs)
                else:
                    prof.start(activities=("cpu",), **kwargs)
                    began += op != "start_armed"
            elif op == "step":
                running = prof._profile is not None
                runner.step()
                began += prof._profile is not None and not running
                await asyncio.sleep(0)
            elif busy:
                await prof.stop()
            else:
                with pytest.raises(FailedPrecondition):
                    await prof.stop()
            if prof._finishing is not None:
                await prof._finishing
        if prof._profile is not None or prof._finishing is not None:
            await prof.stop()
        return began

    began = asyncio.run(run())
    assert len(traces(root)) == began
