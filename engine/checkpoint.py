"""Writes Hugging Face-layout checkpoints (config.json + safetensors) with seeded random weights.

No weights can be downloaded here, so tests, benchmarks and the built-in default model use these.
The files are what transformers' save_pretrained writes for the same architecture, so transformers
loads them as the correctness oracle. With an FP8 layout (FP8_LAYOUTS) the random weights are quantized into
that published layout (engine/fp8_checkpoint.py), as its quantizer would write them."""
from __future__ import annotations

import atexit
import json
import os
import pathlib
import shutil
import tempfile
import zlib

import torch
from safetensors.torch import save_file

from engine.loader import LM_HEAD, is_linear, scale_name, tensor_shapes
from engine.config import ModelConfig
from engine.errors import ConfigError
from engine.fp8_checkpoint import Fp8Layout
from engine.quant import quantize_fp8

ARCH_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM"}

SHAPES: dict[str, dict] = {
    # Small enough for CPU tests; big enough that attention, GQA and the MLP all matter.
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                 rope_theta=10000.0, tie_word_embeddings=False),
    # Llama-3.2-1B.
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
               rope_theta=500000.0, tie_word_embeddings=True,
               rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    # Llama-3-8B.
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
               rope_theta=500000.0, tie_word_embeddings=False),
}
# What write_checkpoint(replace=True) removes from out_dir: the files it writes, and staging folders a
# killed run left (STAGING_PREFIX). Other files (a README, tokenizer files) stay.
STAGING_PREFIX = ".make-model-"
CHECKPOINT_FILES = ("config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
                    STAGING_PREFIX + "*")
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _compressed_tensors(strategy: str, dynamic_input: bool | None, ignore: list[str], block=None) -> dict:
    """llm-compressor's FP8 / FP8_DYNAMIC quantization_config (compressed-tensors float-quantized); dynamic_input
    None: no input activations (weight-only FP8, "input_activations": null)."""
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": strategy,
               "group_size": None, "block_structure": block, "actorder": None, "observer": "minmax",
               "observer_kwargs": {}}
    inputs = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": dynamic_input,
              "strategy": "token" if dynamic_input else "tensor", "group_size": None, "block_structure": None,
              "actorder": None, "observer": None if dynamic_input else "minmax", "observer_kwargs": {}}
    if dynamic_input is None:
        inputs = None
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs,
                                          "output_activations": None}},
            "ignore": ignore, "kv_cache_scheme": None}


# The FP8 layouts write_checkpoint(fp8_layout=...) and make-model --fp8-layout write: config.json's
# quantization_config for each.
FP8_LAYOUTS: dict[str, dict] = {
    # Hugging Face fine-grained FP8 as Qwen3-*-FP8 ships it (lm_head unquantized, not listed).
    "fp8": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
            "modules_to_not_convert": None},
    # The same with blocks that divide a tiny model's fused parts (q/k/v and gate/up concatenate as they are).
    "fp8-32x32": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
                  "modules_to_not_convert": ["lm_head"]},
    # The per-tensor variant (no weight_block_size: one scalar weight_scale_inv) with static activation scales.
    "fp8-tensor-static": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "static",
                          "weight_block_size": None, "modules_to_not_convert": None},
    # compressed-tensors FP8_DYNAMIC: per-channel weights, dynamic per-token inputs; lm_head FP8 too (not ignored).
    "ct-channel": _compressed_tensors("channel", True, []),
    # compressed-tensors FP8: per-tensor weights, static per-tensor input scales (input_scale); lm_head ignored.
    "ct-tensor-static": _compressed_tensors("tensor", False, ["lm_head"]),
    # compressed-tensors weight-only FP8: per-channel weights, "input_activations": null (served W8A16).
    "ct-channel-weight-only": _compressed_tensors("channel", None, []),
}
STATIC_INPUT_SCALE = 0.02  # the input_scale a static layout's writer stores (the engine does not use it)


def fp8_tensors(tensors: dict[str, torch.Tensor], layout: Fp8Layout) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors in `layout`: each linear weight it quantizes as E4M3 data plus fp32 scales
    (quantize_fp8 per block, channel or tensor) under the layout's names, a static input scale beside it in a
    static layout (input_scale [1] for compressed-tensors, a scalar activation_scale for fp8); lm_head only for
    compressed-tensors (transformers' fp8 never converts it)."""
    out = {}
    for name, t in tensors.items():
        module = name.removesuffix(".weight")
        if not (is_linear(name) and layout.quantizes(module) and (name != LM_HEAD or layout.method != "fp8")):
            out[name] = t
            continue
        n, k = t.shape
        block = layout.block if layout.strategy == "block" else (1, k) if layout.strategy == "channel" else (n, k)
        q = quantize_fp8(t, block)
        out[name] = q.data
        hf = layout.method == "fp8"
        out[scale_name(layout, name)] = q.scale.reshape(() if hf else 1) if layout.strategy == "tensor" else q.scale
        if layout.static_input:
            out[f"{module}.activation_scale" if hf else f"{module}.input_scale"] = \
                torch.tensor(STATIC_INPUT_SCALE).reshape(() if hf else 1)
    return out


def make_config(arch: str, shape: str = "tiny", **overrides) -> dict:
    """A config.json dict for `arch` at `shape`; overrides replace or add keys."""
    if arch not in ARCH_CLASSES:
        raise ValueError(f"arch must be one of {sorted(ARCH_CLASSES)}, got {arch!r}")
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {sorted(SHAPES)}, got {shape!r}")
    cfg = {
        "architectures": [ARCH_CLASSES[arch]],
        "model_type": arch,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5 if arch in ("llama", "mistral") else 1e-6,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32" if shape == "tiny" else "bfloat16",
        **SHAPES[shape],
    }
    if arch in ("llama", "qwen3"):
        cfg["attention_bias"] = False
    if arch == "llama":
        cfg["mlp_bias"] = False
    if arch == "mistral":
        cfg["sliding_window"] = None
    if arch in ("qwen2", "qwen3"):
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg["num_hidden_layers"])
    cfg.update(overrides)
    return cfg


