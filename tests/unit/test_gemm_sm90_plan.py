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
    assert set(re.findall(r"GEMM_ENTRY_W8A16\((\w+), GEP_", SOURCE)) == set(gemm_sm90.W8A16_EPILOGUES)
    xk, stages = define("W16_XK"), define("W16_STAGES")
    assert gemm_sm90.W8A16_MAX_KTILES == xk // gemm_sm90.ROW_BYTES
    assert gemm_sm90.W8A16_SMEM == xk // 64 * 1024 + stages * gemm_sm90.GEMM_ROWS * gemm_sm90.ROW_BYTES + 1024
    assert gemm_sm90.W8A16_SMEM <= H100_SMEM_OPTIN - 1024


@pytest.mark.parametrize("nt", gemm_sm90.GEMM_NT)
def test_shared_memory_fits_a_hopper_block_with_a_deep_pipeline(nt):
    assert 4 <= gemm_sm90.stages(nt) <= 8
    assert gemm_sm90.smem_bytes(nt) <= H100_SMEM_OPTIN - 1024  # the static 4 bytes and the driver's reserve
    assert gemm_sm90.stage_bytes(nt) % 1024 == 0  # each stage's tiles start on the 128-byte swizzle's period


def test_rows_take_the_smallest_bucket():
    assert [gemm_sm90.nt_bucket(m) for m in (1, 16, 17, 32, 33, 64, 65, 128, 129, 256)] == [
        16, 16, 32, 32, 64, 64, 128, 128, 256, 256]
    with pytest.raises(KernelArgError, match="at most 256"):
        gemm_sm90.nt_bucket(257)


def test_k_tiles_are_128_bytes_of_a_row():
    assert gemm_sm90.k_tiles(2048) == 32 and gemm_sm90.k_tiles(2048, element_bytes=1) == 16
    assert gemm_sm90.k_tiles(576) == 9 and gemm_sm90.k_tiles(72) == 2 and gemm_sm90.k_tiles(72, 1) == 1


def test_tiles_cover_every_row_and_silu_pairs_gate_with_up():
    assert gemm_sm90.tiles(2048, False) == 16 and gemm_sm90.tiles(960, False) == 8
    assert gemm_sm90.tiles(16384, True) == 128  # I = 8192: 64 gate rows and their up rows a block
    assert gemm_sm90.tiles(200, True) == 2


@pytest.mark.parametrize("n,k,silu", [(3072, 2048, False), (2048, 2048, False), (16384, 2048, True),
                                      (2048, 8192, False), (6144, 4096, False), (4096, 14336, False),
                                      (28672, 4096, True), (128256, 4096, False), (960, 576, False)])
def test_splits_fill_one_wave_and_keep_the_workspace_bound(n, k, silu):
    t = gemm_sm90.tiles(n, silu)
    s = gemm_sm90.splits(t, k, H100_SMS)
    k_tiles = gemm_sm90.k_tiles(k)
    assert 1 <= s <= k_tiles
    if t >= H100_SMS:
        assert s == 1
    else:
        assert t * s <= H100_SMS  # within the workspace's max_blocks (twice the SMs)
        assert s == 1 or k_tiles // s >= gemm_sm90.MIN_SPLIT_KTILES
        assert t * (s + 1) > H100_SMS or s in (k_tiles // gemm_sm90.MIN_SPLIT_KTILES, gemm_sm90.MAX_SPLITS)
