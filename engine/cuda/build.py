"""Compiles every kernels_cu/*.cu with nvcc into one fatbin each (sm_80 and sm_90 machine code plus
compute_90 PTX, or the architectures METRALE_CUDA_ARCHS names; a source that names its own on a line
`// nvcc-gencode: 90a` gets those alone) under kernels_cu/build/. Run as `python -m engine.cuda.build`.

A fatbin is rebuilt only when its stamp (a hash of the source, the shared *.cuh headers and the
nvcc command line) changed. Files compile in parallel. A source may ask for extra nvcc flags on a
line `// nvcc-flags: ...` (the attention kernels use --use_fast_math; the sampling kernels must not).
At run time engine/cuda/library.py loads these fatbins; where none exists, none is current or none
matches the device, it compiles the source with NVRTC (nvrtc_compile, below) and caches the cubin.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import logging
import os
import pathlib
import re
import shutil
import struct
import subprocess
import sys

from engine import env
from engine.cuda.driver import CudaError, KernelLoadError

logger = logging.getLogger(__name__)

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
KERNEL_DIR = REPO_ROOT / "kernels_cu"
BUILD_DIR = KERNEL_DIR / "build"
# sm_80 and sm_90 machine code and compute_90 PTX by default (METRALE_CUDA_ARCHS, engine/env.py)
GENCODE = tuple(flag for arch in env.CUDA_ARCHS for flag in (
    "-gencode", f"arch={arch},code={arch}" if arch.startswith("compute_") else f"arch=compute_{arch},code=sm_{arch}"))
# -no-compress: the driver loads either form; plain entries let tests and tools read the symbols.
NVCC_FLAGS = ("-fatbin", "-O3", "-std=c++17", "-no-compress", *GENCODE)
_FLAGS_LINE = re.compile(r"^//\s*nvcc-flags:\s*(.*)$", re.MULTILINE)
_GENCODE_LINE = re.compile(r"^//\s*nvcc-gencode:\s*(.*)$", re.MULTILINE)


class BuildError(RuntimeError):
    """nvcc is missing or failed; the message carries nvcc's own output."""


def sources(kernel_dir: pathlib.Path = KERNEL_DIR) -> list[pathlib.Path]:
    return sorted(kernel_dir.glob("*.cu"))


def headers(kernel_dir: pathlib.Path = KERNEL_DIR) -> list[pathlib.Path]:
    return sorted(kernel_dir.glob("*.cuh"))


def extra_flags(source_text: str) -> list[str]:
    """Flags a source asks for on its `// nvcc-flags:` line (also given to NVRTC)."""
    m = _FLAGS_LINE.search(source_text)
    return m.group(1).split() if m else []


def own_archs(source_text: str) -> tuple[str, ...]:
    """The architectures a source names for itself on its `// nvcc-gencode:` line ("90a": sm_90a machine code
    alone, for instructions only that architecture has), or () where it takes the build's."""
    m = _GENCODE_LINE.search(source_text)
    return tuple(m.group(1).split()) if m else ()


def compile_flags(source_text: str) -> tuple[str, ...]:
    """nvcc's flags for one source: NVCC_FLAGS, with the source's own architectures in place of GENCODE where it
    names them, then its `// nvcc-flags:`."""
    archs, flags = own_archs(source_text), NVCC_FLAGS
    if archs:
        pairs = {i for i, f in enumerate(flags) if f == "-gencode"}
        flags = tuple(f for i, f in enumerate(flags) if i not in pairs and i - 1 not in pairs) + tuple(
            flag for arch in archs for flag in ("-gencode", f"arch=compute_{arch},code=sm_{arch}"))
    return (*flags, *extra_flags(source_text))


def serves(source_text: str, arch: int) -> bool:
    """Whether a source is built for a device of sm_<arch> (90): every source but one naming other architectures."""
    archs = own_archs(source_text)
    return not archs or any(a.rstrip("a") == str(arch) for a in archs)


def source_hash(src: pathlib.Path, extra: tuple[str, ...] = ()) -> str:
    """Hash of a source, every shared header and the given strings (command line, arch, ...)."""
    h = hashlib.sha256()
    for path in [src, *headers(src.parent)]:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    for s in extra:
        h.update(s.encode())
    return h.hexdigest()


