"""GraphCache: CUDA graphs of decode and verify steps, keyed by the batch's slot vector (or width), and
of short prefill forwards, keyed by their padded shape.

All CUDA-graph logic lives here. A key is the sorted tuple of the batch's slots plus whatever else
fixes the step's shapes (the top-logprob count, the draft length); callers permute results back to
request order. Policy:
- a key is captured only once it has been seen `capture_after` times; until then the step runs
  eagerly, so a churning batch never pays a capture on every step, or, when the caller gives a
  fallback, through a graph keyed by the step's shape alone (the batch width) that reads the slot
  vector from a staging buffer the caller writes first. A fallback key is captured the first time
  it is needed: one graph serves every batch of its width, so it is never wasted on churn;
- keys of a few recurring shapes (padded prefill forwards) are captured the first time too;
- the admission counts remember the last `max_seen` keys (a churning batch makes new keys without
  end, and a key not seen for that long is not worth a graph);
- at most `max_graphs` graphs are held; the least recently used is evicted, and destroyed only once
  the device has finished every replay of it (each replay records an event);
- a capture that fails (out of memory, an invalidated capture, anything) is logged and counted, and the
  step runs eagerly. Where the backend cleaned up after it (recoverable), captures go on: that key is
  tried again only after RETRY_AFTER more sightings, twice that after a second failure, and so on, and
  after `max_failures` failures in all no more graphs are captured. After a failure the backend cannot
  vouch for, no more graphs are captured at once (held ones still replay);
- all graphs share one memory pool; the step functions copy their outputs into buffers allocated
  outside it (the caller's static output buffers).

The backend (TorchGraphBackend on a GPU, a fake in the CPU unit tests) does the CUDA work."""
from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Protocol

from engine.api import GraphStats

log = logging.getLogger(__name__)

RETRY_AFTER = 64  # sightings before a key whose capture failed once is tried again (doubled per failure)


class GraphBackend(Protocol):
    def capture(self, step: Callable[[], None]) -> Any: ...  # runs step once under capture; returns a graph
    def replay(self, graph: Any) -> Any: ...  # launches the graph; returns a "done" marker (an event)
    def is_done(self, marker: Any) -> bool: ...  # has the device finished that replay?
    def destroy(self, graph: Any) -> None: ...
    def pool_bytes(self) -> int: ...
    def recoverable(self, error: Exception) -> bool: ...  # may captures go on after this capture failure?


@dataclass
class _Entry:
    graph: Any
    last_replay: Any = None  # the done-marker of its most recent replay
    inputs: Any = None  # what the graph's captured addresses point into (kept alive with it)


