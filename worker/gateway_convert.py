"""vllm.grpc.engine messages <-> engine types, for the gateway service (worker/gateway.py).

Field semantics follow vLLM's SamplingParams as smg's reference vLLM servicer maps them: an unset
`temperature` is 1.0 (below 1e-5 is greedy), `top_p` and `repetition_penalty` of 0 are off, an unset
`max_tokens` generates until the context is full; min_p, frequency_penalty, presence_penalty, logit_bias
and min_tokens are the engine's logits processors (engine/logits_processors.py, vLLM's semantics); `n`
samples n sequences of the prompt, choice i seeded with seed + i when a seed is given (vLLM's
parallel sampling); `stop` strings end a choice where its text completes one (worker/stop_strings.py,
matched on text detokenized with `skip_special_tokens`); a structured-output `constraint` (JSON schema or
object, regex, EBNF grammar, choice, structural tag) holds every token to its grammar
(worker/structured_output.py). A field the engine cannot honour is refused with
INVALID_ARGUMENT naming it, never ignored. Moot for a worker that returns token ids:
`spaces_between_special_tokens` and `include_stop_str_in_output` shape the text the gateway makes itself.

Response shapes (what smg reads, as smg's reference vLLM servicer sends them): a stream sends one
GenerateStreamChunk per token (delta token ids, `completion_tokens` the delta's count, delta logprobs,
`index` its choice), then, when a choice ends, a GenerateComplete of that index that repeats its last
delta with the finish reason; chunks of different choices interleave. A non-streaming call sends, once
every choice has ended, one GenerateComplete per choice, in index order, with all its output tokens.
Finish reasons are vLLM's strings: "length", "stop" (EOS; a stop token, then named in `matched_token_id`;
or a stop string, named in `matched_stop_str`) and "abort". `prompt_logprobs` (each prompt token's log-probability
and the top k there, from a forward of its own: Engine.prompt_logprobs) come in each choice's first chunk and in
every Complete.
"""
from __future__ import annotations

import datetime
import dataclasses
from dataclasses import dataclass

from engine import api
from engine.config import SUPPORTED_ARCHITECTURES
from engine.errors import InvalidArgument
from engine.sampling import SamplingParams, StoppingCriteria
from engine.sequence import FinishReason
from engine.tokenizer import Tokenizer
from worker.gateway_pb import vpb
from worker.stop_strings import check_stops
from worker.structured_output import constraint_of

GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it samples greedily
UNSET_TEMPERATURE = 1.0  # vLLM's default when the request leaves temperature unset
FINISH_REASONS = {FinishReason.LENGTH: "length", FinishReason.EOS: "stop", FinishReason.STOP_TOKEN: "stop"}
ABORT = "abort"
STOP = "stop"


@dataclass(frozen=True)
class ModelFacts:
    """What the gateway reports and validates against: fixed once the engine has loaded."""

    model_path: str  # absolute checkpoint directory; also where the tokenizer files are looked for
    served_model_name: str  # the model id clients name (--served-model-name, else the checkpoint directory's name)
    model_type: str  # llama | mistral | qwen2 | qwen3
    architectures: tuple[str, ...]
    vocab_size: int
    max_seq_len: int  # tokens per sequence, prompt and output together
    eos_token_ids: tuple[int, ...]
    bos_token_id: int
    dtype: str  # weights and KV cache, e.g. "bfloat16"
    block_size: int
    max_running: int  # sequences decoded at once: min(max_slots, max_batch_size)
    max_top_logprobs: int
    kernel_backend: str
    version: str


def model_facts(engine) -> ModelFacts:
    """Run on the engine thread (EngineRunner.call)."""
    mc, info = engine.model_config, engine.info()
    archs = tuple(name for name, arch in SUPPORTED_ARCHITECTURES.items() if arch == mc.architecture)[:1]
    return ModelFacts(
        model_path=str(engine.model_path.resolve()), served_model_name=info.model_id, model_type=mc.architecture,
        architectures=archs, vocab_size=info.vocab_size, max_seq_len=info.max_seq_len,
        eos_token_ids=tuple(info.eos_token_ids), bos_token_id=mc.bos_token_id or 0, dtype=info.dtype,
        block_size=info.block_size, max_running=min(info.max_slots, info.max_batch_size),
        max_top_logprobs=engine.config.max_top_logprobs, kernel_backend=info.kernel_backend, version=info.version)


# ---------------------------------------------------------------------------------------------
# GenerateRequest -> engine


