"""Hugging Face safetensors checkpoint -> ModelWeights on the device (q/k/v and gate/up fused).

A 16/32-bit checkpoint's weights load in the model dtype (their projections quantized at load with
--quantization fp8); an FP8 checkpoint's (config.json's quantization_config, engine/fp8_checkpoint.py) load
as engine.quant.Fp8Weight with the checkpoint's own scales, whatever --quantization says."""
from __future__ import annotations

import json
import math
import pathlib
import threading

import torch
from safetensors import SafetensorError, safe_open

from engine.config import ModelConfig
from engine.errors import ConfigError, LoadCancelled
from engine.models.llama import LayerWeights, ModelWeights
from engine.fp8_checkpoint import (FP8_SAFETENSORS_DTYPE, SCALE_DTYPES, Fp8Layout, check_scale_values, fuse,
                                   resolve_activation_scheme, to_device)
from engine.quant import DYNAMIC, Fp8Weight, quantize_fp8

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
# The LayerWeights fields --quantization fp8 quantizes (the projections; never norms, biases or embeddings).
QUANTIZED_FIELDS = frozenset({"qkv", "o_proj", "gate_up", "down"})
# The checkpoint tensors that may be FP8 in an FP8 checkpoint: the projections' weights and lm_head's.
LINEAR_SUFFIXES = tuple(n for f in sorted(QUANTIZED_FIELDS) for n in LAYER_TENSORS[f])


def optional_fields(cfg: ModelConfig) -> set[str]:
    """LayerWeights fields this architecture does not have."""
    absent = set()
    if not cfg.qkv_bias:
        absent.add("qkv_bias")
    if not cfg.qk_norm:
        absent |= {"q_norm", "k_norm"}
    return absent


def tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this config must hold, by checkpoint name, with its shape: layer by
    layer, then the embedding, the final norm and lm_head (only when the embeddings are not tied)."""
    hidden, inter, kv = cfg.hidden_size, cfg.intermediate_size, cfg.kv_size
    per_layer = {
        "input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (cfg.q_size, hidden), "self_attn.k_proj.weight": (kv, hidden),
        "self_attn.v_proj.weight": (kv, hidden), "self_attn.o_proj.weight": (hidden, cfg.q_size),
        "self_attn.q_proj.bias": (cfg.q_size,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,),
        "self_attn.q_norm.weight": (cfg.head_dim,), "self_attn.k_norm.weight": (cfg.head_dim,),
        "mlp.gate_proj.weight": (inter, hidden), "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
    }
    absent = {n for f in optional_fields(cfg) for n in LAYER_TENSORS[f]}
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(cfg.num_layers):
        for names in LAYER_TENSORS.values():
            shapes.update({LAYER_PREFIX.format(i=i) + n: per_layer[n] for n in names if n not in absent})
    shapes[EMBED] = (cfg.vocab_size, hidden)
    shapes[NORM] = (hidden,)
    if not cfg.tie_word_embeddings:
        shapes[LM_HEAD] = (cfg.vocab_size, hidden)
    return shapes


# Set once by cancel_loading(); a load checks it before each tensor.
_cancelled = threading.Event()


def cancel_loading() -> None:
    """Makes a weight load in progress on any thread, and any later one in this process, stop before its
    next tensor with LoadCancelled: how a signal during start-up stops the load (the process then exits)."""
    _cancelled.set()


def checkpoint_files(path: pathlib.Path) -> list[pathlib.Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            files = sorted({path / f for f in weight_map.values()})
        except (OSError, ValueError, AttributeError, TypeError) as e:
            raise ConfigError(f"{index} is not a readable safetensors index ({type(e).__name__}: {e}); "
                              f"copy the checkpoint again") from e
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors files in {path}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ConfigError(f"checkpoint shards listed in {index} are missing: {missing}")
    return files


def _unreadable(f: pathlib.Path, e: Exception) -> ConfigError:
    if isinstance(e, OSError):
        return ConfigError(f"cannot read {f}: {e.strerror or e}")
    return ConfigError(f"{f} is not a readable safetensors file ({e}); truncated or corrupt (an interrupted "
                       f"download or copy?): copy it again")


class _Tensors:
    """Name -> tensor across shards, read lazily (one tensor in host memory at a time). Opening a file
    reads and checks its header: safetensors refuses a file shorter than its header says."""

    def __init__(self, files: list[pathlib.Path]):
        self._where: dict[str, pathlib.Path] = {}
        self._handles: dict[pathlib.Path, object] = {}
        for f in files:
            try:
                handle = self._handles[f] = safe_open(str(f), framework="pt")
                names = handle.keys()
            except (SafetensorError, OSError) as e:
                raise _unreadable(f, e) from e
            for name in names:
                self._where[name] = f

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def file_of(self, name: str) -> pathlib.Path:
        return self._where[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self._where[name]].get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """safetensors' name of the tensor's dtype: "F32", "BF16", "F8_E4M3", ..."""
        return self._handles[self._where[name]].get_slice(name).get_dtype()

    def get(self, name: str, part=None) -> torch.Tensor:
        """The tensor, or only its engine.shard.Slice `part` (read through get_slice: the rest is never read)."""
        if _cancelled.is_set():
            raise LoadCancelled("the weight load was cancelled")
        if name not in self._where:
            raise ConfigError(f"checkpoint lacks tensor {name!r}")
        f = self._where[name]
        try:
            if part is None:
                return self._handles[f].get_tensor(name)
            view = self._handles[f].get_slice(name)
            pieces = [view[a:b] if part.dim == 0 else view[:, a:b] for a, b in part.ranges]
            return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=part.dim)
        except (SafetensorError, OSError) as e:
            raise _unreadable(f, e) from e


def check_checkpoint(path: str | pathlib.Path, cfg: ModelConfig) -> _Tensors:
    """Reads only the headers of the checkpoint in `path`: every tensor `cfg` needs is there with its
    shape, and no file is truncated. A ConfigError names the file, or the directory and the tensor.
    Returns the opened checkpoint, for load_weights. path: a checkpoint directory, or a .gguf file
    (its converted checkpoint, engine/gguf.py)."""
    from engine.default_model import resolve_model_dir

    path = resolve_model_dir(path)
    files = checkpoint_files(path)
    tensors = _Tensors(files)
    where = str(files[0]) if len(files) == 1 else f"{path} ({len(files)} shards)"
    shapes = tensor_shapes(cfg)
    missing = [name for name in shapes if name not in tensors]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ConfigError(f"checkpoint {where} lacks tensor {missing[0]!r}{more} that its config.json "
                          f"({cfg.architecture}, {cfg.num_layers} layers) asks for; a partial copy, or a "
                          f"config.json of another model?")
    for name, shape in shapes.items():
        if tensors.shape(name) != shape:
            raise ConfigError(f"{tensors.file_of(name)}: tensor {name!r} has shape {tensors.shape(name)}, "
                              f"config.json implies {shape}")
    _check_fp8(tensors, cfg, shapes)
    return tensors


def is_linear(name: str) -> bool:
    """Whether checkpoint tensor `name` is a linear layer's weight (a projection or lm_head)."""
    return name == LM_HEAD or name.endswith(LINEAR_SUFFIXES)


