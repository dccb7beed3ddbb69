"""KernelLibrary: the kernels of kernels_cu/ loaded into the device's primary context, handed out by name
(`kernels`: name -> engine.cuda.driver.Kernel) to the launch wrappers of engine/cuda/wrappers/, with the device
facts those size their grids from (SM count, shared memory, occupancy, cluster support).

Loading: each kernels_cu/<module>.cu has a fatbin kernels_cu/build/<module>.fatbin (engine/cuda/build.py)
that `cuModuleLoadData` loads. Where the fatbin is missing, stale (its stamp does not match the
source) or holds no code for the device, NVRTC compiles the source for the device's architecture and
the cubin is cached under engine.env.CACHE_DIR / "kernels" (key: source hash + options + arch). Every
function in MODULES is resolved at start; a missing one is a start-up error naming it.

Launching (the wrappers): check shapes, dtypes, contiguity and 16-byte alignment, then launch on the current
torch stream (`stream()`), so launches are ordered with torch ops and are captured by torch.cuda.graph.
"""
from __future__ import annotations

import logging
import pathlib
import threading
from dataclasses import dataclass

import torch

from engine import env
from engine.cuda import build
from engine.cuda.checks import ATTENTION_HEAD_DIMS, DTYPE_SUFFIX, KV_FP8_SUFFIX
from engine.cuda.driver import Kernel, KernelLoadError, check, cuda_driver, error_text
from engine.cuda.wrappers import decode_attention, gemm_sm90, prefill_attention
from engine.cuda.wrappers.skinny_linear import (SKINNY_BLOCKS_PER_SM, SKINNY_EPILOGUE_ARGS, SKINNY_FP8_EPILOGUE_ARGS,
                                                SKINNY_FP8_WARPS, SKINNY_M_BUCKETS, SKINNY_W8A8_EPILOGUE_ARGS)

log = logging.getLogger(__name__)

MIN_COMPUTE_CAPABILITY = (8, 0)  # cp.async, ldmatrix, bf16 mma.sync


@dataclass(frozen=True)
class KernelSpec:
    """An extern "C" kernel and its parameter types, one letter each: p = pointer, i = int32,
    l = int64, f = float32 (the order of the C signature)."""

    name: str
    args: str


def _per_dtype(fmt: str, args: str) -> list[KernelSpec]:
    return [KernelSpec(fmt.format(dt=dt), args) for dt in ("bf16", "fp16")]


KV_SUFFIXES = ("", KV_FP8_SUFFIX)  # the attention and cache-write entries: a 16-bit KV cache, an E4M3 one

