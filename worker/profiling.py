"""StartProfile / StopProfile of the gateway service (smg's common.proto; vLLM's /start_profile and /stop_profile,
SGLang's start_step / num_steps): a torch.profiler trace of what the worker runs, written as Chrome trace JSON
(Perfetto, chrome://tracing, TensorBoard) under the directory the operator named with --profile-dir.

Profiling is off unless the worker was started with --profile-dir, as vLLM needs VLLM_TORCH_PROFILER_DIR: a
caller chooses at most a directory inside it (StartProfileRequest.output_dir), never a path elsewhere on the
host. One profile at a time. It records every thread (the event loop launches the decode steps, the engine
thread runs prefills and verifies) where this torch supports it, and the GPU's kernels through CUPTI.

Forward steps are the runner's decode steps and long calls (prefill, verify, scoring), counted from the worker's
start (EngineRunner.forward_steps, as SGLang counts its forward_ct). start_step: the profile begins as that step
starts (at once if it has passed); num_steps: it ends as the step after its last starts, and its trace is written
then (StopProfile ends it earlier). profile_by_stage is refused by name."""
from __future__ import annotations

import asyncio
import logging
import os
import pathlib
import socket
import time
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile

from engine.errors import FailedPrecondition, InvalidArgument

log = logging.getLogger(__name__)

# StartProfileRequest.activities, as smg and SGLang name them (case-insensitive): -> a torch profiler activity,
# or "MEM" (allocations, profile_memory).
ACTIVITIES = {"CPU": ProfilerActivity.CPU, "GPU": ProfilerActivity.CUDA, "CUDA": ProfilerActivity.CUDA, "MEM": None}


@dataclass
class _Plan:
    """A requested profile: where it goes, what it records, and its step bounds."""
    out_dir: pathlib.Path
    activities: list[ProfilerActivity]
    memory: bool
    with_stack: bool
    record_shapes: bool
    start_step: int | None
    num_steps: int | None


def _all_threads_config():
    """Kineto's config recording the ops of every thread (torch >= 2.6), else None: the starting thread's only."""
    try:
        from torch._C._profiler import _ExperimentalConfig
        return _ExperimentalConfig(profile_all_threads=True)
    except (ImportError, TypeError):
        return None


