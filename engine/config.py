"""EngineConfig (how the engine runs) and ModelConfig (what the checkpoint is)."""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from dataclasses import dataclass, field

from engine.errors import ConfigError
from engine.fp8_checkpoint import Fp8Layout, parse_layout
from engine.quant import ACTIVATION_SCHEMES, CHANNEL, DYNAMIC, KV_CACHE_DTYPES, QUANTIZATIONS, parse_block

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
ROPE_TYPES = ("default", "linear", "dynamic", "llama3")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs. Every field is also a CLI flag (--model, --max-slots, ...)."""

    model: str = field(default="", metadata={"help": "checkpoint directory (config.json + *.safetensors) or a "
                                                      ".gguf file (converted once into the cache dir); empty: the "
                                                      "built-in default model, SmolLM2-135M-Instruct"})
    served_model_name: str = field(default="", metadata={
        "help": "the model id the worker reports (Info, the gateway service's model info, which smg lists in "
                "/v1/models and routes requests by, and the metrics' model label), as vLLM's flag of the same "
                "name; empty: the checkpoint directory's name"})
    device: str = field(default="auto", metadata={"help": "auto (GPU if cuda-python finds one), cpu or cuda",
                                                   "choices": DEVICES})
    kernels: str = field(default="auto", metadata={
        "help": "GPU op backend: auto/cuda (kernels_cu through cuda-python) or torch (the reference ops, "
                "for debugging); the CPU always uses torch", "choices": ("auto", "cuda", "torch")})
    dtype: str = field(default="auto", metadata={"help": "activation/weight dtype; auto: the checkpoint's "
                                                         "(bf16 for fp32 checkpoints) on GPU, float32 on CPU",
                                                 "choices": DTYPES})
    quantization: str = field(default="none", metadata={
        "help": "fp8: the projection weights (qkv, o_proj, gate_up, down) of a 16/32-bit checkpoint are quantized "
                "at load to FP8 E4M3 with fp32 scales per --fp8-weight-block (engine/quant.py); embeddings and "
                "norms keep the model dtype; needs an FP8 GPU (compute capability >= 8.9) or the CPU; none: as "
                "loaded. A published FP8 checkpoint (config.json's quantization_config: Hugging Face 'fp8' block "
                "scales or compressed-tensors FP8, engine/fp8_checkpoint.py) loads its FP8 weights with their own "
                "scales under either value (never re-quantized or dequantized; Info reports fp8); with fp8, its "
                "16-bit projections and (--quantize-lm-head) a 16-bit LM head are quantized at load as well",
        "choices": QUANTIZATIONS})
    quantize_lm_head: bool = field(default=False, metadata={
        "help": "with --quantization fp8, quantize the LM head too (a head tied to the embedding gets its own "
                "FP8 copy; the embedding stays unquantized)"})
    fp8_weight_block: str = field(default=CHANNEL, metadata={
        "help": "with --quantization fp8, the weights' scale blocks: channel (one scale per output channel) or "
                "ROWSxCOLS of the [out, in] weight per scale, e.g. 1x64 or 128x128 (a partial last block where "
                "they do not divide the shape); smaller blocks are more accurate (tests/e2e/test_fp8_accuracy.py). "
                "Blocks other than channel run through torch in fp32 on the GPU until a block-scaled FP8 kernel "
                "exists. An FP8 checkpoint's weights keep the checkpoint's blocks; this applies to what is "
                "quantized at load"})
    fp8_skip_layers: str = field(default="", metadata={
        "help": "with --quantization fp8, decoder layers whose projections stay in the model dtype: comma-separated "
                "indices, negative ones counted from the last layer (\"0,-1\": the first and the last). Accuracy "
                "for speed: on the default model W8A8 with the two first and two last layers kept meets the 0.05 "
                "agreement floor against bf16 that plain W8A8 misses (docs/fp8.md), and each layer kept costs its "
                "share of a decode step's bytes "
                "(2 of 32 layers: ~6%% of an 8B FP8 step). An FP8 checkpoint's own FP8 weights are never "
                "dequantized; its ignore list is the checkpoint's"})
    fp8_activation_scheme: str = field(default=DYNAMIC, metadata={
        "help": "what the FP8 projections (--quantization fp8, or an FP8 checkpoint's) do with their 16-bit "
                "activations: dynamic "
                "(W8A8 above 8 rows of bf16 activations, i.e. prompts and large decode batches: each row quantized "
                "to E4M3 with its own scale, for the FP8 tensor cores) or none (weight-only: W8A16 at every batch; "
                "slower prompts, more accurate: the default model meets the FP8 accuracy floors with it and not "
                "with W8A8, tests/e2e/test_fp8_accuracy.py). An FP8 checkpoint's weights take it too: none "
                "overrides a checkpoint's dynamic scheme, and a weight-only checkpoint (compressed-tensors without "
                "input_activations) runs weight-only under either value (engine/fp8_checkpoint.py); none without "
                "FP8 weights is refused at load",
        "choices": ACTIVATION_SCHEMES})
    kv_cache_dtype: str = field(default="auto", metadata={
        "help": "auto: the KV cache in the model's dtype; fp8: E4M3 with a scale of 1 (half the bytes of a 16-bit "
                "cache, so twice the blocks in the same memory, and half the KV bytes a long-context decode step "
                "reads; engine/quant.py fp8_kv). fp8 runs on the CPU, on the CUDA kernels of a GPU with FP8 "
                "support (compute capability >= 8.9), and with --kernels torch on any GPU",
        "choices": KV_CACHE_DTYPES})
    max_slots: int = field(default=256, metadata={"help": "most live sequences", "aliases": ("--max-num-seqs",)})
    max_batch_size: int = field(default=256, metadata={"help": "most sequences in one Decode/Prefill/Verify"})
    max_seq_len: int = field(default=0, metadata={"help": "most tokens per sequence; 0: the model's "
                                                          "max_position_embeddings", "aliases": ("--max-model-len",)})
    block_size: int = field(default=16, metadata={"help": "tokens per KV-cache block"})
    num_kv_blocks: int = field(default=0, metadata={"help": "KV-cache blocks; 0: sized from kv_cache_memory"})
    kv_cache_memory: float = field(default=0.85, metadata={
        "help": "KV-cache size when num_kv_blocks is 0: a fraction (<= 1) of the device memory left after "
                "the weights, or a number of GiB (> 1); on CPU a fraction means of 256 MiB"})
    max_prefill_tokens: int = field(default=8192, metadata={"help": "tokens per prefill forward (chunk budget)",
                                                            "aliases": ("--max-num-batched-tokens",)})
    max_top_logprobs: int = field(default=20, metadata={"help": "most top-n alternatives per token"})
    max_draft_tokens: int = field(default=16, metadata={"help": "most draft tokens per Verify item"})
    max_graphs: int = field(default=1024, metadata={
        "help": "most CUDA graphs held (LRU): room for every decode batch width and padded prefill shape"})
    capture_after: int = field(default=64, metadata={
        "help": "times a batch's slot vector is seen before it gets a decode graph of its own; until then the "
                "step replays its batch width's graph (fallback_graphs), which differs only by one small copy, so "
                "only a batch that stays the same for many steps is worth a capture"})
    cuda_graphs: bool = field(default=True, metadata={"help": "replay decode steps as CUDA graphs on GPU",
                                                      "negated_by": "--enforce-eager"})
    fallback_graphs: bool = field(default=True, metadata={
        "help": "while a batch's own decode graph is not captured yet, replay one graph per batch width (captured "
                "the first time that width runs) that reads the slot vector from a staging buffer"})
    prefix_caching: bool = field(default=True, metadata={
        "help": "reuse the KV of full blocks whose tokens (and everything before them) a cached sequence already "
                "computed: a Prefill computes only what no block holds (engine/prefix_cache.py); off: every prompt "
                "is computed", "aliases": ("--enable-prefix-caching",)})
    warm_up_widths: int = field(default=-1, metadata={
        "help": "decode batch widths whose CUDA graph the worker captures at start-up, so that no request's step "
                "pays a width's first capture (~5-10 ms): 1..N; -1: up to max_batch_size; 0: none"})
    tensor_parallel_size: int = field(default=1, metadata={
        "help": "processes the model is split over (tensor parallelism: attention heads, the MLP's intermediate "
                "dimension and the vocabulary; engine/shard.py): one per GPU on CUDA (NCCL), gloo on CPU; the "
                "worker starts ranks 1..N-1 itself and serves gRPC from rank 0; must divide the attention heads",
        "aliases": ("-tp",)})
    max_steps_in_flight: int = field(default=2, metadata={
        "help": "decode steps queued on the device at once: with 2, a Decode that arrives while a step runs is "
                "launched behind it, so the host's work between steps overlaps the device; 1 waits for each step"})

    def __post_init__(self):
        positive = ("tensor_parallel_size", "max_slots", "max_batch_size", "block_size", "max_prefill_tokens",
                    "max_draft_tokens", "max_graphs", "capture_after", "max_steps_in_flight")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.warm_up_widths < -1:
            raise ConfigError(f"warm_up_widths must be >= -1, got {self.warm_up_widths}")
        for name in ("max_seq_len", "num_kv_blocks", "max_top_logprobs"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.num_kv_blocks == 1:
            raise ConfigError("num_kv_blocks must be 0 (sized from kv_cache_memory) or >= 2 (block 0 is scratch), "
                              "got 1")
        if self.kv_cache_memory <= 0:
            raise ConfigError(f"kv_cache_memory must be > 0, got {self.kv_cache_memory}")
        if self.device not in DEVICES:
            raise ConfigError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.kernels not in ("auto", "cuda", "torch"):
            raise ConfigError(f"kernels must be auto, cuda or torch, got {self.kernels!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.quantize_lm_head and self.quantization == "none":
            raise ConfigError("quantize_lm_head needs quantization fp8 (--quantization fp8)")
        if parse_block(self.fp8_weight_block) is not None and self.quantization != "fp8":
            raise ConfigError(f"fp8_weight_block {self.fp8_weight_block} needs quantization fp8 (--quantization fp8)")
        self.fp8_skip_indices  # raises for a malformed list
        if self.fp8_skip_layers and self.quantization != "fp8":
            raise ConfigError(f"fp8_skip_layers {self.fp8_skip_layers} needs quantization fp8 (--quantization fp8)")
        if self.fp8_activation_scheme not in ACTIVATION_SCHEMES:
            raise ConfigError(f"fp8_activation_scheme must be one of {ACTIVATION_SCHEMES}, got "
                              f"{self.fp8_activation_scheme!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.max_steps_in_flight > 4:
            raise ConfigError(f"max_steps_in_flight must be at most 4, got {self.max_steps_in_flight}")
        if self.served_model_name != self.served_model_name.strip() or "\n" in self.served_model_name:
            raise ConfigError(f"served_model_name must not start or end with blanks or hold a line break, got "
                              f"{self.served_model_name!r}")
        if self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")

    @property
    def fp8_block(self) -> tuple[int, int] | None:
        """fp8_weight_block as (rows, columns); None: per output channel."""
        return parse_block(self.fp8_weight_block)

    @property
    def fp8_skip_indices(self) -> tuple[int, ...]:
        """fp8_skip_layers as layer indices (negative: from the last layer), unresolved against a model."""
        try:
            return tuple(int(part) for part in self.fp8_skip_layers.split(",")) if self.fp8_skip_layers.strip() else ()
        except ValueError:
            raise ConfigError(f"fp8_skip_layers must be comma-separated layer indices such as 0,-1, got "
                              f"{self.fp8_skip_layers!r}") from None

    def fp8_skipped_layers(self, num_layers: int) -> frozenset[int]:
        """The layers of a num_layers model whose projections --quantization fp8 leaves unquantized; ConfigError
        for an index outside the model."""
        out = set()
        for i in self.fp8_skip_indices:
            if not -num_layers <= i < num_layers:
                raise ConfigError(f"fp8_skip_layers: layer {i} is outside the model's {num_layers} layers "
                                  f"(0 .. {num_layers - 1}, or -{num_layers} .. -1 from the last)")
            out.add(i % num_layers)
        return frozenset(out)

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class RopeConfig:
    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0


@dataclass(frozen=True)
class ModelConfig:
    """The parts of a Hugging Face config.json the engine uses."""

    architecture: str  # llama | mistral | qwen2 | qwen3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: RopeConfig
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int = 0  # 0: full attention
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: str = "float32"
    fp8_layout: Fp8Layout | None = None  # an FP8 checkpoint's layout (quantization_config); None: 16/32-bit

    def __post_init__(self):
        for name, key in (("vocab_size", "vocab_size"), ("hidden_size", "hidden_size"),
                          ("intermediate_size", "intermediate_size"), ("num_layers", "num_hidden_layers"),
                          ("num_heads", "num_attention_heads"), ("num_kv_heads", "num_key_value_heads"),
                          ("head_dim", "head_dim")):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{key} must be > 0, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dir(cls, path: str | pathlib.Path) -> "ModelConfig":
        """Parses path/config.json; every problem is a ConfigError naming the file. path: a checkpoint
        directory, or a .gguf file (its converted checkpoint, engine/gguf.py)."""
        from engine.default_model import resolve_model_dir

        path = resolve_model_dir(path)
        cfg_path = path / "config.json"
        if not path.is_dir():
            what = "is not a directory" if path.exists() else "does not exist"
            raise ConfigError(f"model directory {path} {what} (--model: a directory holding config.json and "
                              f"*.safetensors, or a .gguf file)")
        if not cfg_path.is_file():
            raise ConfigError(f"{cfg_path} not found: a model directory holds config.json and *.safetensors")
        try:
            raw = json.loads(cfg_path.read_text())
        except OSError as e:
            raise ConfigError(f"cannot read {cfg_path}: {e.strerror}") from e
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{cfg_path} is not valid JSON: {e}") from e
        try:
            return cls.from_dict(raw)
        except ConfigError as e:
            raise ConfigError(f"{cfg_path}: {e}") from e

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        if not isinstance(raw, dict):
            raise ConfigError(f"config.json must hold a JSON object, got {type(raw).__name__}")
        archs = raw.get("architectures") or []
        if not isinstance(archs, list):
            archs = [archs]
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            arch = raw.get("model_type") if raw.get("model_type") in SUPPORTED_ARCHITECTURES.values() else None
        if arch is None:
            raise ConfigError(f"unsupported architecture {archs or raw.get('model_type')!r} (config.json's "
                              f"'architectures' / 'model_type'); supported: {sorted(SUPPORTED_ARCHITECTURES)}")
        if raw.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {raw['hidden_act']!r} is not supported (only silu)")
        if raw.get("use_sliding_window"):
            raise ConfigError("use_sliding_window=true (per-layer sliding windows) is not supported")
        try:
            num_heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            head_dim = int(raw.get("head_dim") or (hidden // num_heads if num_heads > 0 else 0))
            eos = raw.get("eos_token_id")
            eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [] if eos is None else [eos]))
            sliding = int(raw.get("sliding_window") or 0) if arch == "mistral" else 0
            return cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
                head_dim=head_dim,
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                rope=_parse_rope(raw),
                qkv_bias=arch == "qwen2" or bool(raw.get("attention_bias", False)),
                qk_norm=arch == "qwen3",
                sliding_window=sliding,
                eos_token_ids=eos_ids,
                bos_token_id=raw.get("bos_token_id"),
                torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
                fp8_layout=parse_layout(raw.get("quantization_config")),
            )
        except KeyError as e:
            raise ConfigError(f"config.json lacks {e.args[0]!r}") from e
        except (TypeError, ValueError) as e:  # a value of the wrong type ("64" parses; "abc" or null does not)
            raise ConfigError(f"config.json has a value the engine cannot use ({type(e).__name__}: {e})") from e


def _parse_rope(raw: dict) -> RopeConfig:
    """Both layouts: legacy `rope_theta` + `rope_scaling` and transformers 5's `rope_parameters`."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    merged = {**scaling, **params}
    rope_type = merged.get("rope_type") or merged.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"rope type {rope_type!r} is not supported; supported: {ROPE_TYPES}")
    theta = float(merged.get("rope_theta", raw.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if "factor" not in merged:
        raise ConfigError(f"rope type {rope_type!r} needs a 'factor'")
    orig = int(merged.get("original_max_position_embeddings") or raw.get("max_position_embeddings", 4096))
    factor = float(merged["factor"])
    if not math.isfinite(factor) or factor <= 0:
        raise ConfigError(f"rope factor must be > 0, got {factor}")
    return RopeConfig(
        rope_type=rope_type,
        theta=theta,
        factor=factor,
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=orig,
    )
