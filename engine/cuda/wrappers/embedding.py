"""The embedding gather (kernels_cu/embedding.cu): out [T, hidden] = weight[input_ids]."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.cuda.checks import dtype_suffix, expect_shape, tensor_arg
from engine.cuda.driver import KernelArgError

if TYPE_CHECKING:
    from engine.cuda.library import KernelLibrary


def launch(lib: KernelLibrary, out: torch.Tensor, input_ids: torch.Tensor, weight: torch.Tensor) -> None:
    """out [T, hidden] = weight [vocab, hidden] rows at input_ids [T] (int64)."""
    sfx = dtype_suffix(weight.dtype, "embedding weight")
    w = tensor_arg(weight, "embedding weight", weight.dtype, 2)
    ids = tensor_arg(input_ids, "input_ids", torch.int64, 1, align=False)
    vocab, hidden = weight.shape
    o = tensor_arg(out, "embedding out", weight.dtype, 2)
    expect_shape(out, "embedding out", (input_ids.shape[0], hidden))
    if hidden % 8:
        raise KernelArgError(f"embedding: hidden size {hidden} is not a multiple of 8")
    if input_ids.shape[0] == 0:
        return
    lib.kernels[f"embedding_{sfx}"]((input_ids.shape[0], 1, 1), (min(256, hidden // 8), 1, 1), 0,
                                    lib.stream(), o, w, ids, hidden, vocab)
