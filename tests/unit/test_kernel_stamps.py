"""A fatbin's stamp (engine/cuda/build.py): a build rebuilds a fatbin whose source, headers or nvcc flags changed;
the loader (engine/cuda/library.py) takes one whose source and headers are unchanged whatever architectures it
was built for. CPU only, no nvcc: the fatbins here are placeholder files."""
from __future__ import annotations

import pathlib

import pytest

from engine.cuda import build


@pytest.fixture
def built(tmp_path) -> tuple[pathlib.Path, pathlib.Path]:
    """A copy of one kernel source and its headers, with a fatbin stamped as built now."""
    src_dir, out = tmp_path / "src", tmp_path / "out"
    src_dir.mkdir()
    out.mkdir()
    for header in build.headers():
        (src_dir / header.name).write_text(header.read_text())
    src = src_dir / "embedding.cu"
    src.write_text((build.KERNEL_DIR / "embedding.cu").read_text())
    build.fatbin_path(src, out).write_bytes(b"placeholder")
    build.stamp_path(src, out).write_text(build.build_stamp(src) + "\n")
    return src, out


def test_a_fatbin_stamped_now_is_current_for_the_build_and_the_loader(built):
    src, out = built
    assert build.is_current(src, out) and build.is_current(src, out, flags=False)


def test_other_architectures_are_stale_for_the_build_but_current_for_the_loader(built, monkeypatch):
    """The trap this guards: fatbins built with METRALE_CUDA_ARCHS=90 and a process started without it (other
    default flags) compiled every kernel with NVRTC at start-up."""
    src, out = built
    monkeypatch.setattr(build, "NVCC_FLAGS", (*build.NVCC_FLAGS[:4], "-gencode", "arch=compute_90,code=sm_90"))
    assert not build.is_current(src, out)
    assert build.is_current(src, out, flags=False)


@pytest.mark.parametrize("edit", ["source", "header"])
def test_a_changed_source_or_header_is_stale_for_both(built, edit):
    src, out = built
    changed = src if edit == "source" else src.parent / build.headers()[0].name
    changed.write_text(changed.read_text() + "\n// edited\n")
    assert not build.is_current(src, out) and not build.is_current(src, out, flags=False)


def test_a_stamp_of_the_old_single_hash_form_is_stale_for_both(built):
    src, out = built
    build.stamp_path(src, out).write_text(build.source_hash(src, (" ".join(build.compile_flags(src.read_text())),)))
    assert not build.is_current(src, out) and not build.is_current(src, out, flags=False)


def test_a_missing_fatbin_or_stamp_is_never_current(built):
    src, out = built
    build.stamp_path(src, out).unlink()
    assert not build.is_current(src, out, flags=False)