def scale_name(layout: Fp8Layout, weight: str) -> str:
    """The checkpoint name of FP8 weight `weight`'s scales ("...q_proj.weight" -> "...q_proj.weight_scale_inv")."""
    return f"{weight.removesuffix('.weight')}.{layout.scale_suffix}"


def _check_fp8(tensors: _Tensors, cfg: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> None:
    """Headers only: every linear weight config.json's quantization_config makes FP8 is E4M3 with scales of
    a float dtype and the layout's shape; no other tensor is FP8. lm_head is FP8 only where the checkpoint
    stores it so (transformers' fp8 leaves it unquantized without listing it)."""
    layout = cfg.fp8_layout
    for name, shape in shapes.items():
        dtype, where = tensors.dtype(name), tensors.file_of(name)
        fp8_here = is_linear(name) and layout is not None and layout.quantizes(name.removesuffix(".weight"))
        if fp8_here and (name != LM_HEAD or dtype == FP8_SAFETENSORS_DTYPE):
            if dtype != FP8_SAFETENSORS_DTYPE:
                raise ConfigError(f"{where}: tensor {name!r} is {dtype}, but config.json's quantization_config "
                                  f"({layout.description}) makes it FP8 ({FP8_SAFETENSORS_DTYPE})")
            scale = scale_name(layout, name)
            if scale not in tensors:
                raise ConfigError(f"checkpoint lacks tensor {scale!r}, the scales of FP8 weight {name!r} "
                                  f"(quantization_config: {layout.description})")
            if tensors.dtype(scale) not in SCALE_DTYPES:
                raise ConfigError(f"{tensors.file_of(scale)}: FP8 scale tensor {scale!r} is {tensors.dtype(scale)}; "
                                  f"scales are {'/'.join(SCALE_DTYPES)}")
            if tensors.shape(scale) not in layout.scale_shapes(*shape):
                raise ConfigError(f"{tensors.file_of(scale)}: FP8 scale tensor {scale!r} has shape "
                                  f"{tensors.shape(scale)}; weight {list(shape)} with {layout.description} scales "
                                  f"needs {' or '.join(map(str, layout.scale_shapes(*shape)))}")
        elif dtype.startswith("F8"):
            why = ("config.json has no quantization_config" if layout is None
                   else "only linear weights can be FP8" if not is_linear(name)
                   else f"quantization_config ({layout.description}) does not quantize it (its ignore list)")
            raise ConfigError(f"{where}: tensor {name!r} is {dtype} (FP8), but {why}")
    for i in range(cfg.num_layers):
        for field in ("qkv", "gate_up"):
            names = [LAYER_PREFIX.format(i=i) + n for n in LAYER_TENSORS[field]]
            if len({tensors.dtype(n) == FP8_SAFETENSORS_DTYPE for n in names}) > 1:
                raise ConfigError(f"checkpoint tensors {names} are fused into one projection and must be all FP8 or "
                                  f"none: quantization_config's ignore list splits them")


def load_weights(path: str | pathlib.Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 quantization: str = "none", quantize_lm_head: bool = False,
                 fp8_block: tuple[int, int] | None = None, shard=None,
                 fp8_activation_scheme: str = DYNAMIC, fp8_skipped_layers: frozenset[int] = frozenset()
                 ) -> ModelWeights:
    """Checks the checkpoint's headers (check_checkpoint), then reads the weights onto `device`.
    quantization "fp8": the QUANTIZED_FIELDS (and with quantize_lm_head the LM head: a tied one as a
    quantized copy, the embedding stays `dtype`) become engine.quant.Fp8Weight, quantized from the
    checkpoint's own values in fp32, with scales per fp8_block (rows, columns; None: per output channel),
    but for the layers in fp8_skipped_layers (EngineConfig.fp8_skipped_layers), whose projections stay `dtype`.
    An FP8 checkpoint's FP8 weights load with their own scales (engine/fp8_checkpoint.py) whatever
    `quantization` says; with "fp8" its 16-bit projections (an ignore list's) and, with quantize_lm_head, a
    16-bit LM head are quantized as above. Every Fp8Weight gets the activation scheme engine.fp8_checkpoint's
    resolve_activation_scheme makes of fp8_activation_scheme (EngineConfig's) and the checkpoint's layout.
    shard: an engine.shard.ShardPlan (tensor parallelism): only this rank's slices of each tensor are read
    (16/32-bit checkpoints: an FP8 one is refused with tensor parallelism for now). Raises LoadCancelled, between tensors, once cancel_loading() was called."""
    if shard is not None and cfg.fp8_layout:
        raise ConfigError(f"an FP8 checkpoint ({cfg.fp8_layout.description}) is not split for tensor parallelism yet "
                          f"(its scale blocks would need slicing with the weights): serve it with "
                          f"--tensor-parallel-size 1")
    tensors = check_checkpoint(path, cfg)
    shapes = tensor_shapes(cfg)
    element = torch.empty((), dtype=dtype).element_size()
    total = sum(math.prod(s) for s in shapes.values()) * element
    loaded = 0
    fp8 = quantization == "fp8"
    scheme = resolve_activation_scheme(fp8_activation_scheme, cfg.fp8_layout)

    def read_fp8(name: str) -> Fp8Weight:
        scale = tensors.get(scale_name(cfg.fp8_layout, name))
        check_scale_values(scale_name(cfg.fp8_layout, name), scale)
        return cfg.fp8_layout.weight(tensors.get(name), scale, scheme)

    def fetch(names: list[str], quantize: bool = False, part=None):
        nonlocal loaded
        try:
            if tensors.dtype(names[0]) == FP8_SAFETENSORS_DTYPE:
                t = to_device(fuse([read_fp8(n) for n in names]), device)
            else:
                slices = [part or (shard.slice_for(n) if shard else None) for n in names]
                parts = [tensors.get(n) if p is None else tensors.get(n, p) for n, p in zip(names, slices)]
                t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
                t = (quantize_fp8(t.to(device), fp8_block, scheme) if quantize
                     else t.to(device=device, dtype=dtype).contiguous())
        except torch.OutOfMemoryError as e:
            raise ConfigError(f"the weights ({total / 2**30:.2f} GiB as {dtype}) do not fit in {device} memory: "
                              f"out of memory at {names[0]!r} after {loaded / 2**30:.2f} GiB") from e
        loaded += t.nbytes
        return t

    absent = optional_fields(cfg)
    layers = []
    for i in range(cfg.num_layers):
        prefix = LAYER_PREFIX.format(i=i)
        quantize = fp8 and i not in fp8_skipped_layers
        fields = {name: None if name in absent
                  else fetch([prefix + n for n in names], quantize and name in QUANTIZED_FIELDS)
                  for name, names in LAYER_TENSORS.items()}
        layers.append(LayerWeights(**fields))
    embed = fetch([EMBED])
    head = LM_HEAD if not cfg.tie_word_embeddings else EMBED
    head_part = shard.lm_head_slice() if shard else None
    if fp8 and quantize_lm_head:
        lm_head = fetch([head], True, head_part)
    elif cfg.tie_word_embeddings:  # a vocab-parallel head tied to the (whole) embedding: a view of its rows
        lm_head = embed if head_part is None else embed[slice(*head_part.ranges[0])]
    else:
        lm_head = fetch([head], part=head_part)
    return ModelWeights(embed=embed, layers=layers, norm=fetch([NORM]), lm_head=lm_head)


def weight_bytes(weights: ModelWeights) -> int:
    """Bytes one decode step must read (tied embeddings counted once)."""
    seen, total = set(), 0
    weights_ = [weights.embed, weights.norm, weights.lm_head]
    for layer in weights.layers:
        weights_ += [t for t in vars(layer).values() if t is not None]
    tensors = [t for w in weights_ for t in (w.tensors() if isinstance(w, Fp8Weight) else [w])]
    for t in tensors:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.nbytes
    return total
