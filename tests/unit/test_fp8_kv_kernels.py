"""The FP8 KV cache on the CUDA kernels, what the CPU can check: the E4M3 conversions of kernels_cu/common.cuh
(compiled by nvcc for the host and compared with torch's, value by value: every bf16 and fp16 value and the edge
cases, the decode's bit moves for every byte), the library's _kvfp8 entries and their shared memory, and the
runtime's rule for --kv-cache-dtype fp8 on a GPU (the capability mocked). The kernels themselves run in
tests/gpu/test_fp8_kv_gpu.py."""
from __future__ import annotations

import pathlib
import subprocess

import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from engine.cuda import build
from engine.cuda.checks import ATTENTION_HEAD_DIMS, KV_FP8_SUFFIX, cache_dtype
from engine.cuda.driver import KernelArgError
from engine.cuda.library import MODULES, PDL_PREFIXES
from engine.cuda.wrappers import decode_attention, prefill_attention
from engine.errors import ConfigError
from engine.quant import FP8_DTYPE
from engine.runtime import kv_cache_dtype

HARNESS = r"""
#include "common.cuh"
#include <cstdio>
// stdin: "e BITS" (fp32 bits -> fp8_bits_from_float), "s 8 LO + HI" (fp8_sel) or "d X" (Fp8Bits<Bf16>::pair(X),
// Fp8Bits<Fp16>::pair(X))
int main() {
  char op;
  unsigned int v;
  while (scanf(" %c %u", &op, &v) == 2) {
    if (op == 'e') {
      float f;
      __builtin_memcpy(&f, &v, 4);
      printf("%u\n", fp8_bits_from_float(f));
    } else if (op == 's') {  // v = 8 lo + hi
      printf("%u\n", fp8_sel(v >> 3, v & 7u));
    } else {
      printf("%u %u\n", Fp8Bits<Bf16>::pair(v), Fp8Bits<Fp16>::pair(v));
    }
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def codec(tmp_path_factory):
    """Runs the host build of common.cuh's E4M3 helpers on a list of requests; returns their answers."""
    nvcc = build.find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found: kernels_cu/common.cuh cannot be compiled here")
    out = tmp_path_factory.mktemp("fp8_codec")
    (out / "codec.cu").write_text(HARNESS)
    exe = out / "codec"
    subprocess.run([nvcc, "-std=c++17", "-arch=sm_80", "-I", str(build.KERNEL_DIR), "-o", str(exe),
                    str(out / "codec.cu")], check=True, capture_output=True)

    def run(lines: list[str]) -> list[str]:
        proc = subprocess.run([str(exe)], input="\n".join(lines) + "\n", capture_output=True, text=True, check=True)
        return proc.stdout.split("\n")[:len(lines)]
    return run


def torch_fp8_bits(x: torch.Tensor) -> torch.Tensor:
    """engine/quant.py fp8_kv's bits: clamp to +-448, then torch's cast (round to nearest even)."""
    return x.float().clamp(-448, 448).to(FP8_DTYPE).view(torch.uint8).long()


def encode(codec, values: torch.Tensor) -> torch.Tensor:
    bits = values.float().view(torch.int32).numpy().astype(np.uint32)
    return torch.tensor([int(v) for v in codec([f"e {b}" for b in bits])])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_kernels_write_every_16_bit_value_as_fp8_kv_does(codec, dtype):
    """Every finite bf16 / fp16 value (what the cache writers convert: k rounded to the model dtype after RoPE,
    v as the projection wrote it) gets torch's E4M3 bits: subnormals, ties to even, saturation at +-448."""
    values = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(dtype)
    values = values[torch.isfinite(values)]
    got, want = encode(codec, values), torch_fp8_bits(values)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, [(values[i].item(), got[i].item(), want[i].item()) for i in bad[:8]]