def find_nvcc() -> str | None:
    nvcc = shutil.which("nvcc")
    if nvcc:
        return nvcc
    for root in env.CUDA_ROOTS:
        if (pathlib.Path(root) / "bin" / "nvcc").is_file():
            return str(pathlib.Path(root) / "bin" / "nvcc")
    return None


def nvcc_command(nvcc: str, src: pathlib.Path, out: pathlib.Path) -> list[str]:
    return [nvcc, *compile_flags(src.read_text()), "-I", str(src.parent), "-o", str(out), str(src)]


def fatbin_path(src: pathlib.Path, out_dir: pathlib.Path = BUILD_DIR) -> pathlib.Path:
    return out_dir / f"{src.stem}.fatbin"


def stamp_path(src: pathlib.Path, out_dir: pathlib.Path = BUILD_DIR) -> pathlib.Path:
    return out_dir / f"{src.stem}.stamp"


def build_stamp(src: pathlib.Path) -> str:
    """What a current fatbin's stamp file holds (independent of the nvcc path and output dir): the hash of its
    source and the shared headers, a space, and the hash of nvcc's flags for it (the architectures included)."""
    flags = " ".join(compile_flags(src.read_text()))
    return f"{source_hash(src)} {hashlib.sha256(flags.encode()).hexdigest()}"


def is_current(src: pathlib.Path, out_dir: pathlib.Path = BUILD_DIR, flags: bool = True) -> bool:
    """Whether src's fatbin in out_dir was built from src and the headers as they are now; flags: and with the
    flags this process would build it with (a build rebuilds otherwise). A loader asks without flags: a fatbin
    built for other architectures (another METRALE_CUDA_ARCHS) still serves a device it holds code for, and where
    it holds none its load fails and NVRTC compiles the source (engine/cuda/library.py), instead of every module
    being compiled at start-up because the variable differs."""
    fatbin, stamp = fatbin_path(src, out_dir), stamp_path(src, out_dir)
    if not (fatbin.is_file() and stamp.is_file()):
        return False
    have, want = stamp.read_text().split(), build_stamp(src).split()
    return have == want if flags else have[:1] == want[:1]


def build_one(nvcc: str, src: pathlib.Path, out_dir: pathlib.Path, force: bool = False) -> bool:
    """Builds one fatbin; returns False when it was already current."""
    if not force and is_current(src, out_dir):
        return False
    out = fatbin_path(src, out_dir)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    cmd = nvcc_command(nvcc, src, tmp)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise BuildError(f"nvcc failed on {src.name} (exit {proc.returncode}):\n  {' '.join(cmd)}\n"
                         f"{proc.stderr.strip() or proc.stdout.strip()}")
    tmp.replace(out)
    stamp_path(src, out_dir).write_text(build_stamp(src) + "\n")
    return True


