"""Prefetching for the data layers, as Caffe's ``BasePrefetchingDataLayer``: batches are made ahead of
``forward`` on background threads, in order, and every random draw happens in the order it would without
prefetching, so the batches (and a training trajectory) are bit-identical with and without it.

How (see :class:`PrefetchingLayer`):

* **one sequencer thread per layer** runs the layer's own batch code (``_produce``) on a *copy* of the
  layer's stream state (its cursor: position, RandomState, order...), batch after batch, and queues each
  batch with a snapshot of the cursor taken right after it; the queue holds ``depth`` batches (Caffe's
  ``PREFETCH_COUNT``, 3; ``data_param { prefetch: N }`` sets it, 0 turns prefetching off for the layer).
  Every RandomState draw stays on this one thread, in the sequential order;
* **decode workers** (a pool of ``workers`` threads) decode the records the sequencer will need next
  (:class:`OrderedFetch`): only records whose turn is certain (the layer says which: its ``_upcoming``),
  so the work done ahead is the work the sequential code would do.  OpenCV's decode, LMDB reads and
  numpy's copies release the GIL, so threads scale without the pickling of processes;
* **the main thread** takes the next batch, sets the layer's state to that batch's snapshot (so the
  layer's attributes and ``stream_state()`` always describe the *consumed* stream, never the read-ahead)
  and moves the arrays to the layer's device: on CUDA the sequencer pins the host arrays and the copy is
  ``non_blocking``;
* anything that changes what the next batches are (``fill``, ``load_stream_state``, ``.train()`` /
  ``.eval()`` switching the transform's phase, :meth:`PrefetchingLayer.set_prefetch`) first stops the
  threads and drops the read-ahead (:meth:`PrefetchingLayer.reset_prefetch`); the next ``forward``
  starts them again from the consumed state;
* an exception on a background thread is re-raised by the ``forward`` of the batch it belongs to, as the
  same (typed) exception, after the layer's state was set to where the sequential code would have stopped;
* shutdown: the threads hold the layer only through a weak reference, stop when it is collected
  (``del net``), and an ``atexit`` hook stops the rest; they are daemon threads named
  ``caffe_compat-prefetch-<layer>`` and ``caffe_compat-decode-<layer>-<i>``.

Defaults: on, ``depth`` 3, ``workers`` :func:`default_workers` (half the CPUs, at least 1, at most 4);
environment ``CAFFE_COMPAT_PREFETCH=0`` turns it off for new layers, ``CAFFE_COMPAT_PREFETCH_WORKERS=N``
sets the pool size; :func:`configure` does the same from Python.
"""

from __future__ import annotations

import atexit
import collections
import os
import queue
import threading
import weakref
from concurrent.futures import Future

import numpy as np
import torch

__all__ = ["DEFAULT_DEPTH", "DecodePool", "OrderedFetch", "Prefetcher", "PrefetchingLayer", "configure",
           "default_workers", "prefetch_enabled"]

#: Caffe's PREFETCH_COUNT.
DEFAULT_DEPTH = 3

_settings = {"enabled": None, "workers": None}


def configure(enabled: bool | None = None, workers: int | None = None) -> None:
    """Process-wide defaults for layers built afterwards (None: back to the environment / built-in default)."""
    _settings["enabled"] = enabled
    _settings["workers"] = None if workers is None else max(0, int(workers))


def prefetch_enabled() -> bool:
    """``configure(enabled=...)``, else ``CAFFE_COMPAT_PREFETCH`` (``0``/``off``/``false`` disable), else on."""
    if _settings["enabled"] is not None:
        return bool(_settings["enabled"])
    return os.environ.get("CAFFE_COMPAT_PREFETCH", "1").strip().lower() not in ("0", "off", "false", "no")