@dataclass(frozen=True)
class GenerateSpec:
    prompt: list[int]
    sampling: SamplingParams
    stopping: StoppingCriteria
    max_total_tokens: int  # the KV reservation of each choice: prompt + max_tokens, or the whole context
    num_logprobs: int | None  # None: no logprobs; 0: the sampled token's; n: and the top n
    n: int = 1  # choices: sequences sampled from the prompt
    stop: tuple[str, ...] = ()  # stop strings (worker/stop_strings.py)
    skip_special_tokens: bool = True  # how the text stop strings are matched in is detokenized
    constraint: tuple[str, str] | None = None  # structured output (worker/structured_output.py): (kind, its text)
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's logprob and the top k there

    def sampling_for(self, index: int) -> SamplingParams:
        """Choice `index`'s parameters: with a seed, seed + index (mod 2**64; vLLM's parallel sampling seeds its
        children so); without one each choice's sequence draws its own."""
        if self.sampling.seed is None or index == 0:
            return self.sampling
        return dataclasses.replace(self.sampling, seed=(self.sampling.seed + index) % 2**64)


def _refuse(field: str, why: str = "is not supported by this worker yet") -> InvalidArgument:
    return InvalidArgument(f"{field} {why}")


def _check_request(request: vpb.GenerateRequest) -> None:
    """Request-level fields beyond the prompt and sampling: each one set is refused by name."""
    if request.HasField("mm_inputs") or len(request.extra_mm_inputs) or request.HasField("media_refs"):
        field = "mm_inputs" if request.HasField("mm_inputs") else \
            "extra_mm_inputs" if len(request.extra_mm_inputs) else "media_refs"
        raise _refuse(field, "is not supported: this worker serves a text-only model")
    if request.HasField("kv_transfer_params") or request.HasField("kv_transfer_params_json"):
        field = "kv_transfer_params" if request.HasField("kv_transfer_params") else "kv_transfer_params_json"
        raise _refuse(field, "is not supported: this worker does no prefill/decode disaggregation")
    if request.HasField("data_parallel_rank") and request.data_parallel_rank != 0:
        raise _refuse("data_parallel_rank", f"must be 0 (this worker is one rank), got {request.data_parallel_rank}")


def _check_sampling(p: vpb.SamplingParams, facts: ModelFacts) -> None:
    """Sampling fields the engine has no counterpart for yet: refused by name when set; and the fields whose
    vLLM limits are the gateway's to check."""
    max_top_logprobs = facts.max_top_logprobs
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(p, name)
        if p.HasField(name) and not 0 <= value <= max_top_logprobs:
            raise _refuse(f"sampling_params.{name}", f"must be in [0, {max_top_logprobs}] on this worker "
                                                     f"(-1, all of the vocabulary, is not served), got {value}")
    if p.n > facts.max_running:
        raise _refuse("sampling_params.n", f"must be at most {facts.max_running} (the sequences this worker runs "
                                           f"at once), got {p.n}")
    if p.HasField("max_tokens") and p.min_tokens > p.max_tokens:
        raise _refuse("sampling_params.min_tokens", f"must be <= max_tokens ({p.max_tokens}), got {p.min_tokens}")
    if p.HasField("max_tokens") and p.max_tokens < 1:
        raise _refuse("sampling_params.max_tokens", f"must be >= 1, got {p.max_tokens}")
    if p.HasField("truncate_prompt_tokens") and not (p.truncate_prompt_tokens >= 1 or p.truncate_prompt_tokens == -1):
        raise _refuse("sampling_params.truncate_prompt_tokens",
                      f"must be >= 1, or -1 for the context length, got {p.truncate_prompt_tokens}")


def _prompt_of(request: vpb.GenerateRequest, tokenizer: Tokenizer | None) -> list[int]:
    if request.WhichOneof("input") == "text":
        if tokenizer is None:
            raise _refuse("text", "input needs the checkpoint's tokenizer, which this worker's checkpoint lacks; "
                                  "send tokenized.input_ids")
        prompt = tokenizer.encode(request.text)
        if not prompt:
            raise InvalidArgument("text is empty: a prompt needs at least one token")
        return prompt
    if not request.tokenized.input_ids:
        raise InvalidArgument("tokenized.input_ids is empty: a prompt needs at least one token")
    return list(request.tokenized.input_ids)

