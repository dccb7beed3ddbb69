"""The fused attention of long eager prefill forwards (CudaOps.prefill_attention hands it forwards of at least
FUSED_MIN_TOKENS prompt tokens): cuDNN's (prefill_cudnn) or FlashAttention's varlen entry (prefill_flash), as
env.PREFILL_ATTENTION says, on the keys gathered from the paged cache. A shape cuDNN refuses moves it to
FlashAttention for good."""
from __future__ import annotations

import logging

import torch

from engine.cuda import prefill_cudnn, prefill_flash

log = logging.getLogger(__name__)

FUSED_MIN_TOKENS = 2048  # eager forwards of fewer prompt tokens use the paged kernel (bench/profile_step.py --only ttft)


class FusedPrefill:
    """route: the module that plans and attends (prefill_cudnn or prefill_flash). The plan is made at a forward's
    first layer and serves its other layers (forget() at each forward's start: it holds that forward's cache rows)."""

    def __init__(self, backend: str):
        self.route = prefill_flash if backend == "flash" else prefill_cudnn
        self._key: tuple | None = None
        self._plan = None

    def forget(self) -> None:
        self._key = None

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 query_start_loc: list[int], seq_lens: list[int], scale: float) -> torch.Tensor:
        key = (tuple(query_start_loc), tuple(seq_lens))
        if self._key != key:
            self._plan = self.route.plan(*key, q.shape[0], block_tables, k_cache.shape[1])
            self._key = key
        try:
            return self.route.attend(self._plan, q, k_cache, v_cache, scale)
        except RuntimeError as e:
            if self.route is prefill_flash:
                raise
            log.warning("cuDNN's fused attention refused a prefill (%s); long prefills use FlashAttention from now on",
                        str(e).splitlines()[0][:200])
            self.route, self._key = prefill_flash, None
            return self(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale)
