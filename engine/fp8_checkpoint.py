"""Published FP8 checkpoints: which layout config.json's `quantization_config` declares, which linear layers it
quantizes, and how their E4M3 weights and scales become engine.quant.Fp8Weight.

Two layouts load as they are (no re-quantization; the scales are the checkpoint's):
- Hugging Face fine-grained FP8 (DeepSeek-V3, Qwen3-*-FP8; transformers' FineGrainedFP8Config):
  {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic" | "static",
   "weight_block_size": [bn, bk] | null, "modules_to_not_convert": [...]}.
  A quantized Linear holds <name>.weight float8_e4m3fn [N, K] and <name>.weight_scale_inv fp32
  [ceil(N / bn), ceil(K / bk)] (one scalar without weight_block_size); despite its name the scale multiplies:
  w[n, k] = weight[n, k] * weight_scale_inv[n // bn, k // bk] (transformers' Fp8Dequantize, vLLM's
  block-FP8 linear). A static scheme's <name>.activation_scale is accepted and not used.
- compressed-tensors FP8 (llm-compressor's FP8 / FP8_DYNAMIC schemes): {"quant_method": "compressed-tensors",
  "format": "float-quantized" | "naive-quantized", "config_groups": {g: {"targets": [...], "weights":
  {"num_bits": 8, "type": "float", "symmetric": true, "dynamic": false, "strategy": "channel" | "tensor" |
  "block", "block_structure": [bn, bk]}, "input_activations": null | {"num_bits": 8, "type": "float",
  "dynamic": true | false, ...}}}, "ignore": [...]}. A quantized Linear holds <name>.weight float8_e4m3fn
  [N, K] and <name>.weight_scale ([N, 1] per channel, [1] or a scalar per tensor, [ceil(N / bn), ceil(K / bk)]
  per block; fp32, bf16 or fp16) with w = weight * weight_scale; a static input scheme's <name>.input_scale is
  accepted and not used: the engine handles activations its own way (16-bit activations, or where W8A8
  runs a dynamic per-token E4M3 scale, which tracks each row's range at least as closely as one static
  per-tensor scale does).
A format, method or scheme outside these is a ConfigError naming it.

Activation schemes (engine.quant's module docstring): a compressed-tensors checkpoint whose config groups have
"input_activations": null is weight-only (Fp8Layout.activation_scheme "none": W8A16 at every batch, as vLLM serves
it); one with 8-bit float input activations, dynamic or static, and every Hugging Face fp8 checkpoint (activation
scheme dynamic or static) is "dynamic" (W8A8 above 8 rows; a static scale is not used, as said above). Config
groups that disagree are a ConfigError, as groups of different weight schemes are. What the engine runs
(resolve_activation_scheme): weight-only where the checkpoint declares it or --fp8-activation-scheme none asks for
it (the flag overrides a checkpoint's dynamic scheme; the default, dynamic, keeps the checkpoint's own); the same
for every FP8 weight of the model, those quantized at load (--quantization fp8) included.

Per-tensor scales load as per-channel ones (each row gets the tensor's scale: exact), so they take the
per-channel kernels. Fused projections (q/k/v -> qkv, gate/up -> gate_up) concatenate data and scales when the
scale rows line up: per channel always; for bn x bk blocks when every part but the last has a multiple of bn
rows (Qwen3-8B's 4096/1024/1024 with 128). Otherwise each part's block rows are repeated per output row
(blocks 1 x bk, scale [N, ceil(K / bk)]) and then concatenated: exact as well (the same scale for every
element), at 4 bytes per row per bk columns of scale (3% of an 8B's projection bytes at bk = 128)."""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from engine.errors import ConfigError
from engine.quant import DYNAMIC, WEIGHT_ONLY, Fp8Weight

FP8_SAFETENSORS_DTYPE = "F8_E4M3"  # safetensors' header name of float8_e4m3fn
SCALE_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
SUPPORTED = "quant_method 'fp8' (fmt e4m3) or 'compressed-tensors' with 8-bit float weights"


