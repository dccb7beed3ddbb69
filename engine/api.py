"""The engine's request and result types (plain data; worker/convert.py maps them to protobuf)."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.sequence import FinishReason


@dataclass(frozen=True)
class PrefillItem:
    seq_id: int
    token_ids: list[int]
    partial: bool = False


@dataclass(frozen=True)
class VerifyItem:
    seq_id: int
    draft_token_ids: list[int]
    draft_probs: list[float] | None = None  # row-major [len(draft_token_ids), vocab] or None


@dataclass
class TokenResult:
    seq_id: int
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]]
    finish_reason: FinishReason
    seq_len: int
    cached_tokens: int = 0  # a prompt's first token only: how many prompt tokens came from the prefix cache


@dataclass
class StepResult:
    tokens: list[TokenResult]
    forward_ns: int


@dataclass
class VerifyResult:
    seq_id: int
    num_accepted: int
    tokens: list[TokenResult]


@dataclass
class VerifyStepResult:
    results: list[VerifyResult]
    forward_ns: int


@dataclass
class AllocResult:
    seq_id: int
    slot: int
    reserved_tokens: int


@dataclass
class GraphStats:
    hits: int = 0
    misses: int = 0
    captures: int = 0
    evictions: int = 0
    capture_failures: int = 0
    capture_seconds: float = 0.0
    graphs_held: int = 0
    pool_bytes: int = 0
    fallbacks: int = 0  # steps whose own key had no graph, run through the batch-width fallback key


@dataclass
class PrefixCacheStats:
    enabled: bool = False
    cached_blocks: int = 0  # blocks with a hash (referenced or evictable)
    evictable_blocks: int = 0  # cached blocks no sequence references (counted in free_blocks too)
    queries: int = 0  # prompts looked up (once per prompt, when it completes)
    query_tokens: int = 0
    hit_tokens: int = 0  # prompt tokens taken from the cache instead of computed
    stored_blocks: int = 0
    evicted_blocks: int = 0
    flushed_blocks: int = 0
    last_event_batch: int = 0  # KV event batches published so far


@dataclass
class PromptLogprobs:
    """A prompt's teacher-forced log-probabilities (Engine.prompt_logprobs), for its tokens from the second on:
    values[i] is token i + 1's, and top_ids[i] / top_values[i] the most likely tokens there, best first."""
    values: list[float]
    top_ids: list[list[int]]
    top_values: list[list[float]]


@dataclass
class StepCounters:
    """Work done since start: what a load test divides by its wall time (steps per second, sequences per step,
    the device's busy share)."""
    decode_steps: int = 0  # decode steps finished (refused ones not counted)
    decode_sequences: int = 0  # their sequences, summed (sequences / steps: the mean batch)
    decode_device_ns: int = 0  # their device time, summed
    prefill_calls: int = 0
    prefill_tokens: int = 0  # prompt tokens computed (cached ones not counted)
    prefill_device_ns: int = 0


@dataclass
class EngineInfo:
    model_id: str
    architecture: str
    dtype: str
    device: str
    vocab_size: int
    eos_token_ids: list[int]
    max_seq_len: int
    block_size: int
    total_blocks: int
    free_blocks: int
    max_slots: int
    free_slots: int
    max_batch_size: int
    live_sequences: int
    kernel_backend: str
    version: str
    graph_cache: GraphStats = field(default_factory=GraphStats)
    steps_in_flight: int = 0  # decode steps launched and not yet finished
    refused_steps: int = 0  # launched decode steps refused because an earlier step ended one of their sequences
    prefix_cache: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    quantization: str = "none"  # of the projection weights: none | fp8 (EngineConfig.quantization)
    quantized_lm_head: bool = False  # whether the LM head is quantized as well
    fp8_weight_block: str = ""  # with fp8: "channel" or "RxC" (EngineConfig.fp8_weight_block); "" with none
    checkpoint_quantization: str = ""  # an FP8 checkpoint's layout (Fp8Layout.description); "" for 16/32-bit
    fp8_activation_scheme: str = ""  # with fp8: "dynamic" (W8A8 above 8 rows) or "none" (weight-only); "" with none
    fp8_skipped_layers: list[int] = field(default_factory=list)  # layers whose projections stay unquantized
    kv_cache_dtype: str = ""  # the KV cache's element type: the model dtype's name, or "float8_e4m3fn"
    tensor_parallel_size: int = 1  # processes (GPUs) the model is split over (EngineConfig.tensor_parallel_size)
    steps: StepCounters = field(default_factory=StepCounters)
