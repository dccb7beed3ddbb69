"""FP8 activation schemes on the CPU (engine/quant.py's module docstring): "dynamic" (W8A8 above 8 rows of bf16
activations) and "none" (weight-only, W8A16 at every row count) on each Fp8Weight; the one rule both backends
decide by (takes_w8a8), TorchOps' weight-only arithmetic, --fp8-activation-scheme's checks, the scheme a loaded
weight gets from the flag and the checkpoint, and what Info reports."""
from __future__ import annotations

import pytest
import torch

from conftest import engine_config
from engine.checkpoint import write_checkpoint
from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.errors import ConfigError
from engine.loader import load_weights
from engine.ops.torch_ops import TorchOps
from engine.quant import (ACTIVATION_SCHEMES, DYNAMIC, WEIGHT_ONLY, Fp8Weight, fp8_linear, quantize_fp8, takes_w8a8,
                          w8a8_linear)
from worker.config import serve_parser


def fp8_weights(weights) -> list[Fp8Weight]:
    """Every Fp8Weight of a ModelWeights (the projections of each layer, and the LM head where it is FP8)."""
    found = [getattr(layer, f) for layer in weights.layers for f in ("qkv", "o_proj", "gate_up", "down")]
    return [w for w in found + [weights.lm_head] if isinstance(w, Fp8Weight)]


# ------------------------------------------------------------------ the rule

def test_takes_w8a8_per_activation_scheme():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 64, generator=g)
    dynamic, weight_only = quantize_fp8(w), quantize_fp8(w, activation_scheme=WEIGHT_ONLY)
    assert (dynamic.activation_scheme, weight_only.activation_scheme) == (DYNAMIC, WEIGHT_ONLY)
    assert ACTIVATION_SCHEMES == ("dynamic", "none")
    # the same E4M3 values and scales: the scheme changes only what the activations go through
    assert torch.equal(dynamic.data.view(torch.uint8), weight_only.data.view(torch.uint8))
    assert torch.equal(dynamic.scale, weight_only.scale)
    for m in (9, 16, 32, 512):
        x = torch.randn(m, 64, generator=g).bfloat16()
        assert takes_w8a8(x, dynamic, torch.bfloat16), m
        assert not takes_w8a8(x, weight_only, torch.bfloat16), m
    x = torch.randn(8, 64, generator=g).bfloat16()
    assert not takes_w8a8(x, dynamic, torch.bfloat16) and not takes_w8a8(x, weight_only, torch.bfloat16)
    blocks = quantize_fp8(w, (1, 32), WEIGHT_ONLY)
    assert blocks.activation_scheme == WEIGHT_ONLY and blocks.block == (1, 32)


def test_fp8_weight_refuses_an_unknown_scheme():
    q = quantize_fp8(torch.randn(4, 16))
    with pytest.raises(ValueError, match="activation_scheme must be one of"):
        Fp8Weight(q.data, q.scale, q.block, "static")
    assert Fp8Weight(q.data, q.scale, q.block).activation_scheme == DYNAMIC  # the default: today's behaviour


# ------------------------------------------------------------------ TorchOps' arithmetic

def test_torch_ops_weight_only_above_eight_rows_is_the_w8a16_reference():
    """A weight-only projection of 9+ rows of bf16 x: fp8_linear's W8A16 (fp32 accumulation of x * data, the row
    scale after, one rounding), bit for bit, written out in fp64 too; not the W8A8 result of the same weight with
    the dynamic scheme. The residual form adds the fp32 product and rounds once."""
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(12, 64, generator=g) * torch.logspace(-2, 1, 12)[:, None]).bfloat16()
    w = torch.randn(96, 64, generator=g) * 0.1
    weight_only, dynamic = quantize_fp8(w, activation_scheme=WEIGHT_ONLY), quantize_fp8(w)
    bias = torch.randn(96, generator=g).bfloat16()
    ops = TorchOps()
    y = ops.linear(x, weight_only, bias)
    assert y.dtype == torch.bfloat16 and torch.equal(y, fp8_linear(x, weight_only, bias))
    exact = (x.double() @ weight_only.data.double().t()) * weight_only.row_scale.double() + bias.double()
    torch.testing.assert_close(y.double(), exact.bfloat16().double(), rtol=2 ** -8, atol=1e-6)
    w8a8 = ops.linear(x, dynamic, bias)
    assert torch.equal(w8a8, (w8a8_linear(x, dynamic) + bias).to(torch.bfloat16))
    assert not torch.equal(y, w8a8)
    # W8A8 rounds each activation to E4M3 (2^-4 relative): the weight-only result is the closer to the bf16 product
    dense = (x.double() @ (weight_only.data.double() * weight_only.scale.double()).t()) + bias.double()
    assert (y.double() - dense).norm() < (w8a8.double() - dense).norm()
    h = torch.randn(12, 96, generator=g).bfloat16()
    want = (h.float() + (x.float() @ weight_only.data.float().t()) * weight_only.row_scale).bfloat16()
    ops.linear_add(h, x, weight_only)
    assert torch.equal(h, want)


# ------------------------------------------------------------------ configuration

def test_the_activation_scheme_config_is_checked():
    assert EngineConfig().fp8_activation_scheme == "dynamic"
    assert EngineConfig(quantization="fp8", fp8_activation_scheme="none").fp8_activation_scheme == "none"
    EngineConfig(quantization="fp8", fp8_activation_scheme="dynamic")
    # valid alone: a published FP8 checkpoint's weights take it (the load refuses it without FP8 weights)
    assert EngineConfig(fp8_activation_scheme="none").quantization == "none"
    with pytest.raises(ConfigError, match=r"fp8_activation_scheme must be one of \('dynamic', 'none'\), got 'static'"):
        EngineConfig(quantization="fp8", fp8_activation_scheme="static")


