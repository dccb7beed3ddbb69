"""engine/fp8_checkpoint.py: quantization_config parsing, module patterns and the exact fusion of FP8 weights."""
from __future__ import annotations

import pytest
import torch

from engine.checkpoint import FP8_LAYOUTS
from engine.errors import ConfigError
from engine.fp8_checkpoint import Fp8Layout, fuse, parse_layout, resolve_activation_scheme, to_device
from engine.quant import dequantize, quantize_fp8


def test_published_layouts_parse():
    hf = parse_layout(FP8_LAYOUTS["fp8"])
    assert (hf.method, hf.scale_suffix, hf.strategy, hf.block) == ("fp8", "weight_scale_inv", "block", (128, 128))
    assert hf.scale_shapes(576, 300) == [(5, 3)] and hf.description == "fp8 128x128"
    ct = parse_layout(FP8_LAYOUTS["ct-channel"])
    assert (ct.method, ct.scale_suffix, ct.strategy, ct.static_input) == ("compressed-tensors", "weight_scale",
                                                                          "channel", False)
    assert ct.fp8_weight_block == "channel" and (64, 1) in ct.scale_shapes(64, 32)
    static = parse_layout(FP8_LAYOUTS["ct-tensor-static"])
    assert static.strategy == "tensor" and static.static_input and not static.quantizes("lm_head")
    assert parse_layout(None) is None
    per_tensor = parse_layout({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": None})
    assert per_tensor.strategy == "tensor" and per_tensor.static_input


def test_the_activation_scheme_a_layout_declares():
    """compressed-tensors without input activations is weight-only; with 8-bit float ones, dynamic or static, and
    every Hugging Face fp8 layout (activation_scheme dynamic or static) is dynamic (W8A8 above 8 rows)."""
    weight_only = parse_layout(FP8_LAYOUTS["ct-channel-weight-only"])
    assert (weight_only.activation_scheme, weight_only.strategy, weight_only.static_input) == ("none", "channel",
                                                                                              False)
    assert weight_only.description == "compressed-tensors channel"
    for name in ("ct-channel", "ct-tensor-static", "fp8", "fp8-32x32", "fp8-tensor-static"):
        assert parse_layout(FP8_LAYOUTS[name]).activation_scheme == "dynamic", name
    groups = {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]},
                    "input_activations": None}}
    block = parse_layout({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": groups})
    assert (block.activation_scheme, block.block) == ("none", (128, 128))


@pytest.mark.parametrize("flag, layout, scheme", [
    ("dynamic", None, "dynamic"), ("none", None, "none"),  # quantized at load: the flag's value
    ("dynamic", "ct-channel", "dynamic"), ("none", "ct-channel", "none"),  # none overrides a dynamic checkpoint
    ("dynamic", "fp8", "dynamic"), ("none", "fp8-tensor-static", "none"),
    ("dynamic", "ct-channel-weight-only", "none"), ("none", "ct-channel-weight-only", "none"),  # weight-only stays
])
def test_the_activation_scheme_rule(flag, layout, scheme):
    assert resolve_activation_scheme(flag, parse_layout(FP8_LAYOUTS[layout]) if layout else None) == scheme


@pytest.mark.parametrize("layout, flag, scheme", [("ct-channel-weight-only", "dynamic", "none"),
                                                  ("ct-channel", "dynamic", "dynamic"), ("ct-channel", "none", "none"),
                                                  ("fp8-32x32", "none", "none")])
def test_loaded_checkpoint_weights_carry_the_scheme(tmp_path, layout, flag, scheme):
    """Every FP8 weight of the checkpoint (fused q/k/v and gate/up, and its FP8 LM head) gets the scheme."""
    from engine.checkpoint import write_checkpoint
    from engine.config import ModelConfig
    from engine.loader import load_weights
    from engine.quant import Fp8Weight

    path = write_checkpoint(tmp_path / layout, arch="llama", shape="tiny", fp8_layout=layout)
    weights = load_weights(path, ModelConfig.from_dir(path), torch.float32, torch.device("cpu"),
                           "fp8" if flag == "none" else "none", fp8_activation_scheme=flag)
    found = [getattr(layer, f) for layer in weights.layers for f in ("qkv", "o_proj", "gate_up", "down")]
    found += [weights.lm_head] if isinstance(weights.lm_head, Fp8Weight) else []
    assert all(isinstance(w, Fp8Weight) for w in found)
    assert {w.activation_scheme for w in found} == {scheme}


def test_fuse_and_to_device_keep_the_scheme():
    g = torch.Generator().manual_seed(1)
    parts = [quantize_fp8(torch.randn(n, 48, generator=g), None, "none") for n in (64, 32, 32)]
    assert fuse(parts).activation_scheme == "none" and to_device(parts[0], torch.device("cpu")).activation_scheme == \
        "none"
    with pytest.raises(ValueError, match="different activation schemes"):
        fuse([parts[0], quantize_fp8(torch.randn(32, 48, generator=g))])


def test_module_patterns():
    layout = Fp8Layout("compressed-tensors", "weight_scale", "channel", None,
                       ignore=("lm_head", "re:.*layers\\.1\\..*", "model.layers.2.mlp"))
    assert layout.quantizes("model.layers.0.mlp.down_proj")
    assert not layout.quantizes("lm_head")
    assert not layout.quantizes("model.layers.1.self_attn.q_proj")
    assert not layout.quantizes("model.layers.2.mlp.up_proj")
    assert layout.quantizes("model.layers.21.mlp.up_proj")  # a parent name stops at a module boundary
    only_attn = Fp8Layout("compressed-tensors", "weight_scale", "channel", None, targets=("re:.*self_attn.*",))
    assert only_attn.quantizes("model.layers.0.self_attn.o_proj")
    assert not only_attn.quantizes("model.layers.0.mlp.up_proj")


@pytest.mark.parametrize("qc, words", [
    ({"quant_method": "gptq"}, "quant_method 'gptq' is not supported"),
    ({"quant_method": "fp8", "weight_block_size": [0, 128]}, "positive integers"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}, "scale_fmt 'ue8m0'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}},
     "format 'pack-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "group"}}}}, "strategy 'group'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                              "input_activations": {"num_bits": 8, "type": "int"}}}}, "8-bit int input activations"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "a": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"}},
        "b": {"weights": {"num_bits": 8, "type": "float", "strategy": "tensor"}}}}, "mixes weight schemes"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "a": {"targets": ["re:.*self_attn.*"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
              "input_activations": None},
        "b": {"targets": ["re:.*mlp.*"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
              "input_activations": {"num_bits": 8, "type": "float", "dynamic": True}}}},
     "mixes weight schemes across config groups (strategy, block, input activations"),
    ("fp8", "must be a JSON object"),
])
def test_unsupported_configs_are_one_clear_error(qc, words):
    with pytest.raises(ConfigError) as e:
        parse_layout(qc)
    assert words in str(e.value)


