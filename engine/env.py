"""Every environment variable the project reads, read once, here. Prefix: METRALE_ (and the
standard CUDA_HOME / CUDA_PATH)."""
import os
import pathlib

# Where the built-in default model and compiled kernels are cached.
CACHE_DIR = pathlib.Path(os.environ.get("METRALE_CACHE_DIR") or pathlib.Path.home() / ".cache" / "metrale-worker")
# Python logging level name for the worker (DEBUG, INFO, WARNING, ...).
LOG_LEVEL = os.environ.get("METRALE_LOG_LEVEL", "INFO")
# CUDA toolkit roots searched for nvcc when it is not on PATH (the standard CUDA variables).
CUDA_ROOTS = tuple(r for r in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda") if r)
# Programmatic dependent launch of the decode kernels on sm_90+ ("0" turns it off; engine/cuda/library.py).
PDL = os.environ.get("METRALE_PDL", "1") != "0"
# How the worker's event loop learns that a step's device work ended: "thread" (a helper thread waits on the step's
# event and wakes the loop) or "poll" (the loop itself queries the event between its other callbacks, a core
# spinning while a step runs; an experiment for the batch-1 round trip, worker/runner.py).
STEP_WAIT = os.environ.get("METRALE_STEP_WAIT", "thread")