def generate_spec(request: vpb.GenerateRequest, facts: ModelFacts, tokenizer: Tokenizer | None = None) -> GenerateSpec:
    """Validates a GenerateRequest and maps it to the engine's terms; raises InvalidArgument. tokenizer: the
    checkpoint's (None: it has none), which text prompts and stop strings need. A text prompt (`text`, which
    smg never sends: it tokenizes) is encoded as vLLM encodes one, with the tokenizer's special tokens (BOS)."""
    _check_request(request)
    p = request.sampling_params
    _check_sampling(p, facts)
    stops = check_stops(list(p.stop), tokenizer)
    constraint = constraint_of(p)

    prompt = _prompt_of(request, tokenizer)
    if p.HasField("truncate_prompt_tokens"):  # keep the last k tokens, as vLLM does
        keep = facts.max_seq_len if p.truncate_prompt_tokens == -1 else p.truncate_prompt_tokens
        prompt = prompt[-keep:]
    context = facts.max_seq_len
    if p.HasField("max_tokens"):
        total = len(prompt) + p.max_tokens
        if total > context:
            raise InvalidArgument(f"the prompt ({len(prompt)} tokens) and max_tokens ({p.max_tokens}) need {total} "
                                  f"tokens; this worker's context length is {context}")
    elif len(prompt) >= context:
        raise InvalidArgument(f"the prompt ({len(prompt)} tokens) leaves no room for a new token in this worker's "
                              f"context length of {context}")
    else:
        total = context

    temperature = p.temperature if p.HasField("temperature") else UNSET_TEMPERATURE
    if 0.0 <= temperature < GREEDY_BELOW:
        temperature = 0.0
    sampling = SamplingParams(
        temperature=temperature,
        top_k=p.top_k,
        top_p=p.top_p if p.top_p else 1.0,
        # int32 on the wire; the engine's seeds are 64-bit: a negative seed is taken modulo 2**64.
        seed=p.seed % 2**64 if p.HasField("seed") else None,
        repetition_penalty=p.repetition_penalty if p.repetition_penalty else 1.0,
        top_logprobs=p.logprobs if p.HasField("logprobs") else 0,
        min_p=p.min_p, frequency_penalty=p.frequency_penalty, presence_penalty=p.presence_penalty,
        logit_bias=tuple(sorted(p.logit_bias.items())), token_mask=constraint is not None)
    stopping = StoppingCriteria(max_new_tokens=p.max_tokens if p.HasField("max_tokens") else 0,
                                stop_token_ids=frozenset(p.stop_token_ids), ignore_eos=p.ignore_eos,
                                min_tokens=p.min_tokens)
    try:  # the engine's own checks, here so that the message names the request's field
        sampling.validate(facts.vocab_size, facts.max_top_logprobs)
        stopping.validate(facts.vocab_size)
    except InvalidArgument as e:
        raise InvalidArgument(f"sampling_params.{e}") from None
    return GenerateSpec(prompt, sampling, stopping, total, p.logprobs if p.HasField("logprobs") else None,
                        max(p.n, 1), stops, p.skip_special_tokens, constraint,
                        p.prompt_logprobs if p.HasField("prompt_logprobs") else None)


# ---------------------------------------------------------------------------------------------
# engine -> GenerateResponse


def output_logprobs(tokens: list[api.TokenResult], num_logprobs: int | None) -> vpb.OutputLogProbs | None:
    """The sampled tokens' logprobs (the model's raw log-softmax, as vLLM reports by default) and, with
    num_logprobs > 0, the top alternatives at each position; None when the request asked for none."""
    if num_logprobs is None or not tokens:
        return None
    msg = vpb.OutputLogProbs(token_logprobs=[t.logprob for t in tokens], token_ids=[t.token_id for t in tokens])
    if num_logprobs:
        for t in tokens:
            top = t.top_logprobs[:num_logprobs]
            msg.top_logprobs.add(values=[lp for _, lp in top], token_ids=[i for i, _ in top])
    return msg


def input_logprobs(prompt: list[int], lp: api.PromptLogprobs) -> vpb.InputLogProbs:
    """The prompt's logprobs as smg's reference vLLM servicer sends them: one entry per prompt token, the first
    without a value (nothing predicts it) and with no alternatives; the top alternatives best first."""
    msg = vpb.InputLogProbs(token_ids=prompt)
    msg.token_logprobs.add()
    msg.top_logprobs.add()
    for value, ids, values in zip(lp.values, lp.top_ids, lp.top_values):
        msg.token_logprobs.add(value=value)
        msg.top_logprobs.add(values=values, token_ids=ids)
    return msg


def chunk(tokens: list[api.TokenResult], prompt_tokens: int, num_logprobs: int | None,
          cached_tokens: int = 0, index: int = 0, prompt_logprobs: vpb.InputLogProbs | None = None
          ) -> vpb.GenerateResponse:
    """prompt_logprobs: on a choice's first chunk only. Built by field (a streamed token's message, on the event
    loop that launches the steps): fields left at their defaults cost nothing, keyword construction ~3x as much."""
    response = vpb.GenerateResponse()
    msg = response.chunk
    msg.token_ids.extend([t.token_id for t in tokens])
    msg.prompt_tokens, msg.completion_tokens = prompt_tokens, len(tokens)
    if cached_tokens:
        msg.cached_tokens = cached_tokens
    if index:
        msg.index = index
    if num_logprobs is not None and tokens:
        msg.output_logprobs.CopyFrom(output_logprobs(tokens, num_logprobs))
    if prompt_logprobs is not None:
        msg.input_logprobs.CopyFrom(prompt_logprobs)
    return response


