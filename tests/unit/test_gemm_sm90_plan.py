"""The Hopper GEMM's launch plan (engine/cuda/wrappers/gemm_sm90.py), on the CPU: row buckets, tiles, K splits and
shared memory agree with kernels_cu/gemm_sm90.cu's constants and the device's limits. The kernels themselves are
checked on the GPU (tests/gpu/test_gemm_sm90.py)."""
from __future__ import annotations

import re

import pytest

from engine.cuda import build
from engine.cuda.driver import KernelArgError
from engine.cuda.wrappers import gemm_sm90

SOURCE = (build.KERNEL_DIR / "gemm_sm90.cu").read_text()
H100_SMS, H100_SMEM_OPTIN = 132, 232448


def define(name: str) -> int:
    return int(re.search(rf"#define {name} (\d+)", SOURCE).group(1))


def test_the_wrapper_and_the_kernel_agree_on_tiles_and_entries():
    assert (define("GEMM_THREADS"), define("GEMM_ROWS"), define("GEMM_ROW_BYTES")) == (
        gemm_sm90.GEMM_THREADS, gemm_sm90.GEMM_ROWS, gemm_sm90.ROW_BYTES)
    assert sorted(int(n) for n in re.findall(r"^GEMM_ENTRIES\((\d+)\)", SOURCE, re.M)) == list(gemm_sm90.GEMM_NT)
    assert set(re.findall(r"GEMM_ENTRY\((\w+), GEP_", SOURCE)) == set(gemm_sm90.GEMM_EPILOGUES)
    assert set(re.findall(r"GEMM_ENTRY_W8A8\((\w+), GEP_", SOURCE)) == set(gemm_sm90.W8A8_EPILOGUES)
    assert "196608" in SOURCE and "+ 1024" in SOURCE  # stages within 192 KiB, plus the alignment slack


@pytest.mark.parametrize("nt", gemm_sm90.GEMM_NT)
def test_shared_memory_fits_a_hopper_block_with_a_deep_pipeline(nt):
    assert 4 <= gemm_sm90.stages(nt) <= 8
    assert gemm_sm90.smem_bytes(nt) <= H100_SMEM_OPTIN - 1024  # the static 4 bytes and the driver's reserve
    assert gemm_sm90.stage_bytes(nt) % 1024 == 0  # each stage's tiles start on the 128-byte swizzle's period
    # the epilogue's [NT][GEMM_LD] fp32 tile lives in the stages once the MMAs are done
    assert nt * define("GEMM_LD") * 4 <= gemm_sm90.stages(nt) * gemm_sm90.stage_bytes(nt)


def test_rows_take_the_smallest_bucket_then_column_tiles_of_128():
    assert [gemm_sm90.nt_bucket(m) for m in (1, 16, 17, 32, 33, 64, 65, 128, 129, 256)] == [
        16, 16, 32, 32, 64, 64, 128, 128, 128, 128]
    assert [gemm_sm90.column_tiles(m) for m in (1, 100, 128, 129, 256)] == [1, 1, 1, 2, 2]
    with pytest.raises(KernelArgError, match="at most 256"):
        gemm_sm90.nt_bucket(257)


def test_k_tiles_are_128_bytes_of_a_row():
    assert gemm_sm90.k_tiles(2048) == 32 and gemm_sm90.k_tiles(2048, element_bytes=1) == 16
    assert gemm_sm90.k_tiles(576) == 9 and gemm_sm90.k_tiles(72) == 2 and gemm_sm90.k_tiles(72, 1) == 1


def test_tiles_cover_every_row_and_silu_pairs_gate_with_up():
    assert gemm_sm90.tiles(2048, False) == 16 and gemm_sm90.tiles(960, False) == 8
    assert gemm_sm90.tiles(16384, True) == 128  # I = 8192: 64 gate rows and their up rows a block
    assert gemm_sm90.tiles(200, True) == 2


@pytest.mark.parametrize("rows", [9, 16, 64, 128, 200, 256])
@pytest.mark.parametrize("n,k,silu", [(3072, 2048, False), (2048, 2048, False), (16384, 2048, True),
                                      (2048, 8192, False), (6144, 4096, False), (4096, 14336, False),
                                      (28672, 4096, True), (128256, 4096, False), (960, 576, False)])
def test_splits_fill_one_wave_and_keep_the_workspace_and_reduction_bound(n, k, silu, rows):
    t = gemm_sm90.tiles(n, silu) * gemm_sm90.column_tiles(rows)
    s = gemm_sm90.splits(gemm_sm90.tiles(n, silu), k, H100_SMS, rows)
    k_tiles = gemm_sm90.k_tiles(k)
    assert 1 <= s <= k_tiles
    if t >= H100_SMS:
        assert s == 1
    else:
        assert t * s <= H100_SMS  # within the workspace's max_blocks (twice the SMs) and its counters
        assert s == 1 or k_tiles // s >= gemm_sm90.MIN_SPLIT_KTILES
        # the last block reads (s - 1) other splits' rows x 128 fp32 sums: bounded against the weight bytes
        assert s * s * gemm_sm90.REDUCE_WEIGHT * min(rows, 128) <= max(1, k * 2)
        assert t * (s + 1) > H100_SMS or (s + 1) ** 2 * gemm_sm90.REDUCE_WEIGHT * min(rows, 128) > k * 2 or s in (
            k_tiles // gemm_sm90.MIN_SPLIT_KTILES, gemm_sm90.MAX_SPLITS)


def test_small_forwards_split_more_than_large_ones():
    # 1B o (16 tiles): 16 rows fill the SMs by splits; 256 rows (two column tiles) split less, their sums being 16x
    assert gemm_sm90.splits(16, 2048, H100_SMS, 16) > gemm_sm90.splits(16, 2048, H100_SMS, 256) >= 1


def test_the_sm90_setting_takes_only_the_measured_routes():
    """METRALE_GEMM=sm90: gate_up (bf16 and W8A8) and the LM head up to 32 rows; the rest (qkv, o, down, more
    rows) stay with cuBLAS, returned as None before anything is allocated or launched. sm90-all: every route."""
    import types

    import torch

    from engine.cuda.hopper_gemm import ROUTES, HopperGemm

    lib = types.SimpleNamespace(device=torch.device("cpu"), num_sms=H100_SMS, gemm_sm90=True)
    routed, every = HopperGemm.create(lib, "sm90"), HopperGemm.create(lib, "sm90-all")
    assert routed.routes == ROUTES and every.routes is None
    assert HopperGemm.create(lib, "cublas") is None
    assert HopperGemm.create(types.SimpleNamespace(gemm_sm90=False), "sm90") is None  # not an sm_90 device
    assert routed._routed("silu", "bf16", 32) and not routed._routed("silu", "bf16", 33)
    assert routed._routed("f32", "bf16", 9) and not routed._routed("store", "bf16", 9)
    assert not routed._routed("residual", "bf16", 16)
    assert routed._routed("silu", "w8a8", 32) and not routed._routed("silu", "w8a8", 33)
    assert not routed._routed("silu", "w8a8", 65) and every._routed("residual", "w8a8", 256)
    x, w = torch.zeros(16, 64, dtype=torch.bfloat16), torch.zeros(128, 64, dtype=torch.bfloat16)
    assert routed.linear(x, w, None, None, torch.bfloat16) is None  # qkv: cuBLAS
    assert routed.linear(x, w, None, torch.zeros(16, 128, dtype=torch.bfloat16), None) is None  # o / down
    assert routed.silu_and_mul(torch.zeros(33, 64, dtype=torch.bfloat16), w) is None  # past 32 rows
