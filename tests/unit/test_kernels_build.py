"""kernels_cu/ builds with nvcc (engine/cuda/build.py) and every fatbin defines every kernel the
KernelLibrary resolves, in each of its entries (sm_80, sm_90 machine code and compute_90 PTX).
CPU only: skipped where nvcc is absent (CI asserts nvcc exists separately)."""
from __future__ import annotations

import pathlib
import struct

import pytest

from engine.cuda import build
from engine.cuda.driver import Kernel
from engine.cuda.library import MODULES, expected_symbols

pytestmark = pytest.mark.skipif(build.find_nvcc() is None, reason="nvcc not found: kernels_cu/ cannot be compiled here")


@pytest.fixture(scope="module")
def fatbin_dir(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("kernels_build")
    build.build_all(out, log=None)
    return out


def test_every_source_is_a_loaded_module():
    assert {p.stem for p in build.sources()} == set(MODULES)


def test_every_fatbin_defines_every_kernel(fatbin_dir):
    for module, names in expected_symbols().items():
        src = build.KERNEL_DIR / f"{module}.cu"
        entries = build.fatbin_symbols(build.fatbin_path(src, fatbin_dir))
        own = build.own_archs(src.read_text())  # "90a": sm_90a machine code, which the fatbin lists as sm_90
        expected = {f"sm_{a.rstrip('a')}" for a in own} if own else {"sm_80", "sm_90", "compute_90"}
        assert set(entries) == expected, f"{module}: entries {sorted(entries)}"
        for target, symbols in entries.items():
            missing = sorted(set(names) - symbols)
            assert not missing, f"{module}.fatbin ({target}) lacks {missing}"


def test_up_to_date_fatbins_are_skipped(fatbin_dir):
    nvcc = build.find_nvcc()
    for src in build.sources():
        assert build.is_current(src, fatbin_dir)
        assert build.build_one(nvcc, src, fatbin_dir) is False


def test_a_failing_source_reports_nvcc_output(tmp_path):
    kernel_dir = tmp_path / "kernels_cu"
    kernel_dir.mkdir()
    (kernel_dir / "broken.cu").write_text('extern "C" __global__ void broken(int* p) { p[0] = undefined_name; }\n')
    with pytest.raises(build.BuildError, match=r"broken\.cu[\s\S]*undefined_name"):
        build.build_all(tmp_path / "out", kernel_dir=kernel_dir, log=None)


def test_the_command_line_builds_a_modified_copy_of_the_sources(tmp_path):
    """`python -m engine.cuda.build --kernels SRC --out OUT` (the A/B builds of bench_kernels --variant):
    the copy's fatbins are stamped with the copy's own hash, so KernelLibrary loads them as current."""
    src = tmp_path / "src"
    src.mkdir()
    for header in build.headers():
        (src / header.name).write_text(header.read_text())
    (src / "embedding.cu").write_text("#define AB_VARIANT 1\n" + (build.KERNEL_DIR / "embedding.cu").read_text())
    assert build.main(["--kernels", str(src), "--out", str(tmp_path / "out")]) == 0
    built = src / "embedding.cu"
    assert build.fatbin_path(built, tmp_path / "out").is_file()
    assert build.is_current(built, tmp_path / "out")
    assert build.build_stamp(built) != build.build_stamp(build.KERNEL_DIR / "embedding.cu")


def test_a_source_naming_its_architectures_is_built_for_those_alone():
    text = (build.KERNEL_DIR / "gemm_sm90.cu").read_text()
    assert build.own_archs(text) == ("90a",)
    flags = build.compile_flags(text)
    assert [f for f in flags if f.startswith("arch=")] == ["arch=compute_90a,code=sm_90a"]
    assert flags[:4] == build.NVCC_FLAGS[:4]
    assert build.serves(text, 90) and not build.serves(text, 80) and not build.serves(text, 100)
    plain = (build.KERNEL_DIR / "embedding.cu").read_text()
    assert build.own_archs(plain) == () and build.compile_flags(plain) == build.NVCC_FLAGS
    assert build.serves(plain, 80) and build.serves(plain, 90)


def test_fast_math_only_where_results_are_not_compared_bitwise():
    flags = {src.stem: build.extra_flags(src.read_text()) for src in build.sources()}
    for module in ("sampling", "spec_accept", "rope_cache_write", "rms_norm", "silu_and_mul", "gemm_sm90"):
        assert "--use_fast_math" not in flags[module], module


def test_launch_parameters_pack_into_8_byte_slots():
    kernel = Kernel("k", None, "pilf")
    kernel._pack(kernel._buf, 0, 0x1122334455667788, -3, -(2**40), 1.5)
    raw = bytes(kernel._buf)
    assert struct.unpack_from("<Q", raw, 0)[0] == 0x1122334455667788
    assert struct.unpack_from("<i", raw, 8)[0] == -3
    assert struct.unpack_from("<q", raw, 16)[0] == -(2**40)
    assert struct.unpack_from("<f", raw, 24)[0] == 1.5
    base = kernel._ptrs[0]
    assert [kernel._ptrs[i] - base for i in range(4)] == [0, 8, 16, 24]


def test_launch_attributes_for_clusters_and_programmatic_dependent_launch(monkeypatch):
    """Kernel.__call__ picks cuLaunchKernel for a plain launch and cuLaunchKernelEx with the cluster and/or
    programmatic-serialization attributes otherwise (a per-call pdl=False drops the latter); the configs are
    made once per kind and carry each launch's grid, block, shared memory and stream."""
    from engine.cuda import driver
    real = driver.cuda_driver()
    calls = []

    class Recorder:
        def __getattr__(self, name):
            return getattr(real, name)

        def cuLaunchKernel(self, func, *args):
            calls.append(("plain", args[:8]))
            return (real.CUresult.CUDA_SUCCESS,)

        def cuLaunchKernelEx(self, config, func, params, extra):
            attrs = {}
            for a in config.attrs[:config.numAttrs]:
                if a.id == real.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION:
                    attrs["cluster"] = (a.value.clusterDim.x, a.value.clusterDim.y, a.value.clusterDim.z)
                elif a.id == real.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION:
                    attrs["pdl"] = a.value.programmaticStreamSerializationAllowed
            calls.append(("ex", (config.gridDimX, config.gridDimY, config.gridDimZ, config.blockDimX,
                                 config.sharedMemBytes, int(config.hStream)), attrs, id(config)))
            return (real.CUresult.CUDA_SUCCESS,)

    monkeypatch.setattr(driver, "cuda_driver", lambda: Recorder())
    plain = Kernel("plain", None, "i")
    plain((2, 1, 1), (32, 1, 1), 0, 0, 7)
    plain((8, 1, 1), (32, 1, 1), 0, 0, 7, cluster=4)
    pdl = Kernel("pdl", None, "i", pdl=True)
    pdl((3, 2, 1), (128, 1, 1), 1024, 5, 7)
    pdl((4, 1, 1), (128, 1, 1), 0, 6, 7)
    pdl((8, 1, 1), (128, 1, 1), 0, 6, 7, cluster=2)
    pdl((3, 1, 1), (64, 1, 1), 0, 6, 7, pdl=False)
    pdl((8, 1, 1), (64, 1, 1), 0, 6, 7, cluster=2, pdl=False)
    assert calls[0] == ("plain", (2, 1, 1, 32, 1, 1, 0, 0))
    assert calls[1][:3] == ("ex", (8, 1, 1, 32, 0, 0), {"cluster": (4, 1, 1)})
    assert calls[2][:3] == ("ex", (3, 2, 1, 128, 1024, 5), {"pdl": 1})
    assert calls[3][:3] == ("ex", (4, 1, 1, 128, 0, 6), {"pdl": 1}) and calls[3][3] == calls[2][3]
    assert calls[4][:3] == ("ex", (8, 1, 1, 128, 0, 6), {"cluster": (2, 1, 1), "pdl": 1})
    assert calls[5] == ("plain", (3, 1, 1, 64, 1, 1, 0, 6))
    assert calls[6][:3] == ("ex", (8, 1, 1, 64, 0, 6), {"cluster": (2, 1, 1)}) and calls[6][3] != calls[4][3]


def test_trace_hooks_compile_to_nothing_by_default():
    """bench/trace_step.py's clock records exist only in builds with METRALE_TRACE (its own copy of the sources)."""
    text = (build.KERNEL_DIR / "common.cuh").read_text()
    assert "#ifdef METRALE_TRACE" in text and "#define METRALE_TRACE" not in text
    assert "#define TRACE_SCOPE\n#define TRACE_MARK(i)\n#endif" in text


def test_cuda_archs_choose_the_gencode(monkeypatch):
    """METRALE_CUDA_ARCHS: machine code per listed architecture, PTX per compute_NN; the default is sm_80, sm_90 and
    compute_90 PTX (engine/env.py)."""
    import importlib

    from engine import env
    from engine.cuda import build
    assert env.CUDA_ARCHS == ("80", "90", "compute_90") or "METRALE_CUDA_ARCHS" in __import__("os").environ
    monkeypatch.setenv("METRALE_CUDA_ARCHS", "90")
    try:
        importlib.reload(env)
        importlib.reload(build)
        assert build.GENCODE == ("-gencode", "arch=compute_90,code=sm_90")
    finally:
        monkeypatch.delenv("METRALE_CUDA_ARCHS")
        importlib.reload(env)
        importlib.reload(build)
    assert build.GENCODE == ("-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90",
                             "-gencode", "arch=compute_90,code=compute_90")
