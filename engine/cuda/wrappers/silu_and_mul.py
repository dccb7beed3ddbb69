"""SiLU-and-mul (kernels_cu/silu_and_mul.cu): out [T, I] = silu(x[:, :I]) * x[:, I:]."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.cuda.checks import dtype_suffix, expect_shape, tensor_arg
from engine.cuda.driver import KernelArgError

if TYPE_CHECKING:
    from engine.cuda.library import KernelLibrary


def launch(lib: KernelLibrary, out: torch.Tensor, x: torch.Tensor) -> None:
    """x [T, 2 I] = [gate | up] -> out [T, I]."""
    sfx = dtype_suffix(x.dtype, "silu_and_mul x")
    xp = tensor_arg(x, "silu_and_mul x", x.dtype, 2)
    T, two_i = x.shape
    I = two_i // 2
    if two_i % 16:
        raise KernelArgError(f"silu_and_mul: the intermediate size {I} must be a multiple of 8")
    o = tensor_arg(out, "silu_and_mul out", x.dtype)
    expect_shape(out, "silu_and_mul out", (T, I))
    if T == 0:
        return
    lib.kernels[f"silu_and_mul_{sfx}"]((T, -(-(I // 8) // 256), 1), (256, 1, 1), 0, lib.stream(), o, xp, I)
