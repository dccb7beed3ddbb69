"""--quantization fp8 end to end on CPU: a tiny random checkpoint served over real gRPC with FP8 weights (per-channel
and 1x8 block scales) answers Prefill/Decode with the tokens its own FP8 weights predict (the greedy tokens are
the argmax of the same engine's teacher-forced scores), Info and /metrics say what is quantized, and a bad
value is refused at start-up with exit 2."""
from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest

from conftest import ROOT, generate_via_grpc, random_prompts, start_server
from metrale.worker.v1 import worker_pb2 as pb
from test_cli import free_port


@pytest.fixture(scope="module", params=[(False, "channel"), (True, "channel"), (True, "1x8")],
                ids=["fp8", "fp8-lm-head", "fp8-1x8-lm-head"])
def fp8_server(request, checkpoints):
    # tied embeddings: with the LM head quantized it is a copy of its own; the embedding stays fp32
    srv = start_server(checkpoints["qwen2-bias-tied"], quantization="fp8",
                       quantize_lm_head=request.param[0], fp8_weight_block=request.param[1])
    srv.lm_head, srv.block = request.param
    yield srv
    srv.stop()


def test_info_reports_fp8(fp8_server):
    info = fp8_server.stub().Info(pb.InfoRequest())
    assert info.quantization == "fp8" and info.quantized_lm_head is fp8_server.lm_head
    assert info.fp8_weight_block == fp8_server.block and info.fp8_activation_scheme == "dynamic"
    assert info.dtype == "float32"  # the activations, embeddings and norms


def test_greedy_tokens_over_grpc_are_the_fp8_models_own_predictions(fp8_server):
    stub = fp8_server.stub()
    vocab = stub.Info(pb.InfoRequest()).vocab_size
    prompts = random_prompts([5, 17, 40], vocab, seed=11)
    outputs = generate_via_grpc(stub, prompts, max_new_tokens=12)
    for prompt, out in zip(prompts, outputs):
        assert len(out) == 12 and all(0 <= t < vocab for t in out)
        # the scorer runs the same FP8 weights in one prefill forward: its argmax rows are the greedy tokens
        logp = fp8_server.engine_call(lambda e, seq=prompt + out: e.score(seq))
        assert logp[len(prompt) - 1:-1].argmax(-1).tolist() == out


def test_unquantized_info_reports_none(server):
    info = server.stub().Info(pb.InfoRequest())
    assert info.quantization == "none" and info.quantized_lm_head is False and info.fp8_weight_block == ""
    assert info.fp8_activation_scheme == ""


def test_metrics_say_what_is_quantized(checkpoints):
    port = free_port()
    srv = start_server(checkpoints["llama-gqa"], worker_changes={"metrics_port": port}, quantization="fp8",
                       fp8_weight_block="1x64", fp8_activation_scheme="none")
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        srv.stop()
    line = next(l for l in text.splitlines() if l.startswith("metrale_weights_info{"))
    assert 'quantization="fp8"' in line and 'lm_head_quantized="false"' in line and line.endswith(" 1.0")
    assert 'fp8_weight_block="1x64"' in line and 'fp8_activation_scheme="none"' in line


def test_an_unknown_quantization_is_one_line_and_exit_2(tiny_model):
    proc = subprocess.run([sys.executable, "-m", "worker", "serve", "--model", str(tiny_model), "--port", "0",
                           "--quantization", "int4"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "argument --quantization: invalid choice: 'int4'" in proc.stderr.splitlines()[-1]
    proc = subprocess.run([sys.executable, "-m", "worker", "serve", "--model", str(tiny_model), "--port", "0",
                           "--quantize-lm-head"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == ("metrale-worker: --quantize-lm-head needs quantization fp8 "
                                                    "(--quantization fp8)")


@pytest.mark.parametrize("args, line", [
    (["--quantization", "fp8", "--fp8-weight-block", "64"],
     "metrale-worker: --fp8-weight-block must be 'channel' or ROWSxCOLS with positive integers (e.g. 1x64, 128x128), "
     "got '64'"),
    (["--quantization", "fp8", "--fp8-weight-block", "0x64"],
     "metrale-worker: --fp8-weight-block must be 'channel' or ROWSxCOLS with positive integers (e.g. 1x64, 128x128), "
     "got '0x64'"),
    (["--fp8-weight-block", "1x64"],
     "metrale-worker: --fp8-weight-block 1x64 needs quantization fp8 (--quantization fp8)"),
])
def test_a_bad_fp8_weight_block_is_one_line_and_exit_2(tiny_model, args, line):
    proc = subprocess.run([sys.executable, "-m", "worker", "serve", "--model", str(tiny_model), "--port", "0", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [line]


@pytest.mark.parametrize("args, line", [
    (["--fp8-skip-layers", "0"], "metrale-worker: --fp8-skip-layers 0 needs quantization fp8 (--quantization fp8)"),
    (["--quantization", "fp8", "--fp8-skip-layers", "last"],
     "metrale-worker: --fp8-skip-layers must be comma-separated layer indices such as 0,-1, got 'last'"),
    (["--quantization", "fp8", "--fp8-skip-layers", "0,{layers}"],
     "metrale-worker: --fp8-skip-layers: layer {layers} is outside the model's {layers} layers (0 .. {last}, or "
     "-{layers} .. -1 from the last)"),
])
def test_a_bad_fp8_skip_layers_is_one_line_and_exit_2(tiny_model, args, line):
    layers = json.loads((tiny_model / "config.json").read_text())["num_hidden_layers"]
    args = [a.format(layers=layers) for a in args]
    proc = subprocess.run([sys.executable, "-m", "worker", "serve", "--model", str(tiny_model), "--port", "0",
                           "--device", "cpu", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines[-1] == line.format(layers=layers, last=layers - 1) and not any("Traceback" in l for l in lines), lines


@pytest.mark.parametrize("args, line", [
    (["--fp8-activation-scheme", "none"],
     "metrale-worker: --fp8-activation-scheme none needs FP8 weights (--quantization fp8, or an FP8 checkpoint: "
     "config.json's quantization_config); {model} holds float32 weights"),
    (["--quantization", "fp8", "--fp8-activation-scheme", "static"],
     "argument --fp8-activation-scheme: invalid choice: 'static'"),
])
def test_a_bad_fp8_activation_scheme_is_one_line_and_exit_2(tiny_model, args, line):
    proc = subprocess.run([sys.executable, "-m", "worker", "serve", "--model", str(tiny_model), "--port", "0", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    if line.startswith("metrale-worker:"):  # refused at load: the log lines of the start, then the one error line
        assert lines[-1] == line.format(model=tiny_model) and not any("Traceback" in ln for ln in lines), lines
    else:  # argparse: its usage, then the error line (how it lists the choices differs by Python version)
        assert line in lines[-1], lines[-1]
