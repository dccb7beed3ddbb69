"""The CUDA driver as the kernels use it: cuda-python's driver module (imported on first use, so a CPU-only
install never imports it), checked calls, the errors of the GPU backend, and Kernel, one CUfunction with its
launch (plain, or with thread-block clusters and programmatic dependent launch through cuLaunchKernelEx).

Launching: parameters are packed into one preallocated buffer per kernel (each argument in an 8-byte slot, a
fixed pointer array into it): one struct.pack_into per launch.
NOTE: the packing buffer is per kernel, so launches of the same kernel must come from one thread at a time
(the engine has one device thread).
"""
from __future__ import annotations

import ctypes
import functools
import struct


class CudaError(RuntimeError):
    """A CUDA driver (or NVRTC) call failed."""

    def __init__(self, call: str, result):
        self.call = call
        self.result = result
        super().__init__(f"{call} failed: {error_text(result)}")


class KernelLoadError(RuntimeError):
    """The kernels cannot be loaded (no GPU support, missing fatbin and NVRTC, missing function)."""


class KernelArgError(ValueError):
    """A launch wrapper refused its arguments (shape, dtype, contiguity, alignment)."""


def error_text(result) -> str:
    """A driver result as text (its name and description), for error messages."""
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
def cuda_driver():
    """cuda-python's driver module, imported on first use (CPU-only installs never import it)."""
    from cuda.bindings import driver
    return driver


def check(call: str, out):
    """cuda-python returns (CUresult, *values): raise CudaError unless CUDA_SUCCESS; return the values."""
    driver = cuda_driver()
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
        driver = cuda_driver()
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
            err, = cuda_driver().cuLaunchKernelEx(config, self.func, self._params, 0)
        if err != self._ok:
            raise CudaError(f"cuLaunchKernel({self.name}, grid={grid}, block={block}, smem={smem}, cluster={cluster}, "
                            f"pdl={pdl})", err)

    def _config(self, cluster: int, pdl: bool):
        driver = cuda_driver()
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
