"""EngineStreams: the engine's own CUDA streams and events, created once; close() destroys the events and retires
the streams (kept for the life of the process: _RETIRED_STREAMS).

- compute: every kernel and torch op of a forward runs here (`with streams.compute_context():`), never
  on the legacy default stream.
- copy: host-to-device staging from pinned buffers; `stage()` orders the copy before the compute that
  reads it with an event (the compute stream waits on the device, the host does not block).
- timing: `timed(i)` brackets work on the compute stream with timer i's two timing events (one timer
  per piece of work that may be in flight at once).
- marks: `mark()` records how far the compute stream's work has been queued (a DeviceMark the host
  can query or wait on), from a ring of events created once: no event is created per step.
- to_host: a device-to-host copy on the compute stream, one driver call (torch's copy_ of a pinned
  tensor costs ~10 us of host time a call: it also records an event for its pinned allocator).

Streams and events are created through cuda-python (non-blocking streams) and wrapped as torch
ExternalStreams, so torch ops, cuLaunchKernel launches (which use the current torch stream) and CUDA
graph capture all see the same stream.
"""
from __future__ import annotations

import contextlib

import torch

from engine.cuda.driver import CudaError, check, cuda_driver

# The streams of closed EngineStreams, kept for the life of the process. When a pinned host tensor that a copy used
# on a stream is freed, torch's pinned-memory allocator records an event on that stream (and the caching allocator
# does the same for device memory a stream was recorded on); an engine's tensors go whenever their last reference
# does, which may be after Engine.close, and recording on a destroyed stream is undefined behaviour (the suspected
# cause of the segfaults and "invalid device context" aborts seen when a closed engine was freed: bench/RESULTS.md).
# Two idle streams an engine cost a few KB of driver memory.
_RETIRED_STREAMS: list = []

# Events in the mark ring. A mark's event is recorded again MARKS marks later; the engine looks at a
# mark only while its step is in flight (at most 4) or, for a retired graph, to see that its last
# replay has ended, where a later recording only makes the answer later, never early.
MARKS = 64


class Timing:
    """Elapsed device time between two events on the compute stream."""

    def __init__(self, start, end):
        self._start, self._end = start, end
        self._ns: int | None = None

    def elapsed_ns(self) -> int:
        """Blocks until the end event has completed, then returns the elapsed nanoseconds."""
        if self._ns is None:
            check("cuEventSynchronize", cuda_driver().cuEventSynchronize(self._end))
            ms = check("cuEventElapsedTime", cuda_driver().cuEventElapsedTime(self._start, self._end))
            self._ns = int(round(ms * 1e6))
        return self._ns


class DeviceMark:
    """A point of the compute stream's queued work: done once the device has run everything queued
    on the stream before it. Safe to wait on from any thread (the GIL is released while waiting)."""

    __slots__ = ("_event",)

    def __init__(self, event):
        self._event = event

    def query(self) -> bool:
        """Whether the device has passed this point (never blocks)."""
        driver = cuda_driver()
        err, = driver.cuEventQuery(self._event)
        if err == driver.CUresult.CUDA_SUCCESS:
            return True
        if err == driver.CUresult.CUDA_ERROR_NOT_READY:
            return False
        raise CudaError("cuEventQuery", err)

    def synchronize(self) -> None:
        """Blocks until the device has passed this point."""
        check("cuEventSynchronize", cuda_driver().cuEventSynchronize(self._event))