def test_the_kernels_encode_the_edge_cases_of_fp32(codec):
    g = torch.Generator().manual_seed(0)
    edges = [0.0, -0.0, 448.0, -448.0, 463.99, 464.0, 464.01, 479.9, 480.0, 1e6, float("inf"), float("-inf"),
             2.0 ** -6, 2.0 ** -6 * (1 - 2 ** -10), 2.0 ** -9, 2.0 ** -10, 2.0 ** -10 * 1.001, 3 * 2.0 ** -10,
             2.0 ** -140, 1.0625, 1.1875, 17.0, 1.0 + 2 ** -4, -(1.0 + 3 * 2 ** -4)]
    values = torch.cat([torch.tensor(edges), torch.randn(20000, generator=g) * 30,
                        torch.randn(5000, generator=g) * 2 ** -7])
    got, want = encode(codec, values), torch_fp8_bits(values)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, [(values[i].item(), got[i].item(), want[i].item()) for i in bad[:8]]
    nan = encode(codec, torch.tensor([float("nan"), -float("nan")]))
    assert nan.tolist() == [0x7F, 0xFF]  # E4M3's NaN code, with the sign


def sign_select(lo: int, hi: int) -> int:
    """What prmt with common.cuh's fp8_sel(lo, hi) builds of two bytes (PTX ISA prmt: a selector nibble with its
    top bit set replicates the selected byte's sign bit over the byte): {lo, sign(lo) x 8, hi, sign(hi) x 8}."""
    sign = lambda b: 0xFF if b & 0x80 else 0  # noqa: E731
    return lo | sign(lo) << 8 | hi << 16 | sign(hi) << 24