class GraphCache:
    def __init__(self, backend: GraphBackend, max_graphs: int, capture_after: int, max_seen: int = 4096,
                 max_failures: int = 16):
        if max_graphs < 1 or capture_after < 1 or max_seen < 1 or max_failures < 1:
            raise ValueError("max_graphs, capture_after, max_seen and max_failures must be >= 1")
        self.max_failures = max_failures
        self._failed: collections.OrderedDict[Hashable, int] = collections.OrderedDict()  # key -> its failures
        self.backend = backend
        self.max_graphs = max_graphs
        self.capture_after = capture_after
        self.max_seen = max_seen
        self._graphs: collections.OrderedDict[Hashable, _Entry] = collections.OrderedDict()  # LRU first
        self._seen: collections.OrderedDict[Hashable, int] = collections.OrderedDict()  # least recently seen first
        self._retired: list[_Entry] = []  # evicted, waiting for their last replay to finish
        self.capture_disabled = False  # set by a capture failure the backend cannot recover from
        self.stats = GraphStats()

    @staticmethod
    def key_for(slots: list[int], *extra: Hashable) -> tuple:
        """Canonical key: the sorted slot vector, then the extra shape-fixing fields."""
        return (tuple(sorted(slots)), *extra)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._graphs

    def __len__(self) -> int:
        return len(self._graphs)

    def keys(self) -> list[Hashable]:
        """The keys of the graphs held, least recently used first."""
        return list(self._graphs)

    def run(self, key: Hashable, prepare: Callable[[], Callable[[], None]],
            fallback: tuple[Hashable, Callable[[], Callable[[], None]], Callable[[], None]] | None = None,
            capture_after: int | None = None) -> bool:
        """Runs the step for `key`: replays its graph, or captures one, or runs it eagerly. Returns True
        when a graph ran. prepare() (called only when no graph is held) builds the step's inputs and
        returns the step; a captured graph keeps that step (and the inputs it holds) alive. The step
        must write its results to buffers outside the graph pool and read no device value on the host.

        fallback = (its key, its prepare, stage): while `key` is held by no graph and not yet due for
        capture, stage() writes this step's inputs where the fallback step reads them, and the fallback
        key runs instead (replayed, or captured at once); counted in stats.fallbacks.

        capture_after: this key's admission threshold instead of the cache's (1 for keys of a few
        recurring shapes, such as a padded prefill forward's)."""
        return self._run(key, prepare, fallback, capture_after or self.capture_after)

    def _run(self, key: Hashable, prepare: Callable[[], Callable[[], None]], fallback, capture_after: int) -> bool:
        self._reap()
        entry = self._graphs.get(key)
        if entry is not None:
            self._graphs.move_to_end(key)
            entry.last_replay = self.backend.replay(entry.graph)
            self.stats.hits += 1
            return True
        seen = self._seen.pop(key, 0) + 1
        self._seen[key] = seen
        if len(self._seen) > self.max_seen:
            self._seen.popitem(last=False)
        failures = self._failed.get(key, 0)
        if failures:  # its capture failed before: tried again after RETRY_AFTER << (failures - 1) sightings
            capture_after = max(capture_after, RETRY_AFTER << (failures - 1))
        if fallback is not None and seen < capture_after:
            fallback_key, fallback_prepare, stage = fallback
            stage()
            self.stats.fallbacks += 1
            return self._run(fallback_key, fallback_prepare, None, 1)
        self.stats.misses += 1
        step = prepare()
        if seen < capture_after or self.capture_disabled:
            step()
            return False
        t0 = time.perf_counter()
        try:
            graph = self.backend.capture(step)
        except Exception as e:  # noqa: BLE001 - any capture failure degrades to eager, never fails the step
            self._capture_failed(key, e)
            step()
            return False
        self.stats.captures += 1
        self.stats.capture_seconds += time.perf_counter() - t0
        self._seen.pop(key, None)
        self._failed.pop(key, None)
        # Capturing does not execute the work: replay once now so this step's results exist.
        entry = _Entry(graph, inputs=step)
        entry.last_replay = self.backend.replay(graph)
        self._graphs[key] = entry
        while len(self._graphs) > self.max_graphs:
            self.evict()
        self._update_gauges()
        return True

    def _capture_failed(self, key: Hashable, error: Exception) -> None:
        self.stats.capture_failures += 1
        self._seen.pop(key, None)
        failures = self._failed.pop(key, 0) + 1
        self._failed[key] = failures
        if len(self._failed) > self.max_seen:
            self._failed.popitem(last=False)
        what = f"CUDA graph capture failed for {_short(key)} ({type(error).__name__}: {error})"
        if not self.backend.recoverable(error):
            self.capture_disabled = True
            log.error("%s; it may have left the capture state broken, so no more graphs are captured (held ones "
                      "still replay)", what)
        elif self.stats.capture_failures >= self.max_failures:
            self.capture_disabled = True
            log.error("%s; %d capture failures in all, so no more graphs are captured (held ones still replay)",
                      what, self.stats.capture_failures)
        else:
            log.warning("%s; running eagerly, this key is tried again after %d more sightings", what,
                        max(self.capture_after, RETRY_AFTER << (failures - 1)), exc_info=log.isEnabledFor(logging.DEBUG))

    def evict(self) -> Hashable | None:
        """Drops the least recently used graph; it is destroyed once its last replay finished."""
        if not self._graphs:
            return None
        key, entry = self._graphs.popitem(last=False)
        self._retired.append(entry)
        self.stats.evictions += 1
        self._reap()
        self._update_gauges()
        return key

    def _reap(self) -> None:
        still = []
        for entry in self._retired:
            if entry.last_replay is None or self.backend.is_done(entry.last_replay):
                self.backend.destroy(entry.graph)
            else:
                still.append(entry)
        self._retired = still

    def _update_gauges(self) -> None:
        self.stats.graphs_held = len(self._graphs)
        self.stats.pool_bytes = self.backend.pool_bytes()

    def clear(self) -> None:
        while self._graphs:
            self.evict()
        for entry in self._retired:
            self.backend.destroy(entry.graph)
        self._retired = []
        self._update_gauges()

    @property
    def num_retired(self) -> int:
        return len(self._retired)


def _short(key: Hashable) -> str:
    text = repr(key)
    return text if len(text) < 80 else text[:77] + "..."


class _Captured:
    """A captured torch.cuda.CUDAGraph and its executable graph's driver handle (None where this torch
    has no raw_cuda_graph_exec)."""

    __slots__ = ("graph", "exec")

    def __init__(self, graph, exec_handle):
        self.graph, self.exec = graph, exec_handle


class CaptureFailed(RuntimeError):
    """A capture gave no graph. clean: the capture is over (the stream no longer captures) and the
    allocator no longer records into a graph pool, so later captures may go on."""

    def __init__(self, message: str, clean: bool):
        super().__init__(message)
        self.clean = clean