def build_all(out_dir: pathlib.Path = BUILD_DIR, kernel_dir: pathlib.Path = KERNEL_DIR, force: bool = False,
              jobs: int | None = None, log=print) -> list[pathlib.Path]:
    """Builds every kernels_cu/*.cu; returns the fatbin paths. Raises BuildError naming each failure."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise BuildError("nvcc not found (PATH, CUDA_HOME, /usr/local/cuda): install the CUDA toolkit to "
                         "build kernels_cu/, or let the engine compile them with NVRTC at start-up")
    srcs = sources(kernel_dir)
    if not srcs:
        raise BuildError(f"no .cu files in {kernel_dir}")
    out_dir.mkdir(parents=True, exist_ok=True)
    jobs = jobs or min(len(srcs), os.cpu_count() or 1)
    errors = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(build_one, nvcc, src, out_dir, force): src for src in srcs}
        for fut in concurrent.futures.as_completed(futures):
            src = futures[fut]
            try:
                built = fut.result()
            except BuildError as e:
                errors.append(str(e))
                continue
            if log:
                log(f"{'built' if built else 'up to date'}: {fatbin_path(src, out_dir)}")
    if errors:
        raise BuildError("\n\n".join(errors))
    return [fatbin_path(src, out_dir) for src in srcs]


# ---------------------------------------------------------------------------------------------
# NVRTC: one source compiled for the device at start-up, where no fatbin serves it (engine/cuda/library.py).

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
    # A source naming its own architectures gets the one of them for this device ("90a" on sm_90).
    target = next((a for a in own_archs(text) if a.rstrip("a") == str(arch)), str(arch))
    opts = [f"--gpu-architecture=sm_{target}", "-std=c++17", *extra_flags(text)]
    key = source_hash(src, (" ".join(opts), f"nvrtc-{major}.{minor}"))[:24]
    path = cache_dir / f"{src.stem}-{key}-sm{arch}.cubin"
    if path.is_file():
        return path.read_bytes(), True
    hdrs = headers(src.parent)
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
        logger.warning("cannot cache the NVRTC cubin at %s: %s", path, e)
    return cubin, False


# ---------------------------------------------------------------------------------------------
# Reading a fatbin (uncompressed entries): which kernels each entry defines.

FATBIN_MAGIC = 0xBA55ED50
KIND_PTX, KIND_ELF = 1, 2


def fatbin_entries(data: bytes) -> list[tuple[int, int, bytes]]:
    """[(kind, arch, payload)] of a fatbin container: kind 1 = PTX text, 2 = ELF cubin; arch = 80, 90..."""
    entries = []
    off = 0
    while off + 16 <= len(data):
        magic, _version, header_size, fat_size = struct.unpack_from("<IHHQ", data, off)
        if magic != FATBIN_MAGIC:
            break
        pos, end = off + header_size, off + header_size + fat_size
        while pos + 32 <= end:
            kind, _ver, entry_header, payload_size = struct.unpack_from("<HHIQ", data, pos)
            arch, = struct.unpack_from("<I", data, pos + 28)
            payload = data[pos + entry_header: pos + entry_header + payload_size]
            entries.append((kind, arch, payload))
            pos += entry_header + payload_size
        off = end
    return entries


def elf_function_symbols(elf: bytes) -> set[str]:
    """Global function symbols of an ELF64 little-endian image (a cubin)."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2:
        raise ValueError("not an ELF64 image (a compressed fatbin entry?)")
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", elf, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    names = set()
    for sh in sections:
        sh_type, sh_offset, sh_size, sh_link, sh_entsize = sh[1], sh[4], sh[5], sh[6], sh[9]
        if sh_type != 2:  # SHT_SYMTAB
            continue
        strtab = sections[sh_link]
        str_off = strtab[4]
        for j in range(sh_size // (sh_entsize or 24)):
            st_name, st_info = struct.unpack_from("<IB", elf, sh_offset + j * 24)
            if (st_info & 0xF) == 2 and (st_info >> 4) == 1:  # STT_FUNC, STB_GLOBAL
                end = elf.index(b"\0", str_off + st_name)
                names.add(elf[str_off + st_name:end].decode())
    return names


def ptx_entries(ptx: bytes) -> set[str]:
    return {n.decode() for n in re.findall(rb"\.entry\s+([A-Za-z_][A-Za-z0-9_]*)", ptx)}


def fatbin_symbols(path: pathlib.Path) -> dict[str, set[str]]:
    """{"sm_80": {...}, "sm_90": {...}, "compute_90": {...}}: kernels defined by each entry."""
    out: dict[str, set[str]] = {}
    for kind, arch, payload in fatbin_entries(path.read_bytes()):
        if kind == KIND_ELF:
            out[f"sm_{arch}"] = elf_function_symbols(payload)
        elif kind == KIND_PTX:
            out[f"compute_{arch}"] = ptx_entries(payload)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.cuda.build", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=BUILD_DIR, help="output directory")
    parser.add_argument("--kernels", type=pathlib.Path, default=KERNEL_DIR,
                        help="source directory (a modified copy of kernels_cu/ for A/B runs)")
    parser.add_argument("--force", action="store_true", help="rebuild even when up to date")
    parser.add_argument("-j", "--jobs", type=int, default=None, help="parallel nvcc processes")
    args = parser.parse_args(argv)
    try:
        build_all(args.out, args.kernels, force=args.force, jobs=args.jobs)
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
