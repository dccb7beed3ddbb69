"""FP8 weights on the CPU: the quantizer's error bounds, the config and flag checks, which weights the loader
quantizes, the reference W8A16 arithmetic of TorchOps.linear, and Engine.score (teacher-forced log-probs)
against transformers."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import engine_config
from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import ConfigError, InvalidArgument, ResourceExhausted
from engine.loader import LAYER_TENSORS, load_weights, weight_bytes
from engine.config import ModelConfig
from engine.ops.torch_ops import TorchOps
from engine import quant
from engine.checkpoint import write_checkpoint
from engine.quant import (FP8_DTYPE, FP8_MAX, SCALE_STEPS, Fp8Weight, check_device, dequantize, fp8_linear,
                          parse_block, quantize_fp8)
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
    assert q.scale.dtype == torch.float32 and q.scale.shape == (shape[0], 1)
    assert q.block == (1, shape[1]) and q.per_channel and q.row_scale.shape == (shape[0],)
    wf = w.float()
    amax = wf.abs().amax(dim=1)
    # the least-error scale is amax / 448 times 2^(j / 64), 0 <= j < 64: nothing clips, and each row's largest
    # element maps into [224, 448]
    assert ((q.row_scale >= amax / FP8_MAX) & (q.row_scale < 2 * amax / FP8_MAX)).all()
    top = q.data.float().abs().amax(dim=1)
    assert ((top >= FP8_MAX / 2) & (top <= FP8_MAX)).all()
    err = (dequantize(q) - wf).abs()
    # round to nearest with 3 mantissa bits: at most 2^-4 of the value in the normal range, at most half the
    # smallest subnormal step (scale * 2^-9 / 2) below it
    bound = torch.maximum(wf.abs() * 2 ** -4, q.scale * 2 ** -10) * (1 + 1e-6)
    assert (err <= bound).all(), (err - bound).max()
    assert dequantize(q, torch.bfloat16).dtype == torch.bfloat16


def test_quantize_zero_rows_get_scale_one_and_zeros():
    w = torch.randn(4, 32)
    w[1] = 0
    w[3] = 0
    q = quantize_fp8(w)
    assert q.row_scale[1] == 1 and q.row_scale[3] == 1
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


# ------------------------------------------------------------------ the per-channel scale search

def row_errors(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[N] sum_k (w[k] - scale * e4m3(w[k] / scale))^2 with scale [N, 1], written out here as the oracle."""
    data = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return (data.float() * scale - w).square().sum(dim=1)


def search_rows(kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(len(kind))
    gauss = torch.randn(256, 576, generator=g)
    if kind == "gaussian":
        return gauss
    if kind == "student-t":  # 2 degrees of freedom (chi2(2) / 2 is -log U): heavy tails, a few elements far out
        return gauss / (-torch.rand(256, 576, generator=g).log()).sqrt()
    if kind == "cauchy":
        return torch.tan(torch.pi * (torch.rand(256, 576, generator=g) - 0.5))
    if kind == "outliers":  # one element per row 30x the bulk
        w = gauss.clone()
        w[torch.arange(256), torch.randint(0, 576, (256,), generator=g)] *= 30
        return w
    if kind == "row magnitudes":  # with zero rows among them
        w = gauss * torch.logspace(-12, 12, 256)[:, None]
        w[::17] = 0
        return w
    if kind == "column magnitudes":  # elements down in E4M3's subnormal range
        return gauss * torch.logspace(-6, 0, 576)[None, :]
    if kind == "bf16":
        return gauss.bfloat16()
    if kind == "short rows":
        return torch.randn(256, 8, generator=g)
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["gaussian", "student-t", "cauchy", "outliers", "row magnitudes", "column magnitudes",
                                  "bf16", "short rows"])
