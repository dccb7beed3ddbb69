"""StartProfile / StopProfile of the gateway service (smg's common.proto; vLLM's /start_profile and /stop_profile):
a torch.profiler trace of whatever the worker runs between the two calls, written as Chrome trace JSON (Perfetto,
chrome://tracing, TensorBoard) under the directory the operator named with --profile-dir.

Profiling is off unless the worker was started with --profile-dir, as vLLM needs VLLM_TORCH_PROFILER_DIR: a
caller chooses at most a directory inside it (StartProfileRequest.output_dir), never a path elsewhere on the
host. One profile runs at a time. It records every thread (the event loop launches the decode steps, the engine
thread runs prefills and verifies) where this torch supports it, and the GPU's kernels through CUPTI. Fields this
worker cannot honour (start_step, num_steps, profile_by_stage) are refused by name, never ignored."""
from __future__ import annotations

import asyncio
import logging
import os
import pathlib
import socket
import time

import torch
from torch.profiler import ProfilerActivity, profile

from engine.errors import FailedPrecondition, InvalidArgument

log = logging.getLogger(__name__)

# StartProfileRequest.activities, as smg and SGLang name them (case-insensitive): -> a torch profiler activity,
# or "MEM" (allocations, profile_memory).
ACTIVITIES = {"CPU": ProfilerActivity.CPU, "GPU": ProfilerActivity.CUDA, "CUDA": ProfilerActivity.CUDA, "MEM": None}


def _all_threads_config():
    """Kineto's config recording the ops of every thread (torch >= 2.6), else None: the starting thread's only."""
    try:
        from torch._C._profiler import _ExperimentalConfig
        return _ExperimentalConfig(profile_all_threads=True)
    except (ImportError, TypeError):
        return None


class TraceProfiler:
    """root: the --profile-dir (empty: profiling is off)."""

    def __init__(self, root: str):
        self.root = pathlib.Path(root).resolve() if root else None
        self._profile: profile | None = None
        self._out_dir: pathlib.Path | None = None
        self._started = 0.0
        self._stopping = False

    @property
    def running(self) -> bool:
        return self._profile is not None

    def start(self, output_dir: str = "", activities: tuple[str, ...] = (), with_stack: bool = False,
              record_shapes: bool = False) -> pathlib.Path:
        """Starts a profile; returns the directory its trace will be written to."""
        if self.root is None:
            raise FailedPrecondition("profiling is off: start the worker with --profile-dir DIR (traces are written "
                                     "under DIR)")
        if self._profile is not None or self._stopping:
            raise FailedPrecondition(f"a profile has been running for {time.monotonic() - self._started:.1f} s; "
                                     f"StopProfile ends it")
        out_dir = self._inside_root(output_dir)
        kinds, memory = self._activities(activities)
        config = _all_threads_config()
        prof = profile(activities=kinds, record_shapes=record_shapes, with_stack=with_stack, profile_memory=memory,
                       **({"experimental_config": config} if config is not None else {}))
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            prof.start()
        except Exception as e:  # noqa: BLE001 - why the profiler cannot start (CUPTI, permissions) is the answer
            raise FailedPrecondition(f"the profiler did not start: {e}") from e
        self._profile, self._out_dir, self._started = prof, out_dir, time.monotonic()
        log.info("profiling (%s) into %s", ", ".join(a.name for a in kinds), out_dir)
        return out_dir

    async def stop(self) -> pathlib.Path:
        """Ends the running profile and writes its trace (on a helper thread: a trace of many steps takes seconds to
        write); returns the trace's path."""
        if self._profile is None:
            raise FailedPrecondition("no profile is running; StartProfile begins one")
        prof, out_dir, seconds = self._profile, self._out_dir, time.monotonic() - self._started
        self._profile, self._stopping = None, True
        try:
            prof.stop()
            stamp = time.strftime("%Y%m%dT%H%M%S")
            path = out_dir / f"trace-{socket.gethostname()}-{os.getpid()}-{stamp}.pt.trace.json"
            await asyncio.get_running_loop().run_in_executor(None, prof.export_chrome_trace, str(path))
        finally:
            self._stopping = False
        log.info("profile of %.1f s written to %s", seconds, path)
        return path

    def close(self) -> None:
        """At shutdown: a running profile is stopped and dropped (nothing is written)."""
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