# Every decode attention entry (kernels_cu/decode_attention.cu DECODE_ENTRY1) takes these arguments.
DECODE_ATTENTION_ARGS = "ppppppppp" + "l" + "iiiiiii" + "f" + "i" + "ppl" + "ppp" + "i"
MODULES: dict[str, list[KernelSpec]] = {
    "embedding": _per_dtype("embedding_{dt}", "pppil"),
    "rms_norm": _per_dtype("rms_norm_{dt}", "pppiillif") + _per_dtype("residual_norm_{dt}", "pppipiif"),
    "rope_cache_write": [KernelSpec(f"rope_cache_write_{dt}_v{v}{kv}", "ppppppppplllii" + "i")
                         for dt in ("bf16", "fp16") for v in (8, 4) for kv in KV_SUFFIXES],
    "decode_attention": [KernelSpec(f"decode_attention_{rope}{dt}_d{d}{kv}", DECODE_ATTENTION_ARGS)
                         for rope in ("", "rope_") for dt in ("bf16", "fp16") for d in ATTENTION_HEAD_DIMS
                         for kv in KV_SUFFIXES]
    + [KernelSpec(f"decode_attention_{dt}_d{d}_s2", DECODE_ATTENTION_ARGS)
       for dt in ("bf16", "fp16") for d in ATTENTION_HEAD_DIMS if d < 128]
    + [KernelSpec(f"decode_attention_{dt}_d{d}_w", "pppppp" + "l" + "iiiiii" + "f" + "i")
       for dt in ("bf16", "fp16") for d in decode_attention.WARP_HEAD_DIMS],
    "prefill_attention": [KernelSpec(f"prefill_attention_{dt}_d{d}{kv}", "pppppp" + "l" + "iiiii" + "f" + "ppi")
                          for dt in ("bf16", "fp16") for d in ATTENTION_HEAD_DIMS for kv in KV_SUFFIXES]
    + [KernelSpec(f"prefill_attention_merge_{dt}_d{d}", "pppp" + "iii")
       for dt in ("bf16", "fp16") for d in ATTENTION_HEAD_DIMS],
    "silu_and_mul": _per_dtype("silu_and_mul_{dt}", "ppi"),
    "fp8_quant": _per_dtype("quantize_rows_fp8_{dt}", "pppi"),
    "skinny_linear": [KernelSpec(f"skinny_{ep}_{dt}_m{m}{w}", args) for ep, args in SKINNY_EPILOGUE_ARGS.items()
                      for dt in ("bf16", "fp16") for m in SKINNY_M_BUCKETS for w in ("", "_w16")]
    + [KernelSpec(f"skinny_{ep}_{dt}_fp8_m{m}{w}", args) for ep, args in SKINNY_FP8_EPILOGUE_ARGS.items()
       for dt in ("bf16", "fp16") for m in SKINNY_M_BUCKETS for w in ("", "_w16")]
    + [KernelSpec(f"skinny_{ep}_{dt}_fp8_m8_w4", args) for ep, args in SKINNY_FP8_EPILOGUE_ARGS.items()
       for dt in ("bf16", "fp16")]
    + [KernelSpec(f"skinny_{ep}_bf16_w8a8_m{m}{w}", args) for ep, args in SKINNY_W8A8_EPILOGUE_ARGS.items()
       for m in SKINNY_M_BUCKETS for w in ("", "_w16")],
    "sampling": [KernelSpec("sample_stats", "p" * 9 + "ii"), KernelSpec("sample_select", "p" * 10 + "ii"),
                 KernelSpec("sample_draw", "p" * 10 + "ii"), KernelSpec("sample_finish", "p" * 5 + "ii"),
                 KernelSpec("sample_topk_split", "ppii"), KernelSpec("sample_topk_merge", "p" * 5 + "iiii")],
    "spec_accept": [KernelSpec("spec_accept_draw", "p" * 6 + "iii"), KernelSpec("spec_accept_finish", "pppii")],
    gemm_sm90.MODULE: [KernelSpec(name, gemm_sm90.GEMM_ARGS) for name in gemm_sm90.entry_names()]
    + [KernelSpec(name, gemm_sm90.W8A8_ARGS) for name in gemm_sm90.w8a8_entry_names()],
    "decode_step": [KernelSpec("decode_prepare", "p" * 22 + "ili" + "pli"),
                    KernelSpec("decode_commit", "ppi" + "p" * 6 + "il"),
                    KernelSpec("verify_commit", "p" * 10 + "iili" + "l")],
}

# Kernels launched with programmatic dependent launch when the library's pdl is on: the decode and verify
# step chain (decode_prepare -> embedding -> skinny -> attention -> skinny ... -> the sampling kernels ->
# decode_commit; the Hopper GEMM's projections in forwards it serves), so each kernel's launch, and the skinny
# kernels' and the GEMM's first weight loads, overlap the end of the kernel before (kernels_cu/common.cuh, grid_dependency_wait). Each of them waits before it reads
# anything the launch before may have written; what each reads before its wait is in its launch contract,
# and tests/unit/test_pdl_contract.py checks CudaOps' launch order against those.
PDL_PREFIXES = ("skinny_", "decode_attention_", "decode_prepare", "embedding_", "sample_", "spec_accept_",
                "decode_commit", "verify_commit", "gemm_sm90_")


def expected_symbols() -> dict[str, list[str]]:
    """{module: [kernel names]}: what every fatbin must define."""
    return {module: [s.name for s in specs] for module, specs in MODULES.items()}


def _raw_stream_fn():
    fn = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if fn is not None:
        return fn
    return lambda index: torch.cuda.current_stream(index).cuda_stream


