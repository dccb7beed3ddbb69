"""The fused attention of long eager prefill forwards (CudaOps.prefill_attention hands it forwards of at least
FUSED_MIN_TOKENS prompt tokens), on the keys gathered from the paged cache: cuDNN's (prefill_cudnn) for forwards
whose longest sequence has at least CUDNN_MIN_KEYS keys, FlashAttention's varlen entry (prefill_flash) for the rest
(env.PREFILL_ATTENTION "cudnn", the default), or FlashAttention for all where it is "flash". A shape cuDNN refuses moves it to
FlashAttention for good. Figures behind the rule: bench/RESULTS.md ("Long prompts")."""
from __future__ import annotations

import logging

import torch

from engine import env
from engine.cuda import prefill_cudnn, prefill_flash

log = logging.getLogger(__name__)

# eager forwards of fewer prompt tokens use the paged kernel (bench/profile_step.py --only ttft)
FUSED_MIN_TOKENS = 2048
CUDNN_MIN_KEYS = env.CUDNN_MIN_KEYS  # cuDNN where a sequence attends to this many keys (8 x 512 prompts ran 2-5%
# faster on Flash when cuDNN's K/V heads were repeated to the query heads)


class FusedPrefill:
    """route: the module that plans and attends long forwards (prefill_cudnn or prefill_flash); shorter ones take
    prefill_flash. The plan is made at a forward's first layer and serves its other layers (forget() at each
    forward's start: it holds that forward's cache rows)."""

    def __init__(self, backend: str):
        self.route = prefill_flash if backend == "flash" else prefill_cudnn
        self.cudnn_min_keys = CUDNN_MIN_KEYS
        self._key: tuple | None = None
        self._plan = None
        self._planned_by = None

    def forget(self) -> None:
        self._key = None

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 query_start_loc: list[int], seq_lens: list[int], scale: float) -> torch.Tensor:
        key = (tuple(query_start_loc), tuple(seq_lens))
        if self._key != key:
            route = self.route if max(seq_lens) >= self.cudnn_min_keys else prefill_flash
            self._plan = route.plan(*key, q.shape[0], block_tables, k_cache.shape[1])
            self._key, self._planned_by = key, route
        try:
            return self._planned_by.attend(self._plan, q, k_cache, v_cache, scale)
        except RuntimeError as e:
            if self._planned_by is prefill_flash:
                raise
            log.warning("cuDNN's fused attention refused a prefill (%s); long prefills use FlashAttention from now on",
                        str(e).splitlines()[0][:200])
            self.route, self._key = prefill_flash, None
            return self(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale)

    def warm_up(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                chunk_tokens: int, max_seq_len: int) -> int:
        """cuDNN plans each new shape once, ~45 ms of host time (bench/RESULTS.md): plans the shapes of a long
        prompt's chunks of chunk_tokens (max_prefill_tokens) after a prefix of whole chunks, up to max_seq_len keys,
        before a request meets them. The warm-up's bucketed prefills plan the fresh prompts' shapes. Returns the
        shapes planned."""
        if self.route is not prefill_cudnn:
            return 0
        try:
            return prefill_cudnn.warm_up(num_heads, num_kv_heads, head_dim, dtype, device, chunk_tokens, max_seq_len)
        except RuntimeError as e:  # as a refused prefill would: FlashAttention from now on
            log.warning("cuDNN's fused attention refused a warm-up shape (%s); long prefills use FlashAttention",
                        str(e).splitlines()[0][:200])
            self.route = prefill_flash
            return 0

