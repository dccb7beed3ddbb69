"""Engine: the only public face of the model. One thread calls it; nothing else touches the model,
the KV cache or the slot state.

Every call validates all of its input before it changes anything, so a refused call (an EngineError)
leaves every sequence, slot and block as it was.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import pathlib
import secrets
import time
from typing import Callable

import torch

from engine import api
from engine.batch import PrefillStaging, build_extend_batch, build_staged_prefill_batch
from engine.config import EngineConfig, ModelConfig
from engine.default_model import default_model_dir
from engine.device import select_device, select_dtype
from engine.errors import (ConfigError, EngineError, FailedPrecondition, InvalidArgument, NotFound,
                           ResourceExhausted)
from engine.kv_cache import BlockAllocator, KVCache
from engine.loader import load_weights, weight_bytes
from engine.models.llama import LlamaModel
from engine.outputs import SlotStaging, StepOutputs, VerifyOutputs
from engine.ops.torch_ops import TorchOps
from engine.sampling import SampleOutput, SamplingParams, StoppingCriteria, model_logprobs, target_logprobs
from engine.cuda.graphs import GraphCache
from engine.sequence import FinishReason, Sequence, SlotTable
from engine.state import SlotState

log = logging.getLogger(__name__)
VERSION = "0.1.0"
CPU_KV_BUDGET_BYTES = 256 << 20  # what a kv_cache_memory fraction is a fraction of, on CPU
# Prefill forwards of at most this many (padded) tokens over at most PREFILL_GRAPH_SEQS sequences replay
# CUDA graphs: a short prompt's forward is bound by its ~200-300 launches (bench/profile_step.py --only
# ttft); from ~1k tokens on at 1B the device time hides them.
PREFILL_GRAPH_TOKENS = 1024
PREFILL_GRAPH_SEQS = 16


class Engine:
    def __init__(self, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        self.model_path = pathlib.Path(config.model) if config.model else default_model_dir()
        self.model_config = mc = ModelConfig.from_dir(self.model_path)
        self.device = select_device(config)
        self.dtype = select_dtype(config, mc, self.device)
        self.max_seq_len = config.max_seq_len or mc.max_position_embeddings
        self.block_size = config.block_size
        self.max_blocks_per_seq = -(-self.max_seq_len // self.block_size)
        t0 = time.perf_counter()
        self.weights = load_weights(self.model_path, mc, self.dtype, self.device)
        num_blocks = self._num_kv_blocks()
        try:
            self.kv = KVCache(mc.num_layers, num_blocks, self.block_size, mc.num_kv_heads, mc.head_dim, self.dtype,
                              self.device)
        except (torch.OutOfMemoryError, RuntimeError) as e:
            need = num_blocks * KVCache.bytes_per_block(mc.num_layers, self.block_size, mc.num_kv_heads, mc.head_dim,
                                                        self.dtype)
            raise ConfigError(f"the KV cache ({num_blocks} blocks, {need / 2**30:.2f} GiB) does not fit in "
                              f"{self.device} memory after the weights; lower num_kv_blocks or kv_cache_memory "
                              f"({type(e).__name__}: {str(e).splitlines()[0]})") from e
        self.blocks = BlockAllocator(num_blocks)
        self.slots = SlotTable(config.max_slots)
        self.state = SlotState(config.max_slots, self.max_blocks_per_seq, mc.vocab_size, self.device)
        self.ops, self.streams, self.graphs = self._backend()
        self.model = LlamaModel(mc, self.weights, self.kv, self.ops, self.max_seq_len + 1)
        self.outputs = StepOutputs(config.max_batch_size, config.max_top_logprobs, config.max_slots, self.device,
                                   config.max_steps_in_flight)
        self._slot_staging = SlotStaging(config.max_batch_size, self.device, config.max_steps_in_flight)
        self._prefill_staging = PrefillStaging(min(PREFILL_GRAPH_TOKENS, config.max_prefill_tokens),
                                               min(PREFILL_GRAPH_SEQS, config.max_batch_size), self.device)
        # The logits a replayed prefill forward writes (outside the graph pool), one row per sequence row.
        self._prefill_logits = torch.empty((self._prefill_staging.max_seqs, mc.vocab_size), dtype=torch.float32,
                                           device=self.device)
        self.verify_outputs = VerifyOutputs(config.max_batch_size, config.max_draft_tokens, config.max_top_logprobs,
                                            self.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # all set-up writes (default stream) land before any step
        self.eos_token_ids = frozenset(mc.eos_token_ids)
        self.sequences: dict[int, Sequence] = {}
        self._next_seq_id = 1
        self._in_flight: collections.deque[PendingStep] = collections.deque()  # launched, not finished; oldest first
        self._next_ring = 0  # the pinned buffers and timer the next launched step uses (of max_steps_in_flight)
        self._refused_steps = 0  # launched steps refused because an earlier step ended one of their sequences
        self._last_plan: BatchPlan | None = None  # the last decode batch's (see _batch_plan)
        log.info("loaded %s (%s, %d layers, %.1f MB) on %s as %s in %.1fs; KV cache %d blocks x %d tokens "
                 "(%.1f MB)", self.model_path, mc.architecture, mc.num_layers, weight_bytes(self.weights) / 1e6,
                 self.device, self.dtype, time.perf_counter() - t0, num_blocks, self.block_size,
                 self.kv.nbytes / 1e6)

    def _backend(self):
        """(ops, streams, graph cache): the kernels on the engine's own streams on a GPU, torch ops on CPU."""
        if self.device.type != "cuda":
            return TorchOps(), None, None
        if self.config.kernels == "torch":
            return TorchOps(), None, None  # the reference ops on the GPU (eager, default stream)
        from engine.cuda.graphs import TorchGraphBackend
        from engine.cuda.ops import CudaOps
        from engine.cuda.streams import EngineStreams

        ops = CudaOps.create(self.device, self.max_seq_len)
        streams = EngineStreams(self.device, timers=1 + self.config.max_steps_in_flight)
        torch.cuda.synchronize(self.device)  # weights and KV written on the default stream are ready
        graphs = None
        if self.config.cuda_graphs and self.model_config.rope.rope_type != "dynamic":
            graphs = GraphCache(TorchGraphBackend(streams), self.config.max_graphs, self.config.capture_after)
        return ops, streams, graphs

    @contextlib.contextmanager
    def _on_device(self, timer: int = 0, torch_stream: bool = True):
        """Runs device work on the engine's compute stream (GPU) and times it: yields a timer whose
        elapsed_ns() is the device time of the work in the block. timer: which of the streams' timers
        (0 for work the host waits for at once, 1 + ring for a launched decode step). torch_stream=False
        leaves torch's current stream alone (switching it costs ~10 us of host time each way): for a
        block whose work is driver calls on the compute stream, or wrapped in _compute_stream itself."""
        if self.streams is None:
            timer = _HostTimer()
            yield timer
            timer.stop()
            return
        if not torch_stream:
            with self.streams.timed(timer) as timing:
                yield timing
            return
        with self.streams.compute_context(), self.streams.timed(timer) as timing:
            yield timing

    def _compute_stream(self):
        """`with self._compute_stream():` torch ops and kernel launches in the block go to the compute
        stream (a GPU), or run at once (CPU)."""
        return self.streams.compute_context() if self.streams is not None else contextlib.nullcontext()

    def _num_kv_blocks(self) -> int:
        cfg, mc = self.config, self.model_config
        if cfg.num_kv_blocks:
            return cfg.num_kv_blocks
        per_block = KVCache.bytes_per_block(mc.num_layers, self.block_size, mc.num_kv_heads, mc.head_dim, self.dtype)
        if cfg.kv_cache_memory > 1:
            budget = cfg.kv_cache_memory * (1 << 30)
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = cfg.kv_cache_memory * free
        else:
            budget = cfg.kv_cache_memory * CPU_KV_BUDGET_BYTES
        num_blocks = int(budget // per_block)
        if num_blocks < 2:
            raise ConfigError(f"the KV cache budget ({budget / 1e6:.1f} MB) holds fewer than 2 blocks of "
                              f"{per_block} bytes; raise kv_cache_memory or lower block_size")
        return num_blocks

    # ---------------------------------------------------------------------------------------------
    # Sequences

    def alloc_sequence(self, max_total_tokens: int, sampling: SamplingParams, stopping: StoppingCriteria,
                       request_id: str = "") -> api.AllocResult:
        vocab = self.model_config.vocab_size
        if not 2 <= max_total_tokens <= self.max_seq_len:
            raise InvalidArgument(f"max_total_tokens must be in [2, {self.max_seq_len}] (a prompt token and a "
                                  f"new one at least), got {max_total_tokens}")
        sampling.validate(vocab, self.config.max_top_logprobs)
        stopping.validate(vocab)
        num_blocks = -(-max_total_tokens // self.block_size)
        if not self.slots.can_allocate():
            raise ResourceExhausted(f"all {self.config.max_slots} sequence slots are in use")
        if not self.blocks.can_allocate(num_blocks):
            raise ResourceExhausted(f"{max_total_tokens} tokens need {num_blocks} KV blocks; "
                                    f"{self.blocks.num_free_blocks} of {self.blocks.num_usable_blocks} are free")
        if sampling.seed is None:
            sampling = dataclasses.replace(sampling, seed=secrets.randbits(64))
        slot = self.slots.allocate()
        block_ids = self.blocks.allocate(num_blocks)
        # The slot's device row is written by the first prefill: an upload from pageable memory here
        # would wait for the decode steps in flight.
        seq = Sequence(seq_id=self._next_seq_id, slot=slot, capacity=max_total_tokens, block_ids=block_ids,
                       sampling=sampling, stopping=stopping, request_id=request_id)
        self._next_seq_id += 1
        self.sequences[seq.seq_id] = seq
        return api.AllocResult(seq.seq_id, slot, max_total_tokens)

    def release(self, seq_ids: list[int]) -> int:
        seqs = self._check_ids(seq_ids, limit=False)
        if any(seq in step.seqs for step in self._in_flight for seq in seqs):
            self._finish_in_flight()  # a slot is freed only after every step that writes it has finished
        self._last_plan = None
        for seq in [self.sequences[i] for i in seq_ids]:
            self.blocks.free(seq.block_ids)
            self.slots.free(seq.slot)
            del self.sequences[seq.seq_id]
        return len(seq_ids)

    # ---------------------------------------------------------------------------------------------
    # Steps

    def prefill(self, items: list[api.PrefillItem]) -> api.StepResult:
        seqs = self._check_ids([it.seq_id for it in items])
        for seq, it in zip(seqs, items):
            if seq.prompt_done:
                raise FailedPrecondition(f"sequence {seq.seq_id}: the prompt is already complete")
            self._check_tokens(it.token_ids, f"sequence {seq.seq_id} token_ids")
            total = seq.seq_len + len(it.token_ids)
            if total == 0:
                raise InvalidArgument(f"sequence {seq.seq_id}: the prompt is empty")
            if total >= seq.capacity:
                raise InvalidArgument(f"sequence {seq.seq_id}: a prompt of {total} tokens leaves no room for a new "
                                      f"token in max_total_tokens={seq.capacity}")
        self._finish_in_flight()
        with self._on_device() as timer:
            for seq in seqs:
                if not seq.token_ids:  # its first chunk: the slot's device row starts here
                    self.state.assign(seq.slot, seq.block_ids, seq.sampling)
            sampled = self._prefill(seqs, items)
        tokens = [sampled[it.seq_id] for it in items if not it.partial]
        return api.StepResult(tokens, timer.elapsed_ns())

    def _prefill(self, seqs: list[Sequence], items: list[api.PrefillItem]) -> dict[int, api.TokenResult]:
        for seq, it in zip(seqs, items):
            seq.token_ids.extend(it.token_ids)
            if not it.partial and seq.num_cached == seq.seq_len:
                seq.num_cached -= 1  # an empty final chunk: recompute the last prompt token for its logits
        completes = {seq.seq_id: not it.partial for seq, it in zip(seqs, items)}
        sampled: dict[int, api.TokenResult] = {}
        while True:  # forwards of at most max_prefill_tokens tokens, several sequences each
            queue = [s for s in seqs if not s.prompt_done and s.seq_len > s.num_cached]
            if not queue:
                break
            budget, chunk = self.config.max_prefill_tokens, []
            for seq in queue[:self.config.max_batch_size]:
                n = min(seq.seq_len - seq.num_cached, budget)
                if n == 0:
                    break
                budget -= n
                chunk.append((seq, n, completes[seq.seq_id] and seq.num_cached + n == seq.seq_len))
            sampled.update(self._prefill_forward(chunk))
        return sampled

    def _prefill_forward(self, chunk: list[tuple[Sequence, int, bool]]) -> dict[int, api.TokenResult]:
        """One forward over chunk = [(sequence, tokens to compute, whether its prompt completes)]; samples
        the first new token of each completing sequence. The forward is padded to a bucketed token
        count (CudaOps.prefill_tokens); a small one replays the CUDA graph of its padded shape."""
        num_tokens = self.ops.prefill_tokens(sum(n for _, n, _ in chunk))
        slots, starts = [s.slot for s, _, _ in chunk], [s.num_cached for s, _, _ in chunk]
        tokens = [s.token_ids[s.num_cached:s.num_cached + n] for s, n, _ in chunk]
        logits_rows = [[n - 1] if last else [] for _, n, last in chunk]
        staging = self._prefill_staging
        graphed = self.graphs is not None and num_tokens <= staging.max_tokens and len(chunk) <= staging.max_seqs
        if graphed:
            num_seqs = 1 << (len(chunk) - 1).bit_length()  # sequence rows, padded to a power of two
            token_slots, input_ids, make_batch = build_staged_prefill_batch(
                staging, self.state.block_table, [s.block_ids for s, _, _ in chunk], slots, starts, tokens,
                logits_rows, self.block_size, num_tokens, num_seqs)
        else:
            batch = build_extend_batch(self.state.block_table, slots, starts, tokens, logits_rows, self.block_size,
                                       self.device, self._dynamic_rope, num_padded=num_tokens)
            token_slots, input_ids = batch.token_slots, batch.input_ids[:batch.token_slots.shape[0]]
        # The prompt counts for repetition penalty (real tokens only: pads come after them).
        self.state.mark_seen(token_slots, input_ids)
        to_sample = [seq for seq, _, last in chunk if last]
        if to_sample:  # uploaded before the forward is queued: a blocking copy would wait for all of it
            sample_slots, positions = torch.tensor([[s.slot for s in to_sample], [s.seq_len for s in to_sample]],
                                                   device=self.device)
        if graphed:
            logits_out = self._prefill_logits

            def prepare():
                return lambda: logits_out[:num_seqs].copy_(self.model.forward(make_batch()))

            # Padded shapes recur (a few dozen in all): captured the second time one runs. The first run,
            # eager, loads the kernels and lets cuBLAS pick its own, which must not happen in a capture
            # (a prefill shape captured first time invalidated the capture on the H200).
            self.graphs.run(("prefill", num_tokens, num_seqs), prepare, capture_after=2)
            logits = logits_out[:len(to_sample)]
        else:
            logits = self.model.forward(batch)
        for seq, n, _ in chunk:
            seq.num_cached += n
        if not to_sample:
            return {}
        num_top = self._num_top(to_sample)
        out = self.ops.sample(logits, self.state.sampling_rows(sample_slots, positions), num_top)
        for seq in to_sample:
            seq.prompt_len = seq.seq_len
        self.state.num_cached[sample_slots] = positions.to(torch.int32)
        self.state.last_token[sample_slots] = out.token_ids
        self.state.mark_seen(sample_slots, out.token_ids)
        self.outputs.write(out, num_top)
        host = self.outputs.read(len(to_sample), num_top, self.streams)
        return {r.seq_id: r for r in self._commit(to_sample, *host)}

    def warm_up_prefill(self) -> int:
        """One prefill forward at each padded token count the backend runs prompts at (a few dozen on
        a GPU, CudaOps.prefill_tokens), so no request pays a shape's first-call costs: cuBLAS picks
        its kernels per new GEMM shape, ~6 ms of host time per forward at 1B. With CUDA graphs, sizes
        that replay graphs run at every padded sequence count (1, 2, 4 .. PREFILL_GRAPH_SEQS), twice
        each, so each shape's graph is captured here. Scratch sequences, released after. Stops at the
        first size the KV cache cannot hold. Returns the shapes run."""
        limit = min(self.config.max_prefill_tokens, self.max_seq_len - 1)
        staging, done = self._prefill_staging, 0
        for size in self.ops.prefill_buckets(limit):
            n = min(size, limit)
            graphed = self.graphs is not None and size <= staging.max_tokens  # the padded size replays graphs
            rows = [1]
            while graphed and rows[-1] * 2 <= min(staging.max_seqs, n):
                rows.append(rows[-1] * 2)
            for num_seqs in rows:
                lengths = [n // num_seqs + (i < n % num_seqs) for i in range(num_seqs)]
                for _ in range(2 if graphed else 1):
                    seq_ids = []
                    try:
                        for m in lengths:
                            seq_ids.append(self.alloc_sequence(m + 1, SamplingParams(),
                                                               StoppingCriteria(max_new_tokens=1)).seq_id)
                        self.prefill([api.PrefillItem(i, [0] * m) for i, m in zip(seq_ids, lengths)])
                    except ResourceExhausted:
                        return done
                    finally:
                        if seq_ids:
                            self.release(seq_ids)
                done += 1
        return done

    def warm_up_decode(self, widths: list[int] | None = None) -> int:
        """Captures the decode graph of each batch width (default 1..config.warm_up_widths, -1: up to
        max_batch_size), the graph every batch of that width replays until its own slot vector has one
        (fallback_graphs), for steps without top logprobs. Otherwise the first request batch of each width
        pays the capture in its step (~5-10 ms of host time). Widest first: the narrower captures then
        reuse the graph pool's blocks instead of growing it (widest last took the 1B pool from ~0.3 to
        3.9 GiB over 256 widths). Scratch sequences of one prompt token, one width at a time, released
        after; a width the slots or the KV cache cannot hold is skipped. Returns the widths run (0 without
        CUDA graphs or fallback graphs, or with capture_after 1, where every batch captures its own)."""
        if self.graphs is None or not self.config.fallback_graphs or self.config.capture_after <= 1:
            return 0
        if widths is None:
            top = self.config.warm_up_widths
            widths = list(range(1, (self.config.max_batch_size if top < 0 else top) + 1))
        done = 0
        for width in sorted({w for w in widths if 1 <= w <= self.config.max_batch_size}, reverse=True):
            seq_ids = []
            try:
                for _ in range(width):
                    seq_ids.append(self.alloc_sequence(3, SamplingParams(),
                                                       StoppingCriteria(max_new_tokens=2, ignore_eos=True)).seq_id)
                self.prefill([api.PrefillItem(i, [0]) for i in seq_ids])
                self.decode(seq_ids)
                done += 1
            except ResourceExhausted:
                pass
            finally:
                if seq_ids:
                    self.release(seq_ids)
        return done

    def decode(self, seq_ids: list[int], input_token_ids: list[int] | None = None) -> api.StepResult:
        """One decode step of seq_ids; waits for it (decode_launch, then finish)."""
        return self.finish(self.decode_launch(seq_ids, input_token_ids))

    def decode_launch(self, seq_ids: list[int], input_token_ids: list[int] | None = None) -> "PendingStep":
        """Validates a decode step and queues its device work without waiting for it; finish(step)
        returns its result. Up to config.max_steps_in_flight steps are queued at once, so the host's work
        between two steps (the commit, the RPC reply, the next launch) overlaps the device's.

        A step is queued behind an unfinished one only while its validity cannot depend on that one's
        outcome, except by EOS or a stop token: with input_token_ids (which rewrite the token history)
        or a sequence the queued steps end by length, the queued steps finish first and the step is
        checked on the committed state. If an earlier step then ends one of its sequences by EOS or a
        stop token, finish() refuses it as decode would have (FAILED_PRECONDITION), puts every sequence
        back as it was, and runs again the steps queued after it."""
        plan = self._batch_plan(seq_ids)
        seqs = plan.seqs
        self._check_running(seqs)
        if input_token_ids:
            if len(input_token_ids) != len(seq_ids):
                raise InvalidArgument(f"input_token_ids has {len(input_token_ids)} entries for {len(seq_ids)} "
                                      f"sequences; give none or one per sequence")
            self._check_tokens(input_token_ids, "input_token_ids")
        if self._in_flight and (input_token_ids or any(_ends_by_length(s) for s in seqs)):
            self._finish_in_flight()
            self._check_running(seqs)
        while len(self._in_flight) >= self.config.max_steps_in_flight:
            self._finish_next()
            self._check_running(seqs)
        step = PendingStep(plan, list(input_token_ids) if input_token_ids else None)
        self._launch(step)
        return step

    def _batch_plan(self, seq_ids: list[int]) -> "BatchPlan":
        """The checked sequences of a decode batch and their slot order; the last batch's plan is kept,
        since a router decodes the same batch step after step (release() drops it)."""
        plan = self._last_plan
        if plan is None or plan.ids != seq_ids:
            seqs = self._check_ids(seq_ids)
            plan = self._last_plan = BatchPlan(list(seq_ids), seqs, self._num_top(seqs))
        return plan

    def finish(self, step: "PendingStep") -> api.StepResult:
        """Waits for a launched step (and the ones launched before it) and returns its result, or raises
        the error that refused it."""
        while not step.done:
            if step not in self._in_flight:
                raise RuntimeError("finish(): the step was not launched by this engine, or the engine closed")
            self._finish_next()
        if step.error is not None:
            raise step.error
        return step.result

    def step_ready(self, step: "PendingStep") -> bool:
        """Whether finish(step) would not wait for the device (its device work has ended)."""
        return step.done or step.ready()

    def _launch(self, step: "PendingStep") -> None:
        """Queues the device work of a decode step; its sequences count its token as cached from now on.
        The step runs on the slots in ascending order (the graph key); results go back in request order."""
        seqs = step.seqs
        step.ring, self._next_ring = self._next_ring, (self._next_ring + 1) % self.config.max_steps_in_flight
        step.entries = self.outputs.entries(step.batch)
        # A replayed step is driver calls on the compute stream; whatever runs torch ops (the token
        # override, an eager or captured step, top-logprob copies) switches torch's stream itself.
        with self._on_device(timer=1 + step.ring, torch_stream=False) as timer:
            if step.input_token_ids:
                with self._compute_stream():
                    for seq, tok in zip(seqs, step.input_token_ids):
                        seq.token_ids[-1] = tok
                        self._rebuild_seen(seq)
                    self.state.last_token[torch.tensor([s.slot for s in seqs], device=self.device)] = \
                        torch.tensor(step.input_token_ids, device=self.device)
            self._run_decode(step.plan, step.ring)
            self.outputs.copy_top_to_host(len(step.batch), step.plan.num_top, step.ring, self.streams)
        step.timer = timer
        if self.streams is not None:  # a mark of this launch, for a thread that waits on it
            step.done_event = self.streams.mark()
        for seq in step.batch:
            seq.num_cached += 1
        self._in_flight.append(step)

    def _finish_next(self) -> None:
        """Finishes the oldest launched step: waits for its device work, then commits its tokens (or
        refuses it, see decode_launch)."""
        step = self._in_flight[0]
        step.wait_device()
        if any(s.finish_reason for s in step.seqs):  # ended by a step committed after this one was launched
            self._refuse_in_flight()
            return
        self._in_flight.popleft()
        plan = step.plan
        results = self._commit(plan.batch, *self.outputs.step_values(step.entries, plan.num_top, step.ring))
        if not plan.in_slot_order:
            by_request = [None] * len(results)
            for pos, i in enumerate(plan.order):
                by_request[i] = results[pos]
            results = by_request
        step.result = api.StepResult(results, step.timer.elapsed_ns())

    def _refuse_in_flight(self) -> None:
        """The oldest launched step holds a sequence an earlier step ended: refuses it, rolls every
        launched step back (host counts, then the slot state from the committed tokens, queued on the
        compute stream behind them) and launches the later ones again, checked anew."""
        steps = list(self._in_flight)
        self._in_flight.clear()
        self._refused_steps += 1
        for step in steps:
            step.wait_device()  # their pinned buffers are reused by the launches below
            for seq in step.batch:
                seq.num_cached -= 1
        seqs = list({seq.seq_id: seq for step in steps for seq in step.seqs}.values())
        with self._on_device():
            slots = torch.tensor([s.slot for s in seqs], device=self.device)
            self.state.num_cached[slots] = torch.tensor([s.num_cached for s in seqs], dtype=torch.int32,
                                                        device=self.device)
            self.state.last_token[slots] = torch.tensor([s.token_ids[-1] for s in seqs], device=self.device)
            for seq in seqs:
                self._rebuild_seen(seq)
        try:
            self._check_running(steps[0].seqs)
        except EngineError as e:
            steps[0].error = e
        else:
            raise RuntimeError("refused a step whose sequences are all running")
        for step in steps[1:]:
            try:
                self._check_running(step.seqs)
                self._launch(step)
            except EngineError as e:
                step.error = e

    def _finish_in_flight(self) -> None:
        """Finishes every launched step (their results wait in their PendingStep for finish())."""
        while self._in_flight:
            self._finish_next()

    def _run_decode(self, plan: "BatchPlan", ring: int = 0) -> None:
        """The decode step of plan.batch (ascending slots), through _run_step. Each sequence's length counts
        the steps launched before this one (num_cached + 1; read only when the step is built, not replayed)."""
        batch, num_top = plan.batch, plan.num_top

        def make_step(slots_t: torch.Tensor) -> Callable[[], None]:
            seq_lens = [s.num_cached + 1 for s in batch]
            return lambda: self._decode_into_outputs(slots_t, seq_lens, num_top)

        self._run_step("decode", plan.slots, (num_top,), make_step, ring, key=plan.decode_key)

    def _run_step(self, kind: str, slots: list[int], shape: tuple,
                  make_step: Callable[[torch.Tensor], Callable[[], None]], ring: int = 0,
                  key: tuple | None = None) -> None:
        """Runs the device work of a decode or uniform verify step over `slots` (ascending); make_step(the
        slot vector on the device) returns that work. It is replayed from the CUDA graph of the slot
        vector when one is held; else, with fallback_graphs, from the graph of the batch width (and
        `shape`), which reads the slot vector from a staging buffer written just before; else it runs
        eagerly. GraphCache decides when to capture either. ring: which pinned staging buffer the slot
        vector goes through (one per step in flight). key: the graph key, when the caller holds it already
        ((kind, *GraphCache.key_for(slots, *shape))).

        Only a replay may run outside torch's compute stream context (it is driver calls on the compute
        stream): every step function is built and run inside it."""
        def on_compute(step: Callable[[], None]) -> Callable[[], None]:
            def run() -> None:
                with self._compute_stream():
                    step()
            return run

        def prepare():
            with self._compute_stream():  # a captured graph keeps this tensor
                return on_compute(make_step(torch.tensor(slots, device=self.device)))

        if self.graphs is None:
            with self._compute_stream():
                make_step(torch.tensor(slots, device=self.device))()
            return
        fallback = None
        if self.config.fallback_graphs:
            width, staged = len(slots), self._slot_staging

            def stage():
                staged.host_np[ring][:width] = slots
                if self.streams is not None:
                    self.streams.to_device(staged.device, staged.host[ring], 8 * width)
                else:  # the CPU tests' fake graphs
                    staged.device[:width].copy_(staged.host[ring][:width])

            fallback = ((kind, "width", width, *shape), lambda: on_compute(make_step(staged.device[:width])), stage)
        self.graphs.run(key or (kind, *GraphCache.key_for(slots, *shape)), prepare, fallback)

    def _decode_into_outputs(self, slots: torch.Tensor, seq_lens: list[int], num_top: int) -> None:
        """Device work of one decode step: inputs from the slot state, forward, sample; the sampled
        tokens and new lengths back to the slot state, the results to the static output buffers.
        No host synchronisation and no host reads (it is captured into CUDA graphs)."""
        batch, rows = self.ops.decode_inputs(self.state, slots, self.block_size, seq_lens, self._dynamic_rope)
        out = self.ops.sample(self.model.forward(batch), rows, num_top)
        self.ops.decode_commit(self.state, slots, out, self.outputs, num_top)

    def verify(self, items: list[api.VerifyItem]) -> api.VerifyStepResult:
        seqs = self._check_ids([it.seq_id for it in items])
        self._finish_in_flight()  # its checks need every sequence's committed state
        self._check_running(seqs)
        vocab = self.model_config.vocab_size
        for seq, it in zip(seqs, items):
            k = len(it.draft_token_ids)
            if k > self.config.max_draft_tokens:
                raise InvalidArgument(f"sequence {seq.seq_id}: {k} draft tokens, at most "
                                      f"{self.config.max_draft_tokens}")
            self._check_tokens(it.draft_token_ids, f"sequence {seq.seq_id} draft_token_ids")
            if seq.seq_len + k > seq.capacity:
                raise InvalidArgument(f"sequence {seq.seq_id}: {k} drafts after {seq.seq_len} tokens exceed "
                                      f"max_total_tokens={seq.capacity}")
            if it.draft_probs:
                if len(it.draft_probs) != k * vocab:
                    raise InvalidArgument(f"sequence {seq.seq_id}: draft_probs has {len(it.draft_probs)} values; "
                                          f"expected {k} x {vocab} (one distribution per draft) or none")
                probs = torch.tensor(it.draft_probs, dtype=torch.float32)
                if not bool(torch.isfinite(probs).all()) or bool((probs < 0).any()):
                    raise InvalidArgument(f"sequence {seq.seq_id}: draft_probs must be finite and >= 0")
        k = len(items[0].draft_token_ids)
        uniform = k > 0 and all(len(it.draft_token_ids) == k and not it.draft_probs for it in items) \
            and not self._dynamic_rope
        # The uniform step is driver calls (a replay, pinned copies) like a decode step: whatever in it runs
        # torch ops switches torch's stream itself. The general one runs torch ops throughout.
        with self._on_device(torch_stream=not uniform) as timer:
            results = self._verify_uniform(seqs, items, k) if uniform else self._verify(seqs, items)
        return api.VerifyStepResult(results, timer.elapsed_ns())

    def _verify_uniform(self, seqs: list[Sequence], items: list[api.VerifyItem], k: int) -> list[api.VerifyResult]:
        """The common case, k drafts for every sequence and no draft distributions: one device step
        (replayed as a CUDA graph keyed by slots and k, like decode) and one read-back."""
        order = sorted(range(len(seqs)), key=lambda i: seqs[i].slot)
        batch = [seqs[i] for i in order]
        drafts = [items[i].draft_token_ids for i in order]
        num_top = self._num_top(seqs)
        self.verify_outputs.write_drafts(drafts, k, self.streams)

        def make_step(slots_t: torch.Tensor) -> Callable[[], None]:
            return lambda: self._verify_into_outputs(slots_t, k, num_top)

        self._run_step("verify", [s.slot for s in batch], (k, num_top), make_step)
        accepted, tokens, logprobs, top_ids, top_lps = self.verify_outputs.read(len(batch), k + 1, num_top,
                                                                                 self.streams)
        results = []
        for b, seq in enumerate(batch):
            j = accepted[b]
            emitted = list(drafts[b][:j]) + [tokens[b]]
            host = (None, logprobs[b], top_ids[b * (k + 1):] if num_top else None,
                    top_lps[b * (k + 1):] if num_top else None)
            out = []
            for i, tok in enumerate(emitted):
                seq.num_cached = seq.seq_len
                reason = seq.append(tok, self.eos_token_ids)
                out.append(self._token_result(seq, host, i, reason))
                if reason != FinishReason.NONE:
                    break
            results.append(api.VerifyResult(seq.seq_id, j, out))
        by_request = [None] * len(seqs)
        for pos, i in enumerate(order):
            by_request[i] = results[pos]
        return by_request

    def _verify_into_outputs(self, slots: torch.Tensor, k: int, num_top: int) -> None:
        """Device work of a uniform Verify: the last token and k drafts of each slot at their positions,
        attention per token, then every row samples the token decode would draw there (its slot's
        parameters, RNG keyed by seed and position, the drafts before it counted as seen). The drafts
        are accepted while they equal those tokens ("greedy match": exact for greedy rows, and for
        sampled rows the same target distribution as rejection sampling with one-hot drafts), so
        Verify emits exactly what decode would have. The slot state moves past the accepted tokens only
        (the rejected positions' KV is dead). No host sync (ops.verify_inputs / verify_commit: one
        kernel each on the GPU)."""
        drafts = self.verify_outputs.drafts[:slots.shape[0], :k]
        fb, rows = self.ops.verify_inputs(self.state, slots, drafts, self.block_size)
        out = self.ops.sample(self.model.forward(fb), rows, num_top)
        self.ops.verify_commit(self.state, slots, drafts, out, self.verify_outputs, num_top)

    def _verify(self, seqs: list[Sequence], items: list[api.VerifyItem]) -> list[api.VerifyResult]:
        """The general Verify (draft lengths differ, or draft distributions given): one forward over each
        sequence's last token and its drafts (attention per token, like decode); the same greedy match
        as the uniform step for drafts without distributions, rejection sampling batched per draft length
        for drafts with them; then the host commit."""
        vocab = self.model_config.vocab_size
        ks = [len(it.draft_token_ids) for it in items]
        batch = build_extend_batch(
            self.state.block_table, [s.slot for s in seqs], [s.num_cached for s in seqs],
            [[s.token_ids[-1]] + list(it.draft_token_ids) for s, it in zip(seqs, items)],
            [list(range(k + 1)) for k in ks], self.block_size, self.device, self._dynamic_rope, per_token=True)
        logits = self.model.forward(batch)  # [sum(k + 1), vocab]
        # Per row: its slot's parameters, the drafts before it counted as seen, the position it decides.
        offsets = [0]
        for k in ks:
            offsets.append(offsets[-1] + k + 1)
        row_slots = [s.slot for s, k in zip(seqs, ks) for _ in range(k + 1)]
        row_pos = [s.seq_len + i for s, k in zip(seqs, ks) for i in range(k + 1)]
        extra = [(offsets[b] + i, tok) for b, it in enumerate(items) for i in range(ks[b] + 1)
                 for tok in it.draft_token_ids[:i]]
        st = self.state.sampling_rows(torch.tensor(row_slots, device=self.device),
                                      torch.tensor(row_pos, device=self.device))
        if extra:
            st.seen[torch.tensor([r for r, _ in extra], device=self.device),
                    torch.tensor([t for _, t in extra], device=self.device)] = True
        # Every row's own draw (what decode would emit there); drafts without distributions are accepted
        # while they equal it (greedy match), drafts with distributions by rejection sampling.
        sampled = self.ops.sample(logits, st).token_ids
        by_probs = [b for b, it in enumerate(items) if it.draft_probs]  # k >= 1: k distributions were given
        rejection: list[torch.Tensor] = []  # per item of by_probs: (num_accepted, token) on the device
        if by_probs:
            target = target_logprobs(logits, st)
            for k in sorted({ks[b] for b in by_probs}):
                group = [b for b in by_probs if ks[b] == k]
                rows = torch.tensor([offsets[b] + i for b in group for i in range(k + 1)], device=self.device)
                drafts = torch.tensor([items[b].draft_token_ids for b in group], dtype=torch.int64,
                                      device=self.device).view(len(group), k)
                probs = torch.stack([torch.tensor(items[b].draft_probs, dtype=torch.float32).view(k, vocab)
                                     for b in group]).to(self.device)
                shape = (len(group), k + 1)
                accepted, tokens = self.ops.accept_drafts(target[rows].view(*shape, vocab), drafts, probs,
                                                          st.seed[rows].view(shape), st.position[rows].view(shape))
                rejection += [torch.stack([accepted[n], tokens[n]]) for n in range(len(group))]
        sampled_host = sampled.tolist()
        decided = dict(zip(sorted(by_probs, key=lambda b: (ks[b], b)),  # the order `rejection` was built in
                           torch.stack(rejection).tolist() if rejection else []))
        host = []
        for b, it in enumerate(items):
            if b in decided:
                host.append(tuple(decided[b]))
                continue
            row = sampled_host[offsets[b]:offsets[b + 1]]
            j = 0
            while j < ks[b] and row[j] == it.draft_token_ids[j]:
                j += 1
            host.append((j, row[j]))
        emitted = [list(it.draft_token_ids[:j]) + [tok] for it, (j, tok) in zip(items, host)]
        rows_e = [offsets[b] + i for b, e in enumerate(emitted) for i in range(len(e))]
        toks_e = [t for e in emitted for t in e]
        out = model_logprobs(logits[torch.tensor(rows_e, device=self.device)],
                             torch.tensor(toks_e, device=self.device), self._num_top(seqs))
        logp = _host(out)
        results, at = [], 0
        for seq, (num_accepted, _), toks in zip(seqs, host, emitted):
            tokens = []
            for j, tok in enumerate(toks):
                seq.num_cached = seq.seq_len
                reason = seq.append(tok, self.eos_token_ids)
                tokens.append(self._token_result(seq, logp, at + j, reason))
                if reason != FinishReason.NONE:
                    break
            at += len(toks)
            results.append(api.VerifyResult(seq.seq_id, num_accepted, tokens))
        # The slot state follows: last token, KV length (past the accepted tokens only), seen tokens.
        slots_t = torch.tensor([s.slot for s in seqs], device=self.device)
        self.state.last_token[slots_t] = torch.tensor([s.token_ids[-1] for s in seqs], device=self.device)
        self.state.num_cached[slots_t] = torch.tensor([s.num_cached for s in seqs], dtype=torch.int32,
                                                      device=self.device)
        kept = [(s.slot, t.token_id) for s, r in zip(seqs, results) for t in r.tokens]
        self.state.mark_seen(torch.tensor([k[0] for k in kept], device=self.device),
                             torch.tensor([k[1] for k in kept], device=self.device))
        return results

    # ---------------------------------------------------------------------------------------------
    # Helpers

    @property
    def _dynamic_rope(self) -> bool:
        return self.model_config.rope.rope_type == "dynamic"

    def _num_top(self, seqs: list[Sequence]) -> int:
        """How many top-logprob candidates a step computes: config.max_top_logprobs when any of its
        sequences asks for some (each gets its own count of them back), else 0. One count: it fixes the
        step's shapes, so each distinct count would be a graph of its own at every batch width (up to
        20 x 256 of them, each captured at first sight); and the step's device-to-pinned copies of the
        candidates ([:n, :count] of [max_batch, max_top_logprobs] buffers) are contiguous only at the
        full count: a strided copy of 5 held the host until the step ended (1B batch 32 queued, 5
        candidates: 1.57-1.66 ms, 1.42 at the full count; H200). Rounding the count up to a power of
        two would halve the candidates' kernels at k = 5 (13.2 vs 22.7 us at batch 1), once the buffers
        are laid out so that every count's copy is contiguous."""
        return self.config.max_top_logprobs if any(s.sampling.top_logprobs for s in seqs) else 0

    def _commit(self, seqs: list[Sequence], token_ids: list[int], logprobs: list[float], top_ids: list | None,
                top_logprobs: list | None) -> list[api.TokenResult]:
        """Appends the sampled tokens (host copies) to the sequences; returns their results. (Run for every
        token of every step: one loop, locals.)"""
        eos, TokenResult = self.eos_token_ids, api.TokenResult
        if top_ids is None:  # no top logprobs in this step (append runs before len: the new length)
            return [TokenResult(seq.seq_id, tok, lp, [], seq.append(tok, eos), len(seq.token_ids))
                    for seq, tok, lp in zip(seqs, token_ids, logprobs)]
        results = []
        for row, (seq, tok) in enumerate(zip(seqs, token_ids)):
            reason = seq.append(tok, eos)
            n = seq.sampling.top_logprobs
            top = list(zip(top_ids[row][:n], top_logprobs[row][:n])) if n else []
            results.append(TokenResult(seq.seq_id, tok, logprobs[row], top, reason, len(seq.token_ids)))
        return results

    @staticmethod
    def _token_result(seq: Sequence, host: tuple, row: int, reason: FinishReason) -> api.TokenResult:
        _, logprobs, top_ids, top_lps = host
        n = seq.sampling.top_logprobs
        top = list(zip(top_ids[row][:n], top_lps[row][:n])) if n else []
        return api.TokenResult(seq.seq_id, seq.token_ids[-1], logprobs[row], top, reason, seq.seq_len)

    def _rebuild_seen(self, seq: Sequence) -> None:
        self.state.seen[seq.slot] = False
        self.state.seen[seq.slot, torch.tensor(seq.token_ids, device=self.device)] = True

    def _check_ids(self, seq_ids: list[int], limit: bool = True) -> list[Sequence]:
        if not seq_ids:
            raise InvalidArgument("the batch is empty")
        if limit and len(seq_ids) > self.config.max_batch_size:
            raise ResourceExhausted(f"batch of {len(seq_ids)} sequences exceeds max_batch_size="
                                    f"{self.config.max_batch_size}")
        if len(set(seq_ids)) != len(seq_ids):
            dups = sorted({i for i in seq_ids if seq_ids.count(i) > 1})
            raise InvalidArgument(f"duplicate sequence ids in one batch: {dups[:8]}")
        unknown = [i for i in seq_ids if i not in self.sequences]
        if unknown:
            raise NotFound(f"unknown sequence ids: {unknown[:8]}")
        return [self.sequences[i] for i in seq_ids]

    @staticmethod
    def _check_running(seqs: list[Sequence]) -> None:
        if all(seq.prompt_len and not seq.finish_reason for seq in seqs):  # every step: the common case first
            return
        for seq in seqs:
            if not seq.prompt_done:
                raise FailedPrecondition(f"sequence {seq.seq_id}: the prompt is not complete (prefill first)")
            if seq.finished:
                raise FailedPrecondition(f"sequence {seq.seq_id} has finished ({seq.finish_reason.name}); "
                                         f"release it")

    def _check_tokens(self, token_ids: list[int], what: str) -> None:
        vocab = self.model_config.vocab_size
        if not token_ids or (min(token_ids) >= 0 and max(token_ids) < vocab):
            return
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidArgument(f"{what}: token ids {bad[:8]} are outside the vocabulary (size {vocab})")

    # ---------------------------------------------------------------------------------------------

    def info(self) -> api.EngineInfo:
        mc = self.model_config
        return api.EngineInfo(
            model_id=self.model_path.name, architecture=mc.architecture, dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.device), vocab_size=mc.vocab_size, eos_token_ids=sorted(self.eos_token_ids),
            max_seq_len=self.max_seq_len, block_size=self.block_size, total_blocks=self.blocks.num_usable_blocks,
            free_blocks=self.blocks.num_free_blocks, max_slots=self.config.max_slots,
            free_slots=self.slots.num_free_slots, max_batch_size=self.config.max_batch_size,
            live_sequences=len(self.sequences), kernel_backend=self.ops.name, version=VERSION,
            steps_in_flight=len(self._in_flight), refused_steps=self._refused_steps,
            graph_cache=dataclasses.replace(self.graphs.stats) if self.graphs is not None else api.GraphStats())

    def close(self) -> None:
        if self.streams is not None:
            self.streams.synchronize()  # launched steps end before their buffers go; nobody finishes them
        self._in_flight.clear()
        self._last_plan = None
        self.sequences.clear()
        if self.graphs is not None:
            self.graphs.clear()
        if self.streams is not None:
            self.outputs.drop_top_hosts()  # pinned buffers torch copied into on the stream go before the stream
            self.verify_outputs.host.clear()
            self.verify_outputs.host_np.clear()
            self._slot_staging = self._prefill_staging = None
            self.streams.close()


class PendingStep:
    """A decode step launched by Engine.decode_launch: its sequences, then (set by the engine) how it
    ran, and once finished its result or the error that refused it."""

    def __init__(self, plan: "BatchPlan", input_token_ids: list[int] | None):
        self.plan = plan
        self.seqs = plan.seqs  # in request order
        self.batch = plan.batch  # in slot order (the device's)
        self.input_token_ids = input_token_ids
        self.ring = 0  # its timer and pinned buffers of top-logprob candidates
        self.entries: list[int] = []  # where its tokens are read (StepOutputs.entries)
        self.timer = None  # its device time (Timing, or _HostTimer on CPU)
        # A DeviceMark recorded by each launch once its results are in pinned memory, new for each launch
        # (its event is recorded again only 64 marks later, long after this launch has finished; the timer's
        # events are reused by the next steps), so any thread may wait on it; None on CPU, where the work
        # ran at launch.
        self.done_event = None
        self.result: api.StepResult | None = None
        self.error: EngineError | None = None

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None

    def ready(self) -> bool:
        """Whether the device work of this launch has ended (never blocks)."""
        event = self.done_event
        return event is None or event.query()

    def wait_device(self) -> None:
        """Blocks (the GIL released) until the device work of this launch has ended. Safe from any
        thread: it reads nothing the engine changes."""
        event = self.done_event
        if event is not None:
            event.synchronize()


class BatchPlan:
    """A decode batch as the device runs it: the sequences in request order, the same in ascending slot
    order (batch[j] is seqs[order[j]]), the slot vector, its graph key and the step's number of top
    logprobs. It depends only on which sequences the batch holds (a sequence's slot and sampling never
    change), so it serves every step of the same batch."""

    __slots__ = ("ids", "seqs", "order", "batch", "slots", "num_top", "decode_key", "in_slot_order")

    def __init__(self, ids: list[int], seqs: list[Sequence], num_top: int):
        self.ids, self.seqs, self.num_top = ids, seqs, num_top
        self.order = sorted(range(len(seqs)), key=lambda i: seqs[i].slot)
        self.batch = [seqs[i] for i in self.order]
        self.slots = [s.slot for s in self.batch]
        self.decode_key = ("decode", *GraphCache.key_for(self.slots, num_top))
        self.in_slot_order = self.order == list(range(len(seqs)))


def _ends_by_length(seq: Sequence) -> bool:
    """Whether the launched steps that include seq end it by length: after them it holds num_cached + 1
    tokens (seq_len, when none includes it, and then it is running)."""
    tokens = seq.num_cached + 1
    if tokens == seq.seq_len:
        return False
    max_new = seq.stopping.max_new_tokens
    return tokens >= seq.capacity or bool(max_new and tokens - seq.prompt_len >= max_new)


class _HostTimer:
    """The CPU's stand-in for a device Timing: the work ran when the block did."""

    def __init__(self):
        self._t0, self._ns = time.perf_counter_ns(), None

    def stop(self) -> None:
        self._ns = time.perf_counter_ns() - self._t0

    def elapsed_ns(self) -> int:
        return self._ns if self._ns is not None else time.perf_counter_ns() - self._t0


def _host(out: SampleOutput) -> tuple[list[int], list[float], list | None, list | None]:
    """Host copies of a sample's results (one device->host sync)."""
    return (out.token_ids.tolist(), out.logprobs.tolist(),
            out.top_ids.tolist() if out.top_ids is not None else None,
            out.top_logprobs.tolist() if out.top_logprobs is not None else None)
