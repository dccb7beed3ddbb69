"""bench/load.py's plots of a sweep: throughput against concurrency, and the TTFT and ITL distributions."""
from __future__ import annotations

import pathlib

import numpy as np


def plot(results: dict, out_png: pathlib.Path) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    fig, ax = plt.subplots(figsize=(6, 4))
    series = [("in-process", results.get("in_process") or [])]
    for depth, how in sorted({(r["pipeline"], r.get("decode", "call")) for r in results.get("grpc") or []}):
        series.append((f"gRPC, {depth} in flight" + (", DecodeStream" if how == "stream" else ""),
                       [r for r in results["grpc"] if (r["pipeline"], r.get("decode", "call")) == (depth, how)]))
    for label, levels in series:
        if levels:
            ax.plot([r["concurrency"] for r in levels], [r["tokens_per_s"] for r in levels], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent sequences")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"Throughput vs concurrency ({results['meta']['device']})")
    ax.legend()
    ax.grid(alpha=0.3)
    written.append(_save(plt, fig, out_png, "-throughput.png"))

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "ttft_ms", "time to first token"), (axes[1], "itl_ms", "inter-token latency")):
        for level in results.get("raw_grpc", []):
            xs = np.sort(np.asarray(level[key]))
            if len(xs):
                ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs),
                        label=f"C={level['concurrency']}, {level.get('pipeline', 1)} in flight"
                              + (", stream" if level.get("decode") == "stream" else ""))
        ax.set_xscale("log")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction")
        ax.set_title(f"{title} CDF (gRPC)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    written.append(_save(plt, fig, out_png, "-latency-cdf.png"))
    return written


def _save(plt, fig, out_png: pathlib.Path, suffix: str) -> str:
    path = out_png.with_name(out_png.stem + suffix)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
