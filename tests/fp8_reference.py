"""Published FP8 checkpoints for tests, and their dequantization written out independently of the engine's
loader: w = weight * scale per block (Hugging Face fp8: weight_scale_inv [ceil(N / bn), ceil(K / bk)]) or per
row / tensor (compressed-tensors: weight_scale [N, 1] or [1]), in fp32, straight from the safetensors files."""
from __future__ import annotations

import json
import pathlib

import torch
from safetensors.torch import load_file, save_file

# name -> (arch, write_checkpoint fp8_layout, overrides): every layout, Llama and Qwen3 (q/k norm) among them.
FP8_CHECKPOINTS: dict[str, tuple[str, str, dict]] = {
    "llama-fp8-128x128": ("llama", "fp8", {}),  # fused parts of 64/32 rows: scales repeated per row
    "qwen3-fp8-32x32": ("qwen3", "fp8-32x32", {}),  # fused parts of 64/32 rows: scales concatenated
    "llama-fp8-tensor-static": ("llama", "fp8-tensor-static", {}),  # scalar weight_scale_inv, activation_scale
    "llama-ct-channel": ("llama", "ct-channel", {}),  # lm_head FP8 too
    "qwen3-ct-tensor-static": ("qwen3", "ct-tensor-static", {"tie_word_embeddings": True}),
}
SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale")


def weight_block(path: pathlib.Path) -> tuple[int, int] | None:
    """The checkpoint's scale block (rows, columns) from its config.json; None: per channel or per tensor."""
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    if qc["quant_method"] == "fp8":
        return tuple(qc["weight_block_size"]) if qc.get("weight_block_size") else None
    weights = next(iter(qc["config_groups"].values()))["weights"]
    return tuple(weights["block_structure"]) if weights["strategy"] == "block" else None


def dequantized_tensors(path: pathlib.Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint in `path` in fp32, each FP8 weight multiplied by its scales; the
    scale and static input-scale tensors dropped."""
    raw = load_file(str(path / "model.safetensors"))
    block = weight_block(path)
    out = {}
    for name, t in raw.items():
        if name.endswith(SCALE_SUFFIXES + ("input_scale", "activation_scale")):
            continue
        if t.dtype != torch.float8_e4m3fn:
            out[name] = t.float()
            continue
        module = name.removesuffix(".weight")
        scale = next(raw[f"{module}.{s}"] for s in SCALE_SUFFIXES if f"{module}.{s}" in raw).float()
        n, k = t.shape
        if block:  # scale [ceil(N / bn), ceil(K / bk)]
            full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:n, :k]
        else:  # [N, 1] per channel, or [1] per tensor
            full = scale.reshape(-1, 1)
        out[name] = t.float() * full
    return out


def write_dequantized(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    """The checkpoint in src dequantized to fp32 in dst (config.json without its quantization_config)."""
    dst.mkdir(parents=True)
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config")
    cfg["torch_dtype"] = "float32"
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({n: t.contiguous() for n, t in dequantized_tensors(src).items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    return dst
