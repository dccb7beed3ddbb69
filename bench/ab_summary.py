"""Summarises the engine_bench JSONs of an A/B call (bench/gpu_session.sh ab): one line per
tree (the folder a JSON sits in: the base trees' subfolders, "new" for the top one), each figure listed per
process in run order, then its median.

    python bench/ab_summary.py OUT_DIR
"""
from __future__ import annotations

import json
import pathlib
import statistics
import sys

FIGURES = [  # (label, engine key, field)
    ("queued b1 ms", "decode_queued_b1", "step_ms"),
    ("b1 ms", "decode_b1", "step_ms"),
    ("b1 device ms", "decode_b1", "device_ms"),
    ("b8 ms", "decode_b8", "step_ms"),
    ("b8 device ms", "decode_b8", "device_ms"),
    ("b32 ms", "decode_b32", "step_ms"),
    ("b32 device ms", "decode_b32", "device_ms"),
    ("queued b32 ms", "decode_queued_b32", "step_ms"),
    ("verify4 / b1", "verify4_b1", "ratio"),
]


def summarise(root: pathlib.Path) -> dict[str, dict[str, list[float]]]:
    trees: dict[str, dict[str, list[float]]] = {}
    for path in sorted(root.rglob("engine-*.json"), key=lambda p: p.name):  # names carry the start time
        tree = "new" if path.parent == root else path.parent.name
        engine = json.loads(path.read_text()).get("engine", {})
        figures = trees.setdefault(tree, {})
        for label, key, field in FIGURES:
            value = engine.get(key, {}).get(field) if isinstance(engine.get(key), dict) else None
            if isinstance(value, (int, float)):
                figures.setdefault(label, []).append(float(value))
    return trees


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    trees = summarise(pathlib.Path(argv[0]))
    if not trees:
        print(f"no engine-*.json under {argv[0]}", file=sys.stderr)
        return 1
    for tree, figures in sorted(trees.items(), key=lambda kv: kv[0] == "new"):
        print(f"== {tree}")
        for label, values in figures.items():
            runs = " ".join(f"{v:.4f}" for v in values)
            print(f"  {label:14s} median {statistics.median(values):.4f}  ({runs})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