def finish_reason(tokens: list[api.TokenResult]) -> str:
    """vLLM's finish reason of a sequence whose last token is tokens[-1]; "abort" if it had not finished."""
    return FINISH_REASONS.get(tokens[-1].finish_reason, ABORT) if tokens else ABORT


def complete(tokens: list[api.TokenResult], prompt_tokens: int, num_logprobs: int | None, reason: str,
             cached_tokens: int = 0, index: int = 0, matched_stop: str | None = None,
             prompt_logprobs: vpb.InputLogProbs | None = None) -> vpb.GenerateResponse:
    """tokens: all output tokens of choice `index` (non-streaming) or its stream's last delta; matched_stop:
    the stop string that ended it (reason "stop"); prompt_logprobs: the prompt's (every Complete carries them)."""
    msg = vpb.GenerateComplete(
        output_ids=[t.token_id for t in tokens], finish_reason=reason, prompt_tokens=prompt_tokens,
        completion_tokens=len(tokens), cached_tokens=cached_tokens,
        output_logprobs=output_logprobs(tokens, num_logprobs), input_logprobs=prompt_logprobs, index=index)
    if matched_stop is not None:
        msg.matched_stop_str = matched_stop
    elif tokens and tokens[-1].finish_reason == FinishReason.STOP_TOKEN:
        msg.matched_token_id = tokens[-1].token_id
    return vpb.GenerateResponse(complete=msg)


# ---------------------------------------------------------------------------------------------
# Model, server and load reports


def model_info(f: ModelFacts, tokenizer_path: str) -> vpb.GetModelInfoResponse:
    """tokenizer_path: the directory holding the tokenizer files, "" when the checkpoint has none (smg
    then needs --tokenizer-path or --model-path of its own)."""
    return vpb.GetModelInfoResponse(
        model_path=f.model_path, is_generation=True, max_context_length=f.max_seq_len, vocab_size=f.vocab_size,
        supports_vision=False, served_model_name=f.served_model_name, tokenizer_path=tokenizer_path,
        model_type=f.model_type, architectures=list(f.architectures), eos_token_ids=list(f.eos_token_ids),
        bos_token_id=f.bos_token_id, max_req_input_len=f.max_seq_len - 1)


def server_info(f: ModelFacts, active_requests: int, paused: bool, last_receive: float,
                uptime_s: float) -> vpb.GetServerInfoResponse:
    return vpb.GetServerInfoResponse(
        active_requests=active_requests, is_paused=paused, last_receive_timestamp=last_receive,
        uptime_seconds=uptime_s, server_type="metrale-worker", data_parallel_size=1, kv_cache_dtype=f.dtype,
        block_size=f.block_size, attention_backend=f.kernel_backend, model_dtype=f"torch.{f.dtype}",
        max_num_seqs=f.max_running)


@dataclass(frozen=True)
class GatewayLoad:
    """What the gateway itself knows of its requests (worker/gateway_requests.py)."""

    waiting: int  # sequences of Generate calls admitted by the servicer that have not started (n per call)
    waiting_prompt_tokens: int  # their prompt tokens (not yet looked up in the prefix cache)
    gen_throughput: float  # tokens per second streamed over the recent window


def loads(info: api.EngineInfo, f: ModelFacts, g: GatewayLoad) -> vpb.GetLoadsResponse:
    """One SchedulerLoad (rank 0). Running counts every live sequence of the engine (Generate streams of
    either service and ModelWorker sequences alike); KV usage is the share of blocks reserved."""
    used_blocks = info.total_blocks - info.free_blocks
    c = info.prefix_cache
    hit_rate = c.hit_tokens / c.query_tokens if c.query_tokens else 0.0
    load = vpb.SchedulerLoad(
        dp_rank=0, num_running_reqs=info.live_sequences, num_waiting_reqs=g.waiting,
        num_total_reqs=info.live_sequences + g.waiting, num_used_tokens=used_blocks * info.block_size,
        max_total_num_tokens=info.total_blocks * info.block_size,
        token_usage=used_blocks / info.total_blocks if info.total_blocks else 0.0,
        gen_throughput=g.gen_throughput, cache_hit_rate=hit_rate,
        utilization=1.0 - info.free_slots / info.max_slots if info.max_slots else 0.0,
        max_running_requests=f.max_running, num_waiting_uncached_tokens=g.waiting_prompt_tokens)
    return vpb.GetLoadsResponse(timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                                version=info.version, dp_rank_count=1, loads=[load])