class TraceProfiler:
    """root: the --profile-dir (empty: profiling is off). attach(runner) once the engine runs: its forward
    steps drive start_step and num_steps."""

    def __init__(self, root: str):
        self.root = pathlib.Path(root).resolve() if root else None
        self._runner = None
        self._armed: _Plan | None = None  # waiting for its start step
        self._profile: profile | None = None
        self._plan: _Plan | None = None
        self._began_at_step = 0
        self._started = 0.0
        self._finishing: asyncio.Task | None = None  # a num_steps profile being written
        self._written = 0  # traces written: numbers each file name (two profiles may end in one second)
        self.last_trace: pathlib.Path | None = None

    def attach(self, runner) -> None:
        self._runner = runner
        runner.step_listeners.append(self._on_step)

    @property
    def _now(self) -> int:
        return self._runner.forward_steps if self._runner is not None else 0

    def start(self, output_dir: str = "", activities: tuple[str, ...] = (), with_stack: bool = False,
              record_shapes: bool = False, start_step: int | None = None, num_steps: int | None = None) -> str:
        """Starts a profile (or arms it for start_step); returns what the caller is told."""
        if self.root is None:
            raise FailedPrecondition("profiling is off: start the worker with --profile-dir DIR (traces are written "
                                     "under DIR)")
        if self._armed is not None or self._profile is not None or self._finishing is not None:
            raise FailedPrecondition("a profile is running or armed; StopProfile ends it")
        if start_step is not None and start_step < 0:
            raise InvalidArgument(f"start_step must be >= 0, got {start_step}")
        if num_steps is not None and num_steps < 1:
            raise InvalidArgument(f"num_steps must be >= 1, got {num_steps}")
        kinds, memory = self._activities(activities)
        plan = _Plan(self._inside_root(output_dir), kinds, memory, with_stack, record_shapes, start_step, num_steps)
        try:
            plan.out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise FailedPrecondition(f"output_dir {plan.out_dir}: cannot make it ({e.strerror or e})") from e
        bound = f" for {num_steps} forward steps" if num_steps else "; StopProfile writes the trace"
        if start_step is not None and start_step > self._now:
            self._armed = plan
            return f"profiling from forward step {start_step} (now {self._now}){bound}, into {plan.out_dir}"
        self._begin(plan)
        return f"profiling from forward step {self._now}{bound}, into {plan.out_dir}"

    def _begin(self, plan: _Plan) -> None:
        config = _all_threads_config()
        prof = profile(activities=plan.activities, record_shapes=plan.record_shapes, with_stack=plan.with_stack,
                       profile_memory=plan.memory, **({"experimental_config": config} if config is not None else {}))
        try:
            prof.start()
        except Exception as e:  # noqa: BLE001 - why the profiler cannot start (CUPTI, permissions) is the answer
            raise FailedPrecondition(f"the profiler did not start: {e}") from e
        self._profile, self._plan, self._started, self._began_at_step = prof, plan, time.monotonic(), self._now
        log.info("profiling (%s) into %s", ", ".join(a.name for a in plan.activities), plan.out_dir)

    def _on_step(self) -> None:
        """As a forward step starts (on the loop): an armed profile begins at its step; a bounded one ends as
        the step after its last starts."""
        if self._armed is not None and self._now >= self._armed.start_step:
            plan, self._armed = self._armed, None
            try:
                self._begin(plan)
            except FailedPrecondition as e:
                log.error("the armed profile did not start: %s", e)
            return
        plan = self._plan
        if (self._profile is not None and self._finishing is None and plan.num_steps is not None
                and self._now - self._began_at_step >= plan.num_steps):
            self._finishing = asyncio.get_running_loop().create_task(self._write())

    async def stop(self) -> str:
        """Ends the running profile (or disarms a waiting one) and writes its trace; returns what the caller is
        told."""
        if self._armed is not None:
            plan, self._armed = self._armed, None
            return f"the profile armed for forward step {plan.start_step} was dropped before it began (now {self._now})"
        if self._finishing is not None:
            return f"trace written to {await self._finishing}"
        if self._profile is None:
            last = f" (the last trace: {self.last_trace})" if self.last_trace else ""
            raise FailedPrecondition(f"no profile is running{last}; StartProfile begins one")
        return f"trace written to {await self._write()}"

    async def _write(self) -> pathlib.Path:
        """Stops the profile and writes its trace, on a helper thread (a trace of many steps takes seconds)."""
        prof, plan, seconds = self._profile, self._plan, time.monotonic() - self._started
        steps = self._now - self._began_at_step
        self._profile = self._plan = None
        try:
            prof.stop()
            stamp, self._written = time.strftime("%Y%m%dT%H%M%S"), self._written + 1
            path = plan.out_dir / f"trace-{socket.gethostname()}-{os.getpid()}-{stamp}-{self._written}.pt.trace.json"
            await asyncio.get_running_loop().run_in_executor(None, prof.export_chrome_trace, str(path))
        finally:
            self._finishing = None
        self.last_trace = path
        log.info("profile of %.1f s (%d forward steps) written to %s", seconds, steps, path)
        return path

    def close(self) -> None:
        """At shutdown: a running profile is stopped and dropped (nothing is written)."""
        self._armed = None
        if self._profile is not None:
            prof, self._profile = self._profile, None
            prof.stop()

    def _inside_root(self, output_dir: str) -> pathlib.Path:
        if not output_dir:
            return self.root
        path = (self.root / output_dir).resolve()  # an absolute output_dir replaces the root here
        if path != self.root and self.root not in path.parents:
            raise InvalidArgument(f"output_dir {output_dir!r} is outside the worker's --profile-dir {self.root}")
        return path

    @staticmethod
    def _activities(names: tuple[str, ...]) -> tuple[list[ProfilerActivity], bool]:
        """The profiler activities and profile_memory of the request's names; none named: CPU, and the GPU's
        kernels where there is a GPU."""
        unknown = [n for n in names if n.upper() not in ACTIVITIES]
        if unknown:
            raise InvalidArgument(f"activities: unknown {unknown}; known: {sorted(ACTIVITIES)}")
        wanted = {n.upper() for n in names}
        if wanted & {"GPU", "CUDA"} and not torch.cuda.is_available():
            raise InvalidArgument("activities: GPU asked for, but this worker runs on the CPU")
        kinds = [ACTIVITIES[n] for n in sorted(wanted) if ACTIVITIES[n] is not None]
        if not kinds:
            kinds = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        return list(dict.fromkeys(kinds)), "MEM" in wanted