@pytest.mark.parametrize("block, rows", [
    ((1, 48), [64, 32, 32]),  # per channel: always concatenated
    ((32, 32), [64, 32, 32]),  # rows multiples of the block rows: concatenated as they are
    ((32, 32), [64, 32, 20]),  # a partial last block is fine too
    ((128, 128), [64, 32, 32]),  # not lined up: repeated per row as 1 x 128 blocks
    ((32, 16), [40, 24, 24]),
])
def test_fuse_is_exact(block, rows):
    g = torch.Generator().manual_seed(0)
    parts = [quantize_fp8(torch.randn(n, 48, generator=g), block) for n in rows]
    fused = fuse(parts)
    assert torch.equal(dequantize(fused), torch.cat([dequantize(p) for p in parts]))
    assert torch.equal(fused.data.view(torch.uint8), torch.cat([p.data for p in parts]).view(torch.uint8))
    lined_up = block[0] == 1 or all(n % block[0] == 0 for n in rows[:-1])
    assert fused.block == (block if lined_up and block[0] > 1 else (1, 48) if block[0] == 1 else (1, block[1]))


def test_an_fp8_checkpoint_is_refused_under_tensor_parallelism(tmp_path):
    """Its scale blocks are not sliced with the weights yet: one ConfigError (exit 2 at start-up) naming the fix."""
    from engine.checkpoint import write_checkpoint
    from engine.config import ModelConfig
    from engine.loader import load_weights
    from engine.shard import ShardPlan

    path = write_checkpoint(tmp_path / "m", arch="llama", shape="tiny", fp8_layout="fp8")
    mc = ModelConfig.from_dir(path)
    with pytest.raises(ConfigError, match="--tensor-parallel-size 1"):
        load_weights(path, mc, torch.float32, torch.device("cpu"), shard=ShardPlan(mc, 0, 2))
