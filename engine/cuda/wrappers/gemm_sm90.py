"""Hopper GEMM for forwards of 9-256 rows (kernels_cu/gemm_sm90.cu, sm_90a only): x [M, K] @ W^T for a bf16 weight
W [N, K] on the warpgroup MMA, with the projection's epilogue fused (store, fp32 logits, the residual add in place,
SiLU-and-mul of a [gate | up] weight); and W8A8 (launch_w8a8): E4M3 x with per-row scales times a per-channel E4M3
weight on the FP8 MMA, engine.quant.w8a8_linear's arithmetic. A block takes 128 weight rows by up to 128 of x's rows
(its column tile; more rows: more column tiles). Where such a grid would leave SMs idle, K is split and the last
block of each tile sums the splits (in split order) into the epilogue; the split count (splits()) weighs the idle
SMs against that block's reads of the other splits' sums, so it depends on the forward's rows (a row's bits may
differ between forwards of different sizes, as cuBLAS's do).

SplitKWorkspace holds the fp32 partial sums and the per-tile arrival counters: one per CudaOps, used by launches of
one stream (the decode and verify forwards), so two launches never share it at once."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from engine.cuda.checks import expect_shape, overlaps, tensor_arg
from engine.cuda.driver import KernelArgError
from engine.quant import FP8_DTYPE

if TYPE_CHECKING:
    from engine.cuda.library import KernelLibrary

MODULE = "gemm_sm90"
GEMM_NT = (16, 32, 64, 128)  # entry suffix _n<NT>: the rows of x a block takes, padded (the MMA's N)
GEMM_EPILOGUES = ("store", "f32", "residual", "silu")
W8A8_EPILOGUES = ("store", "residual", "silu")
GEMM_ARGS = "ppppp" + "iiii"  # out, x, w, ws, counters, M, N, K, splits
W8A8_ARGS = "ppppppp" + "iiii"  # out, x, x_scale, w, w_scale, ws, counters, M, N, K, splits
GEMM_ROWS = 128  # weight rows a block (silu: 64 gate rows and their 64 up rows)
ROW_BYTES = 128  # bytes of each operand row a stage (64 k of bf16, 128 of E4M3)
GEMM_THREADS = 256
MAX_ROWS = 256
# A grid of fewer blocks than SMs is split along K toward one wave, each split keeping at least MIN_SPLIT_KTILES
# k-tiles (its pipeline fill is a fixed cost), and at most as many splits as keep the last block's reads of the
# others' sums (rows x 512 bytes a split, from L2 into one SM) small beside a split's share of the weight tile
# (128 rows x K bytes, from DRAM over all SMs): S^2 <= K bytes / (REDUCE_WEIGHT x rows).
MIN_SPLIT_KTILES = 4
MAX_SPLITS = 16
REDUCE_WEIGHT = 2


def entry_names() -> list[str]:
    return [f"gemm_sm90_{ep}_bf16_n{nt}" for nt in GEMM_NT for ep in GEMM_EPILOGUES]


def w8a8_entry_names() -> list[str]:
    return [f"gemm_sm90_{ep}_w8a8_n{nt}" for nt in GEMM_NT for ep in W8A8_EPILOGUES]


def stage_bytes(nt: int) -> int:
    return (GEMM_ROWS + nt) * ROW_BYTES


def stages(nt: int) -> int:
    return min(8, 196608 // stage_bytes(nt))


def smem_bytes(nt: int) -> int:
    """Dynamic shared memory of an _n<nt> launch (the kernel's gemm_smem_bytes)."""
    return stages(nt) * stage_bytes(nt) + 1024


def nt_bucket(rows: int) -> int:
    """The column tile of a forward of `rows` rows: the smallest entry that takes them, else the largest (with
    ceil(rows / 128) column tiles)."""
    if rows > MAX_ROWS:
        raise KernelArgError(f"gemm_sm90: {rows} rows; the kernels take at most {MAX_ROWS}")
    return next((nt for nt in GEMM_NT if rows <= nt), GEMM_NT[-1])


def column_tiles(rows: int) -> int:
    return max(1, -(-rows // nt_bucket(rows)))


def tiles(n: int, silu: bool) -> int:
    """Blocks along the weight's rows: 128 rows each, or (silu) 64 gate rows with their 64 up rows."""
    return -(-(n // 2) // 64) if silu else -(-n // GEMM_ROWS)


def k_tiles(k: int, element_bytes: int = 2) -> int:
    return -(-k * element_bytes // ROW_BYTES)


def splits(num_tiles: int, k: int, num_sms: int, rows: int, element_bytes: int = 2) -> int:
    """K splits of a forward of `rows` rows over num_tiles weight tiles: 1 where its blocks fill the SMs, else as many
    as bring the grid to about one wave, each of at least MIN_SPLIT_KTILES k-tiles, and at most the reduction's
    bound (REDUCE_WEIGHT)."""
    blocks = num_tiles * column_tiles(rows)
    if blocks >= num_sms:
        return 1
    reduce_bound = math.isqrt(k * element_bytes // (REDUCE_WEIGHT * min(rows, GEMM_NT[-1])))
    return max(1, min(num_sms // blocks, k_tiles(k, element_bytes) // MIN_SPLIT_KTILES, MAX_SPLITS, reduce_bound))


class SplitKWorkspace:
    """The fp32 partial sums of split launches (at most max_blocks blocks of GEMM_NT[-1] x GEMM_ROWS sums) and the
    arrival counter of each tile (zero between launches: the last block of a tile resets its own)."""

    def __init__(self, device: torch.device, num_sms: int):
        self.max_blocks = 2 * num_sms  # splits(): blocks * S <= num_sms where S > 1 (twice: room for tests)
        self.partials = torch.empty(self.max_blocks * GEMM_NT[-1] * GEMM_ROWS, dtype=torch.float32, device=device)
        self.counters = torch.zeros(num_sms, dtype=torch.int32, device=device)


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernels take x @ weight^T: 9..MAX_ROWS rows of contiguous bf16 x, a contiguous bf16 weight of
    the same K (a multiple of 8), both 16-byte aligned."""
    return (x.dim() == 2 and weight.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.dtype == torch.bfloat16
            and weight.dtype == torch.bfloat16 and x.shape[1] == weight.shape[1] and x.shape[1] % 8 == 0
            and x.is_contiguous() and weight.is_contiguous() and not (x.data_ptr() | weight.data_ptr()) & 15)


def launch(lib: KernelLibrary, ws: SplitKWorkspace, epilogue: str, out: torch.Tensor, x: torch.Tensor,
           weight: torch.Tensor, num_splits: int | None = None) -> torch.Tensor:
    """out <- epilogue(x @ weight^T): store / residual out [M, N] bf16 (residual: added in place), f32 out [M, N]
    fp32, silu out [M, N / 2] bf16 for weight = [gate | up]. num_splits: K splits (default splits()). Returns
    out."""
    if epilogue not in GEMM_EPILOGUES:
        raise KernelArgError(f"gemm_sm90: unknown epilogue {epilogue!r} (one of {GEMM_EPILOGUES})")
    xp = tensor_arg(x, "gemm_sm90 x", torch.bfloat16, 2)
    wp = tensor_arg(weight, "gemm_sm90 weight", torch.bfloat16, 2)
    _check(x, weight, 8)
    op = tensor_arg(out, "gemm_sm90 out", torch.float32 if epilogue == "f32" else torch.bfloat16, 2)
    _check_out(out, x, weight, epilogue)
    return _launch(lib, ws, f"gemm_sm90_{epilogue}_bf16", out, (op, xp, wp), x, weight, epilogue, 2, num_splits)


def launch_w8a8(lib: KernelLibrary, ws: SplitKWorkspace, epilogue: str, out: torch.Tensor, x: torch.Tensor,
                x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
                num_splits: int | None = None) -> torch.Tensor:
    """W8A8: out <- epilogue(T((x @ weight^T) * x_scale[:, None] * w_scale[None, :])) for E4M3 x [M, K] and weight
    [N, K] with fp32 scales x_scale [M] and w_scale [N]: store / residual out [M, N] bf16, silu out [M, N / 2]."""
    if epilogue not in W8A8_EPILOGUES:
        raise KernelArgError(f"gemm_sm90 w8a8: unknown epilogue {epilogue!r} (one of {W8A8_EPILOGUES})")
    xp = tensor_arg(x, "gemm_sm90 x", FP8_DTYPE, 2)
    wp = tensor_arg(weight, "gemm_sm90 weight", FP8_DTYPE, 2)
    _check(x, weight, 16)
    xs = tensor_arg(x_scale, "gemm_sm90 x_scale", torch.float32, 1, align=False)
    wsp = tensor_arg(w_scale, "gemm_sm90 w_scale", torch.float32, 1, align=False)
    expect_shape(x_scale, "gemm_sm90 x_scale", (x.shape[0],))
    expect_shape(w_scale, "gemm_sm90 w_scale", (weight.shape[0],))
    op = tensor_arg(out, "gemm_sm90 out", torch.bfloat16, 2)
    _check_out(out, x, weight, epilogue)
    return _launch(lib, ws, f"gemm_sm90_{epilogue}_w8a8", out, (op, xp, xs, wp, wsp), x, weight, epilogue, 1,
                   num_splits)


def _check(x: torch.Tensor, weight: torch.Tensor, k_align: int) -> None:
    M, K = x.shape
    if weight.shape[1] != K or K % k_align:
        raise KernelArgError(f"gemm_sm90: x [{M}, {K}] and weight {tuple(weight.shape)}: K must match and be a "
                             f"multiple of {k_align}")
    nt_bucket(M)


def _check_out(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, epilogue: str) -> None:
    N = weight.shape[0]
    silu = epilogue == "silu"
    if silu and N % 2:
        raise KernelArgError(f"gemm_sm90 silu: the weight's {N} rows are not [gate | up]")
    expect_shape(out, "gemm_sm90 out", (x.shape[0], N // 2 if silu else N))
    if overlaps(out, x) or overlaps(out, weight):
        raise KernelArgError("gemm_sm90: out must not overlap x or the weight")


def _launch(lib: KernelLibrary, ws: SplitKWorkspace, entry: str, out: torch.Tensor, pointers: tuple,
            x: torch.Tensor, weight: torch.Tensor, epilogue: str, element_bytes: int,
            num_splits: int | None) -> torch.Tensor:
    (M, K), N = x.shape, weight.shape[0]
    if M == 0:
        return out
    num_tiles = tiles(N, epilogue == "silu")
    blocks = num_tiles * column_tiles(M)
    most = k_tiles(K, element_bytes)
    s = splits(num_tiles, K, lib.num_sms, M, element_bytes) if num_splits is None else num_splits
    if not 1 <= s <= most:
        raise KernelArgError(f"gemm_sm90: {s} splits of {most} k-tiles")
    if s > 1 and (blocks * s > ws.max_blocks or blocks > ws.counters.numel()):
        raise KernelArgError(f"gemm_sm90: {blocks} blocks x {s} splits exceed the workspace")
    nt = nt_bucket(M)
    lib.kernels[f"{entry}_n{nt}"]((blocks, s, 1), (GEMM_THREADS, 1, 1), smem_bytes(nt), lib.stream(),
                                  *pointers, ws.partials.data_ptr(), ws.counters.data_ptr(), M, N, K, s)
    return out
