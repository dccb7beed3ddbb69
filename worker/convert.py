"""Protobuf messages <-> engine types. No logic beyond the proto's conventions (0 = unset)."""
from __future__ import annotations

from engine import api
from engine.errors import FailedPrecondition, InvalidArgument
from engine.kv_events import KvBlocksRemoved, KvBlocksStored, KvEventBatch
from engine.sampling import SamplingParams, StoppingCriteria
from engine.tokenizer import Tokenizer
from metrale.worker.v1 import worker_pb2 as pb


def sampling_params(msg: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p if msg.top_p else 1.0,
        seed=msg.seed if msg.HasField("seed") else None,
        repetition_penalty=msg.repetition_penalty if msg.repetition_penalty else 1.0,
        top_logprobs=msg.top_logprobs,
        min_p=msg.min_p,
        frequency_penalty=msg.frequency_penalty,
        presence_penalty=msg.presence_penalty,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
    )


def stopping_criteria(msg: pb.StoppingCriteria) -> StoppingCriteria:
    return StoppingCriteria(max_new_tokens=msg.max_new_tokens, stop_token_ids=frozenset(msg.stop_token_ids),
                            ignore_eos=msg.ignore_eos, min_tokens=msg.min_tokens)


def prefill_items(msg: pb.PrefillRequest) -> list[api.PrefillItem]:
    return [api.PrefillItem(it.sequence_id, list(it.token_ids), it.partial) for it in msg.items]


def verify_items(msg: pb.VerifyRequest) -> list[api.VerifyItem]:
    return [api.VerifyItem(it.sequence_id, list(it.draft_token_ids), list(it.draft_probs) or None)
            for it in msg.items]


def has_text_prompt(msg: pb.GenerateRequest) -> bool:
    """Whether the prompt is text or chat (the response then carries text), not token ids."""
    return msg.WhichOneof("prompt_text") is not None


def generate_prompt(msg: pb.GenerateRequest, tokenizer: Tokenizer | None) -> list[int]:
    """The prompt's token ids: prompt_token_ids as they are; text tokenized as transformers'
    tokenizer(text) does; chat rendered with the chat template (its generation prompt unless
    add_generation_prompt is false) and tokenized without special tokens. FailedPrecondition when a
    text or chat prompt meets a worker without a tokenizer (or chat template), InvalidArgument for
    two prompts or an empty chat. Runs no model code; the caller runs it off the event loop."""
    kind = msg.WhichOneof("prompt_text")
    if kind is None:
        return list(msg.prompt_token_ids)
    if msg.prompt_token_ids:
        raise InvalidArgument(f"give one prompt: prompt_token_ids or {kind}, not both")
    if tokenizer is None:
        raise FailedPrecondition(f"a {kind} prompt needs a tokenizer, and this worker's checkpoint has none "
                                 "(no tokenizer.json): send prompt_token_ids")
    if kind == "text":
        return tokenizer.encode(msg.text)
    if tokenizer.chat_template is None:
        raise FailedPrecondition("a chat prompt needs a chat template, and this worker's tokenizer has none "
                                 "(tokenizer_config.json has no chat_template): send text or prompt_token_ids")
    if not msg.chat.messages:
        raise InvalidArgument("chat.messages is empty: a chat prompt needs at least one message")
    messages = [{"role": m.role, "content": m.content} for m in msg.chat.messages]
    add_generation_prompt = msg.chat.add_generation_prompt if msg.chat.HasField("add_generation_prompt") else True
    return tokenizer.encode_chat(messages, add_generation_prompt)


def generate_response(t: api.TokenResult, text: str = "") -> pb.GenerateResponse:
    return pb.GenerateResponse(token=_add_token(pb.Token, t), text=text)


def token(t: api.TokenResult) -> pb.Token:
    return _add_token(pb.Token, t)


def add_tokens(field, tokens: list[api.TokenResult]) -> None:
    """Appends the tokens to a repeated Token field in place (no intermediate messages: a step's
    response is built once)."""
    add = field.add
    for t in tokens:
        _add_token(add, t)


def _add_token(make, t: api.TokenResult) -> pb.Token:
    """make(**fields): pb.Token or a repeated field's add. All fields in one call: half the time of an
    empty add() and five attribute sets, with finish_reason as a plain int (protobuf converts an IntEnum
    slowly)."""
    msg = make(sequence_id=t.seq_id, token_id=t.token_id, logprob=t.logprob, finish_reason=int(t.finish_reason),
               seq_len=t.seq_len, cached_tokens=t.cached_tokens)
    if t.top_logprobs:
        top = msg.top_logprobs.add
        for i, lp in t.top_logprobs:
            top(token_id=i, logprob=lp)
    return msg


def alloc_response(r: api.AllocResult) -> pb.AllocSequenceResponse:
    return pb.AllocSequenceResponse(sequence_id=r.seq_id, slot=r.slot, reserved_tokens=r.reserved_tokens)