class EngineStreams:
    def __init__(self, device: torch.device, timers: int = 1):
        """timers: how many pieces of timed work may be in flight at once (`timed(i)`, i < timers)."""
        driver = cuda_driver()
        self.device = device
        torch.cuda.init()
        with torch.cuda.device(device):
            torch.empty(1, device=device)  # torch's primary context is current on this thread
            flags = driver.CUstream_flags.CU_STREAM_NON_BLOCKING
            self._compute_handle = check("cuStreamCreate", driver.cuStreamCreate(flags))
            self._copy_handle = check("cuStreamCreate", driver.cuStreamCreate(flags))
            self.compute = torch.cuda.ExternalStream(int(self._compute_handle), device=device)
            self.copy = torch.cuda.ExternalStream(int(self._copy_handle), device=device)
            no_timing = driver.CUevent_flags.CU_EVENT_DISABLE_TIMING
            self._copy_done = check("cuEventCreate", driver.cuEventCreate(no_timing))
            self._compute_mark = check("cuEventCreate", driver.cuEventCreate(no_timing))
            self._timers = [tuple(check("cuEventCreate", driver.cuEventCreate(driver.CUevent_flags.CU_EVENT_DEFAULT))
                                  for _ in range(2)) for _ in range(timers)]
            self._marks = [check("cuEventCreate", driver.cuEventCreate(no_timing)) for _ in range(MARKS)]
        self._next_mark = 0
        self._context = None  # the primary context, retained by bind_thread
        self._closed = False

    def bind_thread(self) -> None:
        """Readies the calling thread to run steps (for a thread other than the one that created the streams,
        before it runs any): makes the device's primary context (torch's) current, since driver calls that
        take no context of their own (a graph launch, an event record) fail on a thread that has none; and
        creates this thread's cuBLAS and cuBLASLt handles, which torch makes per thread on first use: a first
        use inside a graph capture fails (cublasCreate is not capturable), so a slot-vector graph captured
        later on this thread would run eagerly instead."""
        driver = cuda_driver()
        torch.cuda.set_device(self.device)
        if self._context is None:
            device = check("cuDeviceGet", driver.cuDeviceGet(self.device.index or 0))
            self._context = check("cuDevicePrimaryCtxRetain", driver.cuDevicePrimaryCtxRetain(device))
        check("cuCtxSetCurrent", driver.cuCtxSetCurrent(self._context))
        with torch.cuda.stream(self.compute):
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                a = torch.zeros((16, 16), dtype=dtype, device=self.device)
                torch.mm(a, a)  # cuBLAS (and cuBLASLt) handle and workspace of this thread and stream
                torch.addmm(a, a, a)
            b = torch.zeros((2, 16, 16), dtype=torch.bfloat16, device=self.device)
            torch.bmm(b, b, out_dtype=torch.float32)  # the split-K decode linear's path
        self.compute.synchronize()

    @property
    def compute_handle(self):
        """The compute stream's driver handle (CUstream)."""
        return self._compute_handle

    @contextlib.contextmanager
    def compute_context(self):
        """Makes the compute stream torch's current stream (kernels launch on it)."""
        with torch.cuda.stream(self.compute):
            yield self.compute

    def stage(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copies pinned host `src` into device `dst` on the copy stream; the compute stream waits for
        it (on the device). dst must be a persistent buffer (it is written on the copy stream); src must
        not be rewritten before `wait_staged()` returns."""
        if src.device.type != "cpu" or not src.is_pinned():
            raise ValueError("stage(): src must be a pinned host tensor (torch.empty(..., pin_memory=True))")
        if not dst.is_cuda or not dst.is_contiguous() or not src.is_contiguous() or dst.dtype != src.dtype \
                or dst.numel() != src.numel():
            raise ValueError(f"stage(): dst must be a contiguous device tensor of src's dtype and size, got "
                             f"{dst.dtype} {tuple(dst.shape)} <- {src.dtype} {tuple(src.shape)}")
        driver = cuda_driver()
        # The copy must not overtake compute work that still reads dst's previous contents.
        check("cuEventRecord", driver.cuEventRecord(self._compute_mark, self._compute_handle))
        check("cuStreamWaitEvent", driver.cuStreamWaitEvent(self._copy_handle, self._compute_mark, 0))
        # A driver copy, not torch's copy_: torch's pinned-memory allocator would record events on the
        # copy stream, which outlive it after close(). wait_staged() is what guards the pinned source.
        check("cuMemcpyHtoDAsync", driver.cuMemcpyHtoDAsync(dst.data_ptr(), src.data_ptr(),
                                                            src.numel() * src.element_size(), self._copy_handle))
        check("cuEventRecord", driver.cuEventRecord(self._copy_done, self._copy_handle))
        check("cuStreamWaitEvent", driver.cuStreamWaitEvent(self._compute_handle, self._copy_done, 0))

    def wait_staged(self) -> None:
        """Blocks the host until the last staged copy has finished (its pinned source is free again)."""
        check("cuEventSynchronize", cuda_driver().cuEventSynchronize(self._copy_done))

    @contextlib.contextmanager
    def timed(self, timer: int = 0):
        """`with streams.timed() as t: ...` then `t.elapsed_ns()`: device time of the work enqueued on the
        compute stream inside the block. Timer `timer` (of `timers`) times one piece of work at a
        time: its events are recorded again by its next use."""
        driver = cuda_driver()
        start, end = self._timers[timer]
        check("cuEventRecord", driver.cuEventRecord(start, self._compute_handle))
        timing = Timing(start, end)
        try:
            yield timing
        finally:
            check("cuEventRecord", driver.cuEventRecord(end, self._compute_handle))

    def mark(self) -> DeviceMark:
        """Marks the work queued on the compute stream so far (see DeviceMark)."""
        event = self._marks[self._next_mark]
        self._next_mark = (self._next_mark + 1) % MARKS
        check("cuEventRecord", cuda_driver().cuEventRecord(event, self._compute_handle))
        return DeviceMark(event)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor, nbytes: int) -> None:
        """Queues a copy of the first nbytes of device tensor src into pinned host tensor dst on the
        compute stream (no host wait). Both must be contiguous and hold nbytes; dst must stay alive
        and unread until the copy has run (a mark recorded after it is done)."""
        self._copy("cuMemcpyDtoHAsync", dst, src, nbytes)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor, nbytes: int) -> None:
        """Queues a copy of the first nbytes of pinned host tensor src into device tensor dst on the
        compute stream (no host wait); src must not be rewritten until the copy has run."""
        self._copy("cuMemcpyHtoDAsync", dst, src, nbytes)

    def _copy(self, call: str, dst: torch.Tensor, src: torch.Tensor, nbytes: int) -> None:
        if nbytes > min(dst.numel() * dst.element_size(), src.numel() * src.element_size()):
            raise ValueError(f"{call}: {nbytes} bytes do not fit {tuple(src.shape)} -> {tuple(dst.shape)}")
        check(call, getattr(cuda_driver(), call)(dst.data_ptr(), src.data_ptr(), nbytes, self._compute_handle))

    def synchronize(self) -> None:
        driver = cuda_driver()
        check("cuStreamSynchronize", driver.cuStreamSynchronize(self._compute_handle))
        check("cuStreamSynchronize", driver.cuStreamSynchronize(self._copy_handle))

    def close(self) -> None:
        """Waits for both streams, then destroys the events. The streams themselves are retired, not destroyed
        (_RETIRED_STREAMS): tensors used on them may be freed after close, and torch's allocators then still
        use the streams (below)."""
        if self._closed:
            return
        self._closed = True
        driver = cuda_driver()
        self.synchronize()
        for event in (self._copy_done, self._compute_mark, *(e for pair in self._timers for e in pair), *self._marks):
            check("cuEventDestroy", driver.cuEventDestroy(event))
        _RETIRED_STREAMS.extend((self._compute_handle, self._copy_handle))
        if self._context is not None:
            check("cuDevicePrimaryCtxRelease", driver.cuDevicePrimaryCtxRelease(
                check("cuDeviceGet", driver.cuDeviceGet(self.device.index or 0))))
            self._context = None
