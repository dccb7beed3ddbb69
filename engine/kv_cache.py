"""The paged KV cache: block ids (BlockAllocator) and the K/V tensors (KVCache)."""
from __future__ import annotations

import torch

from engine.errors import ConfigError, ResourceExhausted
from engine.ops.torch_ops import LayerKV


class BlockAllocator:
    """Owns KV block ids: a free list, and nothing else. Block 0 is never handed out: it is the
    scratch block that padded or unused block-table entries point at."""

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ConfigError(f"the KV cache needs at least 2 blocks (block 0 is scratch), got {num_blocks}; "
                              f"raise --num-kv-blocks or --kv-cache-memory")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, 0, -1))  # pop() hands out low ids first

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if not self.can_allocate(n):
            raise ResourceExhausted(f"need {n} KV blocks, {len(self._free)} of {self.num_usable_blocks} free (release "
                                    f"live sequences, or start the worker with a larger --kv-cache-memory or "
                                    f"--num-kv-blocks)")
        return [self._free.pop() for _ in range(n)]

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(reversed(block_ids))


class KVCache:
    """K and V for every layer: [num_layers, num_blocks, block_size, num_kv_heads, head_dim] each.

    A token at position p of a sequence whose block list is B lives at flat index
    B[p // block_size] * block_size + p % block_size of the [num_blocks * block_size] view.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def layer(self, i: int) -> LayerKV:
        return LayerKV(self.k[i], self.v[i])

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes
