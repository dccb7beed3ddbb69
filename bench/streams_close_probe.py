"""Probe (not a test): does freeing a pinned host tensor that torch copied into on EngineStreams'
compute stream crash once the streams are closed? Prints each step; a crash shows as a signal exit.

    python bench/streams_close_probe.py [release-first]"""
import gc
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engine.cuda.streams import EngineStreams  # noqa: E402

dev = torch.device("cuda", 0)
streams = EngineStreams(dev)
host = torch.empty(1024, dtype=torch.int64, pin_memory=True)
src = torch.arange(1024, device=dev)
with streams.compute_context():
    host.copy_(src, non_blocking=True)  # torch's pinned allocator records an event on the compute stream
    streams.compute.synchronize()
print("copied", int(host[5]), flush=True)
if sys.argv[1:] == ["release-first"]:
    del host
    gc.collect()
    torch.cuda.synchronize()
    print("released the pinned tensor before close()", flush=True)
streams.close()
print("closed the streams", flush=True)
host = None
gc.collect()
torch.cuda.synchronize()
print("freed the pinned tensor after close(): survived", flush=True)