class KernelLibrary:
    """Every kernel of kernels_cu/, loaded for one device: `kernels` maps each name of MODULES to its Kernel."""

    # A cap on decode attention's key splits (an instance may lower it: bench/engine_bench.py --decode-splits).
    decode_max_splits = 128

    def __init__(self, device: torch.device | int | None = None, build_dir: pathlib.Path = build.BUILD_DIR,
                 kernel_dir: pathlib.Path = build.KERNEL_DIR, cache_dir: pathlib.Path | None = None,
                 pdl: bool = False):
        """pdl: launch the kernels of PDL_PREFIXES with programmatic dependent launch (sm_90 and newer;
        ignored before). Off by default, because a skinny kernel so launched reads its weight before the
        kernel just before it has finished: a caller that writes a weight in the launch right before must
        leave it off. The engine's CudaOps turns it on (its weights are written once, at load)."""
        if not torch.cuda.is_available():
            raise KernelLoadError("torch sees no CUDA device")
        if device is None:
            index = torch.cuda.current_device()
        else:
            index = device.index if isinstance(device, torch.device) else int(device)
            index = torch.cuda.current_device() if index is None else index
        self.device = torch.device("cuda", index)
        self.index = index
        self.cache_dir = cache_dir or env.CACHE_DIR / "kernels"
        driver = cuda_driver()
        torch.cuda.init()
        with torch.cuda.device(index):
            torch.empty(1, device=self.device)  # makes torch's (primary) context current on this thread
        check("cuInit", driver.cuInit(0))
        self._cu_device = check("cuDeviceGet", driver.cuDeviceGet(index))
        self.context = check("cuDevicePrimaryCtxRetain", driver.cuDevicePrimaryCtxRetain(self._cu_device))
        check("cuCtxSetCurrent", driver.cuCtxSetCurrent(self.context))
        self._bound = threading.local()
        self._bound.ok = True
        attr = driver.CUdevice_attribute
        major = check("cuDeviceGetAttribute", driver.cuDeviceGetAttribute(
            attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self._cu_device))
        minor = check("cuDeviceGetAttribute", driver.cuDeviceGetAttribute(
            attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self._cu_device))
        self.compute_capability = (major, minor)
        self.pdl = pdl and self.compute_capability >= (9, 0)
        self.num_sms = check("cuDeviceGetAttribute", driver.cuDeviceGetAttribute(
            attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, self._cu_device))
        self.max_smem_optin = check("cuDeviceGetAttribute", driver.cuDeviceGetAttribute(
            attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, self._cu_device))
        self.skinny_wide_tiles = self.num_sms  # skinny grids of at most this many tiles use 16-warp blocks
        # warps per block of the E4M3-weight skinny kernels up to 8 tokens on grids of more than skinny_fp8_wave_tiles
        # tiles (one wave of 8-warp blocks)
        self.skinny_fp8_warps = SKINNY_FP8_WARPS
        self.skinny_fp8_wave_tiles = SKINNY_BLOCKS_PER_SM * self.num_sms
        # Decode attention's splits of one (sequence, head group) form clusters of up to this many blocks
        # (sm_90), which merge in distributed shared memory when they hold every key; 1: no clusters.
        self.decode_cluster = decode_attention.DECODE_CLUSTER if self.compute_capability >= (9, 0) else 1
        # Grids of more than one wave of decode attention at head_dim < 128 take the 2-deep _s2 entries
        # (decode_attention.shallow_entry); False: never (the A/B's switch).
        self.decode_shallow = env.DECODE_SHALLOW
        # One-split grids of more than one wave on the warp entries (decode_attention.warp_entry); False: never.
        self.decode_warp = env.DECODE_WARP
        if self.compute_capability < MIN_COMPUTE_CAPABILITY:
            raise KernelLoadError(f"the CUDA kernels need compute capability >= 8.0 (cp.async, bf16 mma); "
                                  f"device {index} is {major}.{minor}")
        self.modules: dict[str, object] = {}  # module name -> its CUmodule
        self.origin: dict[str, str] = {}  # module -> "fatbin" | "nvrtc" | "nvrtc-cache"
        self.kernels: dict[str, Kernel] = {}
        missing = []
        arch = major * 10 + minor
        for module, specs in MODULES.items():
            src = kernel_dir / f"{module}.cu"
            if src.is_file() and not build.serves(src.read_text(), arch):
                continue  # built for other architectures only (gemm_sm90: sm_90a)
            mod = self._load_module(module, build_dir, kernel_dir)
            for spec in specs:
                err, func = driver.cuModuleGetFunction(mod, spec.name.encode())
                if err != driver.CUresult.CUDA_SUCCESS:
                    missing.append(f"{spec.name} (in {module}, {self.origin[module]}: {error_text(err)})")
                    continue
                self.kernels[spec.name] = Kernel(spec.name, func, spec.args,
                                                 pdl=self.pdl and spec.name.startswith(PDL_PREFIXES))
        if missing:
            raise KernelLoadError("kernels missing from the loaded modules: " + ", ".join(missing))
        smem_attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        for dt in DTYPE_SUFFIX.values():
            for d, kv in ((d, kv) for d in ATTENTION_HEAD_DIMS for kv in KV_SUFFIXES):
                fp8 = kv == KV_FP8_SUFFIX
                sizes = [(f"decode_attention_{dt}_d{d}{kv}", decode_attention.smem_bytes(d, fp8_kv=fp8)),
                         (f"decode_attention_rope_{dt}_d{d}{kv}", decode_attention.smem_bytes(d, rope=True, fp8_kv=fp8)),
                         (f"prefill_attention_{dt}_d{d}{kv}", prefill_attention.smem_bytes(d, fp8))]
                if d < 128 and not fp8:
                    sizes.append((f"decode_attention_{dt}_d{d}_s2", decode_attention.smem_bytes(d, shallow=True)))
                if d in decode_attention.WARP_HEAD_DIMS and not fp8 and \
                        decode_attention.warp_smem_bytes(d) <= self.max_smem_optin:  # else never taken (below)
                    sizes.append((f"decode_attention_{dt}_d{d}_w", decode_attention.warp_smem_bytes(d)))
                for name, size in sizes:
                    if size > self.max_smem_optin:
                        raise KernelLoadError(f"{name} needs {size} bytes of shared memory; the device "
                                              f"allows {self.max_smem_optin}")
                    check(f"cuFuncSetAttribute({name}, MAX_DYNAMIC_SHARED_SIZE_BYTES={size})",
                          driver.cuFuncSetAttribute(self.kernels[name].func, smem_attr, size))
        # The Hopper GEMM (sm_90a): where loaded, CudaOps may run decode forwards' projections on it (env.GEMM).
        self.gemm_sm90 = gemm_sm90.MODULE in self.modules
        for name in gemm_sm90.entry_names() + gemm_sm90.w8a8_entry_names() if self.gemm_sm90 else ():
            size = gemm_sm90.smem_bytes(int(name.rsplit("_n", 1)[1]))
            check(f"cuFuncSetAttribute({name}, MAX_DYNAMIC_SHARED_SIZE_BYTES={size})",
                  driver.cuFuncSetAttribute(self.kernels[name].func, smem_attr, size))
        # sample_topk_merge holds a row's candidates in shared memory (ceil(V / TOPK_CHUNK) * (8 k + 4) bytes;
        # its static shared memory, 256 bytes, comes on top)
        self.topk_smem_limit = self.max_smem_optin - 1024
        check("cuFuncSetAttribute(sample_topk_merge, MAX_DYNAMIC_SHARED_SIZE_BYTES)",
              driver.cuFuncSetAttribute(self.kernels["sample_topk_merge"].func, smem_attr, self.topk_smem_limit))
        # Decode attention blocks one SM holds at once, per head dim (shared memory bounds it: 3 at D = 64), for
        # a 16-bit cache and for an E4M3 one (the _kvfp8 entries: their own tiles and registers).
        self.decode_blocks_per_sm, self.decode_blocks_per_sm_kvfp8 = (
            {d: check(f"cuOccupancyMaxActiveBlocksPerMultiprocessor(decode_attention_bf16_d{d}{kv})",
                      driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                          self.kernels[f"decode_attention_bf16_d{d}{kv}"].func, decode_attention.DECODE_THREADS,
                          decode_attention.smem_bytes(d, fp8_kv=bool(kv))))
             for d in ATTENTION_HEAD_DIMS}
            for kv in KV_SUFFIXES)
        # Warp-entry blocks one SM holds at once (decode_attention.warp_grid), per head dim; 0 where a block's rings
        # exceed the device's shared memory (head_dim 128 on Ada's 99 KiB: the block entries serve there).
        self.decode_warp_blocks_per_sm = {
            d: check(f"cuOccupancyMaxActiveBlocksPerMultiprocessor(decode_attention_bf16_d{d}_w)",
                     driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                         self.kernels[f"decode_attention_bf16_d{d}_w"].func, decode_attention.WARP_WARPS * 32,
                         decode_attention.warp_smem_bytes(d)))
            if decode_attention.warp_smem_bytes(d) <= self.max_smem_optin else 0
            for d in decode_attention.WARP_HEAD_DIMS}
        # Prefill attention blocks (work items of prefill_rows(d) query rows) one SM holds at once, per head dim and
        # cache (prefill_attention.key_splits).
        self.prefill_blocks_per_sm = {
            (d, bool(kv)): check(f"cuOccupancyMaxActiveBlocksPerMultiprocessor(prefill_attention_bf16_d{d}{kv})",
                                 driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                                     self.kernels[f"prefill_attention_bf16_d{d}{kv}"].func, 128,
                                     prefill_attention.smem_bytes(d, bool(kv))))
            for d in ATTENTION_HEAD_DIMS for kv in KV_SUFFIXES}
        self._stream = _raw_stream_fn()
        log.info("CUDA kernels loaded on device %d (sm_%d%d, %d SMs): %s", index, major, minor, self.num_sms,
                 ", ".join(f"{m}={o}" for m, o in self.origin.items()))

    def _load_module(self, module: str, build_dir: pathlib.Path, kernel_dir: pathlib.Path):
        driver = cuda_driver()
        src = kernel_dir / f"{module}.cu"
        fatbin = build.fatbin_path(src, build_dir)
        reason = "no fatbin"
        if fatbin.is_file():
            if src.is_file() and not build.is_current(src, build_dir, flags=False):
                reason = "the fatbin is older than its source (run `python -m engine.cuda.build`)"
            else:
                err, mod = driver.cuModuleLoadData(fatbin.read_bytes())
                if err == driver.CUresult.CUDA_SUCCESS:
                    self.modules[module] = mod
                    self.origin[module] = "fatbin"
                    return mod
                reason = f"cuModuleLoadData({fatbin.name}) failed: {error_text(err)}"
        if not src.is_file():
            raise KernelLoadError(f"kernel module {module}: {reason}, and its source {src} is missing")
        arch = self.compute_capability[0] * 10 + self.compute_capability[1]
        log.info("kernel module %s: %s; compiling %s with NVRTC for sm_%d", module, reason, src.name, arch)
        cubin, cached = build.nvrtc_compile(src, arch, self.cache_dir)
        mod = check(f"cuModuleLoadData({module} NVRTC cubin)", driver.cuModuleLoadData(cubin))
        self.modules[module] = mod
        self.origin[module] = "nvrtc-cache" if cached else "nvrtc"
        return mod

    def close(self) -> None:
        """Unloads the modules (after the device has finished every launch)."""
        driver = cuda_driver()
        torch.cuda.synchronize(self.device)
        for mod in self.modules.values():
            driver.cuModuleUnload(mod)
        self.modules.clear()
        self.kernels.clear()

    # -----------------------------------------------------------------------------------------
    def stream(self) -> int:
        """The current torch stream of the library's device (a raw cudaStream_t), with the library's
        context made current on this thread the first time it launches from it."""
        if not getattr(self._bound, "ok", False):
            check("cuCtxSetCurrent", cuda_driver().cuCtxSetCurrent(self.context))
            self._bound.ok = True
        return self._stream(self.index)