def default_workers() -> int:
    """``configure(workers=...)``, else ``CAFFE_COMPAT_PREFETCH_WORKERS``, else half the CPUs (1 to 4): the
    other half is left to the net's compute."""
    if _settings["workers"] is not None:
        return _settings["workers"]
    value = os.environ.get("CAFFE_COMPAT_PREFETCH_WORKERS")
    if value is not None and value.strip().isdigit():
        return int(value)
    return max(1, min(4, (os.cpu_count() or 1) // 2))


# ---------------------------------------------------------------------------------------------- threads

_live: "weakref.WeakSet[Prefetcher]" = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:  # interpreter exit: stop what is still running before the daemon threads die
    for prefetcher in list(_live):
        prefetcher.close()


class DecodePool:
    """``workers`` daemon threads running submitted calls (0 workers: each call runs at ``submit``)."""

    def __init__(self, workers: int, name: str):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(workers)]
        for thread in self.threads:
            thread.start()

    def _work(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            future, fn, args = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # handed to whoever waits on the result
                    future.set_exception(exc)
            del job, future, fn, args

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        if not self.threads:
            future.set_running_or_notify_cancel()
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                future.set_exception(exc)
        else:
            self.jobs.put((future, fn, args))
        return future

    def close(self) -> None:
        for _ in self.threads:
            self.jobs.put(None)
        for thread in self.threads:
            if thread is not threading.current_thread():
                thread.join()


class OrderedFetch:
    """Results of ``fetch(key)`` in the sequencer's order, computed ahead on a :class:`DecodePool`.

    ``get(key, upcoming)``: ``upcoming(n)`` lists the keys of the next ``n`` calls (this one first) as far
    as they are certain (it may list fewer); those not yet submitted go to the pool, then this call's
    result is returned (its exception raised).  A key that is not the one predicted (never expected: a
    safety net) drops the read-ahead and is fetched here."""

    def __init__(self, fetch, pool: DecodePool | None, span: int):
        self.fetch, self.pool, self.span = fetch, pool, max(1, int(span))
        self.pending: collections.deque = collections.deque()  # (key, future), in call order

    def get(self, key, upcoming):
        if self.pool is None or not self.pool.threads:
            return self.fetch(key)
        if self.pending and not _same(self.pending[0][0], key):
            self.pending.clear()
        if len(self.pending) <= self.span // 2:
            keys = upcoming(self.span)
            for k in keys[len(self.pending):]:
                self.pending.append((k, self.pool.submit(self.fetch, k)))
        if not self.pending or not _same(self.pending[0][0], key):
            self.pending.clear()
            return self.fetch(key)
        return self.pending.popleft()[1].result()


def _same(a, b) -> bool:
    return a is b or a == b


_DONE = object()


class _Failure:
    """A sequencer exception and the cursor snapshot where the sequential code would have stopped."""

    def __init__(self, error: BaseException, snapshot):
        self.error, self.snapshot = error, snapshot


class Prefetcher:
    """A sequencer thread calling ``produce()`` (-> ``(arrays, snapshot)``) and queueing the results,
    ``depth`` ahead; :meth:`take` returns them in order.  ``produce`` raising :class:`StopIteration` ends
    the thread quietly (the layer is gone); another exception is queued as a :class:`_Failure` (``failed``
    gives its snapshot) and ends the thread."""

    def __init__(self, produce, failed, depth: int, name: str):
        self.queue: queue.Queue = queue.Queue(maxsize=max(1, int(depth)))
        self.stop = threading.Event()
        self._produce, self._failed = produce, failed
        self.thread = threading.Thread(target=self._run, name=f"caffe_compat-prefetch-{name}", daemon=True)
        _live.add(self)
        self.thread.start()

    def _put(self, item) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                try:
                    item = self._produce()
                except StopIteration:
                    break
                except BaseException as exc:  # re-raised in the main thread by take()
                    try:
                        snapshot = self._failed()
                    except BaseException:  # the state cannot be told: the layer keeps the consumed one
                        snapshot = None
                    self._put(_Failure(exc, snapshot))
                    return
                if not self._put(item):
                    break
                del item
        finally:
            self._produce = self._failed = None  # let go of the cursor and the layer's weak reference
        self._put(_DONE)

    def take(self):
        """The next ``(arrays, snapshot)``; a :class:`_Failure` when the sequencer failed."""
        while True:
            try:
                item = self.queue.get(timeout=0.1)
            except queue.Empty:
                if not self.thread.is_alive() and self.queue.empty():
                    raise RuntimeError("caffe_compat prefetch thread ended without a batch") from None
                continue
            if item is _DONE:
                raise RuntimeError("caffe_compat prefetch thread ended without a batch")
            return item

    def close(self) -> None:
        self.stop.set()
        while True:  # unblock a put() waiting on a full queue
            try:
                self.queue.get_nowait()
            except queue.Empty:
                break
        if self.thread is not threading.current_thread():
            self.thread.join()
        _live.discard(self)


# ---------------------------------------------------------------------------------------------- layer side

def wants_pinned(device: torch.device) -> bool:
    """Pin the host batches (for ``non_blocking`` copies) when the layer feeds a CUDA device."""
    return device.type == "cuda" and torch.cuda.is_available()


def _pin(arrays, pin: bool):
    tensors = [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
    return [t.pin_memory() for t in tensors] if pin else tensors


def _produce_weak(ref, cursor, phase, fetch, pin):
    layer = ref()
    if layer is None:
        raise StopIteration
    arrays = layer._produce(cursor, phase, fetch)
    return _pin(arrays, pin), layer._snapshot(cursor)


def _decode_weak(ref, key):
    layer = ref()
    if layer is None:
        raise StopIteration
    return layer._decode(key)


def _snapshot_weak(ref, cursor):
    layer = ref()
    return None if layer is None else layer._snapshot(cursor)


def _close(state: dict) -> None:
    for key in ("prefetcher", "pool"):
        part = state.pop(key, None)
        if part is not None:
            part.close()


class PrefetchingLayer:
    """Mixin of the prefetching data layers (see the module docstring).  A layer provides:

    * ``_produce(cursor, phase, fetch) -> list of numpy arrays``: the next batch's tops, advancing
      ``cursor`` (the layer itself when not prefetching); ``fetch(key, upcoming)`` is the decode call to use
      (:class:`OrderedFetch`'s ``get``, or a direct call);
    * ``_decode(key)``: the decoding that may run on the pool (no random draw, no cursor), and
      ``_upcoming(cursor, n)``: the keys of the next ``n`` decodes that are certain;
    * ``_cursor()``: a copy of the layer's stream state to produce from; ``_snapshot(cursor)``: that state
      after a batch (cheap, shared with nothing the cursor mutates later); ``_restore(snapshot)``: make it
      the layer's state;
    * ``_prefetch_depth()``: the queue depth its parameters ask for (None: the default).
    """

    prefetch_depth: int = 0
    prefetch_workers: int = 0
    #: False: nothing to decode (``_decode`` unused), the sequencer works alone (HDF5Data's rows are in memory)
    decodes: bool = True

    def _init_prefetch(self) -> None:
        depth = self._prefetch_depth()
        self.prefetch_depth = (DEFAULT_DEPTH if depth is None else int(depth)) if prefetch_enabled() else 0
        self.prefetch_workers = default_workers()
        self._threads: dict = {}
        self._threads_finalizer = weakref.finalize(self, _close, self._threads)

    def _prefetch_depth(self):
        return None

    def set_prefetch(self, depth: int | None = None, workers: int | None = None) -> None:
        """Change the queue depth (0: off) and/or the decode pool size of this layer; drops the read-ahead."""
        self.reset_prefetch()
        if depth is not None:
            self.prefetch_depth = max(0, int(depth))
        if workers is not None:
            self.prefetch_workers = max(0, int(workers))

    def reset_prefetch(self) -> None:
        """Stop the threads and drop the read-ahead; the layer's state is the consumed stream's already."""
        threads = getattr(self, "_threads", None)
        if threads:
            _close(threads)

    def train(self, mode: bool = True):
        if getattr(self, "_threads", None) and bool(mode) != self.training:
            self.reset_prefetch()  # batches made ahead used the other phase's transform
        return super().train(mode)

    def _fetch_inline(self, key, upcoming):
        return self._decode(key)

    def _next_arrays(self) -> list:
        """The next batch's tops as CPU tensors (pinned when prefetching for CUDA)."""
        if self.prefetch_depth <= 0:
            return [torch.from_numpy(np.ascontiguousarray(a))
                    for a in self._produce(self, self.mode_phase, self._fetch_inline)]
        threads = self._threads
        if "prefetcher" not in threads:
            self._start_prefetch(threads)
        item = threads["prefetcher"].take()
        if isinstance(item, _Failure):
            _close(threads)
            if item.snapshot is not None:
                self._restore(item.snapshot)
            raise item.error
        tensors, snapshot = item
        self._restore(snapshot)
        return tensors

    def _start_prefetch(self, threads: dict) -> None:
        # nothing below holds the layer itself: the threads must not keep it alive (module docstring)
        ref, cursor, phase = weakref.ref(self), self._cursor(), self.mode_phase
        pin = wants_pinned(self.device)
        pool = DecodePool(self.prefetch_workers if self.decodes else 0, f"caffe_compat-decode-{self.layer_name}")
        span = max(8, 2 * self.prefetch_workers, self._decode_span())
        fetch = OrderedFetch(lambda key: _decode_weak(ref, key), pool, span)
        threads["pool"] = pool
        threads["prefetcher"] = Prefetcher(lambda: _produce_weak(ref, cursor, phase, fetch.get, pin),
                                           lambda: _snapshot_weak(ref, cursor), self.prefetch_depth,
                                           self.layer_name)

    def _decode_span(self) -> int:
        return int(getattr(self, "batch_size", 1))

    def _to_device(self, tensors, dtype=None) -> tuple:
        """Each tensor on the layer's device and dtype (``non_blocking`` from pinned memory)."""
        dtype = self.dtype if dtype is None else dtype
        return tuple(t.to(device=self.device, dtype=dtype, non_blocking=t.is_pinned()) for t in tensors)
