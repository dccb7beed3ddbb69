"""Engine: the front door of the model. One owner calls it at a time; nothing else touches the model, the KV
cache or the slot state.

Every call validates all of its input before it changes anything, so a refused call (an EngineError) leaves
every sequence, slot and block as it was. The work itself lives in one module per kind of step:
  prefill.py   Prefiller: chunked, bucketed prefill (CUDA graphs for short forwards)
  decode.py    DecodePipeline: decode steps launched behind the running one, finished or refused
  verify.py    Verifier: speculative drafts scored in one forward, rejected positions rolled back
and the parts they share (model, KV cache, slot state, op backend, graphs and streams) in runtime.py.

Under tensor parallelism every rank holds an Engine over its shard; the methods marked @mirrored are the calls
rank 0 broadcasts to the others before running them (engine/parallel.py): every call that changes engine state
or runs a forward."""
from __future__ import annotations

import dataclasses
import secrets

import numpy as np
import torch

from engine import api
from engine.config import EngineConfig
from engine.decode import DecodePipeline, PendingStep
from engine.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from engine.kv_events import KvEventLog
from engine.parallel import ParallelGroup, mirrored
from engine.prefill import Prefiller
from engine.prefix_cache import BlockPool, extra_key
from engine.quant import Fp8Weight
from engine.runtime import Runtime
from engine.scoring import Scorer
from engine.sampling import SamplingParams, StoppingCriteria
from engine.sequence import Sequence, SequenceTable, SlotTable
from engine.sequence_blocks import SequenceBlocks
from engine.verify import Verifier

VERSION = "0.1.0"


