"""The command line: make-model writes a checkpoint transformers loads; serve drains on SIGTERM."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import grpc

from conftest import ROOT
from metrale.worker.v1 import worker_pb2 as pb
from metrale.worker.v1 import worker_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


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


def test_serve_default_model_then_sigterm_exits_zero(tmp_path):
    port = free_port()
    env = {**os.environ, "METRALE_CACHE_DIR": str(tmp_path / "cache")}
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
        assert info.model_id == "default-llama-tiny-v1" and info.device == "cpu"
        assert (tmp_path / "cache" / "models" / "default-llama-tiny-v1" / "config.json").is_file()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
