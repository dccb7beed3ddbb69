"""RMSNorm (kernels_cu/rms_norm.cu): rms_norm, and residual_norm, the end of a split-K linear layer (the
fp32 partials summed into the residual stream, then optionally its rms_norm)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.cuda.checks import dtype_suffix, expect_shape, overlaps, tensor_arg
from engine.cuda.driver import KernelArgError

if TYPE_CHECKING:
    from engine.cuda.library import KernelLibrary


NORM_MANY_ROWS = 1024  # rms_norm over at least this many rows takes 4 vectors per thread


def launch(lib: KernelLibrary, out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """x: [rows, D] or [T, heads, D] with unit stride on D (other strides free, 16-byte multiples)."""
    sfx = dtype_suffix(x.dtype, "rms_norm x")
    if x.dim() not in (2, 3) or x.stride(-1) != 1:
        raise KernelArgError(f"rms_norm x: expected [rows, D] or [T, heads, D] with a unit last stride, got "
                             f"shape {tuple(x.shape)} strides {x.stride()}")
    D = x.shape[-1]
    xp = tensor_arg(x, "rms_norm x", x.dtype, contiguous=False)
    w = tensor_arg(weight, "rms_norm weight", x.dtype, 1)
    expect_shape(weight, "rms_norm weight", (D,))
    o = tensor_arg(out, "rms_norm out", x.dtype)
    expect_shape(out, "rms_norm out", x.shape)
    if x.dim() == 2:
        outer, inner, s_outer, s_inner = x.shape[0], 1, x.stride(0), 0
    else:
        outer, inner, s_outer, s_inner = x.shape[0], x.shape[1], x.stride(0), x.stride(1)
    if D % 8 or s_outer % 8 or s_inner % 8:
        raise KernelArgError(f"rms_norm: D ({D}) and row strides {x.stride()} must be multiples of 8")
    rows = outer * inner
    if rows == 0:
        return
    tpr, rpb = norm_layout(D, rows)
    lib.kernels[f"rms_norm_{sfx}"]((-(-rows // rpb), 1, 1), (tpr, rpb, 1), 0, lib.stream(),
                                   o, xp, w, rows, inner, s_outer, s_inner, D, float(eps))


def residual_norm(lib: KernelLibrary, h: torch.Tensor, out: torch.Tensor | None, parts: torch.Tensor,
                  weight: torch.Tensor | None, eps: float) -> None:
    """The end of a split-K linear layer: h [rows, D] = h + sum over s of parts [S, rows, D] (fp32), one
    rounding; and with weight (out then [rows, D] too), out = rms_norm(h, weight, eps)."""
    sfx = dtype_suffix(h.dtype, "residual_norm h")
    hp = tensor_arg(h, "residual_norm h", h.dtype, 2)
    rows, D = h.shape
    pp = tensor_arg(parts, "residual_norm parts", torch.float32, 3)
    if parts.shape[1:] != h.shape or parts.shape[0] < 1:
        raise KernelArgError(f"residual_norm parts: expected [S, {rows}, {D}], got {tuple(parts.shape)}")
    if D % 8:
        raise KernelArgError(f"residual_norm: D ({D}) must be a multiple of 8")
    if (weight is None) != (out is None):
        raise KernelArgError("residual_norm: out and weight go together")
    op = wp = 0
    if weight is not None:
        wp = tensor_arg(weight, "residual_norm weight", h.dtype, 1)
        expect_shape(weight, "residual_norm weight", (D,))
        op = tensor_arg(out, "residual_norm out", h.dtype)
        expect_shape(out, "residual_norm out", h.shape)
        if overlaps(out, h):
            raise KernelArgError("residual_norm: out must not overlap h")
    if rows == 0:
        return
    # One 8-element vector per thread up to D = 4096 (32 rows of the 1B hidden size: 32 blocks of 256):
    # every load a thread makes (h, the S partials, the weight) is issued at once, one round trip.
    # At most 512 threads (the entry's launch bounds: 1024 ran out of registers at D = 8192).
    tpr = min(512, 1 << (D // 8 - 1).bit_length())
    rpb = 128 // tpr if tpr <= 32 else 1
    if -(-(D // 8) // tpr) > 4:
        raise KernelArgError(f"residual_norm: D = {D} is too large (at most {512 * 32})")
    lib.kernels[f"residual_norm_{sfx}"]((-(-rows // rpb), 1, 1), (tpr, rpb, 1), 0, lib.stream(),
                                        hp, op, pp, parts.shape[0], wp, rows, D, float(eps))


def norm_layout(D: int, rows: int) -> tuple[int, int]:
    """(threads per row, rows per block) for rms_norm: 16-byte vectors, at most 4 per thread; short
    rows share a 128-thread block. Long rows get 2 vectors per thread, or 4 when there are at least
    NORM_MANY_ROWS rows (prompts, faster there; 32 rows are faster with 2)."""
    vecs = D // 8
    per_thread = 4 if rows >= NORM_MANY_ROWS else 2
    want = vecs if vecs <= 32 else -(-vecs // per_thread)
    tpr = min(1024, 1 << (max(want, 1) - 1).bit_length())
    if -(-vecs // tpr) > 4:
        raise KernelArgError(f"rms_norm: D = {D} is too large (at most {1024 * 32})")
    return tpr, (128 // tpr if tpr <= 32 else 1)