class Engine:
    def __init__(self, config: EngineConfig | None = None, parallel: ParallelGroup | None = None):
        """parallel: this process's tensor-parallel group (engine/parallel.py), None without one."""
        self.config = config = config or EngineConfig()
        self.parallel = parallel
        self.runtime = rt = Runtime.create(config, parallel)
        self.blocks = BlockPool(rt.kv.num_blocks, config.block_size, KvEventLog())
        # Prefix caching: off for dynamic NTK RoPE, whose K/V at a position depend on the sequence's length.
        self.prefix_caching = config.prefix_caching and not rt.dynamic_rope
        self._cache_extra = extra_key(kv_dtype=str(rt.dtype).removeprefix("torch."))
        self.slots = SlotTable(config.max_slots)
        self.sequences = SequenceTable(rt.vocab_size, config.max_batch_size)
        self.decoder = DecodePipeline(rt, self.sequences)
        self.prefiller = Prefiller(rt, self.sequences, self.decoder.num_top, self.decoder.counters)
        self.verifier = Verifier(rt, self.sequences, self.decoder.num_top)
        self.scorer = Scorer(rt, self.sequences, self.slots, self.blocks)

    # Read-only views of the runtime the worker and tools use.
    model_path = property(lambda self: self.runtime.model_path)
    model_config = property(lambda self: self.runtime.model_config)
    device = property(lambda self: self.runtime.device)
    dtype = property(lambda self: self.runtime.dtype)
    max_seq_len = property(lambda self: self.runtime.max_seq_len)
    block_size = property(lambda self: self.runtime.block_size)
    eos_token_ids = property(lambda self: self.runtime.eos_token_ids)

    # ------------------------------------------------------------------ sequences

    def alloc_sequence(self, max_total_tokens: int, sampling: SamplingParams, stopping: StoppingCriteria,
                       request_id: str = "", prefix_caching: bool = True) -> api.AllocResult:
        """Reserves a slot and the KV blocks of max_total_tokens tokens (prompt, new tokens and speculative
        lookahead), so a sequence never runs out of KV mid-generation. prefix_caching False: the sequence
        neither reuses nor registers cached blocks (scratch work such as warm-up)."""
        vocab = self.runtime.vocab_size
        if not 2 <= max_total_tokens <= self.max_seq_len:
            raise InvalidArgument(f"max_total_tokens must be in [2, {self.max_seq_len}] (a prompt token and a new "
                                  f"one at least; the limit is --max-seq-len), got {max_total_tokens}")
        sampling.validate(vocab, self.config.max_top_logprobs)
        stopping.validate(vocab)
        if sampling.seed is None:  # drawn here, before the call is mirrored: every rank samples alike
            sampling = dataclasses.replace(sampling, seed=secrets.randbits(64))
        return self._alloc_sequence(max_total_tokens, sampling, stopping, request_id, prefix_caching)

    @mirrored
    def _alloc_sequence(self, max_total_tokens: int, sampling: SamplingParams, stopping: StoppingCriteria,
                        request_id: str, prefix_caching: bool) -> api.AllocResult:
        block_size = self.block_size
        num_blocks = -(-max_total_tokens // block_size)
        self.check_fits(max_total_tokens)
        if not self.slots.can_allocate():
            raise ResourceExhausted(f"all {self.config.max_slots} sequence slots are in use (--max-slots)", busy=True)
        if not self.blocks.can_allocate(num_blocks):
            raise self._kv_exhausted(max_total_tokens, busy=True)
        # Blocks are reserved here and taken by the first prefill (after it matched the cached prefix); the slot's
        # device row is written then too: an upload from pageable memory here would wait for the steps in flight.
        blocks = SequenceBlocks(self.blocks, num_blocks, self._cache_extra,
                                caching=self.prefix_caching and prefix_caching)
        slot = self.slots.allocate()
        seq = Sequence(seq_id=self.sequences.new_id(), slot=slot, capacity=max_total_tokens, blocks=blocks,
                       sampling=sampling, stopping=stopping, request_id=request_id)
        self.sequences.add(seq)
        return api.AllocResult(seq.seq_id, slot, max_total_tokens)

    def check_fits(self, max_total_tokens: int) -> None:
        """ResourceExhausted (not busy: no wait helps) when max_total_tokens need more KV blocks than the whole cache
        holds; a reservation that fits an idle cache passes."""
        if -(-max_total_tokens // self.block_size) > self.blocks.num_usable_blocks:
            raise self._kv_exhausted(max_total_tokens, busy=False)

    def _kv_exhausted(self, max_total_tokens: int, busy: bool) -> ResourceExhausted:
        num_blocks = -(-max_total_tokens // self.block_size)
        return ResourceExhausted(
            f"{max_total_tokens} tokens need {num_blocks} KV blocks of {self.block_size} tokens; "
            f"{self.blocks.num_free_blocks} of {self.blocks.num_usable_blocks} are free (raise "
            f"--num-kv-blocks or --kv-cache-memory, or release sequences)", busy=busy)

    @mirrored
    def release(self, seq_ids: list[int]) -> int:
        seqs = self.sequences.check_ids(seq_ids, limit=False)
        if self.decoder.holds_any(seqs):
            self.decoder.finish_all()  # a slot is freed only after every step that writes it has finished
        self.decoder.forget_plan()
        for seq in seqs:
            seq.blocks.register(seq.token_ids, seq.num_final)  # what it computed stays cached for others
            seq.blocks.release()
            self.slots.free(seq.slot)
            self.sequences.remove(seq.seq_id)
        self.blocks.events.publish()
        return len(seqs)

    @mirrored
    def flush_cache(self) -> int:
        """Drops every cached block no sequence references (referenced ones stay cached: nothing a live
        sequence holds changes). Returns how many were dropped."""
        dropped = self.blocks.flush()
        self.blocks.events.publish()
        return dropped

    @mirrored
    def set_token_mask(self, seq_id: int, words: np.ndarray) -> None:
        """The allowed tokens of the next token a sequence allocated with sampling.token_mask samples (structured
        output): int32 [ceil(vocab / 32)], bit t % 32 of word t // 32 allowing token t (xgrammar's bitmask). Each
        Prefill that completes its prompt and each decode step of it needs one set just before; set it only once
        the steps that sampled its earlier tokens have finished. Queued on the device without a host wait."""
        seq = self.sequences.check_ids([seq_id], limit=False)[0]
        if not seq.sampling.token_mask:
            raise FailedPrecondition(f"sequence {seq_id} was not allocated to sample under a token mask")
        words = np.asarray(words)
        shape = (self.runtime.state.token_mask.shape[1],)
        if words.shape != shape or words.dtype != np.int32:
            raise InvalidArgument(f"a token mask is int32 {list(shape)} (a bit per token of the vocabulary of "
                                  f"{self.runtime.vocab_size}), got {words.dtype} {list(words.shape)}")
        with self.runtime.dispatch.compute_stream():
            self.runtime.state.set_token_mask(seq.slot, words)
        seq.mask_ready = True

    # ------------------------------------------------------------------ steps

    @mirrored
    def prefill(self, items: list[api.PrefillItem]) -> api.StepResult:
        seqs = self.sequences.check_ids([it.seq_id for it in items])
        packed = self.prefiller.check(seqs, items)
        self.decoder.finish_all()
        result = self.prefiller.prefill(seqs, items, packed)
        self.blocks.events.publish()
        return result

    @mirrored
    def register_prompts(self, max_blocks: int | None = None) -> int:
        """Registers the blocks of the prompts that earlier prefills completed (Prefiller.register_prompts; at most
        about max_blocks of them, None: all): the next prefill does it first anyway; a caller with idle time (the
        worker, once a Prefill's reply is on its way) does it sooner, so that the KV events go out. Returns how
        many blocks were newly cached."""
        stored = self.prefiller.register_prompts(max_blocks)
        self.blocks.events.publish()
        return stored

    @mirrored
    def decode(self, seq_ids: list[int], input_token_ids: list[int] | None = None) -> api.StepResult:
        """One decode step of seq_ids; waits for it (decode_launch, then finish)."""
        return self.finish(self.decode_launch(seq_ids, input_token_ids))

    @mirrored
    def decode_launch(self, seq_ids: list[int], input_token_ids: list[int] | None = None) -> PendingStep:
        """Validates a decode step and queues its device work without waiting for it (engine/decode.py);
        finish(step) returns its result or raises the error that refused it."""
        return self.decoder.launch(seq_ids, input_token_ids)

    @mirrored
    def finish(self, step: PendingStep) -> api.StepResult:
        try:
            return self.decoder.finish(step)
        finally:
            self.blocks.events.publish()  # the blocks its tokens filled (see DecodePipeline._register)

    def step_ready(self, step: PendingStep) -> bool:
        """Whether finish(step) would not wait for the device (its device work has ended)."""
        return step.done or step.ready()

    @property
    def num_in_flight(self) -> int:
        """Decode steps launched and not yet finished."""
        return len(self.decoder.in_flight)

    @mirrored
    def verify(self, items: list[api.VerifyItem]) -> api.VerifyStepResult:
        seqs = self.sequences.check_ids([it.seq_id for it in items])
        self.decoder.finish_all()  # its checks need every sequence's committed state
        result = self.verifier.verify(seqs, items)
        self.blocks.events.publish()
        return result

    @mirrored
    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Teacher-forced log-softmax rows [len(token_ids), vocab] (fp32, CPU) of a token sequence that is no
        live sequence (engine/scoring.py): row i scores the token after token_ids[:i + 1]."""
        self.decoder.finish_all()
        return self.scorer.score(token_ids)

    @mirrored
    def embed(self, token_ids: list[int]) -> torch.Tensor:
        """The embedding of a token sequence that is no live sequence: its last token's final-normed hidden state,
        L2-normalized, [hidden] fp32 on the CPU (engine/scoring.py; a forward of its own, no prefix cache)."""
        self.decoder.finish_all()
        return self.scorer.embed(token_ids)

    @mirrored
    def prompt_logprobs(self, token_ids: list[int], num_top: int = 0) -> api.PromptLogprobs:
        """vLLM's prompt_logprobs of a token sequence that is no live sequence: each token's log-probability
        after the ones before it (from the second token on) and the num_top (<= max_top_logprobs) most likely
        tokens there, from the raw logits (engine/scoring.py; a forward of its own, no prefix cache)."""
        if not 0 <= num_top <= self.config.max_top_logprobs:
            raise InvalidArgument(f"prompt logprobs: the top alternatives must be 0 to {self.config.max_top_logprobs} "
                                  f"(--max-top-logprobs), got {num_top}")
        self.decoder.finish_all()
        return self.scorer.prompt_logprobs(token_ids, num_top)

    # ------------------------------------------------------------------ state

    def info(self) -> api.EngineInfo:
        """Counters only (free-list lengths, graph statistics): safe to read from a scrape thread mid-step."""
        rt, mc = self.runtime, self.model_config
        graphs = rt.dispatch.graphs
        return api.EngineInfo(
            model_id=self.config.served_model_name or rt.model_path.name, architecture=mc.architecture,
            dtype=str(rt.dtype).removeprefix("torch."),
            device=str(rt.device), vocab_size=mc.vocab_size, eos_token_ids=sorted(rt.eos_token_ids),
            max_seq_len=rt.max_seq_len, block_size=rt.block_size, total_blocks=self.blocks.num_usable_blocks,
            free_blocks=self.blocks.num_free_blocks, max_slots=self.config.max_slots,
            free_slots=self.slots.num_free_slots, max_batch_size=self.config.max_batch_size,
            live_sequences=len(self.sequences), kernel_backend=rt.ops.name, version=VERSION,
            steps_in_flight=len(self.decoder.in_flight), refused_steps=self.decoder.refused_steps,
            graph_cache=dataclasses.replace(graphs.stats) if graphs is not None else api.GraphStats(),
            prefix_cache=self._prefix_cache_stats(), quantization=rt.quantization,
            quantized_lm_head=isinstance(rt.weights.lm_head, Fp8Weight), fp8_weight_block=rt.fp8_weight_block,
            checkpoint_quantization=mc.fp8_layout.description if mc.fp8_layout else "",
            fp8_activation_scheme=rt.fp8_activation_scheme, fp8_skipped_layers=rt.fp8_skipped_layers,
            kv_cache_dtype=str(rt.kv.k.dtype).removeprefix("torch."), tensor_parallel_size=rt.shard.size,
            steps=dataclasses.replace(self.decoder.counters))

    def _prefix_cache_stats(self) -> api.PrefixCacheStats:
        pool, s = self.blocks, self.blocks.stats
        return api.PrefixCacheStats(self.prefix_caching, pool.num_cached_blocks, pool.num_evictable_blocks, s.queries,
                                    s.query_tokens, s.hit_tokens, s.stored_blocks, s.evicted_blocks, s.flushed_blocks,
                                    pool.events.last_sequence_number)

    def close(self) -> None:
        """Waits for the device, drops every step and sequence, then the buffers and streams (pinned buffers
        torch copied into on the compute stream go before the stream). On rank 0 of a tensor-parallel group,
        the other ranks are told to close theirs first."""
        if self.parallel is not None:
            self.parallel.stop_followers()
        self.runtime.dispatch.synchronize()  # launched steps end before their buffers go; nobody finishes them
        self.decoder.clear()
        self.sequences.clear()
        self.verifier.outputs.drop_hosts()
        self.prefiller.staging = None
        self.runtime.close()
        if self.parallel is not None:
            self.parallel.close()