def test_the_activation_scheme_flag(capsys):
    parser = serve_parser()
    args = parser.parse_args(["--quantization", "fp8", "--fp8-activation-scheme", "none"])
    assert args.fp8_activation_scheme == "none"
    assert parser.parse_args([]).fp8_activation_scheme == "dynamic"
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--quantization", "fp8", "--fp8-activation-scheme", "static"])
    assert e.value.code == 2
    assert "argument --fp8-activation-scheme: invalid choice: 'static'" in capsys.readouterr().err


# ------------------------------------------------------------------ the loader and Info

@pytest.mark.parametrize("scheme", ["dynamic", "none"])
def test_weights_quantized_at_load_take_the_flags_scheme(checkpoints, scheme):
    path = checkpoints["qwen2-bias-tied"]
    weights = load_weights(path, ModelConfig.from_dir(path), torch.float32, torch.device("cpu"), "fp8", True,
                           fp8_activation_scheme=scheme)
    found = fp8_weights(weights)
    assert len(found) == 4 * len(weights.layers) + 1  # the (tied) LM head's own FP8 copy too
    assert {w.activation_scheme for w in found} == {scheme}


@pytest.mark.parametrize("changes, scheme", [({}, ""), ({"quantization": "fp8"}, "dynamic"),
                                             ({"quantization": "fp8", "fp8_activation_scheme": "none"}, "none")])
def test_info_reports_the_activation_scheme(tiny_model, changes, scheme):
    engine = Engine(engine_config(tiny_model, **changes))
    try:
        info = engine.info()
        held = {w.activation_scheme for w in fp8_weights(engine.runtime.weights)}
    finally:
        engine.close()
    assert info.fp8_activation_scheme == scheme
    assert held == ({scheme} if scheme else set())


def test_a_weight_only_checkpoint_is_reported_and_served_weight_only(tmp_path):
    """compressed-tensors with input_activations null: every FP8 weight weight-only under the default flag, and
    Info says so. A bf16 engine scores a 20-token prompt (one prefill forward of 20 rows) on it exactly as on the
    same weights declared dynamic with --fp8-activation-scheme none (no --quantization fp8: nothing else quantized at
    load), and not as on those under the default (W8A8)."""
    tokens = list(range(3, 23))
    scores, infos = {}, {}
    for layout, changes in (("ct-channel-weight-only", {}), ("ct-channel", {}),
                            ("ct-channel", {"fp8_activation_scheme": "none"})):  # the flag alone
        path = tmp_path / layout
        if not path.exists():
            write_checkpoint(path, arch="llama", seed=5, fp8_layout=layout)
        engine = Engine(engine_config(path, dtype="bfloat16", **changes))
        try:
            key = (layout, bool(changes))
            infos[key] = engine.info(), {w.activation_scheme for w in fp8_weights(engine.runtime.weights)}
            scores[key] = engine.score(tokens)
        finally:
            engine.close()
    info, held = infos["ct-channel-weight-only", False]
    assert (info.quantization, info.checkpoint_quantization, info.fp8_activation_scheme) == (
        "fp8", "compressed-tensors channel", "none")
    assert held == {WEIGHT_ONLY}
    assert infos["ct-channel", False][0].fp8_activation_scheme == "dynamic"
    assert infos["ct-channel", False][1] == {DYNAMIC}
    assert infos["ct-channel", True][0].fp8_activation_scheme == "none"  # the flag overrides the checkpoint's
    assert infos["ct-channel", True][1] == {WEIGHT_ONLY}
    assert torch.equal(scores["ct-channel-weight-only", False], scores["ct-channel", True])
    assert not torch.equal(scores["ct-channel-weight-only", False], scores["ct-channel", False])


@pytest.mark.parametrize("M, bucket", [(9, 16), (16, 16), (17, 32), (32, 32)])
def test_the_w8a16_skinny_entries_of_9_to_32_rows_are_declared_with_their_arguments(monkeypatch, M, bucket):
    """What CudaOps sends a weight-only weight's decode forwards of 9-32 rows (16-bit x, per-channel E4M3 weight: the
    store, residual and silu wrappers) names skinny_<ep>_bf16_fp8_m<bucket>, an entry the library declares (and
    tests/unit/test_kernels_build.py finds in every fatbin) with as many arguments as it declares."""
    from engine.cuda.library import MODULES
    from engine.cuda.wrappers import skinny_linear
    from test_fp8_kv_kernels import EntryRecorder, cpu_tensor_args

    cpu_tensor_args(monkeypatch)
    specs = {s.name: s.args for s in MODULES["skinny_linear"]}
    K, N, bf = 64, 128, torch.bfloat16
    x, w = torch.randn(M, K, dtype=bf), quantize_fp8(torch.randn(N, K), activation_scheme=WEIGHT_ONLY)
    lib = EntryRecorder()
    lib.skinny_wide_tiles = 0
    skinny_linear.store(lib, torch.empty(M, N, dtype=bf), x, w)
    skinny_linear.store(lib, torch.empty(M, N, dtype=torch.float32), x, w)
    skinny_linear.residual(lib, torch.zeros(M, N, dtype=bf), x, w)
    skinny_linear.silu(lib, torch.empty(M, N // 2, dtype=bf), x, w)
    assert [name for name, _ in lib.launched] == [f"skinny_{ep}_bf16_fp8_m{bucket}"
                                                  for ep in ("store", "f32", "residual", "silu")]
    assert all(num_args == len(specs[name]) for name, num_args in lib.launched)