def random_weights(cfg: ModelConfig, seed: int, dtype: torch.dtype,
                   device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Seeded random tensors under their checkpoint names. Each linear layer's std is
    1/sqrt(fan_in), so activations stay O(1) through the layers and attention, the MLP and the
    norms' weights all shape the output; embeddings have std 1 and lm_head
    3/sqrt(hidden), for peaked next-token distributions
    (few near-ties, so greedy comparisons are meaningful)."""
    hidden = cfg.hidden_size
    names = tensor_shapes(cfg)
    out = {}
    for name, shape in names.items():
        gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * t
        elif name.endswith(".bias"):
            t = 0.1 * t
        elif name == LM_HEAD:
            t = t * (3.0 / hidden ** 0.5)
        else:
            t = t / shape[1] ** 0.5
        out[name] = t.to(dtype)
    return out


def write_temporary_checkpoint(shape: str, arch: str = "llama", device: str = "cpu", **kwargs) -> pathlib.Path:
    """write_checkpoint into a new temporary directory that is removed when the process exits (the benchmarks'
    random-weight models: an 8B one is 16 GB, and a device session's runs filled its 64 GB disk when they were left
    behind). Returns the checkpoint's directory."""
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="metrale-model-"))
    atexit.register(shutil.rmtree, tmp, True)
    return write_checkpoint(tmp / shape, arch=arch, shape=shape, device=device, **kwargs)


def write_checkpoint(out_dir: str | pathlib.Path, arch: str = "llama", shape: str = "tiny", seed: int = 0,
                     dtype: str | None = None, device: str = "cpu", max_shard_bytes: int = 4 << 30,
                     replace: bool = False, fp8_layout: str = "", **overrides) -> pathlib.Path:
    """Writes config.json and model.safetensors (or shards plus an index) to out_dir; fp8_layout (a key of
    FP8_LAYOUTS): the linear weights in that published FP8 layout, with its quantization_config.

    A non-empty out_dir is refused (ConfigError) unless `replace`, which removes its checkpoint files
    (CHECKPOINT_FILES) and keeps every other file. The files are written to a staging folder inside
    out_dir and moved in once all are written (config.json last), so out_dir never holds a partial
    checkpoint or a mix of two."""
    out = pathlib.Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not replace:
        raise ConfigError(f"{out} is not empty: writing into it would mix two checkpoints; choose a new or empty "
                          f"directory, or pass --force to replace its checkpoint files")
    if fp8_layout and fp8_layout not in FP8_LAYOUTS:
        raise ConfigError(f"fp8_layout must be one of {sorted(FP8_LAYOUTS)}, got {fp8_layout!r}")
    raw = make_config(arch, shape, **overrides)
    if dtype:
        raw["torch_dtype"] = dtype
    if fp8_layout:
        raw["quantization_config"] = FP8_LAYOUTS[fp8_layout]
    cfg = ModelConfig.from_dict(raw)
    tensors = random_weights(cfg, seed, TORCH_DTYPES[raw["torch_dtype"]], device)
    if cfg.fp8_layout:
        tensors = fp8_tensors(tensors, cfg.fp8_layout)
    try:
        out.mkdir(parents=True, exist_ok=True)
        staging = pathlib.Path(tempfile.mkdtemp(dir=out, prefix=STAGING_PREFIX))
    except OSError as e:
        raise ConfigError(f"cannot create {out}: {e.strerror or e}") from e
    try:
        _write_files(staging, raw, tensors, max_shard_bytes)
        for pattern in CHECKPOINT_FILES:
            for old in out.glob(pattern):
                if not old.is_dir():
                    old.unlink()
                elif old.name.startswith(STAGING_PREFIX) and old != staging:
                    shutil.rmtree(old)  # a staging folder a killed make-model left
        for f in sorted(staging.iterdir(), key=lambda f: f.name == "config.json"):
            os.replace(f, out / f.name)
    except OSError as e:
        raise ConfigError(f"cannot write the checkpoint to {out}: {e.strerror or e}") from e
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _write_files(out: pathlib.Path, raw: dict, tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> None:
    shards, current, size = [], {}, 0
    for name, t in tensors.items():
        if current and size + t.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = t.contiguous().cpu()
        size += t.nbytes
    shards.append(current)
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata=meta)
    else:
        weight_map = {}
        for k, shard in enumerate(shards):
            fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / fname), metadata=meta)
            weight_map.update({name: fname for name in shard})
        total = sum(t.nbytes for t in tensors.values())
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": raw["bos_token_id"], "eos_token_id": raw["eos_token_id"]}, indent=2))
