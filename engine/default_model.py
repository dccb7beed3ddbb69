"""The built-in default model: a tiny seeded-random Llama written once to the cache dir."""
from __future__ import annotations

import os
import pathlib
import shutil
import tempfile

from engine import env
from engine.checkpoint import write_checkpoint

NAME = "default-llama-tiny-v1"


def default_model_dir() -> pathlib.Path:
    path = env.CACHE_DIR / "models" / NAME
    if (path / "config.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{NAME}."))
    write_checkpoint(tmp, arch="llama", shape="tiny", seed=0)
    try:
        os.rename(tmp, path)  # atomic: concurrent starters see a whole checkpoint or none
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (path / "config.json").is_file():
            raise
    return path
