"""Pipelined decode steps: plan a batch, launch its device work, finish (commit) it, or refuse it.

Up to config.max_steps_in_flight steps are queued on the device at once, so the host's work between two
steps (the commit, the RPC reply, the next launch) overlaps the device's. A step is queued behind an
unfinished one only while its validity cannot depend on that one's outcome, except by EOS or a stop token:
with input_token_ids (which rewrite the token history) or a sequence the queued steps end by length, the
queued steps finish first and the step is checked on the committed state. If an earlier step then ends one
of its sequences by EOS or a stop token, finish() refuses it as a fresh launch would have been refused
(FAILED_PRECONDITION), puts every sequence back as it was, and launches again the steps queued after it.

Owns: the steps in flight (PendingStep), the last batch's plan (BatchPlan), the refusal count."""
from __future__ import annotations

import collections
from typing import Callable

import torch

from engine import api, logits_processors
from engine.cuda.graphs import GraphCache
from engine.errors import EngineError, InvalidArgument
from engine.runtime import Runtime
from engine.sequence import Sequence, SequenceTable
from engine.sequence_blocks import SequenceBlocks
from engine.slot_io import SlotIO
from engine.tokens import commit_tokens, in_request_order


class BatchPlan:
    """A decode batch as the device runs it: the sequences in request order, the same in ascending slot
    order (batch[j] is seqs[order[j]]), the slot vector, its graph key, the step's number of top
    logprobs and the logits processors it computes (engine/logits_processors.py flags; 0: none). It depends
    only on which sequences the batch holds (a sequence's slot and sampling never change), so it serves every
    step of the same batch."""

    __slots__ = ("ids", "seqs", "order", "batch", "slots", "num_top", "processors", "shape", "decode_key",
                 "in_slot_order", "masked")

    def __init__(self, ids: list[int], seqs: list[Sequence], num_top: int, processors: int = 0):
        self.ids, self.seqs, self.num_top, self.processors = ids, seqs, num_top, processors
        self.order = sorted(range(len(seqs)), key=lambda i: seqs[i].slot)
        self.batch = [seqs[i] for i in self.order]
        self.slots = [s.slot for s in self.batch]
        self.shape = (num_top, *logits_processors.graph_key(processors))  # what fixes the step's shapes
        self.decode_key = ("decode", *GraphCache.key_for(self.slots, *self.shape))
        self.in_slot_order = self.order == list(range(len(seqs)))
        # The sequences that sample under a token mask: each step needs a fresh mask of each.
        self.masked = [s for s in seqs if s.sampling.token_mask] if processors & logits_processors.TOKEN_MASK else []


class PendingStep:
    """A launched decode step: its plan, then (set at launch) how it ran, and once finished its result or the
    error that refused it."""

    def __init__(self, plan: BatchPlan, input_token_ids: list[int] | None):
        self.plan = plan
        self.seqs = plan.seqs  # in request order
        self.batch = plan.batch  # in slot order (the device's)
        self.input_token_ids = input_token_ids
        self.ring = 0  # its timer and pinned buffers of top-logprob candidates
        self.entries: list[int] = []  # where its tokens are read (StepOutputs.entries)
        self.timer = None  # its device time (a Timing, or a HostTimer on CPU)
        # A DeviceMark recorded by each launch once its results are in pinned memory, new for each launch (its
        # event is recorded again only 64 marks later, long after this launch has finished), so any thread may
        # wait on it; None on CPU, where the work ran at launch.
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
        """Blocks (the GIL released) until the device work of this launch has ended. Safe from any thread: it
        reads nothing the engine changes."""
        event = self.done_event
        if event is not None:
            event.synchronize()


