"""Sampling parameters, the counter-based RNG, and the reference sampler and speculative acceptance.

Every random draw is a pure function of (seed, position, stream, index), so a sequence samples the
same tokens whether it runs alone or in any batch, on CPU or on GPU (kernels_cu/sampling.cu computes
the same hash). Streams: 0 = the token draw (Gumbel-max over the vocabulary, index = token id),
1 = the speculative accept/reject draw (index 0).
"""
from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from engine.errors import InvalidArgument

MASK32 = 0xFFFFFFFF
HASH_MUL = 0x45D9F3B  # < 2**27, so (x < 2**32) * HASH_MUL fits an int64
GOLDEN32 = 0x9E3779B9
STREAM_TOKEN = 0
STREAM_ACCEPT = 1

# Per-request limits of the logits processors (engine/logits_processors.py): each sizes a fixed per-slot table
# of the device state (engine/state.py), so a request above one is refused, never truncated.
MAX_LOGIT_BIAS = 64  # logit_bias entries
MAX_MIN_TOKENS_STOP_IDS = 64  # stop_token_ids of a request with min_tokens (masked until min_tokens are out)
MAX_PENALTY = 2.0  # |frequency_penalty|, |presence_penalty| (OpenAI's and vLLM's range)
MAX_LOGIT_BIAS_VALUE = 100.0  # |bias| (OpenAI's range)

