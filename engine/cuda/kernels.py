"""KernelLibrary: the kernels of kernels_cu/ loaded into the device's primary context, with one thin,
typed launch wrapper per kernel.

Loading: each kernels_cu/<module>.cu has a fatbin kernels_cu/build/<module>.fatbin (engine/cuda/build.py)
that `cuModuleLoadData` loads. Where the fatbin is missing, stale (its stamp does not match the
source) or holds no code for the device, NVRTC compiles the source for the device's architecture and
the cubin is cached under engine.env.CACHE_DIR / "kernels" (key: source hash + options + arch). Every
function in MODULES is resolved at start; a missing one is a start-up error naming it.

Launching: a wrapper checks shapes, dtypes, contiguity and 16-byte alignment, then calls
`cuLaunchKernel` on the current torch stream (so launches are ordered with torch ops and are
captured by torch.cuda.graph). Parameters are packed into one preallocated buffer per kernel (each
argument in an 8-byte slot, a fixed pointer array into it): one struct.pack_into per launch.
NOTE: the packing buffer is per kernel, so launches of the same kernel must come from one thread at
a time (the engine has one device thread).
"""
from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
import pathlib
import struct
import threading
from dataclasses import dataclass

import torch

from engine import env
from engine.cuda import build

log = logging.getLogger(__name__)

DTYPE_SUFFIX = {torch.bfloat16: "bf16", torch.float16: "fp16"}
ATTENTION_HEAD_DIMS = (16, 32, 64, 80, 96, 128)  # any multiple of 16 up to 128 could be added
MIN_COMPUTE_CAPABILITY = (8, 0)  # cp.async, ldmatrix, bf16 mma.sync
NORM_MANY_ROWS = 1024  # rms_norm over at least this many rows takes 4 vectors per thread


@dataclass(frozen=True)
class KernelSpec:
    """An extern "C" kernel and its parameter types, one letter each: p = pointer, i = int32,
    l = int64, f = float32 (the order of the C signature)."""

    name: str
    args: str


def _per_dtype(fmt: str, args: str) -> list[KernelSpec]:
    return [KernelSpec(fmt.format(dt=dt), args) for dt in ("bf16", "fp16")]


# Skinny linear layers (kernels_cu/skinny_linear.cu): one kernel per epilogue x dtype x token bucket.
SKINNY_MAX_M = 32
SKINNY_M_BUCKETS = (8, 16, 32)  # _m8 / _m16 / _m32: 1, 2 or 4 tensor-core n-tiles of 8 tokens
SKINNY_TILE = 16  # weight rows per block (one m16n8k16 A tile)
SKINNY_WARPS, SKINNY_WIDE_WARPS = 8, 16  # warps per block: two blocks per SM, or one (entry suffix _w16)
SKINNY_K_ALIGN = 32  # K elements per warp step
SKINNY_EPILOGUE_ARGS = {
    "store": "ppppp" + "iii" + "f",     # out, x, w, bias, norm_w, M, N, K, eps
    "f32": "ppppp" + "iii" + "f",       # the same, fp32 out
    "silu": "pppp" + "iii" + "f",       # out, x, w, norm_w, M, I, K, eps
    "residual": "ppp" + "iii",          # residual, x, w, M, N, K
    "rope_kv": "p" * 10 + "iiiii" + "f",  # q_out, x, w, bias, norm_w, cos_sin, rope_index, k_cache, v_cache,
                                          # slot_mapping, M, H, Hkv, D, K, eps
}


MODULES: dict[str, list[KernelSpec]] = {
    "embedding": _per_dtype("embedding_{dt}", "pppil"),
    "rms_norm": _per_dtype("rms_norm_{dt}", "pppiillif") + _per_dtype("residual_norm_{dt}", "pppipiif"),
    "rope_cache_write": [KernelSpec(f"rope_cache_write_{dt}_v{v}", "ppppppppplllii" + "i")
                         for dt in ("bf16", "fp16") for v in (8, 4)],
    "decode_attention": [KernelSpec(f"decode_attention_{rope}{dt}_d{d}", "ppppppppp" + "l" + "iiiiiii" + "f" + "i"
                                     + "ppl" + "ppp" + "i")
                         for rope in ("", "rope_") for dt in ("bf16", "fp16") for d in ATTENTION_HEAD_DIMS],
    "prefill_attention": [KernelSpec(f"prefill_attention_{dt}_d{d}", "pppppp" + "l" + "iiiii" + "f")
                          for dt in ("bf16", "fp16") for d in ATTENTION_HEAD_DIMS],
    "silu_and_mul": _per_dtype("silu_and_mul_{dt}", "ppi"),
    "skinny_linear": [KernelSpec(f"skinny_{ep}_{dt}_m{m}{w}", args) for ep, args in SKINNY_EPILOGUE_ARGS.items()
                      for dt in ("bf16", "fp16") for m in SKINNY_M_BUCKETS for w in ("", "_w16")],
    "sampling": [KernelSpec("sample_stats", "p" * 9 + "ii"), KernelSpec("sample_select", "p" * 10 + "ii"),
                 KernelSpec("sample_draw", "p" * 10 + "ii"), KernelSpec("sample_finish", "p" * 5 + "ii"),
                 KernelSpec("sample_topk_split", "ppii"), KernelSpec("sample_topk_merge", "p" * 5 + "iiii")],
    "spec_accept": [KernelSpec("spec_accept_draw", "p" * 6 + "iii"), KernelSpec("spec_accept_finish", "pppii")],
    "decode_step": [KernelSpec("decode_prepare", "p" * 22 + "ili" + "pli"), KernelSpec("decode_commit", "ppi" + "p" * 6 + "il"),
                    KernelSpec("verify_commit", "p" * 10 + "iili" + "l")],
}

# Launch constants shared with the .cu files (their header comments state the same numbers).
DECODE_TILE = 64
DECODE_CLUSTER = 8  # the portable maximum cluster size
# Kernels launched with programmatic dependent launch when the library's pdl is on: the decode and verify
# step chain (decode_prepare -> embedding -> skinny -> attention -> skinny ... -> the sampling kernels ->
# decode_commit), so each kernel's launch, and the skinny kernels' first weight loads, overlap the end of
# the kernel before (kernels_cu/common.cuh, grid_dependency_wait). Each of them waits before it reads
# anything the launch before may have written; what each reads before its wait is in its launch contract,
# and tests/test_pdl_contract.py checks CudaOps' launch order against those.
PDL_PREFIXES = ("skinny_", "decode_attention_", "decode_prepare", "embedding_", "sample_", "spec_accept_",
                "decode_commit", "verify_commit")
DECODE_THREADS = 128
SAMPLE_PART_STRIDE = 8
TOPK_CHUNK = 1024  # tokens per block of sample_topk_split
TOPK_MAX = 32  # the most top-logprob candidates the kernels give (sample_topk_*)


def decode_smem_bytes(head_dim: int, rope: bool = False) -> int:
    """The q tile and 2-3 K and V tiles (rows padded by 8 elements); the fused-RoPE entries (rope) also
    one cos / sin row (fp32)."""
    stages = 2 if head_dim >= 128 else 3
    return (16 + 2 * stages * DECODE_TILE) * (head_dim + 8) * 2 + (head_dim * 4 if rope else 0)