def test_per_channel_scales_never_lose_to_amax_scales(kind):
    """Each row's scale is a candidate amax / 448 * 2^(j / SCALE_STEPS) (1 for a zero row), positive and finite; its
    squared error is never above amax / 448's, within 3% of the best candidate's (found by trying all), and lower
    than amax / 448's over the matrix."""
    w = search_rows(kind)
    wf = w.float()
    q = quantize_fp8(w)
    assert q.block == (1, w.shape[1]) and q.scale.shape == (w.shape[0], 1) and q.data.shape == w.shape
    assert torch.isfinite(q.scale).all() and (q.scale > 0).all()
    amax = wf.abs().amax(dim=1, keepdim=True)
    base = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    zero = (amax == 0)[:, 0]
    assert (q.row_scale[zero] == 1).all() and (q.data[zero].float() == 0).all()
    steps = torch.log2(q.scale / base) * SCALE_STEPS
    assert ((steps - steps.round()).abs() < 1e-3).all() and (steps.round() >= 0).all()
    assert (steps.round() < SCALE_STEPS).all()
    err = (dequantize(q) - wf).square().sum(dim=1)
    torch.testing.assert_close(err, row_errors(wf, q.scale), rtol=1e-5, atol=0)
    at_amax = row_errors(wf, base)
    assert (err <= at_amax).all(), (err - at_amax).max()
    best = torch.stack([row_errors(wf, base * 2 ** (j / SCALE_STEPS)) for j in range(SCALE_STEPS)]).amin(dim=0)
    assert err.sum() <= best.sum() * 1.03, (err.sum() / best.sum()).item()
    assert err.sum() < at_amax.sum() * 0.95, (err.sum() / at_amax.sum()).item()


def test_the_scale_search_in_row_chunks_is_the_same(monkeypatch):
    w = search_rows("student-t")
    whole = quantize_fp8(w)
    monkeypatch.setattr(quant, "SEARCH_CHUNK", 3 * w.shape[1] + 5)  # 3 rows a chunk, a partial last chunk
    chunked = quantize_fp8(w)
    assert torch.equal(chunked.scale, whole.scale) and torch.equal(chunked.data.view(torch.uint8),
                                                                    whole.data.view(torch.uint8))
    # a block one row high and at least K wide is per channel too: the same search
    wide = quantize_fp8(w, (1, 2 * w.shape[1]))
    assert wide.per_channel and wide.block == (1, 2 * w.shape[1]) and torch.equal(wide.scale, whole.scale)


