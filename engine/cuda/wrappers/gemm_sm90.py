"""Hopper GEMM for decode and verify forwards of 9-256 rows (kernels_cu/gemm_sm90.cu, sm_90a only): x [M, K] @ W^T for
a bf16 weight W [N, K] on the warpgroup MMA, with the projection's epilogue fused (store, fp32 logits, the residual
add in place, SiLU-and-mul of a [gate | up] weight); W8A8 (launch_w8a8): E4M3 x with per-row scales times a per-
channel E4M3 weight on the FP8 MMA, engine.quant.w8a8_linear's arithmetic; and W8A16 for decode's 1-8 rows
(launch_w8a16): the E4M3 weight converted to bf16 in registers, engine.quant.fp8_linear's arithmetic. Where a grid
of one split would leave SMs idle, K is split and the last block of each weight tile sums the splits (in split
order) into the epilogue.

SplitKWorkspace holds the fp32 partial sums and the per-tile arrival counters: one per CudaOps, used by launches of
one stream (the decode and verify forwards), so two launches never share it at once."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.cuda.checks import expect_shape, overlaps, tensor_arg
from engine.cuda.driver import KernelArgError
from engine.quant import FP8_DTYPE

if TYPE_CHECKING:
    from engine.cuda.library import KernelLibrary

MODULE = "gemm_sm90"
GEMM_NT = (16, 32, 64, 128, 256)  # entry suffix _n<NT>: the forward's rows, padded (the MMA's N)
GEMM_EPILOGUES = ("store", "f32", "residual", "silu")
W8A8_EPILOGUES = ("store", "residual", "silu")
GEMM_ARGS = "ppppp" + "iiii"  # out, x, w, ws, counters, M, N, K, splits
W8A8_ARGS = "ppppppp" + "iiii"  # out, x, x_scale, w, w_scale, ws, counters, M, N, K, splits
W8A16_EPILOGUES = GEMM_EPILOGUES
W8A16_ARGS = "pppppp" + "iiii"  # out, x, w, w_scale, ws, counters, M, N, K, splits
W8A16_MAX_ROWS = 8  # the _w8a16_n8 entries' rows (decode's skinny forwards)
W8A16_MAX_KTILES = 4096 // 128  # k-tiles of 128 a split: its x stays in shared memory (W16_XK)
W8A16_SMEM = 4096 // 64 * 1024 + 8 * 128 * 128 + 1024  # the kernel's gemm_w8a16_smem_bytes()
GEMM_ROWS = 128  # weight rows a block (silu: 64 gate rows and their 64 up rows)
ROW_BYTES = 128  # bytes of each operand row a stage (64 k of bf16, 128 of E4M3)
GEMM_THREADS = 256
MAX_ROWS = GEMM_NT[-1]
# A grid of fewer tiles than SMs is split along K until it fills about one wave, each split keeping at least this
# many k-tiles (a split's pipeline fill and its partial sums' round trip through L2 are its fixed costs).
MIN_SPLIT_KTILES = 4
MAX_SPLITS = 16


def entry_names() -> list[str]:
    return [f"gemm_sm90_{ep}_bf16_n{nt}" for nt in GEMM_NT for ep in GEMM_EPILOGUES]


def w8a8_entry_names() -> list[str]:
    return [f"gemm_sm90_{ep}_w8a8_n{nt}" for nt in GEMM_NT for ep in W8A8_EPILOGUES]


def w8a16_entry_names() -> list[str]:
    return [f"gemm_sm90_{ep}_w8a16_n8" for ep in W8A16_EPILOGUES]


def stage_bytes(nt: int) -> int:
    return (GEMM_ROWS + nt) * ROW_BYTES


def stages(nt: int) -> int:
    return min(8, 196608 // stage_bytes(nt))


def smem_bytes(nt: int) -> int:
    """Dynamic shared memory of an _n<nt> launch (the kernel's gemm_smem_bytes)."""
    return stages(nt) * stage_bytes(nt) + 1024


def nt_bucket(rows: int) -> int:
    for nt in GEMM_NT:
        if rows <= nt:
            return nt
    raise KernelArgError(f"gemm_sm90: {rows} rows; the kernels take at most {MAX_ROWS}")


def tiles(n: int, silu: bool) -> int:
    """Blocks along the weight's rows: 128 rows each, or (silu) 64 gate rows with their 64 up rows."""
    return -(-(n // 2) // 64) if silu else -(-n // GEMM_ROWS)


def k_tiles(k: int, element_bytes: int = 2) -> int:
    return -(-k * element_bytes // ROW_BYTES)


def splits(num_tiles: int, k: int, num_sms: int, element_bytes: int = 2) -> int:
    """K splits of a grid of num_tiles weight tiles: 1 where the tiles fill the SMs, else as many as bring the grid
    to about one wave, each of at least MIN_SPLIT_KTILES k-tiles."""
    if num_tiles >= num_sms:
        return 1
    k_tiles_ = k_tiles(k, element_bytes)
    return max(1, min(num_sms // num_tiles, k_tiles_ // MIN_SPLIT_KTILES, MAX_SPLITS))


class SplitKWorkspace:
    """The fp32 partial sums of split launches (at most max_blocks blocks of MAX_ROWS x GEMM_ROWS sums) and the
    arrival counter of each tile (zero between launches: the last block of a tile resets its own)."""

    def __init__(self, device: torch.device, num_sms: int):
        self.max_blocks = 2 * num_sms  # splits(): num_tiles * S <= num_sms where S > 1 (twice: room for tests)
        self.partials = torch.empty(self.max_blocks * MAX_ROWS * GEMM_ROWS, dtype=torch.float32, device=device)
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


def launch_w8a16(lib: KernelLibrary, ws: SplitKWorkspace, epilogue: str, out: torch.Tensor, x: torch.Tensor,
                 weight: torch.Tensor, w_scale: torch.Tensor, num_splits: int | None = None) -> torch.Tensor:
    """W8A16 for at most W8A16_MAX_ROWS rows: out <- epilogue((x @ T(weight)^T) * w_scale[None, :]) for bf16 x [M, K],
    an E4M3 weight [N, K] and its per-row fp32 scales w_scale [N] (engine.quant.fp8_linear's arithmetic): store /
    residual out [M, N] bf16, f32 out [M, N] fp32, silu out [M, N / 2] bf16. K is split at least so that each split
    holds at most W8A16_MAX_KTILES k-tiles."""
    if epilogue not in W8A16_EPILOGUES:
        raise KernelArgError(f"gemm_sm90 w8a16: unknown epilogue {epilogue!r} (one of {W8A16_EPILOGUES})")
    xp = tensor_arg(x, "gemm_sm90 x", torch.bfloat16, 2)
    wp = tensor_arg(weight, "gemm_sm90 weight", FP8_DTYPE, 2)
    _check(x, weight, 16)
    if x.shape[0] > W8A16_MAX_ROWS:
        raise KernelArgError(f"gemm_sm90 w8a16: {x.shape[0]} rows; the kernels take at most {W8A16_MAX_ROWS}")
    wsp = tensor_arg(w_scale, "gemm_sm90 w_scale", torch.float32, 1, align=False)
    expect_shape(w_scale, "gemm_sm90 w_scale", (weight.shape[0],))
    op = tensor_arg(out, "gemm_sm90 out", torch.float32 if epilogue == "f32" else torch.bfloat16, 2)
    _check_out(out, x, weight, epilogue)
    most = k_tiles(x.shape[1], 1)
    least = -(-most // W8A16_MAX_KTILES)
    if num_splits is None:
        num_splits = max(least, splits(tiles(weight.shape[0], epilogue == "silu"), x.shape[1], lib.num_sms, 1))
    if num_splits < least:
        raise KernelArgError(f"gemm_sm90 w8a16: {num_splits} splits of {most} k-tiles leave more than "
                             f"{W8A16_MAX_KTILES} a split")
    return _launch(lib, ws, f"gemm_sm90_{epilogue}_w8a16", out, (op, xp, wp, wsp), x, weight, epilogue, 1,
                   num_splits, nt=8, smem=W8A16_SMEM)


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
            num_splits: int | None, nt: int | None = None, smem: int | None = None) -> torch.Tensor:
    (M, K), N = x.shape, weight.shape[0]
    if M == 0:
        return out
    num_tiles = tiles(N, epilogue == "silu")
    most = k_tiles(K, element_bytes)
    s = splits(num_tiles, K, lib.num_sms, element_bytes) if num_splits is None else num_splits
    if not 1 <= s <= most:
        raise KernelArgError(f"gemm_sm90: {s} splits of {most} k-tiles")
    if s > 1 and (num_tiles * s > ws.max_blocks or num_tiles > ws.counters.numel()):
        raise KernelArgError(f"gemm_sm90: {num_tiles} tiles x {s} splits exceed the workspace")
    nt = nt or nt_bucket(M)
    lib.kernels[f"{entry}_n{nt}"]((num_tiles, s, 1), (GEMM_THREADS, 1, 1), smem or smem_bytes(nt), lib.stream(),
                                  *pointers, ws.partials.data_ptr(), ws.counters.data_ptr(), M, N, K, s)
    return out