def decode_blocks(batch: int, num_heads: int, num_kv_heads: int) -> int:
    """Decode attention blocks per split: one per (sequence, KV head, chunk of 16 query heads)."""
    return batch * num_kv_heads * -(-(num_heads // num_kv_heads) // 16)


def prefill_smem_bytes(head_dim: int) -> int:
    return (64 + 2 * 2 * 64) * (head_dim + 8) * 2


def skinny_m_bucket(num_tokens: int) -> int:
    """The token bucket (kernel suffix _m8 / _m16 / _m32) of a skinny launch: the smallest that holds M."""
    for bucket in SKINNY_M_BUCKETS:
        if num_tokens <= bucket:
            return bucket
    raise KernelArgError(f"skinny linear: {num_tokens} tokens; the kernels take at most {SKINNY_MAX_M}")


def expected_symbols() -> dict[str, list[str]]:
    """{module: [kernel names]}: what every fatbin must define."""
    return {module: [s.name for s in specs] for module, specs in MODULES.items()}


class CudaError(RuntimeError):
    """A CUDA driver (or NVRTC) call failed."""

    def __init__(self, call: str, result):
        self.call = call
        self.result = result
        super().__init__(f"{call} failed: {_error_text(result)}")


class KernelLoadError(RuntimeError):
    """The kernels cannot be loaded (no GPU support, missing fatbin and NVRTC, missing function)."""


class KernelArgError(ValueError):
    """A launch wrapper refused its arguments (shape, dtype, contiguity, alignment)."""


def _error_text(result) -> str:
    try:
        from cuda.bindings import driver
        if isinstance(result, driver.CUresult):
            err, text = driver.cuGetErrorString(result)
            text = text.decode() if isinstance(text, bytes) else text
            return f"{result.name} ({text})"
    except Exception:  # noqa: BLE001 - the message must never fail
        pass
    return str(getattr(result, "name", result))


@functools.cache
def _driver():
    """cuda-python's driver module, imported on first use (CPU-only installs never import it)."""
    from cuda.bindings import driver
    return driver


def _check(call: str, out):
    """cuda-python returns (CUresult, *values): raise CudaError unless CUDA_SUCCESS; return the values."""
    driver = _driver()
    err = out[0]
    if err != driver.CUresult.CUDA_SUCCESS:
        raise CudaError(call, err)
    return out[1] if len(out) == 2 else out[1:]


_SLOT = {"p": "Q", "l": "q", "i": "i4x", "f": "f4x"}


class Kernel:
    """One CUfunction with a reusable parameter buffer. A launch with cluster > 1 groups the blocks along
    grid x into thread-block clusters of that size (sm_90; cuLaunchKernelEx). pdl: launched with
    programmatic stream serialization (sm_90; cuLaunchKernelEx): the kernel may start while the kernel
    before it in the stream finishes, and waits for it with griddepcontrol.wait (common.cuh) before
    reading what it wrote."""

    __slots__ = ("name", "func", "pdl", "_pack", "_buf", "_ptrs", "_params", "_launch", "_ok", "_configs")

    def __init__(self, name: str, func, argtypes: str, pdl: bool = False):
        self.name = name
        self.func = func
        self.pdl = pdl
        self._pack = struct.Struct("<" + "".join(_SLOT[c] for c in argtypes)).pack_into
        n = len(argtypes)
        self._buf = ctypes.create_string_buffer(8 * max(n, 1))
        base = ctypes.addressof(self._buf)
        self._ptrs = (ctypes.c_void_p * max(n, 1))(*[base + 8 * i for i in range(n)])
        self._params = ctypes.addressof(self._ptrs)
        driver = _driver()
        self._launch = driver.cuLaunchKernel
        self._ok = driver.CUresult.CUDA_SUCCESS
        self._configs: dict[int, object] = {}  # +-cluster size (- without pdl) -> CUlaunchConfig of cuLaunchKernelEx

    def __call__(self, grid: tuple[int, int, int], block: tuple[int, int, int], smem: int, stream: int, *args,
                 cluster: int = 1, pdl: bool = True):
        """pdl=False launches a pdl kernel serialised this time (after a kernel that does not let it start
        early anyway, where the attribute only costs)."""
        self._pack(self._buf, 0, *args)
        pdl = pdl and self.pdl
        if cluster <= 1 and not pdl:
            err, = self._launch(self.func, grid[0], grid[1], grid[2], block[0], block[1], block[2], smem, stream,
                                self._params, 0)
        else:
            key = cluster if pdl else -cluster
            config = self._configs.get(key) or self._config(cluster, pdl)
            config.gridDimX, config.gridDimY, config.gridDimZ = grid
            config.blockDimX, config.blockDimY, config.blockDimZ = block
            config.sharedMemBytes = smem
            config.hStream = stream
            err, = _driver().cuLaunchKernelEx(config, self.func, self._params, 0)
        if err != self._ok:
            raise CudaError(f"cuLaunchKernel({self.name}, grid={grid}, block={block}, smem={smem}, cluster={cluster}, "
                            f"pdl={pdl})", err)

    def _config(self, cluster: int, pdl: bool):
        driver = _driver()
        attrs = []
        if cluster > 1:
            attr = driver.CUlaunchAttribute()
            attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster, 1, 1
            attrs.append(attr)
        if pdl:
            attr = driver.CUlaunchAttribute()
            attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            attrs.append(attr)
        config = driver.CUlaunchConfig()
        config.attrs = attrs  # the binding copies the attributes in
        config.numAttrs = len(attrs)
        self._configs[cluster if pdl else -cluster] = config
        return config


# ---------------------------------------------------------------------------------------------
# NVRTC fallback

def nvrtc_compile(src: pathlib.Path, arch: int, cache_dir: pathlib.Path) -> tuple[bytes, bool]:
    """Cubin of one kernels_cu source for sm_<arch> (e.g. 90): from the cache, or compiled by NVRTC and
    cached. Returns (cubin, was_cached)."""
    try:
        from cuda.bindings import nvrtc
        err, major, minor = nvrtc.nvrtcVersion()
    except Exception as e:  # noqa: BLE001 - the library itself is missing
        raise KernelLoadError(f"NVRTC is not available ({e}); install the nvidia-cuda-nvrtc wheel "
                              f"(pip install 'cuda-toolkit[nvrtc]') or build the fatbins with "
                              f"`python -m engine.cuda.build`") from e
    text = src.read_text()
    opts = [f"--gpu-architecture=sm_{arch}", "-std=c++17", *build.extra_flags(text)]
    key = build.source_hash(src, (" ".join(opts), f"nvrtc-{major}.{minor}"))[:24]
    path = cache_dir / f"{src.stem}-{key}-sm{arch}.cubin"
    if path.is_file():
        return path.read_bytes(), True
    hdrs = build.headers(src.parent)
    err, prog = nvrtc.nvrtcCreateProgram(text.encode(), src.name.encode(), len(hdrs),
                                         [h.read_bytes() for h in hdrs], [h.name.encode() for h in hdrs])
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CudaError(f"nvrtcCreateProgram({src.name})", err)
    try:
        err, = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            _, size = nvrtc.nvrtcGetProgramLogSize(prog)
            buf = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, buf)
            raise KernelLoadError(f"NVRTC failed to compile {src.name} for sm_{arch} ({err.name}):\n"
                                  f"{buf.decode(errors='replace').strip()}")
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CudaError(f"nvrtcGetCUBINSize({src.name})", err)
        cubin = b" " * size
        err, = nvrtc.nvrtcGetCUBIN(prog, cubin)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CudaError(f"nvrtcGetCUBIN({src.name})", err)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(cubin)
        tmp.replace(path)
    except OSError as e:
        log.warning("cannot cache the NVRTC cubin at %s: %s", path, e)
    return cubin, False


# ---------------------------------------------------------------------------------------------
# Argument checks (cheap: attribute reads only, never a device read)

def _tensor(t: torch.Tensor, what: str, dtype: torch.dtype | tuple, ndim: int | None = None,
            contiguous: bool = True, align: bool = True, host_mapped: bool = False) -> int:
    """The pointer of a kernel argument, after checking it. host_mapped: a pinned host tensor will do too
    (unified addressing maps pinned memory into the device's address space at the same address)."""
    if not isinstance(t, torch.Tensor):
        raise KernelArgError(f"{what}: expected a tensor, got {type(t).__name__}")
    if not (t.is_cuda or (host_mapped and t.is_pinned())):
        raise KernelArgError(f"{what}: expected a CUDA tensor" + (f" or a pinned host one, got one on {t.device}"
                             " (not pinned)" if host_mapped else f", got one on {t.device}"))
    ok = t.dtype == dtype if isinstance(dtype, torch.dtype) else t.dtype in dtype
    if not ok:
        raise KernelArgError(f"{what}: expected dtype {dtype}, got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise KernelArgError(f"{what}: expected {ndim} dims, got shape {tuple(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise KernelArgError(f"{what}: must be contiguous (shape {tuple(t.shape)}, strides {t.stride()})")
    ptr = t.data_ptr()
    if align and ptr & 15:
        raise KernelArgError(f"{what}: data must be 16-byte aligned (address {ptr:#x})")
    return ptr


def _shape(t: torch.Tensor, what: str, shape: tuple) -> None:
    if tuple(t.shape) != tuple(shape):
        raise KernelArgError(f"{what}: expected shape {tuple(shape)}, got {tuple(t.shape)}")


def _suffix(dtype: torch.dtype, what: str) -> str:
    try:
        return DTYPE_SUFFIX[dtype]
    except KeyError:
        raise KernelArgError(f"{what}: the CUDA kernels take bfloat16 or float16 activations, got {dtype} "
                             f"(use TorchOps for float32)") from None


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory of two contiguous tensors overlaps."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _raw_stream_fn():
    fn = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if fn is not None:
        return fn
    return lambda index: torch.cuda.current_stream(index).cuda_stream


# ---------------------------------------------------------------------------------------------

class KernelLibrary:
    """Every kernel of kernels_cu/, loaded for one device."""

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
        driver = _driver()
        torch.cuda.init()
        with torch.cuda.device(index):
            torch.empty(1, device=self.device)  # makes torch's (primary) context current on this thread
        _check("cuInit", driver.cuInit(0))
        self._cu_device = _check("cuDeviceGet", driver.cuDeviceGet(index))
        self.context = _check("cuDevicePrimaryCtxRetain", driver.cuDevicePrimaryCtxRetain(self._cu_device))
        _check("cuCtxSetCurrent", driver.cuCtxSetCurrent(self.context))
        self._bound = threading.local()
        self._bound.ok = True
        attr = driver.CUdevice_attribute
        major = _check("cuDeviceGetAttribute", driver.cuDeviceGetAttribute(
            attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self._cu_device))
        minor = _check("cuDeviceGetAttribute", driver.cuDeviceGetAttribute(
            attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self._cu_device))
        self.compute_capability = (major, minor)
        self.pdl = pdl and self.compute_capability >= (9, 0)
        self.num_sms = _check("cuDeviceGetAttribute", driver.cuDeviceGetAttribute(
            attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, self._cu_device))
        self.max_smem_optin = _check("cuDeviceGetAttribute", driver.cuDeviceGetAttribute(
            attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, self._cu_device))
        self.skinny_wide_tiles = self.num_sms  # skinny grids of at most this many tiles use 16-warp blocks
        # Decode attention's splits of one (sequence, head group) form clusters of up to this many blocks
        # (sm_90), which merge in distributed shared memory when they hold every key; 1: no clusters.
        self.decode_cluster = DECODE_CLUSTER if self.compute_capability >= (9, 0) else 1
        if self.compute_capability < MIN_COMPUTE_CAPABILITY:
            raise KernelLoadError(f"the CUDA kernels need compute capability >= 8.0 (cp.async, bf16 mma); "
                                  f"device {index} is {major}.{minor}")
        self._modules: dict[str, object] = {}
        self.origin: dict[str, str] = {}  # module -> "fatbin" | "nvrtc" | "nvrtc-cache"
        self.kernels: dict[str, Kernel] = {}
        missing = []
        for module, specs in MODULES.items():
            mod = self._load_module(module, build_dir, kernel_dir)
            for spec in specs:
                err, func = driver.cuModuleGetFunction(mod, spec.name.encode())
                if err != driver.CUresult.CUDA_SUCCESS:
                    missing.append(f"{spec.name} (in {module}, {self.origin[module]}: {_error_text(err)})")
                    continue
                self.kernels[spec.name] = Kernel(spec.name, func, spec.args,
                                                 pdl=self.pdl and spec.name.startswith(PDL_PREFIXES))
        if missing:
            raise KernelLoadError("kernels missing from the loaded modules: " + ", ".join(missing))
        smem_attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        for dt in DTYPE_SUFFIX.values():
            for d in ATTENTION_HEAD_DIMS:
                for name, size in ((f"decode_attention_{dt}_d{d}", decode_smem_bytes(d)),
                                   (f"decode_attention_rope_{dt}_d{d}", decode_smem_bytes(d, rope=True)),
                                   (f"prefill_attention_{dt}_d{d}", prefill_smem_bytes(d))):
                    if size > self.max_smem_optin:
                        raise KernelLoadError(f"{name} needs {size} bytes of shared memory; the device "
                                              f"allows {self.max_smem_optin}")
                    _check(f"cuFuncSetAttribute({name}, MAX_DYNAMIC_SHARED_SIZE_BYTES={size})",
                           driver.cuFuncSetAttribute(self.kernels[name].func, smem_attr, size))
        # sample_topk_merge holds a row's candidates in shared memory (ceil(V / TOPK_CHUNK) * (8 k + 4) bytes;
        # its static shared memory, 256 bytes, comes on top)
        self.topk_smem_limit = self.max_smem_optin - 1024
        _check("cuFuncSetAttribute(sample_topk_merge, MAX_DYNAMIC_SHARED_SIZE_BYTES)",
               driver.cuFuncSetAttribute(self.kernels["sample_topk_merge"].func, smem_attr, self.topk_smem_limit))
        # Decode attention blocks one SM holds at once, per head dim (shared memory bounds it: 3 at D = 64).
        self.decode_blocks_per_sm = {
            d: _check(f"cuOccupancyMaxActiveBlocksPerMultiprocessor(decode_attention_bf16_d{d})",
                      driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                          self.kernels[f"decode_attention_bf16_d{d}"].func, DECODE_THREADS, decode_smem_bytes(d)))
            for d in ATTENTION_HEAD_DIMS}
        self._stream = _raw_stream_fn()
        log.info("CUDA kernels loaded on device %d (sm_%d%d, %d SMs): %s", index, major, minor, self.num_sms,
                 ", ".join(f"{m}={o}" for m, o in self.origin.items()))

    def _load_module(self, module: str, build_dir: pathlib.Path, kernel_dir: pathlib.Path):
        driver = _driver()
        src = kernel_dir / f"{module}.cu"
        fatbin = build.fatbin_path(src, build_dir)
        reason = "no fatbin"
        if fatbin.is_file():
            if src.is_file() and not build.is_current(src, build_dir):
                reason = "the fatbin is older than its source (run `python -m engine.cuda.build`)"
            else:
                err, mod = driver.cuModuleLoadData(fatbin.read_bytes())
                if err == driver.CUresult.CUDA_SUCCESS:
                    self._modules[module] = mod
                    self.origin[module] = "fatbin"
                    return mod
                reason = f"cuModuleLoadData({fatbin.name}) failed: {_error_text(err)}"
        if not src.is_file():
            raise KernelLoadError(f"kernel module {module}: {reason}, and its source {src} is missing")
        arch = self.compute_capability[0] * 10 + self.compute_capability[1]
        log.info("kernel module %s: %s; compiling %s with NVRTC for sm_%d", module, reason, src.name, arch)
        cubin, cached = nvrtc_compile(src, arch, self.cache_dir)
        mod = _check(f"cuModuleLoadData({module} NVRTC cubin)", driver.cuModuleLoadData(cubin))
        self._modules[module] = mod
        self.origin[module] = "nvrtc-cache" if cached else "nvrtc"
        return mod

    def close(self) -> None:
        """Unloads the modules (after the device has finished every launch)."""
        driver = _driver()
        torch.cuda.synchronize(self.device)
        for mod in self._modules.values():
            driver.cuModuleUnload(mod)
        self._modules.clear()
        self.kernels.clear()

    # -----------------------------------------------------------------------------------------
    def stream(self) -> int:
        """The current torch stream of the library's device (a raw cudaStream_t), with the library's
        context made current on this thread the first time it launches from it."""
        if not getattr(self._bound, "ok", False):
            _check("cuCtxSetCurrent", _driver().cuCtxSetCurrent(self.context))
            self._bound.ok = True
        return self._stream(self.index)

    def decode_num_splits(self, batch: int, num_heads: int, num_kv_heads: int, head_dim: int,
                          max_seq_len: int) -> int:
        """Key splits of decode attention: enough blocks for about two per SM, but no more than the GPU
        holds at once (a second wave would double the step's attention time: 1B at batch 32 has 256
        (sequence, KV head) blocks, and two splits of each would not fit the 396 an H200 holds), and at
        most one split per 64-token tile of max_seq_len. A pure function of host-known sizes (graph-safe)."""
        blocks = decode_blocks(batch, num_heads, num_kv_heads)
        max_tiles = max(1, -(-max_seq_len // DECODE_TILE))
        one_wave = self.decode_blocks_per_sm[head_dim] * self.num_sms // blocks
        splits = max(1, min(-(-2 * self.num_sms // blocks), one_wave, max_tiles, self.decode_max_splits))
        return splits if splits <= self.decode_cluster else splits // self.decode_cluster * self.decode_cluster

    def decode_fits_one_wave(self, batch: int, num_heads: int, num_kv_heads: int, head_dim: int,
                             max_seq_len: int) -> bool:
        """Whether every block of a decode attention launch (decode_num_splits splits) is resident at once."""
        blocks = decode_blocks(batch, num_heads, num_kv_heads)
        splits = self.decode_num_splits(batch, num_heads, num_kv_heads, head_dim, max_seq_len)
        return blocks * splits <= self.decode_blocks_per_sm[head_dim] * self.num_sms

    def decode_cluster_size(self, num_splits: int) -> int:
        """The cluster size of a decode attention launch of num_splits splits (1: none): all the splits when
        they fit in one cluster, else decode_cluster (decode_num_splits makes them a multiple of it)."""
        if self.decode_cluster <= 1 or num_splits <= 1:
            return 1
        return num_splits if num_splits <= self.decode_cluster else self.decode_cluster

    def vocab_splits(self, rows: int, vocab: int) -> int:
        """Vocabulary splits of the sampling kernels: about eight 256-thread blocks per SM (a full SM; with
        four, 32 rows of a 128k vocabulary took 24 us in sample_stats on an H200), at least 1024 tokens each."""
        return max(1, min(-(-vocab // 1024), -(-8 * self.num_sms // max(rows, 1))))

    # -----------------------------------------------------------------------------------------
    # One wrapper per kernel.

    def embedding(self, out: torch.Tensor, input_ids: torch.Tensor, weight: torch.Tensor) -> None:
        sfx = _suffix(weight.dtype, "embedding weight")
        w = _tensor(weight, "embedding weight", weight.dtype, 2)
        ids = _tensor(input_ids, "input_ids", torch.int64, 1, align=False)
        vocab, hidden = weight.shape
        o = _tensor(out, "embedding out", weight.dtype, 2)
        _shape(out, "embedding out", (input_ids.shape[0], hidden))
        if hidden % 8:
            raise KernelArgError(f"embedding: hidden size {hidden} is not a multiple of 8")
        if input_ids.shape[0] == 0:
            return
        self.kernels[f"embedding_{sfx}"]((input_ids.shape[0], 1, 1), (min(256, hidden // 8), 1, 1), 0,
                                         self.stream(), o, w, ids, hidden, vocab)

    def rms_norm(self, out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        """x: [rows, D] or [T, heads, D] with unit stride on D (other strides free, 16-byte multiples)."""
        sfx = _suffix(x.dtype, "rms_norm x")
        if x.dim() not in (2, 3) or x.stride(-1) != 1:
            raise KernelArgError(f"rms_norm x: expected [rows, D] or [T, heads, D] with a unit last stride, got "
                                 f"shape {tuple(x.shape)} strides {x.stride()}")
        D = x.shape[-1]
        xp = _tensor(x, "rms_norm x", x.dtype, contiguous=False)
        w = _tensor(weight, "rms_norm weight", x.dtype, 1)
        _shape(weight, "rms_norm weight", (D,))
        o = _tensor(out, "rms_norm out", x.dtype)
        _shape(out, "rms_norm out", x.shape)
        if x.dim() == 2:
            outer, inner, s_outer, s_inner = x.shape[0], 1, x.stride(0), 0
        else:
            outer, inner, s_outer, s_inner = x.shape[0], x.shape[1], x.stride(0), x.stride(1)
        if D % 8 or s_outer % 8 or s_inner % 8:
            raise KernelArgError(f"rms_norm: D ({D}) and row strides {x.stride()} must be multiples of 8")
        rows = outer * inner
        if rows == 0:
            return
        tpr, rpb = self._norm_layout(D, rows)
        self.kernels[f"rms_norm_{sfx}"]((-(-rows // rpb), 1, 1), (tpr, rpb, 1), 0, self.stream(),
                                        o, xp, w, rows, inner, s_outer, s_inner, D, float(eps))

    def residual_norm(self, h: torch.Tensor, out: torch.Tensor | None, parts: torch.Tensor,
                      weight: torch.Tensor | None, eps: float) -> None:
        """The end of a split-K linear layer: h [rows, D] = h + sum over s of parts [S, rows, D] (fp32), one
        rounding; and with weight (out then [rows, D] too), out = rms_norm(h, weight, eps)."""
        sfx = _suffix(h.dtype, "residual_norm h")
        hp = _tensor(h, "residual_norm h", h.dtype, 2)
        rows, D = h.shape
        pp = _tensor(parts, "residual_norm parts", torch.float32, 3)
        if parts.shape[1:] != h.shape or parts.shape[0] < 1:
            raise KernelArgError(f"residual_norm parts: expected [S, {rows}, {D}], got {tuple(parts.shape)}")
        if D % 8:
            raise KernelArgError(f"residual_norm: D ({D}) must be a multiple of 8")
        if (weight is None) != (out is None):
            raise KernelArgError("residual_norm: out and weight go together")
        op = wp = 0
        if weight is not None:
            wp = _tensor(weight, "residual_norm weight", h.dtype, 1)
            _shape(weight, "residual_norm weight", (D,))
            op = _tensor(out, "residual_norm out", h.dtype)
            _shape(out, "residual_norm out", h.shape)
            if _overlaps(out, h):
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
        self.kernels[f"residual_norm_{sfx}"]((-(-rows // rpb), 1, 1), (tpr, rpb, 1), 0, self.stream(),
                                             hp, op, pp, parts.shape[0], wp, rows, D, float(eps))

    @staticmethod
    def _norm_layout(D: int, rows: int) -> tuple[int, int]:
        """(threads per row, rows per block) for rms_norm: 16-byte vectors, at most 4 per thread; short
        rows share a 128-thread block. Long rows get 2 vectors per thread, or 4 when there are at least
        NORM_MANY_ROWS rows (prompts; H200: [4096, 4096] 23.4 -> 20.3 us, while 32 rows are faster
        with 2)."""
        vecs = D // 8
        per_thread = 4 if rows >= NORM_MANY_ROWS else 2
        want = vecs if vecs <= 32 else -(-vecs // per_thread)
        tpr = min(1024, 1 << (max(want, 1) - 1).bit_length())
        if -(-vecs // tpr) > 4:
            raise KernelArgError(f"rms_norm: D = {D} is too large (at most {1024 * 32})")
        return tpr, (128 // tpr if tpr <= 32 else 1)

    def rope_cache_write(self, q_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         cos_sin: torch.Tensor, rope_index: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        sfx = _suffix(q.dtype, "rope q")
        T, H, D = q.shape
        Hkv = k.shape[1]
        for t, name, heads in ((q, "rope q", H), (k, "rope k", Hkv), (v, "rope v", Hkv)):
            if t.dim() != 3 or t.shape[0] != T or t.shape[1] != heads or t.shape[2] != D:
                raise KernelArgError(f"{name}: expected [{T}, {heads}, {D}], got {tuple(t.shape)}")
            if t.stride(2) != 1 or t.stride(1) != D or t.stride(0) % 8:
                raise KernelArgError(f"{name}: heads must be contiguous (strides [*, {D}, 1], token stride a "
                                     f"multiple of 8), got {t.stride()}")
        qp = _tensor(q, "rope q", q.dtype, contiguous=False)
        kp = _tensor(k, "rope k", q.dtype, contiguous=False)
        vp = _tensor(v, "rope v", q.dtype, contiguous=False)
        qo = _tensor(q_out, "rope q_out", q.dtype)
        _shape(q_out, "rope q_out", (T, H, D))
        cs, ri, sm, kc, vc = self._rope_operands(cos_sin, rope_index, slot_mapping, k_cache, v_cache, T, Hkv, D,
                                                 q.dtype)
        if D % 8:
            raise KernelArgError(f"rope: head_dim {D} must be a multiple of 8")
        if T == 0:
            return
        vec = 8 if D % 16 == 0 else 4
        self.kernels[f"rope_cache_write_{sfx}_v{vec}"]((T, 1, 1), (128, 1, 1), 0, self.stream(),
                                                       qo, qp, kp, vp, cs, ri, kc, vc, sm,
                                                       q.stride(0), k.stride(0), v.stride(0), H, Hkv, D)

    def _rope_operands(self, cos_sin: torch.Tensor, rope_index: torch.Tensor, slot_mapping: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, T: int, Hkv: int, D: int,
                       dtype: torch.dtype) -> tuple[int, int, int, int, int]:
        """Checks what RoPE with a KV-cache write reads besides q/k/v: cos_sin [P, D] fp32, rope_index and
        slot_mapping [T] int64, the two caches. Returns their pointers."""
        cs = _tensor(cos_sin, "cos_sin", torch.float32, 2)
        if cos_sin.shape[1] != D:
            raise KernelArgError(f"cos_sin: expected [P, {D}], got {tuple(cos_sin.shape)}")
        ri = _tensor(rope_index, "rope_index", torch.int64, 1, align=False)
        sm = _tensor(slot_mapping, "slot_mapping", torch.int64, 1, align=False)
        if rope_index.shape[0] != T or slot_mapping.shape[0] != T:
            raise KernelArgError(f"rope_index / slot_mapping: expected [{T}], got {tuple(rope_index.shape)} / "
                                 f"{tuple(slot_mapping.shape)}")
        kc = self._cache(k_cache, "k_cache", dtype, Hkv, D)
        vc = self._cache(v_cache, "v_cache", dtype, Hkv, D)
        _shape(v_cache, "v_cache", k_cache.shape)
        return cs, ri, sm, kc, vc

    @staticmethod
    def _cache(cache: torch.Tensor, what: str, dtype: torch.dtype, num_kv_heads: int, head_dim: int) -> int:
        ptr = _tensor(cache, what, dtype, 4)
        if cache.shape[2] != num_kv_heads or cache.shape[3] != head_dim:
            raise KernelArgError(f"{what}: expected [num_blocks, block_size, {num_kv_heads}, {head_dim}], got "
                                 f"{tuple(cache.shape)}")
        bs = cache.shape[1]
        if bs <= 0 or bs & (bs - 1):
            raise KernelArgError(f"{what}: block_size {bs} must be a power of two")
        return ptr

    def _attention_inputs(self, what: str, q: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor) -> tuple[str, int, int, int, int, int, int]:
        """Checks q [*, H, D] (contiguous heads) and the paged caches of decode / prefill attention
        (what = "decode" / "prefill"). Returns (suffix, H, D, Hkv, q, k_cache, v_cache pointers)."""
        sfx = _suffix(q.dtype, f"{what} q")
        if q.dim() != 3 or q.stride(2) != 1 or q.stride(1) != q.shape[2] or q.stride(0) % 8:
            rows = "B" if what == "decode" else "T"
            raise KernelArgError(f"{what} q: expected [{rows}, H, D] with contiguous heads, got shape "
                                 f"{tuple(q.shape)} strides {q.stride()}")
        H, D = q.shape[1:]
        if D not in ATTENTION_HEAD_DIMS:
            raise KernelArgError(f"{what} attention: head_dim {D} is not one of {ATTENTION_HEAD_DIMS}")
        Hkv = k_cache.shape[2] if k_cache.dim() == 4 else -1
        if Hkv <= 0 or H % Hkv:
            raise KernelArgError(f"{what} attention: {H} query heads and k_cache {tuple(k_cache.shape)}")
        qp = _tensor(q, f"{what} q", q.dtype, contiguous=False)
        kc = self._cache(k_cache, "k_cache", q.dtype, Hkv, D)
        vc = self._cache(v_cache, "v_cache", q.dtype, Hkv, D)
        _shape(v_cache, "v_cache", k_cache.shape)
        return sfx, H, D, Hkv, qp, kc, vc

    def decode_attention(self, out: torch.Tensor, part_o: torch.Tensor | None, part_lse: torch.Tensor | None,
                         counters: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, sliding_window: int,
                         num_splits: int, cluster: int | None = None,
                         rope: tuple[torch.Tensor, ...] | None = None, pdl: bool = True,
                         fresh: int = -1) -> None:
        """cluster: the launch's cluster size (None: decode_cluster_size(num_splits); 1: no clusters, the
        splits always merge through global memory). pdl=False: no programmatic dependent launch for this
        call even when the library's pdl is on. fresh >= 0 (with pdl): the caller promises that the launch
        right before wrote none of seq_lens, block_tables, rope's index and slots, and no cache row of a
        position < seq_len - fresh, so the kernel reads those before it waits for that launch
        (kernels_cu/decode_attention.cu); -1: nothing before the wait.
        rope = (k, v, cos_sin, rope_index, slot_mapping): q is unrotated and the new token's k and v
        ([B, Hkv, D] views with contiguous heads, one batch stride) are not in the cache yet: the kernel
        applies rope_cache_write itself (same bits), so that op's launch goes away."""
        sfx, H, D, Hkv, qp, kc, vc = self._attention_inputs("decode", q, k_cache, v_cache)
        B = q.shape[0]
        bt = _tensor(block_tables, "block_tables", torch.int32, 2, contiguous=False, align=False)
        if block_tables.stride(1) != 1 or block_tables.shape[0] != B:
            raise KernelArgError(f"block_tables: expected [{B}, max_blocks] with unit column stride, got shape "
                                 f"{tuple(block_tables.shape)} strides {block_tables.stride()}")
        sl = _tensor(seq_lens, "seq_lens", torch.int32, 1, align=False)
        _shape(seq_lens, "seq_lens", (B,))
        o = _tensor(out, "decode out", q.dtype)
        _shape(out, "decode out", (B, H, D))
        head_chunks = -(-(H // Hkv) // 16)
        po = pl = ct = 0
        if num_splits > 1:
            po = _tensor(part_o, "decode part_o", torch.float32)
            pl = _tensor(part_lse, "decode part_lse", torch.float32, align=False)
            _shape(part_o, "decode part_o", (B, H, num_splits, D))
            _shape(part_lse, "decode part_lse", (B, H, num_splits))
            ct = _tensor(counters, "decode counters", torch.int32, 1, align=False)
            if counters.shape[0] < B * Hkv * head_chunks:
                raise KernelArgError(f"decode counters: {counters.shape[0]} tickets for {B * Hkv * head_chunks} "
                                     f"(batch x KV heads x head chunks)")
        if B == 0:
            return
        rp = (0, 0, 0, 0, 0, 0)
        if rope is not None:
            k_new, v_new, cos_sin, rope_index, slot_mapping = rope
            for t, name in ((k_new, "decode rope k"), (v_new, "decode rope v")):
                if t.dim() != 3 or tuple(t.shape) != (B, Hkv, D) or t.stride(2) != 1 or t.stride(1) != D:
                    raise KernelArgError(f"{name}: expected [{B}, {Hkv}, {D}] with contiguous heads, got shape "
                                         f"{tuple(t.shape)} strides {t.stride()}")
            if k_new.stride(0) != v_new.stride(0) or k_new.stride(0) % 8:
                raise KernelArgError(f"decode rope k / v: one batch stride, a multiple of 8, got {k_new.stride(0)} "
                                     f"and {v_new.stride(0)}")
            cs, ri, sm, _, _ = self._rope_operands(cos_sin, rope_index, slot_mapping, k_cache, v_cache, B, Hkv, D,
                                                   q.dtype)
            rp = (_tensor(k_new, "decode rope k", q.dtype, contiguous=False),
                  _tensor(v_new, "decode rope v", q.dtype, contiguous=False), k_new.stride(0), cs, ri, sm)
        bs_log2 = k_cache.shape[1].bit_length() - 1
        cluster = self.decode_cluster_size(num_splits) if cluster is None else cluster
        if cluster > 1 and (num_splits % cluster or cluster > self.decode_cluster):
            raise KernelArgError(f"decode attention: clusters of {cluster} for {num_splits} splits (at most "
                                 f"{self.decode_cluster} on this device, dividing the splits)")
        fused = rope is not None
        self.kernels[f"decode_attention_{'rope_' if fused else ''}{sfx}_d{D}"](
            (num_splits, Hkv * head_chunks, B), (DECODE_THREADS, 1, 1), decode_smem_bytes(D, fused), self.stream(),
            o, po, pl, ct, qp, kc, vc, bt, sl, q.stride(0), block_tables.stride(0), H, Hkv, head_chunks, bs_log2,
            num_splits, int(sliding_window or 0), float(scale) * math.log2(math.e), cluster, *rp,
            int(fresh) if pdl and self.pdl else -1, cluster=cluster, pdl=pdl)

    def prefill_attention(self, out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, work: torch.Tensor, scale: float, sliding_window: int) -> None:
        """work [n, 4] int32 rows (b, first query token, rows <= 64, position of the first row)."""
        sfx, H, D, Hkv, qp, kc, vc = self._attention_inputs("prefill", q, k_cache, v_cache)
        T = q.shape[0]
        bt = _tensor(block_tables, "block_tables", torch.int32, 2, contiguous=False, align=False)
        if block_tables.stride(1) != 1:
            raise KernelArgError(f"block_tables: the column stride must be 1, got {block_tables.stride()}")
        wk = _tensor(work, "prefill work", torch.int32, 2)
        if work.shape[1] != 4:
            raise KernelArgError(f"prefill work: expected [n, 4], got {tuple(work.shape)}")
        o = _tensor(out, "prefill out", q.dtype)
        _shape(out, "prefill out", (T, H, D))
        if work.shape[0] == 0:
            return
        bs_log2 = k_cache.shape[1].bit_length() - 1
        self.kernels[f"prefill_attention_{sfx}_d{D}"](
            (work.shape[0], H, 1), (128, 1, 1), prefill_smem_bytes(D), self.stream(),
            o, qp, kc, vc, bt, wk, q.stride(0), block_tables.stride(0), H, Hkv, bs_log2, int(sliding_window or 0),
            float(scale) * math.log2(math.e))

    def silu_and_mul(self, out: torch.Tensor, x: torch.Tensor) -> None:
        sfx = _suffix(x.dtype, "silu_and_mul x")
        xp = _tensor(x, "silu_and_mul x", x.dtype, 2)
        T, two_i = x.shape
        I = two_i // 2
        if two_i % 16:
            raise KernelArgError(f"silu_and_mul: the intermediate size {I} must be a multiple of 8")
        o = _tensor(out, "silu_and_mul out", x.dtype)
        _shape(out, "silu_and_mul out", (T, I))
        if T == 0:
            return
        self.kernels[f"silu_and_mul_{sfx}"]((T, -(-(I // 8) // 256), 1), (256, 1, 1), 0, self.stream(), o, xp, I)

    # Skinny linear layers for decode (kernels_cu/skinny_linear.cu): y = x @ weight^T for 1..32 tokens,
    # reading the weight once, with the neighbouring elementwise ops fused. With norm_weight (the NORM
    # prologue), x is the raw residual stream and the result is that of rms_norm(x, norm_weight, eps).

    def _skinny_inputs(self, what: str, x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None,
                       pair_span: int) -> tuple:
        """Checks x [M, K], weight [N, K] and norm_weight [K]; pair_span = the distance the epilogue pairs
        rows over times 2 (N, 2 I or head_dim): N % pair_span == 0 and pair_span % 16 == 0.
        Returns (suffix, M, N, K, x, weight, norm_weight) with pointers (0 = absent)."""
        sfx = _suffix(x.dtype, f"{what} x")
        xp = _tensor(x, f"{what} x", x.dtype, 2)
        wp = _tensor(weight, f"{what} weight", x.dtype, 2)
        M, K = x.shape
        N = weight.shape[0]
        if weight.shape[1] != K:
            raise KernelArgError(f"{what}: weight {tuple(weight.shape)} does not match x {tuple(x.shape)} "
                                 f"(expected [N, {K}])")
        if K == 0 or K % SKINNY_K_ALIGN:
            raise KernelArgError(f"{what}: K = {K} must be a positive multiple of {SKINNY_K_ALIGN}")
        if N == 0 or pair_span <= 0 or pair_span % SKINNY_TILE or N % pair_span:
            raise KernelArgError(f"{what}: N = {N} rows cannot be cut into 16-row tiles of row pairs {pair_span // 2} "
                                 f"apart (need N % {pair_span} == 0 and {pair_span} % 16 == 0)")
        if M > SKINNY_MAX_M:
            raise KernelArgError(f"{what}: {M} tokens; the skinny kernels take at most {SKINNY_MAX_M} (use a GEMM)")
        nw = 0
        if norm_weight is not None:
            nw = _tensor(norm_weight, f"{what} norm_weight", x.dtype, 1)
            _shape(norm_weight, f"{what} norm_weight", (K,))
        return sfx, M, N, K, xp, wp, nw

    @staticmethod
    def _skinny_output(out: torch.Tensor, what: str, dtype, shape: tuple, x: torch.Tensor, weight: torch.Tensor) -> int:
        ptr = _tensor(out, what, dtype, len(shape), align=False)
        _shape(out, what, shape)
        if out.numel() and (_overlaps(out, x) or _overlaps(out, weight)):
            raise KernelArgError(f"{what}: must not overlap x or the weight (other blocks still read them)")
        return ptr

    @staticmethod
    def _skinny_bias(bias: torch.Tensor | None, what: str, dtype: torch.dtype, N: int) -> int:
        if bias is None:
            return 0
        ptr = _tensor(bias, f"{what} bias", dtype, 1, align=False)
        _shape(bias, f"{what} bias", (N,))
        return ptr

    def _skinny_launch(self, ep: str, sfx: str, M: int, N: int, *args) -> None:
        """One block per 16-row tile. A grid of at most skinny_wide_tiles tiles (default: one per SM) gets
        16-warp blocks, so each SM has as many weight loads in flight as two 8-warp blocks would give it."""
        tiles = N // SKINNY_TILE
        wide = tiles <= self.skinny_wide_tiles
        self.kernels[f"skinny_{ep}_{sfx}_m{skinny_m_bucket(M)}{'_w16' if wide else ''}"](
            (tiles, 1, 1), (32 * (SKINNY_WIDE_WARPS if wide else SKINNY_WARPS), 1, 1), 0, self.stream(), *args)

    def skinny_store(self, out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     norm_weight: torch.Tensor | None = None, eps: float = 1e-6) -> None:
        """out [M, N] = x' @ weight^T (+ bias), x' = rms_norm(x, norm_weight, eps) or x; out in x's dtype, or
        fp32 (logits: no rounding)."""
        N = weight.shape[0] if weight.dim() == 2 else 0
        sfx, M, N, K, xp, wp, nw = self._skinny_inputs("skinny_store", x, weight, norm_weight, N)
        ep = "f32" if out.dtype == torch.float32 else "store"
        o = self._skinny_output(out, "skinny_store out", (x.dtype, torch.float32), (M, N), x, weight)
        bp = self._skinny_bias(bias, "skinny_store", x.dtype, N)
        if M == 0:
            return
        self._skinny_launch(ep, sfx, M, N, o, xp, wp, bp, nw, M, N, K, float(eps))

    def skinny_silu(self, out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                    norm_weight: torch.Tensor | None = None, eps: float = 1e-6) -> None:
        """The gated MLP's first half: weight = [gate | up] [2 I, K]; out [M, I] = silu(x' @ gate^T) * (x' @ up^T)."""
        N = weight.shape[0] if weight.dim() == 2 else 0
        sfx, M, N, K, xp, wp, nw = self._skinny_inputs("skinny_silu", x, weight, norm_weight, N)
        I = N // 2
        o = self._skinny_output(out, "skinny_silu out", x.dtype, (M, I), x, weight)
        if M == 0:
            return
        self._skinny_launch("silu", sfx, M, N, o, xp, wp, nw, M, I, K, float(eps))

    def skinny_residual(self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
        """residual [M, N] += x @ weight^T in place (one rounding, as addmm with beta = 1)."""
        N = weight.shape[0] if weight.dim() == 2 else 0
        sfx, M, N, K, xp, wp, _ = self._skinny_inputs("skinny_residual", x, weight, None, N)
        rp = self._skinny_output(residual, "skinny_residual residual", x.dtype, (M, N), x, weight)
        if M == 0:
            return
        self._skinny_launch("residual", sfx, M, N, rp, xp, wp, M, N, K)

    def skinny_rope_kv(self, q_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       norm_weight: torch.Tensor | None, cos_sin: torch.Tensor, rope_index: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int,
                       num_kv_heads: int, eps: float = 1e-6) -> None:
        """The fused QKV projection: qkv = x' @ weight^T (+ bias) with weight = [q (H D rows) | k (Hkv D) | v (Hkv D)]
        and x' = rms_norm(x, norm_weight, eps) or x; q and k rotated (rotate-half) by cos_sin[rope_index];
        q -> q_out [M, H, D]; k and v -> the caches at slot_mapping (a negative slot skips the token's cache
        write)."""
        H, Hkv = int(num_heads), int(num_kv_heads)
        N = weight.shape[0] if weight.dim() == 2 else 0
        if H <= 0 or Hkv <= 0 or N % (H + 2 * Hkv):
            raise KernelArgError(f"skinny_rope_kv: weight {tuple(weight.shape)} is not [(H + 2 Hkv) D, K] for "
                                 f"H = {H}, Hkv = {Hkv}")
        D = N // (H + 2 * Hkv)
        sfx, M, N, K, xp, wp, nw = self._skinny_inputs("skinny_rope_kv", x, weight, norm_weight, D)
        qo = self._skinny_output(q_out, "skinny_rope_kv q_out", x.dtype, (M, H, D), x, weight)
        bp = self._skinny_bias(bias, "skinny_rope_kv", x.dtype, N)
        cs, ri, sm, kc, vc = self._rope_operands(cos_sin, rope_index, slot_mapping, k_cache, v_cache, M, Hkv, D,
                                                 x.dtype)
        if M == 0:
            return
        self._skinny_launch("rope_kv", sfx, M, N, qo, xp, wp, bp, nw, cs, ri, kc, vc, sm, M, H, Hkv, D, K, float(eps))

    # Sampling: four kernels, always launched together (see kernels_cu/sampling.cu).
    def _sampling_rows(self, logits, seen, temperature, top_k, top_p, seed, penalty, position):
        lg = _tensor(logits, "logits", torch.float32, 2, align=False)
        N, V = logits.shape
        sn = _tensor(seen, "seen", torch.bool, 2, align=False)
        _shape(seen, "seen", (N, V))
        ptrs = [lg, sn]
        for t, name, dt in ((temperature, "temperature", torch.float32), (top_k, "top_k", torch.int64),
                            (top_p, "top_p", torch.float32), (seed, "seed", torch.int64),
                            (penalty, "repetition_penalty", torch.float32), (position, "position", torch.int64)):
            ptrs.append(_tensor(t, name, dt, 1, align=False))
            _shape(t, name, (N,))
        return N, V, ptrs

    def sample_stats(self, parts, logits, seen, temperature, top_k, top_p, seed, penalty, position) -> None:
        N, V, ptrs = self._sampling_rows(logits, seen, temperature, top_k, top_p, seed, penalty, position)
        pp = _tensor(parts, "sample parts", torch.float32, 3)
        S = parts.shape[1]
        _shape(parts, "sample parts", (N, S, SAMPLE_PART_STRIDE))
        self.kernels["sample_stats"]((S, N, 1), (256, 1, 1), 0, self.stream(), pp, *ptrs, V, S)

    def sample_select(self, thresholds, parts, logits, seen, temperature, top_k, top_p, seed, penalty,
                      position) -> None:
        N, V, ptrs = self._sampling_rows(logits, seen, temperature, top_k, top_p, seed, penalty, position)
        th = _tensor(thresholds, "sample thresholds", torch.int32, 1, align=False)
        _shape(thresholds, "sample thresholds", (N,))
        pp = _tensor(parts, "sample parts", torch.float32, 3)
        S = parts.shape[1]
        self.kernels["sample_select"]((N, 1, 1), (1024, 1, 1), 0, self.stream(), th, pp, *ptrs, V, S)

    def sample_draw(self, parts, thresholds, logits, seen, temperature, top_k, top_p, seed, penalty,
                    position) -> None:
        N, V, ptrs = self._sampling_rows(logits, seen, temperature, top_k, top_p, seed, penalty, position)
        pp = _tensor(parts, "sample parts", torch.float32, 3)
        th = _tensor(thresholds, "sample thresholds", torch.int32, 1, align=False)
        S = parts.shape[1]
        self.kernels["sample_draw"]((S, N, 1), (256, 1, 1), 0, self.stream(), pp, th, *ptrs, V, S)

    def sample_finish(self, tokens, logprobs, parts, logits, temperature) -> None:
        lg = _tensor(logits, "logits", torch.float32, 2, align=False)
        N, V = logits.shape
        tk = _tensor(tokens, "tokens", torch.int64, 1, align=False)
        lp = _tensor(logprobs, "logprobs", torch.float32, 1, align=False)
        _shape(tokens, "tokens", (N,))
        _shape(logprobs, "logprobs", (N,))
        pp = _tensor(parts, "sample parts", torch.float32, 3)
        tp = _tensor(temperature, "temperature", torch.float32, 1, align=False)
        S = parts.shape[1]
        self.kernels["sample_finish"]((N, 1, 1), (32, 1, 1), 0, self.stream(), tk, lp, pp, lg, tp, V, S)

    def sample_topk(self, top_ids, top_logprobs, cand, parts, logits) -> None:
        """The k = top_ids.shape[1] largest raw logits of each row, in order (ties: the lower id), and their
        log-softmax (the stats sample_stats left in parts): sample_topk_split then sample_topk_merge.
        cand: [N, ceil(V / TOPK_CHUNK), k] int64 scratch. topk_fits(V, k) says whether it can."""
        lg = _tensor(logits, "logits", torch.float32, 2, align=False)
        N, V = logits.shape
        k = top_ids.shape[1] if top_ids.dim() == 2 else 0
        if not self.topk_fits(V, k):
            raise KernelArgError(f"sample_topk: k = {k} of {V} tokens; the kernels give 1 to {TOPK_MAX} candidates, "
                                 f"from at most {self.topk_smem_limit // (8 * k + 4) * TOPK_CHUNK if k else 0} tokens")
        chunks = -(-V // TOPK_CHUNK)
        ti = _tensor(top_ids, "top_ids", torch.int64, 2, align=False)
        tl = _tensor(top_logprobs, "top_logprobs", torch.float32, 2, align=False)
        cp = _tensor(cand, "topk candidates", torch.int64, 3, align=False)
        _shape(top_ids, "top_ids", (N, k))
        _shape(top_logprobs, "top_logprobs", (N, k))
        _shape(cand, "topk candidates", (N, chunks, k))
        pp = _tensor(parts, "sample parts", torch.float32, 3)
        S = parts.shape[1]
        _shape(parts, "sample parts", (N, S, SAMPLE_PART_STRIDE))
        self.kernels["sample_topk_split"]((chunks, N, 1), (256, 1, 1), 0, self.stream(), cp, lg, V, k)
        self.kernels["sample_topk_merge"]((N, 1, 1), (32, 1, 1), chunks * (8 * k + 4), self.stream(), ti, tl, cp,
                                          pp, lg, V, S, chunks, k)

    def topk_fits(self, vocab: int, k: int) -> bool:
        """Whether sample_topk takes k candidates of a vocabulary of this size (its merge holds a row's in
        shared memory)."""
        return 1 <= k <= min(TOPK_MAX, vocab) and -(-vocab // TOPK_CHUNK) * (8 * k + 4) <= self.topk_smem_limit

    def spec_accept_draw(self, parts, target_logp, draft_ids, draft_probs, seed, position) -> None:
        tl = _tensor(target_logp, "target_logp", torch.float32, 3, align=False)
        B, K1, V = target_logp.shape
        K = K1 - 1
        if K < 1:
            raise KernelArgError(f"spec accept: need at least one draft per sequence, target_logp {tuple(target_logp.shape)}")
        di = _tensor(draft_ids, "draft_ids", torch.int64, 2, align=False)
        _shape(draft_ids, "draft_ids", (B, K))
        dp = 0
        if draft_probs is not None:
            dp = _tensor(draft_probs, "draft_probs", torch.float32, 3, align=False)
            _shape(draft_probs, "draft_probs", (B, K, V))
        sd = _tensor(seed, "seed", torch.int64, 2, align=False)
        _shape(seed, "seed", (B, K1))
        ps = _tensor(position, "position", torch.int64, 2, align=False)
        _shape(position, "position", (B, K1))
        pp = _tensor(parts, "accept parts", torch.float32, 3)
        S = parts.shape[1]
        _shape(parts, "accept parts", (B, S, SAMPLE_PART_STRIDE))
        self.kernels["spec_accept_draw"]((S, B, 1), (256, 1, 1), 0, self.stream(), pp, tl, di, dp, sd, ps, K, V, S)

    def spec_accept_finish(self, num_accepted, tokens, parts, num_drafts: int) -> None:
        B, S = parts.shape[:2]
        na = _tensor(num_accepted, "num_accepted", torch.int64, 1, align=False)
        tk = _tensor(tokens, "tokens", torch.int64, 1, align=False)
        _shape(num_accepted, "num_accepted", (B,))
        _shape(tokens, "tokens", (B,))
        pp = _tensor(parts, "accept parts", torch.float32, 3)
        self.kernels["spec_accept_finish"]((B, 1, 1), (32, 1, 1), 0, self.stream(), na, tk, pp, num_drafts, S)

    # Decode step state (kernels_cu/decode_step.cu): the slot-resident state a decode step reads before its
    # forward and writes back after sampling. Slot and token values are not checked here (no host sync).

    @staticmethod
    def _vectors(tensors, n: int) -> list[int]:
        """Checks 1-D tensors [(tensor, name, dtype)] of n entries each (per-slot state columns, or a
        step's per-row values); returns their pointers."""
        ptrs = []
        for t, name, dt in tensors:
            ptrs.append(_tensor(t, name, dt, 1, align=False))
            _shape(t, name, (n,))
        return ptrs

    def decode_prepare(self, slots, num_cached, last_token, block_table, temperature, top_k, top_p, seed, penalty,
                       seen, block_size, input_ids, positions, slot_mapping, seq_lens, tables, row_temperature,
                       row_top_k, row_top_p, row_seed, row_penalty, row_position, row_seen,
                       drafts: torch.Tensor | None = None) -> None:
        """The inputs of a decode forward and its sampling rows, read from the slot state (one row per
        slots[b]): input_ids, positions, slot_mapping, seq_lens, tables [B, MB], row_* (row_position =
        position + 1, the index of the token each row draws), row_seen [B, V]. With drafts [B, k] (a
        uniform Verify; rows may be strided), every slot has k + 1 rows, b (k + 1) + i: its last token (i = 0)
        or draft i - 1 at position num_cached + i, with drafts 0 .. i - 1 counted as seen; the outputs then
        have B (k + 1) rows."""
        sl = _tensor(slots, "slots", torch.int64, 1, align=False)
        n, dp, ds = 1, 0, 0
        if drafts is not None:
            dp = _tensor(drafts, "drafts", torch.int64, 2, contiguous=False, align=False)
            if drafts.shape[0] != slots.shape[0] or drafts.stride(1) != 1:
                raise KernelArgError(f"drafts: expected [{slots.shape[0]}, k] with contiguous rows, got shape "
                                     f"{tuple(drafts.shape)} strides {drafts.stride()}")
            n, ds = drafts.shape[1] + 1, drafts.stride(0)
        B = slots.shape[0] * n
        S = num_cached.shape[0] if isinstance(num_cached, torch.Tensor) and num_cached.dim() == 1 else -1
        nc, lt, tp, tk, pp, sd, pn = self._vectors(
            ((num_cached, "num_cached", torch.int32), (last_token, "last_token", torch.int64),
             (temperature, "temperature", torch.float32), (top_k, "top_k", torch.int64),
             (top_p, "top_p", torch.float32), (seed, "seed", torch.int64),
             (penalty, "repetition_penalty", torch.float32)), S)
        bt = _tensor(block_table, "block_table", torch.int32, 2, align=False)
        if block_table.shape[0] != S:
            raise KernelArgError(f"block_table: expected [{S}, max_blocks] (one row per slot), got "
                                 f"{tuple(block_table.shape)}")
        MB = block_table.shape[1]
        sn = _tensor(seen, "seen", torch.bool, 2, align=False)
        if seen.shape[0] != S:
            raise KernelArgError(f"seen: expected [{S}, vocab] (one row per slot), got {tuple(seen.shape)}")
        V = seen.shape[1]
        if not isinstance(block_size, int) or block_size <= 0:
            raise KernelArgError(f"block_size: expected a positive int, got {block_size!r}")
        outs = self._vectors(
            ((input_ids, "input_ids", torch.int64), (positions, "positions", torch.int64),
             (slot_mapping, "slot_mapping", torch.int64), (seq_lens, "seq_lens", torch.int32)), B)
        tb = _tensor(tables, "tables", torch.int32, 2, align=False)
        _shape(tables, "tables", (B, MB))
        rows = self._vectors(
            ((row_temperature, "row_temperature", torch.float32), (row_top_k, "row_top_k", torch.int64),
             (row_top_p, "row_top_p", torch.float32), (row_seed, "row_seed", torch.int64),
             (row_penalty, "row_penalty", torch.float32), (row_position, "row_position", torch.int64)), B)
        rs = _tensor(row_seen, "row_seen", torch.bool, 2, align=False)
        _shape(row_seen, "row_seen", (B, V))
        if B == 0:
            return
        parts = max(1, min(16, -(-V // (16 * 1024))))  # seen copied in pieces of <= 1024 16-byte vectors
        self.kernels["decode_prepare"]((B, parts, 1), (256, 1, 1), 0, self.stream(), *outs, tb, *rows, rs,
                                       sl, nc, lt, bt, tp, tk, pp, sd, pn, sn, MB, V, block_size, dp, ds, n)

    def verify_commit(self, slots, drafts, sampled, logprobs, num_cached, last_token, seen, out_accepted,
                      out_tokens, out_logprobs) -> None:
        """A uniform Verify's results back to the slot state: per slot row b, the accepted count a (the
        prefix where sampled [B, k + 1] equals drafts [B, k]), the token t = sampled[b, a] after them;
        num_cached[s] += 1 + a, last_token[s] = t, seen marked for every emitted token (sampled[b, :a + 1],
        then t); out_accepted / out_tokens [>= B], out_logprobs [>= B, k + 1] (strided rows) = logprobs."""
        sl = _tensor(slots, "slots", torch.int64, 1, align=False)
        B = slots.shape[0]
        dp = _tensor(drafts, "drafts", torch.int64, 2, contiguous=False, align=False)
        if drafts.shape[0] != B or drafts.stride(1) != 1:
            raise KernelArgError(f"drafts: expected [{B}, k] with contiguous rows, got shape {tuple(drafts.shape)} "
                                 f"strides {drafts.stride()}")
        k = drafts.shape[1]
        sp = _tensor(sampled, "sampled", torch.int64, 1, align=False)
        lp = _tensor(logprobs, "logprobs", torch.float32, 1, align=False)
        for t, name in ((sampled, "sampled"), (logprobs, "logprobs")):
            _shape(t, name, (B * (k + 1),))
        S = num_cached.shape[0] if isinstance(num_cached, torch.Tensor) and num_cached.dim() == 1 else -1
        nc, lt = self._vectors(((num_cached, "num_cached", torch.int32), (last_token, "last_token", torch.int64)), S)
        sn = _tensor(seen, "seen", torch.bool, 2, align=False)
        if seen.shape[0] != S:
            raise KernelArgError(f"seen: expected [{S}, vocab] (one row per slot), got {tuple(seen.shape)}")
        oa = _tensor(out_accepted, "out_accepted", torch.int64, 1, align=False)
        ot = _tensor(out_tokens, "out_tokens", torch.int64, 1, align=False)
        ol = _tensor(out_logprobs, "out_logprobs", torch.float32, 2, contiguous=False, align=False)
        if (out_accepted.shape[0] < B or out_tokens.shape[0] < B or out_logprobs.shape[0] < B
                or out_logprobs.shape[1] < k + 1 or out_logprobs.stride(1) != 1):
            raise KernelArgError(f"verify_commit: outputs for {B} slots of {k + 1} rows: out_accepted "
                                 f"{tuple(out_accepted.shape)}, out_tokens {tuple(out_tokens.shape)}, out_logprobs "
                                 f"{tuple(out_logprobs.shape)} strides {out_logprobs.stride()}")
        if B == 0:
            return
        self.kernels["verify_commit"]((-(-B // 128), 1, 1), (128, 1, 1), 0, self.stream(), oa, ot, ol, nc, lt, sn,
                                      sl, dp, sp, lp, B, k, drafts.stride(0), out_logprobs.stride(0), seen.shape[1])

    def decode_commit(self, slots, tokens, logprobs, num_cached, last_token, seen, out_tokens, out_logprobs) -> None:
        """The sampled tokens back to the slot state (num_cached[s] += 1, last_token[s] = token,
        seen[s, token] = True for s = slots[b]; the slots must be distinct) and to the results kept per slot
        and position: out_tokens / out_logprobs [S, R] at [s, num_cached[s] % R] (num_cached before the
        step). The results may be pinned host tensors: the kernel writes them through unified addressing."""
        sl = _tensor(slots, "slots", torch.int64, 1, align=False)
        B = slots.shape[0]
        tk, lp = self._vectors(((tokens, "tokens", torch.int64), (logprobs, "logprobs", torch.float32)), B)
        S = num_cached.shape[0] if isinstance(num_cached, torch.Tensor) and num_cached.dim() == 1 else -1
        nc, lt = self._vectors(((num_cached, "num_cached", torch.int32), (last_token, "last_token", torch.int64)), S)
        sn = _tensor(seen, "seen", torch.bool, 2, align=False)
        if seen.shape[0] != S:
            raise KernelArgError(f"seen: expected [{S}, vocab] (one row per slot), got {tuple(seen.shape)}")
        V = seen.shape[1]
        ot = _tensor(out_tokens, "out_tokens", torch.int64, 2, align=False, host_mapped=True)
        ol = _tensor(out_logprobs, "out_logprobs", torch.float32, 2, align=False, host_mapped=True)
        R = out_tokens.shape[1]
        for t, name in ((out_tokens, "out_tokens"), (out_logprobs, "out_logprobs")):
            if t.shape[0] != S or t.shape[1] != R or R < 1:
                raise KernelArgError(f"{name}: expected [{S}, R >= 1] (a row per slot, the rows of both alike), "
                                     f"got {tuple(t.shape)}")
        if B == 0:
            return
        self.kernels["decode_commit"]((-(-B // 128), 1, 1), (128, 1, 1), 0, self.stream(),
                                      ot, ol, R, nc, lt, sn, sl, tk, lp, B, V)
