"""EngineStreams on the GPU: waiting for the device lets the process's other threads run (the worker's
event loop answers calls while the engine thread waits for a step)."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from engine.cuda.streams import EngineStreams

pytestmark = pytest.mark.gpu


def _progress_while(wait) -> tuple[int, float]:
    """How far a spinning Python thread gets while wait() blocks, and how long wait() took (s)."""
    progress, stop = [0], threading.Event()

    def spin() -> None:
        while not stop.is_set():
            progress[0] += 1
    thread = threading.Thread(target=spin)
    thread.start()
    time.sleep(0.02)
    try:
        before, t0 = progress[0], time.perf_counter()
        wait()
        return progress[0] - before, time.perf_counter() - t0
    finally:
        stop.set()
        thread.join()


def test_waiting_on_a_mark_lets_other_threads_run():
    """DeviceMark.synchronize (the engine thread's wait for a step) releases the GIL: a thread that
    spins meanwhile keeps counting. Held, it would not count at all until the device finished."""
    streams = EngineStreams(torch.device("cuda", torch.cuda.current_device()))
    try:
        with streams.compute_context():
            torch.cuda._sleep(200_000_000)  # ~0.1 s of device time at ~2 GHz
        mark = streams.mark()
        assert not mark.query()
        progress, seconds = _progress_while(mark.synchronize)
        assert mark.query() and seconds > 0.02
        # A Python loop counts ~10^7 a second; 10^4 in over 20 ms rules out a held GIL.
        assert progress > 10_000, f"{progress} iterations in {seconds * 1e3:.1f} ms of waiting"
    finally:
        streams.close()


def test_upload_does_not_wait_for_the_queued_work():
    """engine.device.upload returns while the GPU still runs the work queued before it (torch's `.to(device)` from
    pageable memory would return only after it: a prefill's plan, made at its first layer, then left the GPU idle),
    and the uploaded values arrive in stream order. The sleep kernel runs ~50 ms."""
    import numpy as np

    from engine.device import upload
    dev = torch.device("cuda", torch.cuda.current_device())
    values = np.arange(70_000, dtype=np.int64)  # over the 64 KB the driver stages without waiting
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)
    t = upload(values, dev)
    assert not torch.cuda.current_stream().query(), "upload waited for the queued sleep"
    assert torch.equal(t.cpu(), torch.from_numpy(values))
    torch.cuda._sleep(100_000_000)
    torch.from_numpy(values).to(dev)  # what it replaces: the check above can tell the two apart
    assert torch.cuda.current_stream().query()