def test_a_published_per_channel_checkpoint_keeps_its_scales(tmp_path):
    """A compressed-tensors per-channel checkpoint whose scales put each row's largest element at 320 (neither
    amax / 448 nor a candidate of the search) loads with those scales and E4M3 values as they are, also with
    --quantization fp8."""
    path = write_checkpoint(tmp_path / "ct", arch="llama", seed=5, fp8_layout="ct-channel")
    files = load_file(str(path / "model.safetensors"))
    for name in [n for n, t in files.items() if t.dtype == FP8_DTYPE]:
        scale_name = name.removesuffix("weight") + "weight_scale"
        w = files[name].float() * files[scale_name]
        amax = w.abs().amax(dim=1, keepdim=True)
        files[scale_name] = torch.where(amax > 0, amax / 320, torch.ones_like(amax))
        files[name] = (w / files[scale_name]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    save_file(files, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = ModelConfig.from_dir(path)
    searched = 0
    for quantization in ("none", "fp8"):
        weights = load_weights(path, cfg, torch.float32, torch.device("cpu"), quantization)
        for i, layer in enumerate(weights.layers):
            for field in ("qkv", "o_proj", "gate_up", "down"):
                names = [f"model.layers.{i}.{n}" for n in LAYER_TENSORS[field]]
                scale = torch.cat([files[n.removesuffix("weight") + "weight_scale"] for n in names])
                q = getattr(layer, field)
                assert torch.equal(q.scale, scale)
                assert torch.equal(q.data.view(torch.uint8), torch.cat([files[n] for n in names]).view(torch.uint8))
                searched += not torch.equal(quantize_fp8(dequantize(q)).scale, q.scale)
    assert searched > 0  # the search would have chosen other scales: these are the file's


# ------------------------------------------------------------------ block scales

def block_amax(w: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """amax(|w|) per block, by loops over the blocks (partial edge blocks included): the quantizer's oracle."""
    n, k = w.shape
    return torch.tensor([[w[i:i + bn, j:j + bk].abs().max().item() for j in range(0, k, bk)] for i in range(0, n, bn)])


@pytest.mark.parametrize("shape, block", [((7, 33), (1, 8)), ((64, 576), (1, 64)), ((576, 200), (128, 128)),
                                          ((96, 64), (32, 64)), ((5, 9), (2, 4)), ((3, 10), (1, 1)),
                                          ((40, 70), (1000, 1000))])
def test_block_quantization_is_within_e4m3_rounding_per_block(shape, block):
    """Each block (the last row/column blocks partial where bn, bk do not divide N, K) gets amax/448, its largest
    element maps to +-448, and every element is within E4M3 rounding of its block scale."""
    g = torch.Generator().manual_seed(shape[0] + shape[1])
    n, k = shape
    bn, bk = block
    # magnitudes that vary along both axes, so that blocks differ
    w = torch.randn(shape, generator=g) * torch.logspace(-3, 1, n)[:, None] * torch.logspace(0, 2, k)[None, :]
    q = quantize_fp8(w, block)
    assert q.block == block and q.data.shape == shape and q.data.dtype == FP8_DTYPE and q.data.is_contiguous()
    assert q.scale.shape == (-(-n // bn), -(-k // bk)) and q.scale.dtype == torch.float32 and q.scale.is_contiguous()
    assert not q.per_channel or (bn == 1 and bk >= k)
    amax = block_amax(w, bn, bk)
    torch.testing.assert_close(q.scale, amax / FP8_MAX)
    assert torch.equal(block_amax(q.data.float(), bn, bk), torch.full(amax.shape, FP8_MAX))
    scale = q.expanded_scale()
    assert scale.shape == shape
    assert torch.equal(scale, q.scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k])
    err = (dequantize(q) - w).abs()
    bound = torch.maximum(w.abs() * 2 ** -4, scale * 2 ** -10) * (1 + 1e-6)
    assert (err <= bound).all(), (err - bound).max()
    # round trip: quantizing the dequantized weight again gives the same E4M3 values and scales
    again = quantize_fp8(dequantize(q), block)
    assert torch.equal(again.data.float(), q.data.float()) and torch.allclose(again.scale, q.scale, rtol=1e-6)
    assert q.nbytes == n * k + q.scale.numel() * 4


def test_smaller_blocks_are_more_accurate_on_uneven_rows():
    """Within a row whose columns differ in magnitude, 1x64 amax scales lose less than one amax scale per row."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 576, generator=g) * torch.logspace(-3, 0, 576)[None, :]
    per_row = row_errors(w, w.abs().amax(dim=1, keepdim=True) / FP8_MAX).sum().sqrt() / w.norm()
    errs = [per_row] + [(dequantize(quantize_fp8(w, b)) - w).norm() / w.norm() for b in ((1, 192), (1, 64), (1, 32))]
    assert errs[0] > errs[1] > errs[2] > errs[3], errs


def test_zero_blocks_get_scale_one_and_zeros():
    w = torch.randn(6, 20)
    w[2:4, :8] = 0  # the whole block (1, 0) in 2x8 blocks, and half of another
    w[4:6, 16:] = 0  # a partial edge block [2, 4]
    q = quantize_fp8(w, (2, 8))
    assert q.scale.shape == (3, 3) and q.scale[1, 0] == 1 and q.scale[2, 2] == 1
    assert torch.equal(q.data[2:4, :8].float(), torch.zeros(2, 8))
    assert torch.equal(q.data[4:6, 16:].float(), torch.zeros(2, 4))
    assert torch.isfinite(dequantize(q)).all()
    assert torch.equal(dequantize(quantize_fp8(torch.zeros(5, 9), (2, 4))), torch.zeros(5, 9))


@pytest.mark.parametrize("block", [None, (1, 64), (1, 32), (128, 128), (3, 50)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_of_any_block_is_the_block_sum_in_fp64(block, dtype):
    """fp8_linear = sum over K-groups g of (x_g @ data_g^T) * scale[n-block, g] + bias, up to fp32 rounding and one
    rounding to the output dtype; TorchOps.linear (and linear_add) take the same path."""
    g = torch.Generator().manual_seed(5)
    n, k = 300, 200  # 300 = 2 * 128 + 44, 200 = 3 * 64 + 8 = 6 * 32 + 8: partial edge blocks
    x = torch.randn(7, k, generator=g).to(dtype)
    w = quantize_fp8(torch.randn(n, k, generator=g) * torch.logspace(-2, 0, k)[None, :], block)
    bias = torch.randn(n, generator=g).to(dtype)
    bn, bk = w.block
    exact = torch.zeros(7, n, dtype=torch.float64)
    for j in range(0, k, bk):  # the block sum, group by group
        part = x[:, j:j + bk].double() @ w.data[:, j:j + bk].double().t()  # [M, N]
        exact += part * w.scale[:, j // bk].double().repeat_interleave(bn)[:n]
    exact += bias.double()
    tol = 1e-5 if dtype == torch.float32 else 2 ** -8
    y = fp8_linear(x, w, bias)
    assert y.dtype == dtype and y.shape == (7, n)
    torch.testing.assert_close(y.double(), exact, rtol=tol, atol=tol)
    y32 = TorchOps().linear(x, w, bias, out_dtype=torch.float32)
    torch.testing.assert_close(y32.double(), exact, rtol=1e-5, atol=1e-5)
    h = torch.randn(7, n, generator=g).to(dtype)
    want = (h.double() + exact - bias.double())
    TorchOps().linear_add(h, x, w)
    torch.testing.assert_close(h.double(), want, rtol=tol, atol=tol)


def test_fp8_weight_checks_its_scale_shape_and_row_scale():
    q = quantize_fp8(torch.randn(10, 16), (4, 8))
    assert not q.per_channel
    with pytest.raises(ValueError, match="per-channel"):
        q.row_scale
    with pytest.raises(ValueError, match=r"needs scales \[3, 2\]"):
        Fp8Weight(q.data, torch.ones(10, 1), (4, 8))
    with pytest.raises(ValueError, match="positive"):
        quantize_fp8(torch.randn(4, 4), (0, 4))
    # a block at least as wide as K with one row is per-channel: the scale-after-accumulation path
    assert quantize_fp8(torch.randn(10, 16), (1, 64)).per_channel


# ------------------------------------------------------------------ the reference arithmetic

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_ops_linear_is_w8a16_with_the_scale_after_the_fp32_accumulation(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 64, generator=g).to(dtype)
    w = quantize_fp8(torch.randn(96, 64, generator=g) * 0.1)
    bias = torch.randn(96, generator=g).to(dtype)
    ops = TorchOps()
    exact = (x.double() @ w.data.double().t()) * w.row_scale.double() + bias.double()  # the arithmetic, in fp64
    y = ops.linear(x, w, bias)
    assert y.dtype == dtype and y.shape == (5, 96)
    # one rounding of the fp32 result to the output dtype
    tol = 1e-5 if dtype == torch.float32 else 2 ** -8
    torch.testing.assert_close(y.double(), exact, rtol=tol, atol=tol)
    assert ops.linear(x, w, out_dtype=torch.float32).dtype == torch.float32
    assert ops.logits(x, w).dtype == torch.float32
    # linear_add: h += x @ w^T, rounded once (computed in fp32 from h's value)
    h = torch.randn(5, 96, generator=g).to(dtype)
    want = (h.float() + (x.float() @ w.data.float().t()) * w.row_scale).to(dtype)
    ops.linear_add(h, x, w)
    assert torch.equal(h, want)


def test_w8a8_is_taken_above_eight_rows_of_bf16_into_bf16_only():
    g = torch.Generator().manual_seed(3)
    w = quantize_fp8(torch.randn(96, 64, generator=g))
    x = torch.randn(9, 64, generator=g).bfloat16()
    assert quant.takes_w8a8(x, w, torch.bfloat16)
    assert not quant.takes_w8a8(x[:8], w, torch.bfloat16)  # decode batches up to 8 stay W8A16
    assert not quant.takes_w8a8(x, w, torch.float32)  # fp32 logits
    assert not quant.takes_w8a8(x.float(), w, torch.float32) and not quant.takes_w8a8(x.half(), w, torch.float16)
    assert not quant.takes_w8a8(x, quantize_fp8(torch.randn(96, 64, generator=g), (1, 32)), torch.bfloat16)
    assert not quant.takes_w8a8(x[:, :56], quantize_fp8(torch.randn(96, 56, generator=g)), torch.bfloat16)


def test_torch_ops_linear_above_eight_rows_of_bf16_is_w8a8():
    """Each row of x quantized to E4M3 with scale amax / 448, the products summed exactly, both scales applied,
    rounded once to bf16 (what torch._scaled_mm's row-wise scaling computes on the GPU); written out in fp64."""
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(12, 64, generator=g) * torch.logspace(-2, 1, 12)[:, None]).bfloat16()
    w = quantize_fp8(torch.randn(96, 64, generator=g) * 0.1)
    a = x.double().abs().amax(1, keepdim=True) / FP8_MAX
    xq = (x.double() / a).to(FP8_DTYPE).double()
    exact = (xq @ w.data.double().t()) * a * w.row_scale.double()
    ops = TorchOps()
    y = ops.linear(x, w)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), exact.bfloat16().double(), rtol=2 ** -8, atol=1e-6)
    # not the W8A16 arithmetic of fewer rows
    assert not torch.equal(y, fp8_linear(x, w))
    # the residual: h += that, in bf16
    h = torch.randn(12, 96, generator=g).bfloat16()
    want = h + exact.bfloat16()
    ops.linear_add(h, x, w)
    torch.testing.assert_close(h.double(), want.double(), rtol=2 ** -7, atol=2 ** -7)


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


@pytest.mark.parametrize("text, block", [("channel", None), ("1x64", (1, 64)), ("128x128", (128, 128)),
                                         ("3x1", (3, 1))])
def test_fp8_weight_block_parses(text, block):
    assert parse_block(text) == block
    config = EngineConfig(quantization="fp8", fp8_weight_block=text)
    assert config.fp8_block == block
    assert EngineConfig().fp8_weight_block == "channel" and EngineConfig().fp8_block is None


@pytest.mark.parametrize("text", ["", "64", "1x", "x64", "0x64", "1x0", "-1x64", "1x64x2", "1 x 64", "1X64", "1.5x2",
                                  "1x\u00b2", "Channel", "per-channel"])
def test_fp8_weight_block_refuses_bad_values(text):
    with pytest.raises(ConfigError, match="fp8_weight_block must be 'channel' or ROWSxCOLS"):
        EngineConfig(quantization="fp8", fp8_weight_block=text)


def test_fp8_weight_block_needs_fp8():
    with pytest.raises(ConfigError, match="fp8_weight_block 1x64 needs quantization fp8"):
        EngineConfig(fp8_weight_block="1x64")
    EngineConfig(fp8_weight_block="channel")  # the default, with or without fp8


@pytest.mark.parametrize("text, layers", [("", set()), ("0", {0}), ("0,-1", {0, 29}), ("-30, 29,5", {0, 29, 5}),
                                          ("1,1,-29", {1})])
def test_fp8_skip_layers_resolve_against_the_model(text, layers):
    assert EngineConfig(quantization="fp8", fp8_skip_layers=text).fp8_skipped_layers(30) == layers


def test_fp8_skip_layers_refuses_what_it_cannot_name():
    with pytest.raises(ConfigError, match="fp8_skip_layers must be comma-separated layer indices such as 0,-1, got "
                                          "'first'"):
        EngineConfig(quantization="fp8", fp8_skip_layers="first")
    with pytest.raises(ConfigError, match="fp8_skip_layers must be comma-separated"):
        EngineConfig(quantization="fp8", fp8_skip_layers="0,,1")
    with pytest.raises(ConfigError, match="fp8_skip_layers 0 needs quantization fp8"):
        EngineConfig(fp8_skip_layers="0")
    config = EngineConfig(quantization="fp8", fp8_skip_layers="30")
    with pytest.raises(ConfigError, match=r"layer 30 is outside the model's 30 layers \(0 .. 29, or -30 .. -1"):
        config.fp8_skipped_layers(30)
    with pytest.raises(ConfigError, match="layer -31 is outside"):
        EngineConfig(quantization="fp8", fp8_skip_layers="-31").fp8_skipped_layers(30)


def test_fp8_skip_layers_leave_those_layers_unquantized(tiny_model):
    """The listed layers' projections load in the model dtype, the others as FP8; Info names the unquantized ones."""
    from conftest import engine_config
    from engine.engine import Engine

    engine = Engine(engine_config(tiny_model, quantization="fp8", fp8_skip_layers="-1"))
    try:
        layers = engine.runtime.weights.layers
        last = len(layers) - 1
        assert engine.info().fp8_skipped_layers == [last]
        for i, layer in enumerate(layers):
            for name in ("qkv", "o_proj", "gate_up", "down"):
                assert isinstance(getattr(layer, name), Fp8Weight) == (i != last), (i, name)
    finally:
        engine.close()


def test_fp8_weight_block_flag():
    parser = serve_parser()
    args = parser.parse_args(["--quantization", "fp8", "--fp8-weight-block", "1x64"])
    assert args.fp8_weight_block == "1x64"
    assert parser.parse_args([]).fp8_weight_block == "channel"


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


def test_the_loader_quantizes_in_blocks(checkpoints):
    path = checkpoints["llama-gqa"]
    cfg = ModelConfig.from_dir(path)
    plain = load_weights(path, cfg, torch.float32, torch.device("cpu"))
    w = load_weights(path, cfg, torch.float32, torch.device("cpu"), "fp8", True, (1, 8))
    for layer, ref in zip(w.layers, plain.layers):
        for field in ("qkv", "o_proj", "gate_up", "down"):
            q, want = getattr(layer, field), quantize_fp8(getattr(ref, field), (1, 8))
            assert q.block == (1, 8) and torch.equal(q.data.float(), want.data.float()), field
            assert torch.equal(q.scale, want.scale), field
    assert w.lm_head.block == (1, 8)


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


def test_activation_quantization_is_the_former_formula_in_three_passes():
    """quantize_activations (W8A8's dynamic per-token scales): the same bits as x.float() / (amax * fp32(1 / 448)),
    clamped and cast, for bf16, fp16 and fp32 rows of every magnitude (the reciprocal's product, not amax / 448:
    the one form torch's CPU and CUDA ops and kernels_cu/fp8_quant.cu compute alike); a zero row gives zeros (and
    a scale that makes them zeros again); nothing reaches NaN."""
    from engine.quant import FP8_DTYPE, FP8_MAX, quantize_activations

    g = torch.Generator().manual_seed(3)
    rows = torch.randn(64, 512, generator=g) * torch.logspace(-6, 4, 64)[:, None]
    rows[5] = 0.0
    rows[9, 17] = 3e4  # one outlier
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = rows.to(dtype)
        data, scale = quantize_activations(x)
        assert data.dtype == FP8_DTYPE and scale.shape == (64, 1) and scale.dtype == torch.float32
        xf = x.float()
        amax = xf.abs().amax(dim=1, keepdim=True)
        want_scale = torch.where(amax > 0, amax * torch.tensor(1 / FP8_MAX, dtype=torch.float32), torch.ones_like(amax))
        want = (xf / want_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        nonzero = amax[:, 0] > 0
        assert torch.equal(data.view(torch.uint8)[nonzero], want.view(torch.uint8)[nonzero]), dtype
        assert torch.equal(scale[nonzero], want_scale[nonzero])
        assert not data.float().isnan().any() and data.float().abs().max() <= FP8_MAX
        assert torch.equal(data[5].float(), torch.zeros(512)) and (data[5].float() * scale[5]).abs().max() == 0