class DecodePipeline:
    def __init__(self, rt: Runtime, sequences: SequenceTable):
        self.rt = rt
        self.sequences = sequences
        self.slot_io = SlotIO.for_ops(rt.ops, rt.state, rt.block_size)
        self.in_flight: collections.deque[PendingStep] = collections.deque()  # launched, not finished; oldest first
        self.refused_steps = 0  # launched steps refused because an earlier step ended one of their sequences
        self.counters = api.StepCounters()  # decode and prefill work since start (the Prefiller counts its own)
        self._next_ring = 0  # the pinned buffers and timer the next launched step uses (of max_steps_in_flight)
        self._last_plan: BatchPlan | None = None

    # ------------------------------------------------------------------ launch

    def launch(self, seq_ids: list[int], input_token_ids: list[int] | None = None) -> PendingStep:
        """Validates a decode step and queues its device work without waiting for it (see the module doc);
        finish(step) returns its result."""
        plan = self._batch_plan(seq_ids)
        seqs = plan.seqs
        check_running = self.sequences.check_running
        check_running(seqs)
        if plan.masked:
            self.sequences.check_masks(plan.masked)
        if input_token_ids:
            if len(input_token_ids) != len(seq_ids):
                raise InvalidArgument(f"input_token_ids has {len(input_token_ids)} entries for {len(seq_ids)} "
                                      f"sequences; give none or one per sequence")
            self.sequences.check_tokens(input_token_ids, "input_token_ids")
        if self.in_flight and (input_token_ids or any(_ends_by_length(s) for s in seqs)):
            self.finish_all()
            check_running(seqs)
        while len(self.in_flight) >= self.rt.config.max_steps_in_flight:
            self._finish_next()
            check_running(seqs)
        step = PendingStep(plan, list(input_token_ids) if input_token_ids else None)
        self._launch(step)
        for seq in plan.masked:  # each mask serves one step
            seq.mask_ready = False
        return step

    def _batch_plan(self, seq_ids: list[int]) -> BatchPlan:
        """The checked sequences of a decode batch and their slot order; the last batch's plan is kept, since a
        router decodes the same batch step after step (forget_plan() drops it)."""
        plan = self._last_plan
        if plan is None or plan.ids != seq_ids:
            seqs = self.sequences.check_ids(seq_ids)
            plan = self._last_plan = BatchPlan(list(seq_ids), seqs, self.num_top(seqs),
                                               logits_processors.batch_flags(seqs))
        return plan

    def num_top(self, seqs: list[Sequence]) -> int:
        """How many top-logprob candidates a step computes: config.max_top_logprobs when any of its sequences
        asks for some (each gets its own count back), else 0. One count: it fixes the step's shapes, so each
        distinct count would be a graph of its own at every batch width; and the step's device-to-pinned
        copies of the candidates ([:n, :count] of [max_batch, max_top_logprobs] buffers) are contiguous only
        at the full count (a strided copy holds the host until the step ends)."""
        return self.rt.config.max_top_logprobs if any(s.sampling.top_logprobs for s in seqs) else 0

    def forget_plan(self) -> None:
        self._last_plan = None

    def _launch(self, step: PendingStep) -> None:
        """Queues the device work of a decode step; its sequences count its token as cached from now on. The
        step runs on the slots in ascending order (the graph key); results go back in request order."""
        rt, seqs = self.rt, step.seqs
        dispatch = rt.dispatch
        step.ring, self._next_ring = self._next_ring, (self._next_ring + 1) % rt.config.max_steps_in_flight
        step.entries = rt.outputs.entries(step.batch)
        # A replayed step is driver calls on the compute stream; whatever runs torch ops (the token override, an
        # eager or captured step, top-logprob copies) switches torch's stream itself.
        with dispatch.on_device(timer=1 + step.ring, torch_stream=False) as timer:
            if step.input_token_ids:
                with dispatch.compute_stream():
                    for seq, tok in zip(seqs, step.input_token_ids):
                        seq.token_ids[-1] = tok
                        rt.state.rebuild_seen(seq.slot, seq.token_ids, seq.prompt_len, _counts_outputs(seq))
                    rt.state.last_token[torch.tensor([s.slot for s in seqs], device=rt.device)] = \
                        torch.tensor(step.input_token_ids, device=rt.device)
            self._run(step.plan, step.ring)
            rt.outputs.copy_top_to_host(len(step.batch), step.plan.num_top, step.ring, dispatch.streams)
        step.timer = timer
        step.done_event = dispatch.mark()  # a mark of this launch, for a thread that waits on it
        for seq in step.batch:
            seq.num_cached += 1
        self.in_flight.append(step)

    def _run(self, plan: BatchPlan, ring: int) -> None:
        """The device work of the step (through StepDispatch: a slot-vector graph, the width's graph or eager).
        Each sequence's length counts the steps launched before this one (num_cached + 1; read only when the
        step is built, not replayed)."""
        batch, num_top, procs = plan.batch, plan.num_top, plan.processors

        def make_step(slots_t: torch.Tensor) -> Callable[[], None]:
            seq_lens = [s.num_cached + 1 for s in batch]
            return lambda: self._step_into_outputs(slots_t, seq_lens, num_top, procs)

        self.rt.dispatch.run_slots("decode", plan.slots, plan.shape, make_step, ring, key=plan.decode_key)

    def _step_into_outputs(self, slots: torch.Tensor, seq_lens: list[int], num_top: int, procs: int) -> None:
        """Device work of one decode step: inputs from the slot state, forward, the logits processors (procs:
        their flags, 0: none), sample; the sampled tokens and new lengths back to the slot state, the results to
        the output buffers. No host synchronisation and no host reads (it is captured into CUDA graphs)."""
        rt = self.rt
        batch, rows = self.slot_io.decode_inputs(slots, seq_lens, rt.dynamic_rope)
        logits = rt.model.forward(batch)
        procs_rows = logits_processors.ProcessorRows.gather(rt.state, slots, rows.position, procs) if procs else None
        out = logits_processors.sample(rt.ops, logits, rows, num_top, procs_rows)
        self.slot_io.decode_commit(slots, out, rt.outputs, num_top, procs)

    # ------------------------------------------------------------------ finish

    def finish(self, step: PendingStep) -> api.StepResult:
        """Waits for a launched step (and the ones launched before it) and returns its result, or raises the
        error that refused it."""
        while not step.done:
            if step not in self.in_flight:
                raise RuntimeError("finish(): the step was not launched by this engine, or the engine closed")
            self._finish_next()
        if step.error is not None:
            raise step.error
        return step.result

    def finish_all(self) -> None:
        """Finishes every launched step (their results wait in their PendingStep for finish())."""
        while self.in_flight:
            self._finish_next()

    def holds_any(self, seqs: list[Sequence]) -> bool:
        """Whether a launched, unfinished step includes one of seqs."""
        return any(seq in step.seqs for step in self.in_flight for seq in seqs)

    def _finish_next(self) -> None:
        """Finishes the oldest launched step: waits for its device work, then commits its tokens (or refuses
        it, see the module doc)."""
        step = self.in_flight[0]
        step.wait_device()
        if any(s.finish_reason for s in step.seqs):  # ended by a step committed after this one was launched
            self._refuse_in_flight()
            return
        self.in_flight.popleft()
        plan = step.plan
        results = commit_tokens(plan.batch, *self.rt.outputs.step_values(step.entries, plan.num_top, step.ring),
                                self.rt.eos_token_ids)
        self._register_full_blocks(plan.batch)
        if not plan.in_slot_order:
            results = in_request_order(results, plan.order)
        step.result = api.StepResult(results, step.timer.elapsed_ns())
        counters = self.counters
        counters.decode_steps += 1
        counters.decode_sequences += len(results)
        counters.decode_device_ns += step.result.forward_ns

    def _register_full_blocks(self, seqs: list[Sequence]) -> None:
        """Registers the blocks the committed tokens filled in the prefix cache: positions below seq_len - 1
        hold their final KV once the steps that wrote them finished (the steps still in flight write later
        positions only)."""
        block_size = self.rt.block_size
        SequenceBlocks.register_filled([(seq.blocks, seq.token_ids, seq.seq_len - 1) for seq in seqs
                                        if seq.seq_len > (seq.blocks.num_registered + 1) * block_size])

    def _refuse_in_flight(self) -> None:
        """The oldest launched step holds a sequence an earlier step ended: refuses it, rolls every launched
        step back (host counts, then the slot state from the committed tokens, queued on the compute stream
        behind them) and launches the later ones again, checked anew."""
        rt = self.rt
        steps = list(self.in_flight)
        self.in_flight.clear()
        self.refused_steps += 1
        for step in steps:
            step.wait_device()  # their pinned buffers are reused by the launches below
            for seq in step.batch:
                seq.num_cached -= 1
        seqs = list({seq.seq_id: seq for step in steps for seq in step.seqs}.values())
        with rt.dispatch.on_device():
            slots = torch.tensor([s.slot for s in seqs], device=rt.device)
            rt.state.num_cached[slots] = torch.tensor([s.num_cached for s in seqs], dtype=torch.int32,
                                                      device=rt.device)
            rt.state.last_token[slots] = torch.tensor([s.token_ids[-1] for s in seqs], device=rt.device)
            for seq in seqs:
                rt.state.rebuild_seen(seq.slot, seq.token_ids, seq.prompt_len, _counts_outputs(seq))
        try:
            self.sequences.check_running(steps[0].seqs)
        except EngineError as e:
            steps[0].error = e
        else:
            raise RuntimeError("refused a step whose sequences are all running")
        for step in steps[1:]:
            try:
                self.sequences.check_running(step.seqs)
                self._launch(step)
            except EngineError as e:
                step.error = e

    def clear(self) -> None:
        """Forgets every step in flight (the engine closes; the device was synchronised)."""
        self.in_flight.clear()
        self._last_plan = None


def _counts_outputs(seq: Sequence) -> bool:
    """Whether the slot state keeps seq's output-token counts (rolled back with its seen tokens)."""
    return bool(logits_processors.flags_of(seq.sampling, seq.stopping) & logits_processors.PENALTIES)


def _ends_by_length(seq: Sequence) -> bool:
    """Whether the launched steps that include seq end it by length: after them it holds num_cached + 1
    tokens (seq_len, when none includes it, and then it is running)."""
    tokens = seq.num_cached + 1
    if tokens == seq.seq_len:
        return False
    max_new = seq.stopping.max_new_tokens
    return tokens >= seq.capacity or bool(max_new and tokens - seq.prompt_len >= max_new)