# Logits-processor flags: which processors a request uses (engine/logits_processors.py, which documents them).
MIN_TOKENS = 1  # stop ids and EOS masked until min_tokens new tokens are out
LOGIT_BIAS = 2
PENALTIES = 4  # frequency / presence penalty (reads the output counts)
MIN_P = 8
REPETITION = 16  # a processed row's repetition penalty (only with another flag: then it moves out of the kernel)
TOKEN_MASK = 32  # structured output: only the tokens of a mask the caller sets before each step (Engine.set_token_mask)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1 (or 0): off
    seed: int | None = None  # None: a random seed is drawn at alloc
    repetition_penalty: float = 1.0  # 1 (or 0): off
    top_logprobs: int = 0
    # The logits processors (vLLM's semantics; applied in engine/logits_processors.py). 0 / empty: off.
    min_p: float = 0.0  # keep tokens with probability >= min_p x the most likely token's (after temperature)
    frequency_penalty: float = 0.0  # logit -= frequency_penalty x (times the token is in the OUTPUT so far)
    presence_penalty: float = 0.0  # logit -= presence_penalty if the token is in the output so far
    # (token id, bias) pairs, sorted by id; a mapping given here is converted. Added to the raw logits.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Structured output: each new token is drawn from the tokens a mask allows, set by the caller before every step
    # that samples one (Engine.set_token_mask; the caller runs the grammar, e.g. worker/structured_output.py).
    token_mask: bool = False

    def __post_init__(self):
        if isinstance(self.logit_bias, Mapping):
            object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias.items())))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @functools.cached_property
    def processors(self) -> int:
        """The logits-processor flags of these parameters (computed once: a decode plan reads them per sequence)."""
        flags = LOGIT_BIAS if self.logit_bias else 0
        if self.frequency_penalty or self.presence_penalty:
            flags |= PENALTIES
        if self.min_p and not self.greedy:  # greedy: the most likely token always stays
            flags |= MIN_P
        if self.repetition_penalty != 1.0:
            flags |= REPETITION
        if self.token_mask:
            flags |= TOKEN_MASK
        return flags

    def validate(self, vocab_size: int, max_top_logprobs: int) -> None:
        self._validate_processors(vocab_size)
        t, p, r = self.temperature, self.top_p, self.repetition_penalty
        if not math.isfinite(t) or t < 0:
            raise InvalidArgument(f"temperature must be a finite number >= 0, got {t}")
        if not math.isfinite(p) or not 0.0 < p <= 1.0:
            raise InvalidArgument(f"top_p must be in (0, 1], got {p}")
        if self.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0, got {self.top_k}")
        if not math.isfinite(r) or r <= 0:
            raise InvalidArgument(f"repetition_penalty must be a finite number > 0, got {r}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise InvalidArgument(f"seed must fit in 64 bits, got {self.seed}")
        if not 0 <= self.top_logprobs <= min(max_top_logprobs, vocab_size):
            raise InvalidArgument(f"top_logprobs must be in [0, {min(max_top_logprobs, vocab_size)}], "
                                  f"got {self.top_logprobs}")

    def _validate_processors(self, vocab_size: int) -> None:
        if not math.isfinite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidArgument(f"min_p must be in [0, 1] (0: off), got {self.min_p}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value) or abs(value) > MAX_PENALTY:
                raise InvalidArgument(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0: off), got {value}")
        bias = self.logit_bias
        if len(bias) > MAX_LOGIT_BIAS:
            raise InvalidArgument(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS} are served")
        ids = [t for t, _ in bias]
        if len(set(ids)) != len(ids):
            twice = sorted({t for t in ids if ids.count(t) > 1})
            raise InvalidArgument(f"logit_bias names a token id twice: {twice[:8]}")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidArgument(f"logit_bias token ids {bad[:8]} are outside the vocabulary (size {vocab_size})")
        bad_values = [(t, v) for t, v in bias if not (math.isfinite(v) and abs(v) <= MAX_LOGIT_BIAS_VALUE)]
        if bad_values:
            t, v = bad_values[0]
            limit = MAX_LOGIT_BIAS_VALUE
            raise InvalidArgument(f"logit_bias values must be in [-{limit:g}, {limit:g}], got {v} for token {t}")


@dataclass(frozen=True)
class StoppingCriteria:
    max_new_tokens: int = 0  # 0: until the reservation is full
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    ignore_eos: bool = False
    # EOS and stop_token_ids cannot be sampled before this many new tokens (vLLM's min_tokens: the model's EOS ids
    # are masked whatever ignore_eos says, as vLLM does). 0: off.
    min_tokens: int = 0

    @functools.cached_property
    def processors(self) -> int:
        """The logits-processor flags of these criteria."""
        return MIN_TOKENS if self.min_tokens else 0

    def validate(self, vocab_size: int) -> None:
        if self.max_new_tokens < 0:
            raise InvalidArgument(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        bad = sorted(t for t in self.stop_token_ids if not 0 <= t < vocab_size)
        if bad:
            raise InvalidArgument(f"stop_token_ids {bad[:8]} are outside the vocabulary (size {vocab_size})")
        if self.min_tokens < 0:
            raise InvalidArgument(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_new_tokens and self.min_tokens > self.max_new_tokens:
            raise InvalidArgument(f"min_tokens ({self.min_tokens}) must be <= max_new_tokens ({self.max_new_tokens})")
        if self.min_tokens and len(self.stop_token_ids) > MAX_MIN_TOKENS_STOP_IDS:
            raise InvalidArgument(f"stop_token_ids may hold at most {MAX_MIN_TOKENS_STOP_IDS} ids with min_tokens "
                                  f"(they are masked until min_tokens are out), got {len(self.stop_token_ids)}")


# ---------------------------------------------------------------------------------------------
# Counter-based RNG. Integer tensors hold uint32 values in int64 so that every step is exact.

def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash (the 0x45d9f3b integer hash), on int64 tensors holding uint32 values."""
    x = (((x >> 16) ^ x) * HASH_MUL) & MASK32
    x = (((x >> 16) ^ x) * HASH_MUL) & MASK32
    return (x >> 16) ^ x


def counter_hash(seed: torch.Tensor, position: torch.Tensor, stream: int, index: torch.Tensor) -> torch.Tensor:
    """uint32 hash of (seed: uint64, position, stream, index), broadcast over the arguments' shapes."""
    seed_lo = seed & MASK32
    seed_hi = (seed >> 32) & MASK32
    h = _mix32((index + stream * GOLDEN32) & MASK32)
    h = _mix32(h ^ (position & MASK32))
    h = _mix32(h ^ seed_lo)
    return _mix32(h ^ seed_hi)


def uniform(seed: torch.Tensor, position: torch.Tensor, stream: int, index: torch.Tensor) -> torch.Tensor:
    """float32 uniform in (0, 1) with 23 random bits: ((h >> 9) + 0.5) / 2**23."""
    h = counter_hash(seed, position, stream, index)
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / 8388608.0)


def gumbel(seed: torch.Tensor, position: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, vocab] Gumbel noise for the token draw of each row (seed [N], position [N])."""
    index = torch.arange(vocab_size, device=seed.device, dtype=torch.int64)
    u = uniform(seed[:, None], position[:, None], STREAM_TOKEN, index[None, :])
    return -torch.log(-torch.log(u))


def seed_as_int64(seed: int) -> int:
    """A uint64 seed stored in an int64 tensor (two's complement); the hash reads it back bitwise."""
    return seed - 2**64 if seed >= 2**63 else seed


# ---------------------------------------------------------------------------------------------
# Reference sampler (torch ops, any device).

@dataclass
class SamplingTensors:
    """Per-row sampling parameters for N rows of logits."""

    temperature: torch.Tensor  # [N] float32, 0 = greedy
    top_k: torch.Tensor  # [N] int64, 0 = off
    top_p: torch.Tensor  # [N] float32, 1 = off
    seed: torch.Tensor  # [N] int64 (uint64 bits)
    repetition_penalty: torch.Tensor  # [N] float32, 1 = off
    seen: torch.Tensor  # [N, vocab] bool: tokens already in the sequence (read only in rows whose penalty is not 1;
    # CudaOps leaves the other rows as they were)
    position: torch.Tensor  # [N] int64: index in the sequence of the token being drawn


def penalized_logits(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """HF-style repetition penalty: seen tokens' logits divided (if > 0) or multiplied by the penalty."""
    pen = st.repetition_penalty[:, None]
    scaled = torch.where(logits > 0, logits / pen, logits * pen)
    return torch.where(st.seen & (pen != 1.0), scaled, logits)


def target_logprobs(logits: torch.Tensor, st: SamplingTensors, filtered: bool | None = None) -> torch.Tensor:
    """[N, vocab] log-probabilities of the distribution a row samples from: penalty, temperature,
    top-k, top-p (in that order, as transformers applies them). Greedy rows get a one-hot (0 / -inf).
    filtered: whether any row uses top-k/top-p; None reads it from st (a host sync), a bool given by
    the caller keeps the function free of host syncs (capturable)."""
    x = penalized_logits(logits.float(), st)
    greedy = st.temperature == 0.0
    x = x / torch.where(greedy, torch.ones_like(st.temperature), st.temperature)[:, None]
    argmax = torch.argmax(x, dim=-1)
    onehot = torch.full_like(x, float("-inf")).scatter(-1, argmax[:, None], 0.0)
    if filtered is None:
        filtered = bool(((st.top_k > 0) | (st.top_p < 1.0)).any())
    if not filtered:
        return torch.where(greedy[:, None], onehot, torch.log_softmax(x, dim=-1))
    vocab = x.shape[-1]
    sorted_x, order = torch.sort(x, dim=-1, descending=True)
    rank = torch.arange(vocab, device=x.device)[None, :]
    k = torch.where(st.top_k > 0, st.top_k.clamp(max=vocab), torch.full_like(st.top_k, vocab))
    keep_sorted = rank < k[:, None]
    probs_sorted = torch.softmax(sorted_x.masked_fill(~keep_sorted, float("-inf")), dim=-1)
    mass_before = torch.cumsum(probs_sorted, dim=-1) - probs_sorted
    keep_sorted &= (mass_before < st.top_p[:, None]) | (rank == 0)
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    logp = torch.log_softmax(x.masked_fill(~keep, float("-inf")), dim=-1)
    return torch.where(greedy[:, None], onehot, logp)


def draw(logp: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Gumbel-max draw from log-probabilities [N, vocab] (exact for any distribution; -inf never wins).
    Rows with temperature 0 hold a one-hot, so the draw is their argmax."""
    return torch.argmax(logp + gumbel(st.seed, st.position, logp.shape[-1]), dim=-1)


@dataclass
class SampleOutput:
    token_ids: torch.Tensor  # [N] int64
    logprobs: torch.Tensor  # [N] float32: raw model log-softmax of the chosen token
    top_ids: torch.Tensor | None  # [N, n] int64
    top_logprobs: torch.Tensor | None  # [N, n] float32


def model_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> SampleOutput:
    raw = torch.log_softmax(logits.float(), dim=-1)
    chosen = raw.gather(-1, token_ids[:, None]).squeeze(-1)
    if num_top:
        top = torch.topk(raw, num_top, dim=-1)
        return SampleOutput(token_ids, chosen, top.indices, top.values)
    return SampleOutput(token_ids, chosen, None, None)


def sample(logits: torch.Tensor, st: SamplingTensors, num_top: int = 0) -> SampleOutput:
    """One token per row of logits [N, vocab]."""
    if bool((st.temperature == 0.0).all()):
        token_ids = torch.argmax(penalized_logits(logits.float(), st), dim=-1)
    else:
        token_ids = draw(target_logprobs(logits, st), st)
    return model_logprobs(logits, token_ids, num_top)


def accept_drafts(target_logp: torch.Tensor, draft_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                  seed: torch.Tensor, position: torch.Tensor) -> tuple[int, int]:
    """Speculative acceptance for one sequence.

    target_logp [k+1, vocab]: the target's sampling distribution at each draft position and one past.
    draft_ids [k]; draft_probs [k, vocab] or None (drafts taken as deterministic: q = one-hot).
    seed, position [k+1]: each row's seed and the index of the token it decides.
    Accept draft i with probability min(1, p(x)/q(x)); on the first rejection draw from
    normalize(max(p - q, 0)); if all are accepted draw the bonus token from row k. This keeps the
    target distribution exactly (Leviathan et al. 2023, Chen et al. 2023); for greedy rows p is a
    one-hot, so it is an exact-match test.
    Returns (num_accepted, the one token drawn from the target after them).
    """
    k = draft_ids.shape[0]
    p = target_logp[:k].exp()
    if draft_probs is None:
        q = torch.zeros_like(p).scatter(-1, draft_ids[:, None], 1.0)
    else:
        q = draft_probs.to(p)
    rows = torch.arange(k, device=p.device)
    p_x = p[rows, draft_ids]
    q_x = q[rows, draft_ids]
    u = uniform(seed[:k], position[:k], STREAM_ACCEPT, torch.zeros_like(position[:k]))
    accepted = (u * q_x < p_x) & (p_x > 0)
    rejected = (~accepted).nonzero()
    j = int(rejected[0]) if rejected.numel() else k
    if j < k:
        residual = (p[j] - q[j]).clamp(min=0)
        if float(residual.sum()) <= 0:  # p == q: every draft would be accepted; cannot happen when rejected
            residual = p[j]
        logp_j = torch.log(residual)
    else:
        logp_j = target_logp[k]
    noise = gumbel(seed[j:j + 1], position[j:j + 1], logp_j.shape[-1])
    return j, int(torch.argmax(logp_j[None, :] + noise, dim=-1)[0])
