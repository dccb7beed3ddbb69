"""Every environment variable the project reads, read once, here. Prefix: METRALE_."""
import os
import pathlib

# Where the built-in default model and compiled kernels are cached.
CACHE_DIR = pathlib.Path(os.environ.get("METRALE_CACHE_DIR") or pathlib.Path.home() / ".cache" / "metrale-worker")
# Python logging level name for the worker (DEBUG, INFO, WARNING, ...).
LOG_LEVEL = os.environ.get("METRALE_LOG_LEVEL", "INFO")