def prefill_response(r: api.StepResult) -> pb.PrefillResponse:
    msg = pb.PrefillResponse(forward_ns=r.forward_ns)
    add_tokens(msg.tokens, r.tokens)
    return msg


def decode_response(r: api.StepResult) -> pb.DecodeResponse:
    msg = pb.DecodeResponse(forward_ns=r.forward_ns)
    add_tokens(msg.tokens, r.tokens)
    return msg


def decode_stream_response(r: api.StepResult) -> pb.DecodeStreamResponse:
    msg = pb.DecodeStreamResponse()
    msg.step.SetInParent()
    msg.step.forward_ns = r.forward_ns
    add_tokens(msg.step.tokens, r.tokens)
    return msg


def step_error(code: int, message: str) -> pb.DecodeStreamResponse:
    return pb.DecodeStreamResponse(error=pb.StepError(code=code, message=message))


def verify_response(r: api.VerifyStepResult) -> pb.VerifyResponse:
    msg = pb.VerifyResponse(forward_ns=r.forward_ns)
    for v in r.results:
        result = msg.results.add(sequence_id=v.seq_id, num_accepted=v.num_accepted)
        add_tokens(result.tokens, v.tokens)
    return msg


def kv_event_batch(b: KvEventBatch, messages=pb):
    """An engine KV event batch (engine/kv_events.py) as the wire message. messages: the generated module
    whose KvEventBatch / KvSnapshotChunk to build: ours (worker.proto) or smg's common_pb2, the same shape."""
    msg = messages.KvEventBatch(sequence_number=b.sequence_number, timestamp=b.timestamp)
    for e in b.events:
        event = msg.events.add(event_id=e.event_id)
        data = e.data
        if isinstance(data, KvBlocksStored):
            stored = event.stored
            stored.SetInParent()
            if data.parent_block_hash is not None:
                stored.parent_block_hash = data.parent_block_hash
            for block in data.blocks:
                stored.blocks.add(block_hash=block.block_hash, token_ids=block.token_ids, block_size=block.block_size)
        elif isinstance(data, KvBlocksRemoved):
            event.removed.block_hashes.extend(data.block_hashes)
        else:
            event.cleared.SetInParent()
    if b.snapshot is not None:
        s = b.snapshot
        msg.snapshot.CopyFrom(messages.KvSnapshotChunk(index=s.index, count=s.count, blocks=s.blocks,
                                                       unknown_before=s.unknown_before))
    return msg


def info_response(i: api.EngineInfo, tokenizer: Tokenizer | None = None) -> pb.InfoResponse:
    """tokenizer: the worker's (None: the checkpoint has none); Info says whether there is one and its
    chat template."""
    g, c, s = i.graph_cache, i.prefix_cache, i.steps
    return pb.InfoResponse(
        has_tokenizer=tokenizer is not None, chat_template=(tokenizer and tokenizer.chat_template) or "",
        model_id=i.model_id, architecture=i.architecture, dtype=i.dtype, device=i.device, vocab_size=i.vocab_size,
        eos_token_ids=i.eos_token_ids, max_seq_len=i.max_seq_len, block_size=i.block_size,
        total_blocks=i.total_blocks, free_blocks=i.free_blocks, max_slots=i.max_slots, free_slots=i.free_slots,
        max_batch_size=i.max_batch_size, kernel_backend=i.kernel_backend, version=i.version,
        live_sequences=i.live_sequences, quantization=i.quantization, quantized_lm_head=i.quantized_lm_head,
        fp8_weight_block=i.fp8_weight_block, checkpoint_quantization=i.checkpoint_quantization,
        fp8_activation_scheme=i.fp8_activation_scheme, fp8_skipped_layers=i.fp8_skipped_layers,
        kv_cache_dtype=i.kv_cache_dtype, tensor_parallel_size=i.tensor_parallel_size,
        graph_cache=pb.GraphCacheInfo(hits=g.hits, misses=g.misses, captures=g.captures, evictions=g.evictions,
                                      capture_failures=g.capture_failures, capture_seconds=g.capture_seconds,
                                      graphs_held=g.graphs_held, pool_bytes=g.pool_bytes, fallbacks=g.fallbacks),
        prefix_cache=pb.PrefixCacheInfo(enabled=c.enabled, cached_blocks=c.cached_blocks,
                                        evictable_blocks=c.evictable_blocks, queries=c.queries,
                                        query_tokens=c.query_tokens, hit_tokens=c.hit_tokens,
                                        stored_blocks=c.stored_blocks, evicted_blocks=c.evicted_blocks,
                                        flushed_blocks=c.flushed_blocks, last_event_batch=c.last_event_batch),
        steps=pb.StepCounters(decode_steps=s.decode_steps, decode_sequences=s.decode_sequences,
                              decode_device_ns=s.decode_device_ns, prefill_calls=s.prefill_calls,
                              prefill_tokens=s.prefill_tokens, prefill_device_ns=s.prefill_device_ns))
