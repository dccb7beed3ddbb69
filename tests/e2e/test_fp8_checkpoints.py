"""Published FP8 checkpoints (engine/fp8_checkpoint.py) on CPU: tiny random Llama and Qwen3 checkpoints written in
the Hugging Face fp8 layout (128x128 and 32x32 blocks; per tensor with static activation scales) and
compressed-tensors FP8 (per channel; per tensor with static input scales), following their specifications
(engine/checkpoint.py FP8_LAYOUTS).

- The loader's weights are the checkpoint's own FP8 values and scales: dequantized, exactly the dequantization
  of the files written out independently (tests/fp8_reference.py), and within E4M3 rounding of the random
  weights they were quantized from.
- An engine on each matches the same engine on the dequantized fp32 checkpoint (teacher-forced log-probs), and
  transformers' own loading of the checkpoint where it has one on CPU.
- --quantization fp8 uses the checkpoint's scales; Info says what is loaded; one checkpoint is served over gRPC.
- Bad input (an unsupported quant_method or scheme, missing scales, scales of the wrong shape or dtype, an FP8
  tensor without a quantization_config) is one line and exit 2 at start-up."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import ROOT, engine_config, generate_via_grpc, random_prompts, start_server
from engine.checkpoint import write_checkpoint, random_weights
from engine.config import ModelConfig
from engine.engine import Engine
from engine.loader import LAYER_PREFIX, LAYER_TENSORS, LM_HEAD, QUANTIZED_FIELDS, load_weights
from engine.quant import Fp8Weight, dequantize
from metrale.worker.v1 import worker_pb2 as pb
from tests.fp8_reference import FP8_CHECKPOINTS, dequantized_tensors, write_dequantized

pytestmark = pytest.mark.timeout(300)
SEED = 7
E4M3_REL = 2.0 ** -4  # E4M3 round-to-nearest: relative error of a normal value
E4M3_SUBNORMAL = 2.0 ** -9  # its smallest subnormal, times the scale: the absolute error floor


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory) -> dict[str, tuple]:
    """name -> (FP8 checkpoint, its dequantized fp32 copy)."""
    root = tmp_path_factory.mktemp("fp8-checkpoints")
    out = {}
    for name, (arch, layout, overrides) in FP8_CHECKPOINTS.items():
        fp8 = write_checkpoint(root / name, arch=arch, seed=SEED, fp8_layout=layout, **overrides)
        out[name] = fp8, write_dequantized(fp8, root / f"{name}-dequantized")
    return out


def score(path, tokens: list[int], **changes) -> torch.Tensor:
    engine = Engine(engine_config(path, **changes))
    try:
        return engine.score(tokens)
    finally:
        engine.close()


def tokens_for(path, n: int = 48) -> list[int]:
    vocab = ModelConfig.from_dir(path).vocab_size
    return random_prompts([n], vocab, seed=3)[0]


@pytest.mark.parametrize("name", FP8_CHECKPOINTS)
def test_loader_gives_the_checkpoints_own_fp8_weights(fp8_dirs, name):
    fp8, _ = fp8_dirs[name]
    cfg = ModelConfig.from_dir(fp8)
    weights = load_weights(fp8, cfg, torch.float32, torch.device("cpu"))
    reference = dequantized_tensors(fp8)
    source = random_weights(cfg, SEED, torch.float32)  # what write_checkpoint quantized
    files = load_file(str(fp8 / "model.safetensors"))
    for i, layer in enumerate(weights.layers):
        for field in QUANTIZED_FIELDS:
            w = getattr(layer, field)
            names = [LAYER_PREFIX.format(i=i) + n for n in LAYER_TENSORS[field]]
            assert isinstance(w, Fp8Weight) and w.data.dtype == torch.float8_e4m3fn
            # the E4M3 values are the file's, bit for bit (no re-quantization)
            assert torch.equal(w.data.view(torch.uint8), torch.cat([files[n] for n in names]).view(torch.uint8))
            deq = dequantize(w)
            ref, src = torch.cat([reference[n] for n in names]), torch.cat([source[n] for n in names])
            assert torch.equal(deq, ref), (field, (deq - ref).abs().max())
            bound = E4M3_REL * src.abs() + w.expanded_scale() * E4M3_SUBNORMAL
            assert ((deq - src).abs() <= bound).all(), field
    head_is_fp8 = files.get(LM_HEAD, torch.empty(0)).dtype == torch.float8_e4m3fn
    assert isinstance(weights.lm_head, Fp8Weight) is head_is_fp8
    assert isinstance(weights.embed, torch.Tensor) and weights.embed.dtype == torch.float32


@pytest.mark.parametrize("name", FP8_CHECKPOINTS)
def test_engine_on_an_fp8_checkpoint_matches_it_dequantized(fp8_dirs, name):
    fp8, dense = fp8_dirs[name]
    tokens = tokens_for(fp8)
    logp, ref = score(fp8, tokens), score(dense, tokens)
    # per-channel weights scale the fp32 accumulators, the dequantized copy the weights: fp32 rounding apart
    assert (logp - ref).abs().max() < 1e-3
    assert torch.equal(logp.argmax(-1), ref.argmax(-1))
    # and FP8 is not a no-op: the dequantized weights are not the random source's
    source_dir = write_checkpoint(fp8.parent / f"{name}-source", arch=FP8_CHECKPOINTS[name][0], seed=SEED,
                                  **FP8_CHECKPOINTS[name][2])
    assert (score(source_dir, tokens) - ref).abs().max() > 1e-2


@pytest.mark.parametrize("name", FP8_CHECKPOINTS)
def test_transformers_loads_the_same_fp8_checkpoint(fp8_dirs, name):
    """transformers dequantizes an fp8 checkpoint on a machine without an FP8 GPU (to the model's dtype: fp32
    here); compressed-tensors checkpoints need the compressed-tensors package, which this project does not
    install, so that cross-check runs only where it is installed."""
    fp8, _ = fp8_dirs[name]
    if FP8_CHECKPOINTS[name][1].startswith("ct-"):
        pytest.importorskip("compressed_tensors", reason="transformers loads compressed-tensors checkpoints only "
                                                         "with the compressed-tensors package, not installed")
    from tests.oracle import hf_logits

    tokens = tokens_for(fp8)
    ref = torch.log_softmax(hf_logits(fp8, tokens), dim=-1)
    logp = score(fp8, tokens)
    assert (logp - ref).abs().max() < 1e-3


def test_quantization_fp8_uses_the_checkpoints_scales(fp8_dirs):
    fp8, _ = fp8_dirs["llama-ct-channel"]
    cfg = ModelConfig.from_dir(fp8)
    plain = load_weights(fp8, cfg, torch.float32, torch.device("cpu"))
    online = load_weights(fp8, cfg, torch.float32, torch.device("cpu"), "fp8", fp8_block=(1, 16))
    for a, b in zip(plain.layers, online.layers):
        for field in QUANTIZED_FIELDS:
            wa, wb = getattr(a, field), getattr(b, field)
            assert wa.block == wb.block and torch.equal(wa.scale, wb.scale)
            assert torch.equal(wa.data.view(torch.uint8), wb.data.view(torch.uint8))
    # a 16-bit (ignored) LM head is quantized at load with --quantize-lm-head, per --fp8-weight-block
    fp8, _ = fp8_dirs["llama-fp8-128x128"]
    weights = load_weights(fp8, ModelConfig.from_dir(fp8), torch.float32, torch.device("cpu"), "fp8", True, (1, 16))
    assert isinstance(weights.lm_head, Fp8Weight) and weights.lm_head.block == (1, 16)


@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_info_reports_what_is_loaded(fp8_dirs, quantization):
    fp8, dense = fp8_dirs["qwen3-fp8-32x32"]
    engine = Engine(engine_config(fp8, quantization=quantization))
    try:
        info = engine.info()
    finally:
        engine.close()
    assert (info.quantization, info.fp8_weight_block, info.checkpoint_quantization) == ("fp8", "32x32", "fp8 32x32")
    assert info.quantized_lm_head is False and info.fp8_activation_scheme == "dynamic"
    engine = Engine(engine_config(fp8_dirs["llama-ct-channel"][0]))
    try:
        info = engine.info()
    finally:
        engine.close()
    assert (info.quantization, info.fp8_weight_block, info.quantized_lm_head) == ("fp8", "channel", True)
    assert info.checkpoint_quantization == "compressed-tensors channel"


def test_an_fp8_checkpoint_served_over_grpc(fp8_dirs):
    fp8, dense = fp8_dirs["qwen3-ct-tensor-static"]
    srv = start_server(fp8)
    try:
        stub = srv.stub()
        info = stub.Info(pb.InfoRequest())
        assert (info.quantization, info.fp8_weight_block) == ("fp8", "channel")
        assert info.checkpoint_quantization == "compressed-tensors tensor" and not info.quantized_lm_head
        assert info.fp8_activation_scheme == "dynamic"  # static input scales: W8A8, the scales not used
        prompts = random_prompts([6, 21], info.vocab_size, seed=5)
        outputs = generate_via_grpc(stub, prompts, max_new_tokens=10)
    finally:
        srv.stop()
    for prompt, out in zip(prompts, outputs):
        # the tokens the dequantized fp32 checkpoint predicts, teacher-forced over the served sequence
        ref = score(dense, prompt + out)
        assert ref[len(prompt) - 1:-1].argmax(-1).tolist() == out


# ----------------------------------------------------------------------------------------- bad input


def serve_line(model) -> tuple[int, list[str]]:
    proc = subprocess.run([sys.executable, "-m", "worker", "serve", "--model", str(model), "--port", "0"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stderr.strip().splitlines()


def edited_copy(src, dst, config=None, tensors=None):
    """A copy of checkpoint src in dst with config.json's quantization_config replaced (config: a dict, or
    "drop") and tensors changed (tensors: fn(dict) -> dict)."""
    shutil.copytree(src, dst)
    if config is not None:
        raw = json.loads((dst / "config.json").read_text())
        if config == "drop":
            del raw["quantization_config"]
        else:
            raw["quantization_config"] = config
        (dst / "config.json").write_text(json.dumps(raw))
    if tensors is not None:
        f = dst / "model.safetensors"
        save_file(tensors(load_file(str(f))), str(f), metadata={"format": "pt"})
    return dst


Q_SCALE = "model.layers.0.self_attn.q_proj.weight_scale_inv"
CT = "llama-ct-channel"


def _ct_int8(qc):
    qc = json.loads(json.dumps(qc))
    qc["config_groups"]["group_0"]["weights"]["type"] = "int"
    return qc


def _without(name):
    return lambda t: {n: v for n, v in t.items() if n != name}


def _replaced(name, value):
    return lambda t: {**t, name: value}


BAD_INPUTS = {
    "gptq": ("llama-fp8-128x128", {"quant_method": "gptq", "bits": 4}, None,
             "quantization_config's quant_method 'gptq' is not supported"),
    "awq": ("llama-fp8-128x128", {"quant_method": "awq", "bits": 4}, None,
            "quantization_config's quant_method 'awq' is not supported"),
    "bitsandbytes": ("llama-fp8-128x128", {"quant_method": "bitsandbytes", "load_in_4bit": True}, None,
                     "quantization_config's quant_method 'bitsandbytes' is not supported"),
    "ct-int8": (CT, "int8", None, "config group 'group_0' has 8-bit int weights; only 8-bit float (FP8 E4M3) "
                                  "weights are supported"),
    "fp8-e5m2": ("llama-fp8-128x128", {"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, None,
                 "has fmt 'e5m2'; only 'e4m3' is supported"),
    "fp8-bad-block": ("llama-fp8-128x128", {"quant_method": "fp8", "weight_block_size": [128]}, None,
                      "weight_block_size must be [rows, columns] of positive integers, got [128]"),
    "missing-scale": ("llama-fp8-128x128", None, _without(Q_SCALE),
                      f"checkpoint lacks tensor {Q_SCALE!r}, the scales of FP8 weight "
                      f"'model.layers.0.self_attn.q_proj.weight'"),
    "scale-shape": ("llama-fp8-128x128", None, _replaced(Q_SCALE, torch.ones(2, 1)),
                    f"FP8 scale tensor {Q_SCALE!r} has shape (2, 1); weight [64, 64] with fp8 128x128 scales needs "
                    f"(1, 1)"),
    "scale-dtype": ("llama-fp8-128x128", None, _replaced(Q_SCALE, torch.ones(1, 1, dtype=torch.int32)),
                    f"FP8 scale tensor {Q_SCALE!r} is I32; scales are F32/BF16/F16"),
    "ct-scale-shape": (CT, None, _replaced("model.layers.1.mlp.down_proj.weight_scale", torch.ones(64, 2)),
                       "'model.layers.1.mlp.down_proj.weight_scale' has shape (64, 2)"),
    "no-quantization-config": ("llama-fp8-128x128", "drop", None,
                               "tensor 'model.layers.0.self_attn.q_proj.weight' is F8_E4M3 (FP8), but config.json has "
                               "no quantization_config"),
    "fp8-embedding": (CT, None, lambda t: {**t, "model.embed_tokens.weight":
                                           t["model.embed_tokens.weight"].to(torch.float8_e4m3fn)},
                      "tensor 'model.embed_tokens.weight' is F8_E4M3 (FP8), but only linear weights can be FP8"),
    "16-bit-where-fp8": (CT, None, lambda t: {**t, "model.layers.0.mlp.up_proj.weight":
                                              t["model.layers.0.mlp.up_proj.weight"].float()},
                         "tensor 'model.layers.0.mlp.up_proj.weight' is F32, but config.json's quantization_config "
                         "(compressed-tensors channel) makes it FP8 (F8_E4M3)"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_fp8_input_is_one_line_and_exit_2(fp8_dirs, tmp_path, case):
    source, config, tensors, expected = BAD_INPUTS[case]
    src = fp8_dirs[source][0]
    if config == "int8":
        config = _ct_int8(json.loads((src / "config.json").read_text())["quantization_config"])
    model = edited_copy(src, tmp_path / case, config, tensors)
    rc, lines = serve_line(model)
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith("metrale-worker: ") and expected in lines[0], lines[0]
