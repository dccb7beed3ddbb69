"""Tensor-parallel sharding arithmetic (Megatron style): which rows or columns of each checkpoint tensor a rank
holds. Pure arithmetic on a ModelConfig, no torch.distributed (engine/parallel.py does the communication).

  q_proj, k_proj, v_proj (+ bias)   column-parallel: the rank's query heads, and the KV heads they read
  o_proj                            row-parallel: the columns of the rank's query heads; all-reduce after
  gate_proj, up_proj                column-parallel: the rank's slice of the intermediate dimension (both alike)
  down_proj                         row-parallel: the same slice, as columns; all-reduce after
  lm_head (or the tied embedding)   vocab-parallel: the rank's rows of the vocabulary; logits all-gathered
  embedding, norms, q/k norms       replicated

Query heads: num_heads must divide by the TP size N; rank r holds heads [r * H/N, (r + 1) * H/N).
KV heads: the attention ops need a uniform GQA group on each rank (local query head j reads local KV head
j // local_group). With g = H / Hkv query heads per KV head and hpr = H / N per rank, local_group = gcd(hpr, g):
the rank's heads fall in chunks of local_group consecutive heads that never straddle a KV group, and chunk c
reads KV head (r * hpr + c * local_group) // g. So a rank holds hpr / local_group KV heads, replicated across
ranks (and within one, where a KV group is cut by a rank boundary) only where needed:
  H=32 Hkv=8  N=2: 4 KV heads per rank, each held once (the plain split)
  H=8  Hkv=1  N=2: KV head 0 on both ranks (replicated: fewer KV heads than ranks)
  H=6  Hkv=3  N=2: rank 0 holds KV heads 0, 0, 1 and rank 1 holds 1, 2, 2 (3 does not divide by 2)
  H=24 Hkv=6  N=4: rank 0 holds KV heads 0, 0, 1; rank 1 holds 1, 2, 2; ...
The intermediate dimension and the vocabulary split into N contiguous parts whose sizes differ by at most 1."""
from __future__ import annotations

import math
from dataclasses import dataclass

from engine.config import ModelConfig
from engine.errors import ConfigError

ROW_PARALLEL = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


@dataclass(frozen=True)
class Slice:
    """Which part of a checkpoint tensor a rank reads: `ranges` (start, stop) along `dim`, concatenated."""

    dim: int
    ranges: tuple[tuple[int, int], ...]

    @property
    def size(self) -> int:
        return sum(b - a for a, b in self.ranges)


def split(n: int, size: int, rank: int) -> tuple[int, int]:
    """Rank's contiguous part [start, stop) of n items over size ranks (sizes differ by at most 1)."""
    return rank * n // size, (rank + 1) * n // size


def check_tensor_parallel(cfg: ModelConfig, size: int) -> None:
    """A ConfigError unless the model splits over `size` ranks."""
    if size < 1:
        raise ConfigError(f"tensor_parallel_size must be >= 1, got {size}")
    if cfg.num_heads % size:
        raise ConfigError(f"--tensor-parallel-size {size} does not divide the model's {cfg.num_heads} attention "
                          f"heads (num_attention_heads); pick a divisor of {cfg.num_heads}")
    if cfg.intermediate_size < size or cfg.vocab_size < size:
        raise ConfigError(f"--tensor-parallel-size {size} exceeds the model's intermediate size or vocabulary")


@dataclass(frozen=True)
class ShardPlan:
    """What rank `rank` of `size` holds of a model `cfg` (see the module doc)."""

    cfg: ModelConfig
    rank: int = 0
    size: int = 1

    def __post_init__(self):
        check_tensor_parallel(self.cfg, self.size)
        if not 0 <= self.rank < self.size:
            raise ConfigError(f"rank {self.rank} is outside [0, {self.size})")

    # ------------------------------------------------------------------ heads

    @property
    def num_heads(self) -> int:
        """Query heads on this rank."""
        return self.cfg.num_heads // self.size

    @property
    def first_head(self) -> int:
        return self.rank * self.num_heads

    @property
    def local_group(self) -> int:
        """Query heads per local KV head."""
        return math.gcd(self.num_heads, self.cfg.num_heads // self.cfg.num_kv_heads)

    @property
    def kv_heads(self) -> tuple[int, ...]:
        """The global KV head behind each local KV head, in local order (a head may repeat)."""
        group = self.cfg.num_heads // self.cfg.num_kv_heads
        return tuple((self.first_head + c * self.local_group) // group
                     for c in range(self.num_heads // self.local_group))

    @property
    def num_kv_heads(self) -> int:
        return len(self.kv_heads)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.cfg.head_dim

    # ------------------------------------------------------------------ MLP and vocabulary

    @property
    def intermediate(self) -> tuple[int, int]:
        return split(self.cfg.intermediate_size, self.size, self.rank)

    @property
    def vocab(self) -> tuple[int, int]:
        return split(self.cfg.vocab_size, self.size, self.rank)

    @property
    def vocab_widths(self) -> tuple[int, ...]:
        """Each rank's number of vocabulary rows (for the logits all-gather)."""
        return tuple(b - a for a, b in (split(self.cfg.vocab_size, self.size, r) for r in range(self.size)))

    # ------------------------------------------------------------------ checkpoint tensors

    def slice_for(self, name: str) -> Slice | None:
        """The part of checkpoint tensor `name` (a full name or a layer-relative one) this rank reads; None:
        the whole tensor (replicated, or a single rank)."""
        if self.size == 1:
            return None
        d = self.cfg.head_dim
        suffix = name.split(".", 3)[-1] if name.startswith("model.layers.") else name
        q = (self.first_head * d, (self.first_head + self.num_heads) * d)
        if suffix in ("self_attn.q_proj.weight", "self_attn.q_proj.bias"):
            return Slice(0, (q,))
        if suffix in ("self_attn.k_proj.weight", "self_attn.k_proj.bias", "self_attn.v_proj.weight",
                      "self_attn.v_proj.bias"):
            return Slice(0, _merged([(h * d, (h + 1) * d) for h in self.kv_heads]))
        if suffix == "self_attn.o_proj.weight":
            return Slice(1, (q,))
        if suffix in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
            return Slice(0, (self.intermediate,))
        if suffix == "mlp.down_proj.weight":
            return Slice(1, (self.intermediate,))
        if suffix == "lm_head.weight":
            return Slice(0, (self.vocab,))
        return None

    def lm_head_slice(self) -> Slice | None:
        """The LM head's rows (also when it is the tied embedding, which itself stays whole)."""
        return None if self.size == 1 else Slice(0, (self.vocab,))


def _merged(ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Adjacent ranges joined (a repeated head stays a range of its own)."""
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return tuple(out)
