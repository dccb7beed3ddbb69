"""Rotary position embedding tables, with the scaling variants transformers defines
(transformers/modeling_rope_utils.py): default, linear, llama3 and dynamic NTK."""
from __future__ import annotations

import math

import torch

from engine.config import ModelConfig


def inv_freq(cfg: ModelConfig, seq_len: int | None = None) -> torch.Tensor:
    """[head_dim / 2] fp32 inverse frequencies; seq_len matters only for dynamic NTK."""
    rope, dim = cfg.rope, cfg.head_dim
    base = rope.theta
    if rope.rope_type == "dynamic":
        # Dynamic NTK: stretch the base once the sequence outgrows max_position_embeddings.
        length = max(seq_len or 0, cfg.max_position_embeddings)
        ratio = rope.factor * torch.tensor(length) / cfg.max_position_embeddings - (rope.factor - 1)
        base = base * ratio ** (dim / (dim - 2))
    freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))
    if rope.rope_type == "linear":
        freq = freq / rope.factor
    elif rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / freq
        scaled = torch.where(wavelen > low_wavelen, freq / rope.factor, freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        freq = torch.where(medium, smoothed, scaled)
    return freq.to(torch.float32)


def cos_sin(freq: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[len(positions), head_dim]: cos of position * freq, then sin (fp32, as transformers)."""
    angles = positions.to(torch.float32)[:, None] * freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


class RotaryTable:
    """cos/sin rows for a forward pass. Static variants index one precomputed table by position;
    dynamic NTK computes each token's row from its sequence's length in this forward (what
    transformers does for one sequence: the longest position in the call sets the base)."""

    def __init__(self, cfg: ModelConfig, max_positions: int, device: torch.device):
        self.cfg = cfg
        self.dynamic = cfg.rope.rope_type == "dynamic"
        self.table = cos_sin(inv_freq(cfg), torch.arange(max_positions)).to(device)

    def rows(self, positions: torch.Tensor, scale_lens: list[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos_sin table, index per token). scale_lens: per token, its sequence's length after this
        forward (needed for dynamic NTK only)."""
        if not self.dynamic or scale_lens is None \
                or max(scale_lens, default=0) <= self.cfg.max_position_embeddings:
            return self.table, positions
        rows = []
        pos_cpu = positions.cpu()
        for length in sorted(set(scale_lens)):
            rows.append((length, inv_freq(self.cfg, length)))
        freqs = dict(rows)
        table = torch.stack([cos_sin(freqs[n], pos_cpu[i:i + 1])[0] for i, n in enumerate(scale_lens)])
        return table.to(self.table.device), torch.arange(len(scale_lens), device=positions.device)
