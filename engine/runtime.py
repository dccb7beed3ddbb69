"""Runtime: the parts every kind of step uses, built once when the engine starts.

The model and its weights, the paged KV cache, the per-slot device state, the op backend, where steps run
(StepDispatch: the compute stream, step timers, CUDA graphs) and where decode and prefill steps leave their
results for the host (StepOutputs). Prefill, decode and verify (engine/prefill.py, decode.py, verify.py)
each own their step's logic and its own buffers; they share these parts through one Runtime."""
from __future__ import annotations

import logging
import pathlib
import time
from dataclasses import dataclass

import torch

from engine import env
from engine.config import EngineConfig, ModelConfig
from engine.default_model import resolve_model_dir
from engine.device import select_device, select_dtype
from engine.cuda.dispatch import StepDispatch
from engine.errors import ConfigError
from engine.fp8_checkpoint import resolve_activation_scheme
from engine.kv_cache import KVCache
from engine.loader import QUANTIZED_FIELDS, load_weights, weight_bytes
from engine.models.llama import LlamaModel, ModelWeights
from engine.ops.torch_ops import TorchOps
from engine.outputs import StepOutputs
from engine.parallel import Collectives, ParallelGroup
from engine.quant import FP8_DTYPE, FP8_MIN_CAPABILITY, WEIGHT_ONLY, Fp8Weight, check_device
from engine.shard import ShardPlan
from engine.state import SlotState

log = logging.getLogger(__name__)
CPU_KV_BUDGET_BYTES = 256 << 20  # what a kv_cache_memory fraction is a fraction of, on CPU


