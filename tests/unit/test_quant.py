"""FP8 weights on the CPU: the quantizer's error bounds, the config and flag checks, which weights the loader
quantizes, the reference W8A16 arithmetic of TorchOps.linear, and Engine.score (teacher-forced log-probs)
against transformers."""
from __future__ import annotations

import pytest
import torch

from conftest import engine_config
from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import ConfigError, InvalidArgument, ResourceExhausted
from engine.loader import load_weights, weight_bytes
from engine.config import ModelConfig
from engine.ops.torch_ops import TorchOps
from engine.quant import FP8_DTYPE, FP8_MAX, Fp8Weight, check_device, dequantize, quantize_fp8
from tests.oracle import hf_logits
from worker.config import serve_parser


# ------------------------------------------------------------------ the quantizer

@pytest.mark.parametrize("shape", [(1, 1), (7, 33), (64, 576), (3, 4096)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_round_trip_is_within_e4m3_rounding_per_channel(shape, dtype):
    g = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    # rows of very different magnitudes: each gets its own scale
    w = (torch.randn(shape, generator=g) * torch.logspace(-4, 2, shape[0])[:, None]).to(dtype)
    q = quantize_fp8(w)
    assert q.data.dtype == FP8_DTYPE and q.data.shape == shape and q.data.is_contiguous()
    assert q.scale.dtype == torch.float32 and q.scale.shape == (shape[0],)
    wf = w.float()
    amax = wf.abs().amax(dim=1)
    torch.testing.assert_close(q.scale, amax / FP8_MAX)
    # every row's largest element maps to +-448 exactly
    assert torch.equal(q.data.float().abs().amax(dim=1), torch.full((shape[0],), FP8_MAX))
    err = (dequantize(q) - wf).abs()
    # round to nearest with 3 mantissa bits: at most 2^-4 of the value in the normal range, at most half the
    # smallest subnormal step (scale * 2^-9 / 2) below it
    bound = torch.maximum(wf.abs() * 2 ** -4, q.scale[:, None] * 2 ** -10) * (1 + 1e-6)
    assert (err <= bound).all(), (err - bound).max()
    assert dequantize(q, torch.bfloat16).dtype == torch.bfloat16


def test_quantize_zero_rows_get_scale_one_and_zeros():
    w = torch.randn(4, 32)
    w[1] = 0
    w[3] = 0
    q = quantize_fp8(w)
    assert q.scale[1] == 1 and q.scale[3] == 1
    assert torch.equal(q.data[1].float(), torch.zeros(32)) and torch.equal(q.data[3].float(), torch.zeros(32))
    assert torch.isfinite(dequantize(q)).all() and torch.isfinite(q.scale).all()
    assert torch.equal(dequantize(quantize_fp8(torch.zeros(2, 16))), torch.zeros(2, 16))


def test_quantize_refuses_what_is_not_a_matrix():
    with pytest.raises(ValueError, match="2-D"):
        quantize_fp8(torch.randn(4))
    with pytest.raises(ValueError, match="2-D"):
        quantize_fp8(torch.randn(2, 3, 4))


def test_fp8_weight_reports_its_shape_and_bytes():
    q = quantize_fp8(torch.randn(48, 64))
    assert q.shape == (48, 64) and q.device.type == "cpu"
    assert q.nbytes == 48 * 64 + 48 * 4 and len(q.tensors()) == 2


# ------------------------------------------------------------------ the reference arithmetic

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_ops_linear_is_w8a16_with_the_scale_after_the_fp32_accumulation(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 64, generator=g).to(dtype)
    w = quantize_fp8(torch.randn(96, 64, generator=g) * 0.1)
    bias = torch.randn(96, generator=g).to(dtype)
    ops = TorchOps()
    exact = (x.double() @ w.data.double().t()) * w.scale.double() + bias.double()  # the arithmetic, in fp64
    y = ops.linear(x, w, bias)
    assert y.dtype == dtype and y.shape == (5, 96)
    # one rounding of the fp32 result to the output dtype
    tol = 1e-5 if dtype == torch.float32 else 2 ** -8
    torch.testing.assert_close(y.double(), exact, rtol=tol, atol=tol)
    assert ops.linear(x, w, out_dtype=torch.float32).dtype == torch.float32
    assert ops.logits(x, w).dtype == torch.float32
    # linear_add: h += x @ w^T, rounded once (computed in fp32 from h's value)
    h = torch.randn(5, 96, generator=g).to(dtype)
    want = (h.float() + (x.float() @ w.data.float().t()) * w.scale).to(dtype)
    ops.linear_add(h, x, w)
    assert torch.equal(h, want)


def test_torch_ops_linear_takes_a_plain_weight_as_before():
    x, w = torch.randn(3, 16), torch.randn(8, 16)
    ops = TorchOps()
    torch.testing.assert_close(ops.linear(x, w), x @ w.t())
    h = torch.zeros(3, 8)
    ops.linear_add(h, x, w)
    torch.testing.assert_close(h, x @ w.t())


# ------------------------------------------------------------------ configuration

def test_quantization_config_is_checked():
    assert EngineConfig().quantization == "none" and EngineConfig().quantize_lm_head is False
    EngineConfig(quantization="fp8", quantize_lm_head=True)
    with pytest.raises(ConfigError, match="quantization must be one of"):
        EngineConfig(quantization="int4")
    with pytest.raises(ConfigError, match="quantize_lm_head needs quantization fp8"):
        EngineConfig(quantize_lm_head=True)


def test_quantization_flags(capsys):
    parser = serve_parser()
    args = parser.parse_args(["--quantization", "fp8", "--quantize-lm-head"])
    assert args.quantization == "fp8" and args.quantize_lm_head is True
    args = parser.parse_args([])
    assert args.quantization == "none" and args.quantize_lm_head is False
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--quantization", "fp16"])
    assert e.value.code == 2
    assert "invalid choice: 'fp16'" in capsys.readouterr().err


def test_fp8_device_check_passes_on_the_cpu():
    check_device("fp8", torch.device("cpu"))  # the reference path runs anywhere
    check_device("none", torch.device("cpu"))


# ------------------------------------------------------------------ the loader

@pytest.mark.parametrize("name", ["llama-gqa", "llama-mha-tied-llama3", "qwen2-bias-tied", "qwen3-qknorm"])
@pytest.mark.parametrize("head", [False, True])
def test_the_loader_quantizes_the_projections_only(checkpoints, name, head):
    path = checkpoints[name]
    cfg = ModelConfig.from_dir(path)
    plain = load_weights(path, cfg, torch.float32, torch.device("cpu"))
    w = load_weights(path, cfg, torch.float32, torch.device("cpu"), "fp8", head)
    for layer, ref in zip(w.layers, plain.layers):
        for field in ("qkv", "o_proj", "gate_up", "down"):
            q = getattr(layer, field)
            assert isinstance(q, Fp8Weight) and q.shape == getattr(ref, field).shape, field
            assert torch.equal(q.data, quantize_fp8(getattr(ref, field)).data), field
        for field in ("input_norm", "post_norm", "qkv_bias", "q_norm", "k_norm"):
            t = getattr(layer, field)
            assert t is None or (isinstance(t, torch.Tensor) and torch.equal(t, getattr(ref, field))), field
    assert isinstance(w.embed, torch.Tensor) and torch.equal(w.embed, plain.embed)
    assert isinstance(w.norm, torch.Tensor)
    if head:
        assert isinstance(w.lm_head, Fp8Weight) and torch.equal(w.lm_head.data, quantize_fp8(plain.lm_head).data)
    else:
        assert isinstance(w.lm_head, torch.Tensor) and torch.equal(w.lm_head, plain.lm_head)
        assert (w.lm_head is w.embed) == cfg.tie_word_embeddings
    quantized = [getattr(layer, f) for layer in plain.layers for f in ("qkv", "o_proj", "gate_up", "down")]
    quantized += [plain.lm_head] if head else []
    saved = sum(t.numel() * 4 - (t.numel() + 4 * t.shape[0]) for t in quantized)  # fp32 -> E4M3 + row scales
    assert weight_bytes(w) == weight_bytes(plain) - saved + (plain.lm_head.nbytes if head and plain.lm_head is plain.embed
                                                             else 0)


# ------------------------------------------------------------------ Engine.score

@pytest.mark.parametrize("name", ["llama-gqa", "mistral-gqa4-window", "qwen2-bias-tied", "qwen3-qknorm"])
def test_score_of_an_fp32_engine_matches_transformers(checkpoints, name):
    path = checkpoints[name]
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, ModelConfig.from_dir(path).vocab_size, (90,), generator=g).tolist()
    # several forwards (max_prefill_tokens 32), each continuing the KV the previous one wrote
    engine = Engine(engine_config(path, max_prefill_tokens=32, dtype="float32"))
    try:
        free = engine.info().free_blocks, engine.info().free_slots
        got = engine.score(tokens)
        assert (engine.info().free_blocks, engine.info().free_slots) == free  # nothing left allocated
        assert engine.info().prefix_cache.cached_blocks == 0  # and nothing registered
    finally:
        engine.close()
    want = torch.log_softmax(hf_logits(path, tokens), dim=-1)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_score_refuses_bad_input_and_changes_nothing(tiny_model):
    engine = Engine(engine_config(tiny_model, max_slots=1))
    try:
        with pytest.raises(InvalidArgument, match="1 to 512"):
            engine.score([])
        with pytest.raises(InvalidArgument, match="1 to 512"):
            engine.score([1] * 513)
        with pytest.raises(InvalidArgument, match="outside the vocabulary"):
            engine.score([1, 10 ** 6])
        from engine.sampling import SamplingParams, StoppingCriteria
        seq = engine.alloc_sequence(8, SamplingParams(), StoppingCriteria()).seq_id
        with pytest.raises(ResourceExhausted, match="slots"):
            engine.score([1, 2, 3])
        engine.release([seq])
        assert engine.score([1, 2, 3]).shape[0] == 3
        assert engine.info().free_slots == 1 and engine.info().live_sequences == 0
    finally:
        engine.close()
