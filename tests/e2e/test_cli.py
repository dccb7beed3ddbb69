"""The command line: make-model writes a checkpoint transformers loads; serve drains on SIGTERM; every
start-up problem is one line on stderr naming the flag, file or port, and exit code 2; a signal during
the model load stops it."""
from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc

from conftest import ROOT
from metrale.worker.v1 import worker_pb2 as pb
from metrale.worker.v1 import worker_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_make_model_writes_a_checkpoint_transformers_loads(tmp_path):
    out = tmp_path / "q3"
    subprocess.run([sys.executable, "-m", "worker", "make-model", "--arch", "qwen3", "--shape", "tiny", str(out)],
                   check=True, cwd=ROOT, timeout=120)
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "Qwen3ForCausalLM"


def test_serve_default_model_then_sigterm_exits_zero(default_model):
    port = free_port()
    # The session's cache dir, where the default_model fixture converted the default model: the first
    # start on a machine fetches and converts it (tests/e2e/test_real_model.py covers that path's output).
    env = {**os.environ, "METRALE_CACHE_DIR": str(default_model.parent.parent)}
    proc = subprocess.Popen([sys.executable, "-m", "worker", "serve", "--host", "127.0.0.1", "--port", str(port),
                             "--grace-period-s", "5"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + 120
        while True:
            try:
                if health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.RpcError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read() if proc.poll() else ""
            time.sleep(0.2)
        info = pb_grpc.ModelWorkerStub(channel).Info(pb.InfoRequest())
        assert info.model_id == "SmolLM2-135M-Instruct-Q4_1" and info.device == "cpu"
        assert info.vocab_size == 49152 and list(info.eos_token_ids) == [2]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


# ----------------------------------------------------------------------------------------------------
# Start-up errors: one line, exit 2

LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING) [\w.]+: ")


def cli(tmp_path, *args: str, timeout: float = 120, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "METRALE_CACHE_DIR": str(tmp_path / "cache"), **(extra_env or {})}
    return subprocess.run([sys.executable, "-m", "worker", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def serve_args(model, *extra: str) -> list[str]:
    return ["serve", "--model", str(model), "--host", "127.0.0.1", "--port", "0", "--device", "cpu", *extra]


def one_line_error(proc: subprocess.CompletedProcess, *names: str) -> str:
    """Exit 2; stderr is log lines, then the error line last, which names every one of `names`; nothing
    else (no traceback, no asyncio noise). Returns the error line."""
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2, proc.stderr
    assert lines and lines[-1].startswith("metrale-worker: "), proc.stderr
    assert all(LOG_LINE.match(line) for line in lines[:-1]), proc.stderr
    assert "Traceback" not in proc.stderr and "Event loop is closed" not in proc.stderr, proc.stderr
    for name in names:
        assert name in lines[-1], (name, lines[-1])
    return lines[-1]


@pytest.fixture()
def listening():
    """A port another process would hold: a socket bound and listening on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("flag", ["--port", "--metrics-port", "--health-port"])
def test_a_port_in_use_is_one_line_before_the_load(tmp_path, tiny_model, listening, flag):
    args = serve_args(tiny_model)
    if flag == "--port":
        args[args.index("--port") + 1] = str(listening)
    else:
        args += [flag, str(listening)]
    proc = cli(tmp_path, *args)
    one_line_error(proc, flag, str(listening), "in use")
    assert "loading" not in proc.stderr  # refused before the model loads


@pytest.mark.parametrize("name,value,expect", [
    ("METRALE_GEMM", "sm9", "sm90, cublas, sm90-all"),
    ("METRALE_PREFILL_ATTENTION", "flash3", "cudnn, flash"),
    ("METRALE_STEP_WAIT", "spin", "poll, thread"),
    ("METRALE_PDL", "off", "0, 1"),
    ("METRALE_LOG_LEVEL", "LOUD", "DEBUG, INFO"),
    ("METRALE_W8A8_SKINNY_ROWS", "lots", "whole number"),
    ("METRALE_PREFILL_GRAPH_TOKENS", "-4", "whole number"),
    ("METRALE_PREFILL_GRAPH_ATTENTION", "cudnn", "paged, flash"),
])
def test_a_bad_environment_variable_is_one_line_before_anything(tmp_path, tiny_model, name, value, expect):
    """A typo in a METRALE_ variable is refused, not silently a different configuration (or a traceback at import)."""
    proc = cli(tmp_path, *serve_args(tiny_model), extra_env={name: value})
    one_line_error(proc, name, repr(value), expect)
    assert "loading" not in proc.stderr


def test_environment_values_in_their_documented_sets_serve(tmp_path, tiny_model):
    """The check refuses only what is outside the sets: lower-case log levels and every documented value start."""
    proc = cli(tmp_path, *serve_args(tiny_model, "--port", "-1"), extra_env={
        "METRALE_LOG_LEVEL": "debug", "METRALE_GEMM": "cublas", "METRALE_STEP_WAIT": "thread", "METRALE_PDL": "0",
        "METRALE_PREFILL_ATTENTION": "flash", "METRALE_W8A8_SKINNY_ROWS": "0", "METRALE_PREFILL_GRAPH_ATTENTION": "flash"})
    line = one_line_error(proc, "port", "-1")  # refused by the flag, i.e. after the environment passed
    assert "METRALE_" not in line


def tls_files(tmp_path):
    from test_security import make_ca_and_cert
    ca_key, ca_cert, _, ca_file = make_ca_and_cert(tmp_path, "ca")
    _, _, key_file, cert_file = make_ca_and_cert(tmp_path, "server", ca=(ca_key, ca_cert))
    return cert_file, key_file, ca_file


@pytest.mark.parametrize("case", ["token-missing", "token-empty", "token-dir", "cert-missing", "key-missing",
                                  "key-of-another-cert", "ca-missing", "ca-not-pem", "profile-dir-a-file"])
def test_a_missing_or_bad_token_or_tls_file_is_one_line_before_the_load(tmp_path, tiny_model, case):
    cert, key, _ = tls_files(tmp_path)
    (tmp_path / "other").mkdir()
    _, other_key, _ = tls_files(tmp_path / "other")
    missing = tmp_path / "no-such-file"
    token = tmp_path / "token"
    token.write_text("  \n")
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    flags, names = {
        "token-missing": (["--auth-token-file", missing], ["--auth-token-file", str(missing)]),
        "token-empty": (["--auth-token-file", token], ["--auth-token-file", str(token), "empty"]),
        "token-dir": (["--auth-token-file", tmp_path], ["--auth-token-file", str(tmp_path)]),
        "cert-missing": (["--tls-cert-file", missing, "--tls-key-file", key], ["--tls-cert-file", str(missing)]),
        "key-missing": (["--tls-cert-file", cert, "--tls-key-file", missing], ["--tls-key-file", str(missing)]),
        "key-of-another-cert": (["--tls-cert-file", cert, "--tls-key-file", other_key], [str(cert), str(other_key)]),
        "ca-missing": (["--tls-cert-file", cert, "--tls-key-file", key, "--tls-client-ca-file", missing],
                       ["--tls-client-ca-file", str(missing)]),
        "ca-not-pem": (["--tls-cert-file", cert, "--tls-key-file", key, "--tls-client-ca-file", junk],
                       ["--tls-client-ca-file", str(junk)]),
        "profile-dir-a-file": (["--profile-dir", junk], ["--profile-dir", str(junk), "can write into"]),
    }[case]
    proc = cli(tmp_path, *serve_args(tiny_model, *map(str, flags)))
    one_line_error(proc, *names)
    assert "loading" not in proc.stderr


def broken_checkpoint(tmp_path, case: str):
    """A tiny checkpoint broken one way; returns (its dir, what the error line must name)."""
    import safetensors.torch

    from engine.checkpoint import write_checkpoint
    path = write_checkpoint(tmp_path / case, arch="llama", shape="tiny", seed=1)
    weights, config = path / "model.safetensors", path / "config.json"
    raw = json.loads(config.read_text())
    if case == "truncated":
        os.truncate(weights, weights.stat().st_size - 1000)
        return path, [str(weights), "truncated"]
    if case == "not-safetensors":
        weights.write_bytes(b"<html>404 Not Found</html>\n" * 10)
        return path, [str(weights)]
    if case == "unknown-architecture":
        raw.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
        config.write_text(json.dumps(raw))
        return path, [str(config), "GPT2LMHeadModel", "LlamaForCausalLM"]
    if case == "config-not-json":
        config.write_text(json.dumps(raw)[:-20])
        return path, [str(config), "JSON"]
    if case == "config-bad-value":
        raw["num_attention_heads"] = "four"
        config.write_text(json.dumps(raw))
        return path, [str(config), "four"]
    if case == "missing-tensor":
        tensors = safetensors.torch.load_file(weights)
        del tensors["model.layers.1.mlp.down_proj.weight"]
        safetensors.torch.save_file(tensors, weights)
        return path, [str(weights), "model.layers.1.mlp.down_proj.weight"]
    if case == "wrong-shape":
        raw["intermediate_size"] = 96
        config.write_text(json.dumps(raw))
        return path, [str(weights), "model.layers.0.mlp.gate_proj.weight", "(128, 64)", "(96, 64)"]
    if case == "no-weights":
        weights.unlink()
        return path, [str(path), "safetensors"]
    raise ValueError(case)


@pytest.mark.parametrize("case", ["truncated", "not-safetensors", "unknown-architecture", "config-not-json",
                                  "config-bad-value", "missing-tensor", "wrong-shape", "no-weights"])
def test_a_bad_checkpoint_is_one_line_naming_the_file_before_the_load(tmp_path, case):
    path, names = broken_checkpoint(tmp_path, case)
    proc = cli(tmp_path, *serve_args(path))
    one_line_error(proc, *names)
    assert "loading" not in proc.stderr


def test_a_kv_cache_that_cannot_hold_two_blocks_names_the_flags(tmp_path, tiny_model):
    proc = cli(tmp_path, *serve_args(tiny_model, "--kv-cache-memory", "0.00001"))
    line = one_line_error(proc, "--kv-cache-memory", "--num-kv-blocks")
    # tiny: 2 layers x 16 tokens x 2 KV heads x 16 dims x K and V x 4 bytes (float32 on CPU) per block.
    assert str(2 * 16 * 2 * 16 * 2 * 4) in line


def test_make_model_refuses_a_non_empty_directory_without_force(tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    proc = cli(tmp_path, "make-model", str(out))
    one_line_error(proc, str(out), "--force")
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_make_model_force_replaces_a_sharded_checkpoint_cleanly(tmp_path):
    from engine.checkpoint import write_checkpoint
    from engine.config import ModelConfig
    from engine.loader import check_checkpoint
    out = write_checkpoint(tmp_path / "m", arch="qwen2", shape="tiny", max_shard_bytes=60_000)
    assert len(list(out.glob("*.safetensors"))) > 2
    (out / "notes.txt").write_text("mine")
    proc = cli(tmp_path, "make-model", "--arch", "llama", "--force", str(out))
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                     "notes.txt"]
    cfg = ModelConfig.from_dir(out)
    assert cfg.architecture == "llama"
    check_checkpoint(out, cfg)


# ----------------------------------------------------------------------------------------------------
# A signal during the model load

# Runs the CLI with every tensor read slowed down by argv[1] seconds (a large checkpoint on a slow disk),
# and START_STOP_GRACE_S set to argv[2].
SLOW_LOAD = """
import sys, time
import engine.loader, worker.server
seconds, worker.server.START_STOP_GRACE_S = float(sys.argv[1]), float(sys.argv[2])
read = engine.loader._Tensors.get
def slow_read(self, name):
    time.sleep(seconds)
    return read(self, name)
engine.loader._Tensors.get = slow_read
from worker.__main__ import main
sys.exit(main(sys.argv[3:]))
"""


def signal_during_load(tmp_path, model, seconds_per_tensor: float, grace_s: float, sig=signal.SIGTERM):
    """Starts a serve whose load is slow, sends `sig` once it logged that loading began; returns
    (exit code, seconds from the signal to the exit, stderr)."""
    env = {**os.environ, "METRALE_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.Popen([sys.executable, "-c", SLOW_LOAD, str(seconds_per_tensor), str(grace_s),
                             *serve_args(model)], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
    seen = []
    try:
        while not any("loading" in line for line in seen):
            seen.append(lines.get(timeout=60))
        proc.send_signal(sig)
        t0 = time.monotonic()
        code = proc.wait(timeout=30)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    time.sleep(0.1)
    while not lines.empty():
        seen.append(lines.get())
    return code, elapsed, "".join(seen)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_the_load_stops_it_and_exits_zero(tmp_path, tiny_model, sig):
    # 21 tensors at 0.5 s each: the load alone would take over 10 s.
    code, elapsed, stderr = signal_during_load(tmp_path, tiny_model, 0.5, grace_s=30, sig=sig)
    assert code == 0, stderr
    assert elapsed < 4, (elapsed, stderr)
    assert "stopped before serving" in stderr and "serving " not in stderr.replace("stopped before serving", "")
    assert "Traceback" not in stderr


def test_a_load_that_does_not_stop_is_left_behind_after_the_grace(tmp_path, tiny_model):
    # One tensor read that takes a minute: the load never reaches its next check.
    code, elapsed, stderr = signal_during_load(tmp_path, tiny_model, 60, grace_s=1)
    assert code == 0, stderr
    assert 1 <= elapsed < 5, (elapsed, stderr)
    assert "did not stop" in stderr and "Traceback" not in stderr