class TorchGraphBackend:
    """torch.cuda.CUDAGraph on the engine's compute stream, one shared memory pool.

    A capture is CUDAGraph.capture_begin (thread-local mode: the runner's waiter thread may wait on an
    event meanwhile), the step, capture_end, without the torch.cuda.graph context manager, for two
    reasons. It synchronises the device and empties the allocator's caches before every capture (a
    capture needs neither). And where capture_end fails (an invalidated capture), torch raises before it
    ends the allocator's recording into the pool, so the next capture into that pool would fail too
    ("already recording") and the allocator would defer its event processing from then on. Here a
    failed capture_end is cleaned up: the caching allocator's recording is ended and its pool reference
    dropped, and later graphs go to a fresh pool (torch's pinned-memory allocator was told to record
    into the old one too, and Python cannot end that). Such a failure is then recoverable.

    Replays launch the executable graph with one driver call (cuGraphLaunch) instead of
    CUDAGraph.replay(), which first refills torch's CUDA RNG seed and offset for the replay (two small
    kernels, ~10 us of host time). The engine's steps draw no random numbers from torch (sampling has
    its own counter-based RNG, keyed by the slot's seed and position), so there is nothing to refill."""

    def __init__(self, streams):
        import torch

        from engine.cuda.driver import check, cuda_driver

        self.torch = torch
        self._check, self._drv = check, cuda_driver()
        self.streams = streams
        self.device_index = streams.device.index if streams.device.index is not None else torch.cuda.current_device()
        self.pool = torch.cuda.graph_pool_handle()
        self._pools = [tuple(self.pool)]  # this one and those left after a failed capture_end
        self._bytes = 0

    def capture(self, step: Callable[[], None]) -> _Captured:
        torch = self.torch
        graph = torch.cuda.CUDAGraph()
        before = torch.cuda.memory_stats(self.device_index).get("reserved_bytes.all.current", 0)
        step_error = end_error = None
        with torch.cuda.stream(self.streams.compute):
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                step()
            except Exception as e:  # noqa: BLE001 - the capture is ended below whatever the step raised
                step_error = e
            try:
                graph.capture_end()
            except Exception as e:  # noqa: BLE001
                end_error = e
        if step_error is None and end_error is None:
            self._bytes += max(0, torch.cuda.memory_stats(self.device_index).get("reserved_bytes.all.current", 0)
                               - before)
            raw_exec = getattr(graph, "raw_cuda_graph_exec", None)
            return _Captured(graph, raw_exec() if raw_exec is not None else None)
        if end_error is None:
            graph.reset()  # a whole capture of a step that raised: torch's state is as after any capture
        else:
            self._abandon_pool()
        err, status = self._drv.cuStreamIsCapturing(self.streams.compute_handle)
        clean = err == self._drv.CUresult.CUDA_SUCCESS and \
            status == self._drv.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE
        error = step_error or end_error
        if clean and isinstance(error, torch.OutOfMemoryError):
            raise error
        raise CaptureFailed(f"{type(error).__name__}: {error}" + (f" (then capture_end: {end_error})"
                                                                   if step_error and end_error else ""),
                            clean=clean) from error

    def _abandon_pool(self) -> None:
        """After a failed capture_end: ends the caching allocator's recording into the pool (torch did
        not), drops the reference its capture_begin took, and sends later captures to a fresh pool."""
        torch = self.torch
        try:
            torch._C._cuda_endAllocateToPool(self.device_index, self.pool)
        except RuntimeError:  # "not currently recording": capture_end got that far before it failed
            pass
        else:
            torch._C._cuda_releasePool(self.device_index, self.pool)
        self.pool = torch.cuda.graph_pool_handle()
        self._pools.append(tuple(self.pool))

    def replay(self, captured: _Captured):
        if captured.exec is None:
            with self.torch.cuda.stream(self.streams.compute):
                captured.graph.replay()
        else:
            self._check("cuGraphLaunch", self._drv.cuGraphLaunch(captured.exec, self.streams.compute_handle))
        return self.streams.mark()

    def is_done(self, marker) -> bool:
        return marker.query()

    def destroy(self, captured: _Captured) -> None:
        captured.exec = None
        captured.graph.reset()

    def recoverable(self, error: Exception) -> bool:
        """Out of memory, or a capture this backend cleaned up after (CaptureFailed.clean): captures may
        go on. Anything else (the stream still capturing) may have left the capture state broken."""
        if isinstance(error, CaptureFailed):
            return error.clean
        return isinstance(error, self.torch.OutOfMemoryError)

    def pool_bytes(self) -> int:
        """Bytes of the device segments this backend's graph pools hold (the allocator's snapshot), or the
        growth of reserved memory across captures where the snapshot has no pool ids."""
        try:
            segments = self.torch.cuda.memory_snapshot()
            held = [s["total_size"] for s in segments if tuple(s.get("segment_pool_id", ())) in self._pools]
            return sum(held) if held or not self._bytes else self._bytes
        except Exception:  # noqa: BLE001 - statistics only
            return self._bytes