@dataclass
class Runtime:
    config: EngineConfig
    model_path: pathlib.Path
    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    max_seq_len: int
    weights: ModelWeights
    kv: KVCache
    state: SlotState
    ops: TorchOps  # TorchOps, or CudaOps (a subclass) on a GPU
    model: LlamaModel
    dispatch: StepDispatch
    outputs: StepOutputs
    eos_token_ids: frozenset[int]
    shard: ShardPlan  # what this rank holds (everything without tensor parallelism)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def dynamic_rope(self) -> bool:
        """Dynamic NTK RoPE: every token's rotation depends on its sequence's length (no CUDA graphs)."""
        return self.model_config.rope.rope_type == "dynamic"

    @property
    def quantization(self) -> str:
        """What the projection weights are: "fp8" (quantized at load, or an FP8 checkpoint's own) or "none"."""
        return "fp8" if self.model_config.fp8_layout or self.config.quantization == "fp8" else "none"

    @property
    def fp8_weight_block(self) -> str:
        """The projections' FP8 scale blocks ("channel" or "RxC", EngineConfig.fp8_weight_block's spelling): an
        FP8 checkpoint's, else --fp8-weight-block's; "" without FP8."""
        layout = self.model_config.fp8_layout
        return layout.fp8_weight_block if layout else self.config.fp8_weight_block if self.quantization == "fp8" else ""

    @property
    def fp8_activation_scheme(self) -> str:
        """What the FP8 projections do with their activations ("dynamic": W8A8 above 8 rows, or "none": weight-only;
        EngineConfig.fp8_activation_scheme's spelling, engine/fp8_checkpoint.py resolve_activation_scheme); "" without
        FP8."""
        if self.quantization != "fp8":
            return ""
        return resolve_activation_scheme(self.config.fp8_activation_scheme, self.model_config.fp8_layout)

    @property
    def fp8_skipped_layers(self) -> list[int]:
        """With FP8 projections, the decoder layers none of whose projections is FP8 (--fp8-skip-layers, or an FP8
        checkpoint's ignore list); [] without FP8."""
        if self.quantization != "fp8":
            return []
        return [i for i, layer in enumerate(self.weights.layers)
                if not any(isinstance(getattr(layer, n), Fp8Weight) for n in QUANTIZED_FIELDS)]

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_seq_len // self.block_size)

    @classmethod
    def create(cls, config: EngineConfig, parallel: ParallelGroup | None = None) -> "Runtime":
        """Loads the checkpoint onto the device, sizes and allocates the KV cache, and starts the op backend.
        parallel: this rank's tensor-parallel group; it loads only its shard (engine/shard.py), and every rank
        takes the smallest KV block count of all. Raises ConfigError naming what cannot run (a METRALE_ variable set
        to a value it does not take too: env.check)."""
        env.check()
        model_path = resolve_model_dir(config.model)  # the default model, a directory, or a .gguf's conversion
        mc = ModelConfig.from_dir(model_path)
        device = select_device(config)
        dtype = select_dtype(config, mc, device)
        check_device("fp8" if mc.fp8_layout else config.quantization, device,
                     mc.fp8_layout.description if mc.fp8_layout else "")
        if config.fp8_activation_scheme == WEIGHT_ONLY and config.quantization != "fp8" and not mc.fp8_layout:
            raise ConfigError(f"fp8_activation_scheme none needs FP8 weights (--quantization fp8, or an FP8 "
                              f"checkpoint: config.json's quantization_config); {model_path} holds {mc.torch_dtype} "
                              f"weights")
        kv_dtype = kv_cache_dtype(config, dtype, device)
        max_seq_len = config.max_seq_len or mc.max_position_embeddings
        t0 = time.perf_counter()
        shard = ShardPlan(mc, parallel.rank, parallel.size) if parallel else ShardPlan(mc)
        weights = load_weights(model_path, mc, dtype, device, config.quantization, config.quantize_lm_head,
                               config.fp8_block, shard if shard.size > 1 else None, config.fp8_activation_scheme,
                               config.fp8_skipped_layers(mc.num_layers))
        num_blocks = _num_kv_blocks(config, mc, kv_dtype, device, shard.num_kv_heads)
        if parallel is not None:  # block ids are the same on every rank: the smallest cache of all
            num_blocks = parallel.min_int(num_blocks)
            parallel.collectives = Collectives(shard.size, shard.vocab_widths)
        kv = _allocate_kv(config, mc, kv_dtype, device, num_blocks, shard.num_kv_heads)
        max_blocks = -(-max_seq_len // config.block_size)
        state = SlotState(config.max_slots, max_blocks, mc.vocab_size, device, mc.eos_token_ids, max_seq_len)
        ops, streams = _backend(config, device, max_seq_len)
        graphs = None
        if streams is not None and config.cuda_graphs and mc.rope.rope_type != "dynamic":
            from engine.cuda.graphs import GraphCache, TorchGraphBackend

            graphs = GraphCache(TorchGraphBackend(streams), config.max_graphs, config.capture_after)
        dispatch = StepDispatch(device, streams, graphs, config.max_batch_size, config.max_steps_in_flight,
                                config.fallback_graphs)
        model = LlamaModel(mc, weights, kv, ops, max_seq_len + 1, shard,
                           parallel.collectives if parallel is not None and shard.size > 1 else None)
        outputs = StepOutputs(config.max_batch_size, config.max_top_logprobs, config.max_slots, device,
                              config.max_steps_in_flight)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # all set-up writes (default stream) land before any step
        rt = cls(config, model_path, mc, device, dtype, max_seq_len, weights, kv, state, ops, model, dispatch,
                 outputs, frozenset(mc.eos_token_ids), shard)
        log.info("loaded %s (%s, %d layers, %.1f MB) on %s as %s (quantization %s%s) in %.1fs; KV cache %d blocks "
                 "x %d tokens (%.1f MB)", model_path, mc.architecture, mc.num_layers, weight_bytes(weights) / 1e6,
                 device, dtype, rt.quantization, (f", {rt.fp8_weight_block} blocks, activation scheme "
                                                  f"{rt.fp8_activation_scheme}" if rt.fp8_weight_block else "")
                 + (f", from a {mc.fp8_layout.description} checkpoint" if mc.fp8_layout else "")
                 + (", LM head too" if isinstance(weights.lm_head, Fp8Weight) else ""),
                 time.perf_counter() - t0, kv.num_blocks, config.block_size, kv.nbytes / 1e6)
        return rt

    def close(self) -> None:
        self.dispatch.close(self.outputs)


def _backend(config: EngineConfig, device: torch.device, max_seq_len: int):
    """(ops, streams): the kernels on the engine's own streams on a GPU, the torch reference ops on CPU (or
    on a GPU with kernels=torch: eager, default stream)."""
    if device.type != "cuda" or config.kernels == "torch":
        return TorchOps(), None
    from engine.cuda.ops import CudaOps
    from engine.cuda.streams import EngineStreams

    ops = CudaOps.create(device, max_seq_len)
    streams = EngineStreams(device, timers=1 + config.max_steps_in_flight)
    torch.cuda.synchronize(device)  # weights and KV written on the default stream are ready
    return ops, streams


def kv_cache_dtype(config: EngineConfig, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's dtype: the model's, or E4M3 with --kv-cache-dtype fp8. On a GPU the CUDA kernels read and
    write an E4M3 cache (their _kvfp8 entries) from compute capability 8.9 on (Ada, Hopper: the GPUs with FP8, as
    --quantization fp8 needs); an older GPU serves it only with --kernels torch."""
    if config.kv_cache_dtype != "fp8":
        return dtype
    if device.type == "cuda" and config.kernels != "torch":
        capability = torch.cuda.get_device_capability(device)
        if capability < FP8_MIN_CAPABILITY:
            raise ConfigError(f"--kv-cache-dtype fp8 needs a GPU with FP8 support (compute capability >= "
                              f"{FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]}: Ada or Hopper) for the CUDA kernels; "
                              f"{device} ({torch.cuda.get_device_name(device)}) has {capability[0]}.{capability[1]}: "
                              f"use --kv-cache-dtype auto, or --kernels torch")
    return FP8_DTYPE


def _allocate_kv(config: EngineConfig, mc: ModelConfig, dtype: torch.dtype, device: torch.device, num_blocks: int,
                 num_kv_heads: int) -> KVCache:
    """num_kv_heads: the KV heads this rank holds (mc.num_kv_heads without tensor parallelism)."""
    try:
        return KVCache(mc.num_layers, num_blocks, config.block_size, num_kv_heads, mc.head_dim, dtype, device)
    except (torch.OutOfMemoryError, RuntimeError) as e:
        need = num_blocks * KVCache.bytes_per_block(mc.num_layers, config.block_size, num_kv_heads, mc.head_dim,
                                                    dtype)
        raise ConfigError(f"the KV cache ({num_blocks} blocks of {config.block_size} tokens, {need / 2**30:.2f} GiB; "
                          f"--num-kv-blocks {config.num_kv_blocks}, --kv-cache-memory {config.kv_cache_memory}) does "
                          f"not fit in {device} memory after the weights; lower --num-kv-blocks or --kv-cache-memory "
                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e


def _num_kv_blocks(config: EngineConfig, mc: ModelConfig, dtype: torch.dtype, device: torch.device,
                   num_kv_heads: int) -> int:
    if config.num_kv_blocks:
        return config.num_kv_blocks
    per_block = KVCache.bytes_per_block(mc.num_layers, config.block_size, num_kv_heads, mc.head_dim, dtype)
    if config.kv_cache_memory > 1:
        budget = config.kv_cache_memory * (1 << 30)
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = config.kv_cache_memory * free
    else:
        budget = config.kv_cache_memory * CPU_KV_BUDGET_BYTES
    num_blocks = int(budget // per_block)
    if num_blocks < 2:
        raise ConfigError(f"the KV cache budget ({budget / 1e6:.1f} MB from --kv-cache-memory "
                          f"{config.kv_cache_memory}) holds fewer than 2 blocks of {per_block} bytes; raise "
                          f"--kv-cache-memory, set --num-kv-blocks, or lower --block-size")
    return num_blocks