@dataclass(frozen=True)
class Fp8Layout:
    """What config.json's quantization_config declares about the checkpoint's FP8 weights."""

    method: str  # "fp8" | "compressed-tensors"
    scale_suffix: str  # "weight_scale_inv" | "weight_scale": <module>.<scale_suffix> holds the scales
    strategy: str  # "block" | "channel" | "tensor"
    block: tuple[int, int] | None  # (bn, bk) rows x columns per scale for "block"
    targets: tuple[str, ...] = ("Linear",)  # what is quantized: "Linear" (every linear), names or "re:" regexes
    ignore: tuple[str, ...] = ()  # what is not, in the same forms
    static_input: bool = False  # static activation scales on disk (input_scale / activation_scale), not used
    activation_scheme: str = DYNAMIC  # WEIGHT_ONLY: compressed-tensors without input activations (module docstring)

    @property
    def description(self) -> str:
        """Info's checkpoint_quantization: e.g. "fp8 128x128", "compressed-tensors channel"."""
        return f"{self.method} {f'{self.block[0]}x{self.block[1]}' if self.block else self.strategy}"

    @property
    def fp8_weight_block(self) -> str:
        """EngineConfig.fp8_weight_block's spelling of the blocks loaded: per-tensor scales load per channel."""
        return f"{self.block[0]}x{self.block[1]}" if self.block else "channel"

    def quantizes(self, module: str) -> bool:
        """Whether the linear layer `module` (e.g. "model.layers.0.mlp.down_proj") is FP8 in the checkpoint."""
        return any(_matches(module, t) for t in self.targets) and not any(_matches(module, i) for i in self.ignore)

    def scale_shapes(self, n: int, k: int) -> list[tuple[int, ...]]:
        """The shapes a [n, k] weight's scale may have on disk."""
        if self.strategy == "block":
            bn, bk = self.block
            return [(-(-n // bn), -(-k // bk))]
        if self.strategy == "channel":
            return [(n, 1), (n,)]
        return [(), (1,), (1, 1)]

    def weight(self, data: torch.Tensor, scale: torch.Tensor, activation_scheme: str = DYNAMIC) -> Fp8Weight:
        """data [N, K] float8_e4m3fn and its scale (a shape of scale_shapes, checked) -> Fp8Weight with fp32
        scales and the given activation scheme (resolve_activation_scheme's); per-tensor and per-channel scales
        become [N, 1] (block 1 x K)."""
        n, k = data.shape
        scale = scale.float()
        if self.strategy == "block":
            return Fp8Weight(data.contiguous(), scale.contiguous(), self.block, activation_scheme)
        return Fp8Weight(data.contiguous(), scale.reshape(-1, 1).expand(n, 1).contiguous(), (1, k), activation_scheme)


def resolve_activation_scheme(flag: str, layout: Fp8Layout | None) -> str:
    """The activation scheme of every FP8 weight the engine holds (module docstring): WEIGHT_ONLY where
    --fp8-activation-scheme (EngineConfig.fp8_activation_scheme, `flag`) is "none" or the checkpoint's layout is
    weight-only, else DYNAMIC."""
    weight_only = flag == WEIGHT_ONLY or (layout is not None and layout.activation_scheme == WEIGHT_ONLY)
    return WEIGHT_ONLY if weight_only else DYNAMIC


def _matches(module: str, pattern: str) -> bool:
    """compressed-tensors' and transformers' module patterns: "Linear" (every linear layer here), "re:<regex>"
    (re.match from the start), else a module name, a parent of it ("model.layers.0") or a suffix
    ("lm_head", "mlp.down_proj")."""
    if pattern == "Linear":
        return True
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return module == pattern or module.startswith(pattern + ".") or module.endswith("." + pattern)


def parse_layout(qc) -> Fp8Layout | None:
    """config.json's quantization_config (None or absent: a 16/32-bit checkpoint) -> its Fp8Layout, or a
    ConfigError naming what is not supported."""
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ConfigError(f"quantization_config must be a JSON object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method == "fp8":
        return _parse_hf_fp8(qc)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(qc)
    raise ConfigError(f"quantization_config's quant_method {method!r} is not supported; supported: {SUPPORTED} "
                      f"(or a 16/32-bit checkpoint, optionally with --quantization fp8)")


def _parse_hf_fp8(qc: dict) -> Fp8Layout:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"quantization_config (quant_method 'fp8') has fmt {fmt!r}; only 'e4m3' is supported")
    if qc.get("activation_scheme", "dynamic") not in ("dynamic", "static"):
        raise ConfigError(f"quantization_config (quant_method 'fp8') has activation_scheme "
                          f"{qc.get('activation_scheme')!r}; supported: 'dynamic', 'static'")
    if qc.get("scale_fmt", "float") not in ("float", None):
        raise ConfigError(f"quantization_config (quant_method 'fp8') has scale_fmt {qc.get('scale_fmt')!r}; only "
                          f"fp32 scales are supported")
    block = qc.get("weight_block_size")
    ignore = tuple(qc.get("modules_to_not_convert") or ())
    static = qc.get("activation_scheme") == "static"
    if block is None:
        return Fp8Layout("fp8", "weight_scale_inv", "tensor", None, ignore=ignore, static_input=static)
    return Fp8Layout("fp8", "weight_scale_inv", "block", _block(block, "weight_block_size"), ignore=ignore,
                     static_input=static)


def _block(value, key: str) -> tuple[int, int]:
    if not (isinstance(value, list) and len(value) == 2 and all(type(v) is int and v > 0 for v in value)):
        raise ConfigError(f"quantization_config's {key} must be [rows, columns] of positive integers, got {value!r}")
    return value[0], value[1]


def _parse_compressed_tensors(qc: dict) -> Fp8Layout:
    where = "quantization_config (compressed-tensors)"
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ConfigError(f"{where} has no config_groups")
    layouts = set()
    targets: list[str] = []
    static = False
    for name, group in groups.items():
        if not isinstance(group, dict):
            raise ConfigError(f"{where}: config group {name!r} must be a JSON object")
        fmt = group.get("format") or qc.get("format")
        if fmt not in ("float-quantized", "naive-quantized"):
            raise ConfigError(f"{where} has format {fmt!r}; supported: 'float-quantized', 'naive-quantized' (FP8)")
        w = group.get("weights") or {}
        scheme = (w.get("num_bits"), w.get("type"))
        if scheme != (8, "float"):
            raise ConfigError(f"{where}: config group {name!r} has {w.get('num_bits')}-bit {w.get('type')} weights; "
                              f"only 8-bit float (FP8 E4M3) weights are supported")
        if not w.get("symmetric", True) or w.get("dynamic"):
            raise ConfigError(f"{where}: config group {name!r} has asymmetric or dynamic weight scales; only "
                              f"symmetric static ones are supported")
        strategy = w.get("strategy")
        if strategy not in ("channel", "tensor", "block"):
            raise ConfigError(f"{where}: config group {name!r} has weight strategy {strategy!r}; supported: "
                              f"'channel', 'tensor', 'block'")
        block = _block(w.get("block_structure"), "block_structure") if strategy == "block" else None
        act = group.get("input_activations")
        if act is not None and (act.get("num_bits"), act.get("type")) != (8, "float"):
            raise ConfigError(f"{where}: config group {name!r} has {act.get('num_bits')}-bit {act.get('type')} input "
                              f"activations; supported: none or 8-bit float")
        static |= act is not None and not act.get("dynamic")
        layouts.add((strategy, block, DYNAMIC if act is not None else WEIGHT_ONLY))
        targets += list(group.get("targets") or ["Linear"])
    if len(layouts) > 1:
        raise ConfigError(f"{where} mixes weight schemes across config groups (strategy, block, input activations: "
                          f"{sorted(map(str, layouts))}); one scheme for every layer is supported")
    (strategy, block, scheme), = layouts
    return Fp8Layout("compressed-tensors", "weight_scale", strategy, block, tuple(targets),
                     tuple(qc.get("ignore") or ()), static, scheme)


def fuse(parts: list[Fp8Weight]) -> Fp8Weight:
    """Concatenates FP8 weights along the output dim (q/k/v -> qkv, gate/up -> gate_up), exactly (module
    docstring): data and scales concatenated where the scale rows line up, else as 1 x bk row blocks."""
    if len(parts) == 1:
        return parts[0]
    scheme = parts[0].activation_scheme
    if any(p.activation_scheme != scheme for p in parts):
        raise ValueError(f"fuse: the parts have different activation schemes {[p.activation_scheme for p in parts]}")
    data = torch.cat([p.data for p in parts])
    if all(p.per_channel for p in parts):
        return Fp8Weight(data, torch.cat([p.scale for p in parts]), (1, data.shape[1]), scheme)
    bn, bk = parts[0].block
    if all(p.block == (bn, bk) for p in parts) and all(p.shape[0] % bn == 0 for p in parts[:-1]):
        return Fp8Weight(data, torch.cat([p.scale for p in parts]), (bn, bk), scheme)
    rows = [p.scale.repeat_interleave(p.block[0], dim=0)[:p.shape[0]] for p in parts]  # [N_i, ceil(K / bk)] each
    return Fp8Weight(data, torch.cat(rows).contiguous(), (1, bk), scheme)


def to_device(w: Fp8Weight, device: torch.device) -> Fp8Weight:
    return Fp8Weight(w.data.to(device), w.scale.to(device), w.block, w.activation_scheme)


def check_scale_values(name: str, scale: torch.Tensor) -> None:
    """A scale that is not finite makes every weight it covers NaN or inf."""
    if not bool(torch.isfinite(scale).all()):
        raise ConfigError(f"checkpoint tensor {name!r} holds scales that are not finite (NaN or inf); the checkpoint "
                          f"is corrupt")