def prmt(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32 in its default mode: byte k of the result is byte (sel >> 4k) & 7 of {b, a}, or, where bit 3 of
    that nibble is set, that byte's sign bit over all 8 bits."""
    src = (b << 32 | a).to_bytes(8, "little")
    out = 0
    for k in range(4):
        nib = sel >> 4 * k & 0xF
        byte = src[nib & 7]
        out |= (0xFF if byte & 0x80 else 0) << 8 * k if nib & 8 else byte << 8 * k
    return out


def test_fp8_sel_picks_two_bytes_each_followed_by_its_sign(codec):
    g = torch.Generator().manual_seed(1)
    words = torch.randint(0, 1 << 32, (8, 2), generator=g, dtype=torch.int64).tolist()
    pairs = [(lo, hi) for lo in range(8) for hi in range(8)]
    sels = [int(x) for x in codec([f"s {8 * lo + hi}" for lo, hi in pairs])]
    for (lo, hi), sel in zip(pairs, sels):
        for a, b in words:
            src = (b << 32 | a).to_bytes(8, "little")
            assert prmt(a, b, sel) == sign_select(src[lo], src[hi]), (lo, hi, hex(sel))


def test_the_kernels_read_every_e4m3_value_exactly(codec):
    """The integer half of the read (Fp8Bits<T>::pair of the bytes as prmt's sign-replicating select lays them out)
    times the power of two the kernels multiply by (2^120 for bf16, 2^8 for fp16) is the E4M3 value, for every byte
    but the NaN codes, in both halves of the pair."""
    codes = torch.arange(256)
    finite = codes[(codes & 0x7F) != 0x7F]
    want = finite.to(torch.uint8).view(FP8_DTYPE).float()
    partner = finite.flip(0)  # the other half of each pair: every code in both halves
    lines = [f"d {sign_select(b, c)}" for b, c in zip(finite.tolist(), partner.tolist())]
    pairs = [tuple(int(x) for x in line.split()) for line in codec(lines)]
    for shift, codes_at in ((0, finite), (16, partner)):
        want = codes_at.to(torch.uint8).view(FP8_DTYPE).double()
        bf16 = torch.tensor([p[0] >> shift & 0xFFFF for p in pairs], dtype=torch.int32).to(torch.int16)
        fp16 = torch.tensor([p[1] >> shift & 0xFFFF for p in pairs], dtype=torch.int32).to(torch.int16)
        bf16, fp16 = bf16.view(torch.bfloat16), fp16.view(torch.float16)
        assert torch.equal(bf16.double() * 2.0 ** 120, want), shift
        assert torch.equal(fp16.double() * 2.0 ** 8, want), shift
        assert torch.equal(torch.signbit(bf16), torch.signbit(want)) and torch.equal(torch.signbit(fp16),
                                                                                   torch.signbit(want))


def test_every_attention_and_cache_write_entry_has_an_fp8_kv_twin():
    names = {s.name for specs in MODULES.values() for s in specs}
    for module, prefixes in (("rope_cache_write", ["rope_cache_write_"]), ("decode_attention", ["decode_attention_"]),
                             ("prefill_attention", ["prefill_attention_bf16", "prefill_attention_fp16"])):
        base = [s.name for s in MODULES[module] if s.name.startswith(tuple(prefixes))
                and not s.name.endswith(KV_FP8_SUFFIX)
                # 2-deep 16-bit tiles (the E4M3 entries' depth is their own) and the warp entries (16-bit only)
                and not s.name.endswith(("_s2", "_w"))]
        assert base and all(n + KV_FP8_SUFFIX in names for n in base), module
        args = {s.name: s.args for s in MODULES[module]}
        assert all(args[n] == args[n + KV_FP8_SUFFIX] for n in base), module
    skinny = {s.name: s.args for s in MODULES["skinny_linear"]}
    rope = [n for n in skinny if n.startswith("skinny_rope_kv_")]
    # 16-bit weights and E4M3 weights (…_fp8_m*) alike: 2 dtypes x 3 token buckets x 2 widths, and for E4M3 the 4-warp
    # blocks of the 8-token bucket (…_fp8_m8_w4); W8A8 (…_w8a8_m*): bf16 x 3 token buckets x 2 widths
    assert len(rope) == 12 + 14 + 6 and sum("_fp8_" in n for n in rope) == 14 and sum("_w8a8_" in n for n in rope) == 6
    assert all(skinny[n.replace("rope_kv_", "rope_kvfp8_")] == skinny[n] for n in rope)
    # the programmatic-dependent-launch chain keeps its members: decode attention and the skinny QKV kernel
    assert all(n.startswith(PDL_PREFIXES) for n in names if n.startswith(("decode_attention_", "skinny_rope_kvfp8")))


@pytest.mark.parametrize("d", ATTENTION_HEAD_DIMS)
def test_the_fp8_kv_entries_fit_the_shared_memory_of_every_fp8_gpu(d):
    """Ada (8.9) lets a block opt in to 99 KiB of shared memory, Hopper to 227 KiB; the E4M3 entries must load on
    both. Decode's E4M3 tiles (3-5 stages of byte rows) hold the merge's fp32 rows after the loop."""
    ada = 101376
    for rope in (False, True):
        size = decode_attention.smem_bytes(d, rope, fp8_kv=True)
        assert size <= ada, (d, rope, size)
    assert prefill_attention.smem_bytes(d, fp8_kv=True) <= ada
    stages = 2 * (2 if d >= 128 else 3) - 1
    row = d if d % 32 else d + 16
    assert 2 * stages * 64 * row >= (80 * d + 144) * 4  # the static_assert of decode_attention.cu


def test_cache_dtype_follows_the_k_cache():
    assert cache_dtype(torch.empty(1, dtype=FP8_DTYPE), torch.bfloat16) == FP8_DTYPE
    assert cache_dtype(torch.empty(1, dtype=torch.bfloat16), torch.bfloat16) == torch.bfloat16
    assert cache_dtype(torch.empty(1, dtype=torch.float32), torch.float16) == torch.float16  # then refused by dtype


def test_fp8_kv_on_the_cuda_kernels_needs_a_gpu_with_fp8(monkeypatch):
    """runtime.kv_cache_dtype: an E4M3 cache on the CUDA kernels from compute capability 8.9 on; below, one line
    naming the device and the two ways out; --kernels torch serves it on any GPU (the capability not asked)."""
    cuda = torch.device("cuda", 0)
    capability = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["value"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    fp8 = EngineConfig(kv_cache_dtype="fp8")
    for cc in ((9, 0), (8, 9), (10, 0)):
        capability["value"] = cc
        assert kv_cache_dtype(fp8, torch.bfloat16, cuda) == FP8_DTYPE
        assert kv_cache_dtype(EngineConfig(kv_cache_dtype="fp8", kernels="cuda"), torch.float16, cuda) == FP8_DTYPE
    for cc in ((8, 0), (8, 6), (7, 5)):
        capability["value"] = cc
        with pytest.raises(ConfigError) as err:
            kv_cache_dtype(fp8, torch.bfloat16, cuda)
        msg = str(err.value)
        assert "\n" not in msg and "compute capability >= 8.9" in msg and f"has {cc[0]}.{cc[1]}" in msg
        assert "A100" in msg and "--kv-cache-dtype auto" in msg and "--kernels torch" in msg

    def no_query(device=None):
        raise AssertionError("the capability is asked only for the CUDA kernels")
    monkeypatch.setattr(torch.cuda, "get_device_capability", no_query)
    assert kv_cache_dtype(EngineConfig(kv_cache_dtype="fp8", kernels="torch"), torch.bfloat16, cuda) == FP8_DTYPE
    assert kv_cache_dtype(fp8, torch.float32, torch.device("cpu")) == FP8_DTYPE
    assert kv_cache_dtype(EngineConfig(), torch.bfloat16, cuda) == torch.bfloat16
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int8")


def test_the_header_states_the_shared_memory_the_wrapper_computes():
    text = (pathlib.Path(build.KERNEL_DIR) / "decode_attention.cu").read_text()
    assert "STAGES8 = D >= 128 ? 3 : 5" in text and "LD8 = D % 32 ? D : D + 16" in text


def test_the_fp8_kv_entries_size_their_splits_by_their_own_occupancy():
    """key_splits / fits_one_wave of the E4M3 entries read the library's decode_blocks_per_sm_kvfp8 (their own
    shared memory and registers), the 16-bit ones decode_blocks_per_sm."""
    from types import SimpleNamespace
    lib = SimpleNamespace(num_sms=132, decode_cluster=8, decode_max_splits=128,
                          decode_blocks_per_sm={64: 3, 128: 3}, decode_blocks_per_sm_kvfp8={64: 4, 128: 1})
    for batch, d in ((32, 64), (8, 128), (1, 128), (64, 64)):
        blocks = batch * 8  # (sequence, KV head) blocks a split: 32 query heads over 8, one head chunk
        for fp8 in (False, True):
            per_sm = (lib.decode_blocks_per_sm_kvfp8 if fp8 else lib.decode_blocks_per_sm)[d]
            splits = decode_attention.key_splits(lib, batch, 32, 8, d, 32768, fp8_kv=fp8)
            assert splits == 1 or blocks * splits <= per_sm * lib.num_sms, (batch, d, fp8, splits)
            assert decode_attention.fits_one_wave(lib, batch, 32, 8, d, 32768, fp8_kv=fp8) == (
                blocks * splits <= per_sm * lib.num_sms)
    # 1B at batch 32: 256 blocks a split; 3 a SM hold one split (396), 4 a SM two (528)
    assert decode_attention.key_splits(lib, 32, 32, 8, 64, 32768) == 1
    assert decode_attention.key_splits(lib, 32, 32, 8, 64, 32768, fp8_kv=True) == 2
    # 8B at batch 8: 64 blocks a split; about two a SM (5 splits) where 3 fit, 2 where 1 fits
    assert decode_attention.key_splits(lib, 8, 32, 8, 128, 32768) == 5
    assert decode_attention.key_splits(lib, 8, 32, 8, 128, 32768, fp8_kv=True) == 2


class EntryRecorder:
    """Stands in for the KernelLibrary under the skinny wrappers: records the entry each launch names and its
    argument count."""

    skinny_wide_tiles = 132
    skinny_fp8_warps, skinny_fp8_wave_tiles = 4, 264

    def __init__(self):
        self.launched: list[tuple[str, int]] = []
        recorder = self

        class Kernels:
            def __getitem__(self, name):
                return lambda grid, block, smem, stream, *args, pdl=False: recorder.launched.append((name, len(args)))
        self.kernels = Kernels()

    def stream(self) -> int:
        return 0


def cpu_tensor_args(monkeypatch) -> None:
    """The wrappers' tensor_arg without its device check (CPU tensors); its dtype, rank and layout checks stay."""
    from engine.cuda import checks
    from engine.cuda.wrappers import skinny_linear

    def cpu_tensor_arg(t, what, dtype, ndim=None, contiguous=True, align=True, host_mapped=False):
        ok = t.dtype == dtype if isinstance(dtype, torch.dtype) else t.dtype in dtype
        if not (ok and (ndim is None or t.dim() == ndim) and (not contiguous or t.is_contiguous())):
            raise KernelArgError(f"{what}: {t.dtype} {tuple(t.shape)}")
        return t.data_ptr()
    for module in (checks, skinny_linear):
        monkeypatch.setattr(module, "tensor_arg", cpu_tensor_arg)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fp8_weight", [False, True], ids=["w16", "w_fp8"])
@pytest.mark.parametrize("fp8_cache", [False, True], ids=["kv16", "kv_fp8"])
@pytest.mark.parametrize("wide_tiles", [0, 1000], ids=["8warps", "16warps"])
def test_the_skinny_qkv_wrapper_names_a_built_entry_for_every_weight_and_cache(monkeypatch, dtype, fp8_weight,
                                                                                fp8_cache, wide_tiles):
    """skinny_linear.rope_kv with a 16-bit or per-channel FP8 weight and a 16-bit or E4M3 cache names an entry the
    library declares (and tests/unit/test_kernels_build.py finds in every fatbin), with its argument count: FP8
    weights with an FP8 KV cache take skinny_rope_kvfp8_<dt>_fp8_m8. The device check of tensor_arg is stubbed
    (CPU tensors); every other check runs."""
    from engine.cuda.wrappers import skinny_linear
    from engine.quant import quantize_fp8

    cpu_tensor_args(monkeypatch)
    H, Hkv, D, K, M = 4, 2, 16, 64, 3
    N = (H + 2 * Hkv) * D
    w = torch.randn(N, K).to(dtype)
    weight = quantize_fp8(w) if fp8_weight else w
    cache = torch.zeros(4, 16, Hkv, D, dtype=FP8_DTYPE if fp8_cache else dtype)
    lib = EntryRecorder()
    lib.skinny_wide_tiles = wide_tiles  # grids of at most this many tiles take 16-warp blocks
    skinny_linear.rope_kv(lib, torch.empty(M, H, D, dtype=dtype), torch.randn(M, K).to(dtype), weight, None, None,
                          torch.zeros(64, D), torch.zeros(M, dtype=torch.long), cache, cache.clone(),
                          torch.arange(M), H, Hkv)
    specs = {s.name: s.args for s in MODULES["skinny_linear"]}
    (name, num_args), = lib.launched
    dt = "bf16" if dtype == torch.bfloat16 else "fp16"
    want = (f"skinny_rope_kv{'fp8' if fp8_cache else ''}_{dt}{'_fp8' if fp8_weight else ''}_m8"
            f"{'_w16' if N // 16 <= wide_tiles else ''}")
    assert name == want and name in specs and num_args == len(specs[name])


@pytest.mark.parametrize("M, bucket", [(3, 8), (13, 16), (32, 32)])
def test_the_w8a8_skinny_wrappers_name_a_built_entry_with_its_arguments(monkeypatch, M, bucket):
    """skinny_linear's store / silu / residual / rope_kv with x_scale (W8A8: E4M3 x and its per-row scales, a
    per-channel FP8 weight) name skinny_<ep>_bf16_w8a8_m<bucket>, which the library declares, with as many
    arguments as it declares; what W8A8 cannot take is refused with KernelArgError: a norm weight (x arrives
    normalized), a 16-bit weight, 16-bit x, and scales of the wrong shape."""
    from engine.cuda.wrappers import skinny_linear
    from engine.quant import quantize_activations, quantize_fp8

    cpu_tensor_args(monkeypatch)
    specs = {s.name: s.args for s in MODULES["skinny_linear"]}
    K, N, H, Hkv, D = 64, 128, 4, 2, 16
    xq, scale = quantize_activations(torch.randn(M, K, dtype=torch.bfloat16))
    w = quantize_fp8(torch.randn(N, K))
    lib = EntryRecorder()
    lib.skinny_wide_tiles = 0
    bf = torch.bfloat16
    skinny_linear.store(lib, torch.empty(M, N, dtype=bf), xq, w, x_scale=scale)
    skinny_linear.silu(lib, torch.empty(M, N // 2, dtype=bf), xq, w, x_scale=scale)
    skinny_linear.residual(lib, torch.zeros(M, N, dtype=bf), xq, w, x_scale=scale)
    cache = torch.zeros(4, 16, Hkv, D, dtype=bf)
    skinny_linear.rope_kv(lib, torch.empty(M, H, D, dtype=bf), xq, w, None, None, torch.zeros(64, D),
                          torch.zeros(M, dtype=torch.long), cache, cache.clone(), torch.arange(M), H, Hkv, x_scale=scale)
    assert [name for name, _ in lib.launched] == [f"skinny_{ep}_bf16_w8a8_m{bucket}"
                                                  for ep in ("store", "silu", "residual", "rope_kv")]
    assert all(num_args == len(specs[name]) for name, num_args in lib.launched)
    out = torch.empty(M, N, dtype=bf)
    with pytest.raises(KernelArgError, match="normalized"):
        skinny_linear.store(lib, out, xq, w, norm_weight=torch.ones(K, dtype=bf), x_scale=scale)
    with pytest.raises(KernelArgError, match="Fp8Weight"):
        skinny_linear.store(lib, out, xq, torch.randn(N, K, dtype=bf), x_scale=scale)
    with pytest.raises(KernelArgError):
        skinny_linear.store(lib, out, torch.randn(M, K, dtype=bf), w, x_scale=scale)
    with pytest.raises(KernelArgError):
        skinny_linear.store(lib, out, xq, w, x_scale=scale[:1] if M > 1 else torch.ones(2, 1))
    assert len(lib.launched) == 4


@pytest.mark.parametrize("fp8_weight", [False, True], ids=["w16", "w_fp8"])
@pytest.mark.parametrize("M", [1, 8, 9])
def test_skinny_block_width_follows_the_grid(monkeypatch, fp8_weight, M):
    """The skinny wrappers' block width: 16 warps on grids of at most skinny_wide_tiles tiles; past that 8, except
    E4M3 weights up to 8 tokens on grids of more than one wave of 8-warp blocks (skinny_fp8_wave_tiles), which take
    4-warp blocks (…_fp8_m8_w4). Every entry named is one the library declares."""
    from engine.cuda.wrappers import skinny_linear
    from engine.quant import quantize_fp8

    cpu_tensor_args(monkeypatch)
    specs = {s.name for s in MODULES["skinny_linear"]}
    lib = EntryRecorder()
    lib.skinny_wide_tiles, lib.skinny_fp8_wave_tiles = 4, 8  # grids of 4 and 8 tiles: one wave
    K = 64
    for tiles, want in ((4, "_w16"), (5, ""), (8, ""), (9, "_w4" if fp8_weight and M <= 8 else "")):
        w = torch.randn(16 * tiles, K).to(torch.bfloat16)
        weight = quantize_fp8(w) if fp8_weight else w
        skinny_linear.store(lib, torch.empty(M, 16 * tiles, dtype=torch.bfloat16), torch.randn(M, K).to(torch.bfloat16),
                            weight)
        name, _ = lib.launched[-1]
        assert name.endswith(f"_m{8 if M <= 8 else 16}{want}") and name in specs, (tiles, name)
