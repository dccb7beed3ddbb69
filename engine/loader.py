"""Hugging Face safetensors checkpoint -> ModelWeights on the device (q/k/v and gate/up fused)."""
from __future__ import annotations

import json
import pathlib

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.errors import ConfigError
from engine.models.llama import LayerWeights, ModelWeights

# Checkpoint tensor names, per LayerWeights field. A list is concatenated along dim 0 (fused).
LAYER_TENSORS: dict[str, list[str]] = {
    "input_norm": ["input_layernorm.weight"],
    "qkv": ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
    "qkv_bias": ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"],
    "q_norm": ["self_attn.q_norm.weight"],
    "k_norm": ["self_attn.k_norm.weight"],
    "o_proj": ["self_attn.o_proj.weight"],
    "post_norm": ["post_attention_layernorm.weight"],
    "gate_up": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
    "down": ["mlp.down_proj.weight"],
}
LAYER_PREFIX = "model.layers.{i}."
EMBED, NORM, LM_HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"


def optional_fields(cfg: ModelConfig) -> set[str]:
    """LayerWeights fields this architecture does not have."""
    absent = set()
    if not cfg.qkv_bias:
        absent.add("qkv_bias")
    if not cfg.qk_norm:
        absent |= {"q_norm", "k_norm"}
    return absent


def checkpoint_files(path: pathlib.Path) -> list[pathlib.Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({path / f for f in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors files in {path}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ConfigError(f"checkpoint shards listed in the index are missing: {missing}")
    return files


class _Tensors:
    """Name -> tensor across shards, read lazily (one tensor in host memory at a time)."""

    def __init__(self, files: list[pathlib.Path]):
        self._where: dict[str, pathlib.Path] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    self._where[name] = f
        self._handles: dict[pathlib.Path, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise ConfigError(f"checkpoint lacks tensor {name!r}")
        f = self._where[name]
        if f not in self._handles:
            self._handles[f] = safe_open(str(f), framework="pt")
        return self._handles[f].get_tensor(name)


def load_weights(path: str | pathlib.Path, cfg: ModelConfig, dtype: torch.dtype,
                 device: torch.device) -> ModelWeights:
    path = pathlib.Path(path)
    tensors = _Tensors(checkpoint_files(path))

    def fetch(names: list[str], shape: tuple[int, ...]) -> torch.Tensor:
        parts = [tensors.get(n) for n in names]
        t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        if tuple(t.shape) != shape:
            raise ConfigError(f"tensor {names} has shape {tuple(t.shape)}, expected {shape} from config.json")
        return t.to(device=device, dtype=dtype).contiguous()

    hidden, inter, qkv_rows = cfg.hidden_size, cfg.intermediate_size, cfg.q_size + 2 * cfg.kv_size
    shapes = {
        "input_norm": (hidden,), "qkv": (qkv_rows, hidden), "qkv_bias": (qkv_rows,),
        "q_norm": (cfg.head_dim,), "k_norm": (cfg.head_dim,), "o_proj": (hidden, cfg.q_size),
        "post_norm": (hidden,), "gate_up": (2 * inter, hidden), "down": (hidden, inter),
    }
    absent = optional_fields(cfg)
    layers = []
    for i in range(cfg.num_layers):
        prefix = LAYER_PREFIX.format(i=i)
        fields = {name: None if name in absent else fetch([prefix + n for n in names], shapes[name])
                  for name, names in LAYER_TENSORS.items()}
        layers.append(LayerWeights(**fields))
    embed = fetch([EMBED], (cfg.vocab_size, hidden))
    if cfg.tie_word_embeddings or LM_HEAD not in tensors:
        if not cfg.tie_word_embeddings:
            raise ConfigError(f"checkpoint lacks {LM_HEAD!r} and tie_word_embeddings is false")
        lm_head = embed
    else:
        lm_head = fetch([LM_HEAD], (cfg.vocab_size, hidden))
    return ModelWeights(embed=embed, layers=layers, norm=fetch([NORM], (hidden,)), lm_head=lm_head)


def weight_bytes(weights: ModelWeights) -> int:
    """Bytes one decode step must read (tied embeddings counted once)."""
    seen, total = set(), 0
    tensors = [weights.embed, weights.norm, weights.lm_head]
    for layer in weights.layers:
        tensors += [t for t in vars(layer).values() if t is not None]
    for t in tensors:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.nbytes
    return total
