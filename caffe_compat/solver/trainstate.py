"""The ``.trainstate`` file: what :func:`~caffe_compat.solver.train.train` saves beside each snapshot so that a
resumed run repeats the uninterrupted one, and its restoring (:func:`load_train_state`).

Resuming (``resume=<prefix>_iter_N.solverstate``, ``caffe-compat train --resume``)
-------------------------------------------------------------------------------
Caffe's ``.solverstate`` holds the iteration, ``current_step`` and the update history; the weights come
from its ``.caffemodel``.  That is all Caffe itself restores: its data layers start their databases from
the first record again and its RNG is reseeded, so a resumed Caffe run does not repeat the uninterrupted
one.  ``train`` writes, beside every snapshot it takes (after the ``.caffemodel`` and the ``.solverstate``,
atomically: temporary file + rename), ``<prefix>_iter_N.trainstate`` with the rest of the continuation,
and ``train(resume=...)`` restores it after Caffe's Restore, so that in deterministic mode (same seed,
same data, same devices) the resumed run gives the **same losses and weights as the uninterrupted run**:

* the global RNGs: torch CPU (and CUDA, when initialised), ``numpy.random`` and ``random`` — Dropout
  masks, miners, user transforms draw from them;
* every layer of the TRAIN and TEST nets that has ``stream_state()``/``load_stream_state()`` (Data,
  ImageData, HDF5Data, MemoryData's cursor, DummyData, the LabelShufflingLayer port: cursor, RandomState,
  shuffled order) and the state of each layer's own ``generator`` (a ``torch.Generator``, e.g. Dropout's);
* for ``data`` (and each ``test_data``) iterable: how many batches of the current pass were taken, the
  global RNG states just before the pass's ``iter()`` (a DataLoader draws its seeds there), and — when
  the iterable, or its ``batch_sampler``/``sampler``, has ``state_dict()``/``load_state_dict()`` (the
  samplers of :mod:`caffe_compat.data.samplers`, torchdata's StatefulDataLoader) — that state.  On
  resume a sampler whose state has an ``epoch``/``batch`` position continues at the next batch directly;
  another stateful iterable gets its ``load_state_dict``; a plain iterable (a list, a DataLoader over a
  fixed sampler) is replayed from the start of the pass, the taken batches dropped.  Pass the same
  (deterministic) ``data`` as the interrupted run; with DataLoader workers, per-worker random transforms
  are exact only with ``num_workers=0`` (the batches go to other workers after a resume);
* the average_loss window (the CSV's ``smoothed_loss`` continues as in the uninterrupted run, where
  Caffe's own resume starts a new window) and the fp16 GradScaler's state.

File format: UTF-8 JSON, ``{"format": "caffe-compat trainstate", "version": 1, "iter": N, "rng": ...,
"nets": {"train": {layer: state}, "test0": ...}, "data": {"train": ..., "test0": ...}, "loss_window": ...,
"grad_scaler": ...}``; arrays (RNG states, orders) are ``{"__ndarray__": base64, "dtype", "shape"}``
(``__tensor__`` for torch tensors), tuples ``{"__tuple__": [...]}`` — no pickle, nothing executed on
load.

Integrity: the writer appends ``"sha256": <hex>`` as the last key, the SHA-256 of the file's JSON without
it (the bytes up to that key, closed by ``}``); the file stays one JSON document.  :func:`read_train_state`
reads only a regular file within a bound (an eighth of :func:`~caffe_compat.io.safe_open.memory_budget`,
at least 64 MiB), verifies the digest before parsing (a truncated or edited file is a FormatError
"digest mismatch: the file was truncated or modified"), then checks the JSON against the schema before
anything is used: every key (missing and unknown ones named), every type and range (the RNG states'
sizes and words, arrays' dtypes — booleans, integers and floats only — and shapes against their data, the
cursors, the loss window, the GradScaler), nesting at most 64 levels; an error names the file and the
JSON path (``rng.python[1]: expected 625 integers``).  What only the net can judge (a cursor against a
layer's records, an order that must be a permutation of them, a label's records) is checked as the
state is applied, and a layer that refuses its state is restored to what it held.  A file **without a
digest** (written by a caffe-compat before the digest was recorded) is accepted with a warning: its
schema is still checked, its integrity cannot be.  Resuming from a ``.solverstate`` without its ``.trainstate`` (a real Caffe snapshot, or one taken
by ``Solver.snapshot()`` outside ``train``) restores what Caffe restores and logs a warning that the data
stream and the RNGs restart; a ``.trainstate`` of another iteration is ignored with a warning.  Under
torchrun rank 0 writes the file and every rank reads it (the ranks' data layers are seeded alike; their
RNG streams are rank 0's after the resume).
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import random
import re

import numpy as np
import torch

from caffe_compat.errors import CaffeCompatError, FormatError, NotRegularFileError
from caffe_compat.io.atomic import write_bytes_atomic
from caffe_compat.io.safe_open import memory_budget, read_regular_bytes
from caffe_compat.solver.solver import Solver
from caffe_compat.solver.trainstate_schema import _Bad, _decode, _shown, _validate, decode_state

__all__ = ["TRAINSTATE_FORMAT", "TRAINSTATE_VERSION", "TrainStateWriter", "decode_state", "encode_state",
           "load_train_state", "read_train_state", "rng_states", "serialize_train_state", "set_rng_states",
           "train_state_path"]

log = logging.getLogger("caffe_compat.solver.train")  # train()'s messages, one logger for the whole loop

TRAINSTATE_FORMAT = "caffe-compat trainstate"
TRAINSTATE_VERSION = 1


def encode_state(obj):
    """``obj`` as JSON values: dicts, lists, numbers, strings; arrays/tensors/tuples/bytes tagged."""
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: encode_state(v) for k, v in obj.items()}
        return {"__items__": [[encode_state(k), encode_state(v)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [encode_state(v) for v in obj]}
    if isinstance(obj, list):
        return [encode_state(v) for v in obj]
    if torch.is_tensor(obj):
        array = obj.detach().cpu().numpy()
        return {"__tensor__": base64.b64encode(np.ascontiguousarray(array).tobytes()).decode("ascii"),
                "dtype": array.dtype.str, "shape": list(array.shape)}
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise CaffeCompatError("train state: object arrays cannot be saved")
        return {"__ndarray__": base64.b64encode(np.ascontiguousarray(obj).tobytes()).decode("ascii"),
                "dtype": obj.dtype.str, "shape": list(obj.shape)}
    if isinstance(obj, (bytes, bytearray)):
        return {"__bytes__": base64.b64encode(bytes(obj)).decode("ascii")}
    if isinstance(obj, np.generic):
        return obj.item()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise CaffeCompatError(f"train state: cannot save a {type(obj).__name__} (state_dict() values must be "
                           f"numbers, strings, lists, dicts, tuples, arrays or tensors)")


def train_state_path(solverstate) -> str:
    """``<prefix>_iter_N.trainstate`` beside ``<prefix>_iter_N.solverstate``."""
    stem, ext = os.path.splitext(str(solverstate))
    return (stem if ext == ".solverstate" else str(solverstate)) + ".trainstate"


def rng_states() -> dict:
    """The global RNG states: torch CPU (and CUDA, when initialised), ``numpy.random``, ``random``."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(legacy=False),
             "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_states(state: dict) -> None:
    """Restore what :func:`rng_states` returned."""
    torch.set_rng_state(torch.as_tensor(state["torch"], dtype=torch.uint8))
    np.random.set_state(state["numpy"])
    python = state["python"]
    random.setstate((python[0], tuple(int(v) for v in python[1]), python[2]))
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([torch.as_tensor(c, dtype=torch.uint8) for c in cuda])
        else:
            log.warning("the train state holds %d CUDA RNG states, this machine has %d devices: CUDA RNGs not "
                        "restored", len(cuda), torch.cuda.device_count())




_DIGEST_KEY = "sha256"
_TRAILER = re.compile(rb',"sha256":"([0-9a-f]{64})"\}\s*\Z')


def serialize_train_state(state: dict) -> bytes:
    """The file's bytes: the JSON of ``encode_state(state)`` with ``"sha256": <hex digest of the JSON
    without it>`` appended as its last key."""
    body = json.dumps(encode_state(state), separators=(",", ":")).encode("ascii")
    if not (body.startswith(b"{") and body.endswith(b"}")) or body == b"{}":
        raise CaffeCompatError("train state: expected a non-empty object")
    return body[:-1] + b',"%s":"%s"}' % (_DIGEST_KEY.encode(), hashlib.sha256(body).hexdigest().encode())


def _read_limit() -> int:
    """The largest .trainstate read: an eighth of the memory budget (parsed JSON takes several times its
    text), at least 64 MiB."""
    return max(memory_budget() // 8, 64 << 20)


def read_train_state(path, iteration_bound: int = 2 ** 63 - 1) -> dict:
    """The checked content of the ``.trainstate`` file ``path``: a regular file within the read limit, its
    digest verified, its JSON checked against the schema (every key, type and range), arrays decoded.
    A FormatError (NotRegularFileError) names the file and the JSON path of the first problem.  A file
    without a digest (written before caffe-compat recorded one) is accepted with a warning."""
    try:
        data = read_regular_bytes(path, "the train state", _read_limit())
    except NotRegularFileError:
        raise
    except OSError as exc:
        raise FormatError(f"{path}: cannot read the train state ({exc.strerror or exc})") from None
    trailer = _TRAILER.search(data)
    if trailer is not None:
        recorded = trailer[1].decode("ascii")
        actual = hashlib.sha256(data[:trailer.start()] + b"}").hexdigest()
        if actual != recorded:
            raise FormatError(f"{path}: digest mismatch: the file was truncated or modified (the content's sha256 "
                              f"is {actual[:16]}..., the file records {recorded[:16]}...)")
    try:
        raw = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        reason = f"{type(exc).__name__}: {exc}"[:200]
        if trailer is None:
            raise FormatError(f"{path}: digest mismatch: the file was truncated or modified (no digest at its end, "
                              f"and it is not JSON: {reason})") from None
        raise FormatError(f"{path}: not a readable train state ({reason})") from None
    if not isinstance(raw, dict) or raw.get("format") != TRAINSTATE_FORMAT:
        raise FormatError(f"{path}: not a caffe-compat train state (no \"format\": \"{TRAINSTATE_FORMAT}\")")
    version = raw.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise FormatError(f"{path}: version: expected a positive integer, got {_shown(version)}")
    if version > TRAINSTATE_VERSION:
        raise FormatError(f"{path}: train state version {version} is newer than this caffe-compat's "
                          f"({TRAINSTATE_VERSION})")
    if trailer is None:
        if _DIGEST_KEY in raw:
            raise FormatError(f"{path}: digest mismatch: the file was truncated or modified (its sha256 is not "
                              f"where the writer puts it)")
        log.warning("resume: %s has no digest (written by an older caffe-compat): its content is "
                    "checked against the schema, its integrity cannot be", path)
    try:
        return _validate(_decode(raw, "", 0), iteration_bound)
    except _Bad as exc:
        raise FormatError(f"{path}: {exc}") from None
    except RecursionError:
        raise FormatError(f"{path}: nested too deeply") from None


def _unwrap(module):
    while "inner" in getattr(module, "_modules", {}):  # distributed.ShardTops
        module = module._modules["inner"]
    return module


def _net_states(net) -> dict:
    states = {}
    for key, module in net.layers.items():
        module, entry = _unwrap(module), {}
        if callable(getattr(module, "stream_state", None)):
            entry["stream"] = module.stream_state()
        generator = getattr(module, "generator", None)
        if isinstance(generator, torch.Generator):
            entry["generator"] = generator.get_state()
        if entry:
            states[key] = entry
    return states


_FOREIGN = (KeyError, TypeError, ValueError, IndexError, OverflowError, RuntimeError, AttributeError)


class _applying:
    """Context: a saved part that the receiving object refuses (its own typed error, or a foreign one from
    a user's ``load_state_dict``) becomes a typed error naming the file and the JSON path."""

    def __init__(self, path, where: str):
        self.path, self.where = path, where

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if exc is None:
            return False
        if isinstance(exc, CaffeCompatError):
            raise type(exc)(f"{self.path}: {self.where}: {exc}") from None
        if isinstance(exc, _FOREIGN):
            raise FormatError(f"{self.path}: {self.where}: does not fit ({type(exc).__name__}: {exc})"[:600]) from None
        return False


def _permutation(array, n: int) -> bool:
    array = np.asarray(array)
    return array.ndim == 1 and array.size == n and bool(np.array_equal(np.sort(array), np.arange(n)))


def _label_groups(module):
    stream = getattr(module, "_stream", None)
    lists = getattr(stream, "image_lists", None)
    if not isinstance(lists, list):
        return None
    return [np.sort(group) for group in lists], len(getattr(stream, "label_order", ()))


def _loaded_stream_problem(module, groups) -> str | None:
    """What is out of range in the stream state ``module`` now holds (our data layers' cursors, orders and
    permutations), or None."""
    count = getattr(module, "num_records", None)
    position = getattr(module, "position", None)
    if isinstance(count, int):
        if isinstance(position, (int, np.integer)) and not 0 <= position < count:
            return f"position {position} is not below the layer's {count} records"
        order = getattr(module, "order", None)
        if isinstance(order, np.ndarray) and not _permutation(order, count):
            return f"order is not a permutation of the layer's {count} records"
    files, file_order = getattr(module, "files", None), getattr(module, "file_order", None)
    if isinstance(file_order, np.ndarray) and isinstance(files, list):
        if not _permutation(file_order, len(files)):
            return f"file_order is not a permutation of the layer's {len(files)} files"
        if not 0 <= int(getattr(module, "file_index", 0)) < len(files):
            return f"file_index {module.file_index} is not below the layer's {len(files)} files"
    rows, arrays = getattr(module, "rows", None), getattr(module, "arrays", None)
    if isinstance(rows, np.ndarray) and arrays:
        if not _permutation(rows, len(arrays[0])):
            return f"rows is not a permutation of the file's {len(arrays[0])} rows"
        if isinstance(position, (int, np.integer)) and not 0 <= position < len(rows):
            return f"position {position} is not below the file's {len(rows)} rows"
    if groups is not None:
        stream = module._stream
        before, labels = groups
        if len(stream.image_lists) != len(before) or any(
                not np.array_equal(np.sort(group), want) for group, want in zip(stream.image_lists, before)):
            return "stream.image_lists do not hold each label's records"
        if not _permutation(stream.label_order, labels):
            return f"stream.label_order is not a permutation of the {labels} labels"
        if not 0 <= int(stream.label_index) < max(labels, 1):
            return f"stream.label_index {stream.label_index} is not below the {labels} labels"
    return None


def _load_net_states(net, states: dict, what: str, path="train state", name: str = "train") -> None:
    for key, entry in states.items():
        if key not in net.layers:
            log.warning("resume: the train state has layer '%s' of the %s net, which this net lacks", key, what)
            continue
        module = _unwrap(net.layers[key])
        where = f"nets.{name}.{key}"
        if "stream" in entry:
            if not callable(getattr(module, "load_stream_state", None)):
                log.warning("resume: layer '%s' of the %s net cannot take its saved data state", key, what)
            else:
                groups, previous = _label_groups(module), module.stream_state()
                try:
                    with _applying(path, f"{where}.stream (layer '{key}' of the {what} net)"):
                        module.load_stream_state(entry["stream"])
                    problem = _loaded_stream_problem(module, groups)
                    if problem:
                        raise FormatError(f"{path}: {where}.stream: {problem} (layer '{key}' of the {what} net)")
                except CaffeCompatError:
                    module.load_stream_state(previous)  # the layer is left as it was
                    raise
        generator = getattr(module, "generator", None)
        if "generator" in entry and isinstance(generator, torch.Generator):
            size, saved = int(generator.get_state().numel()), int(np.asarray(entry["generator"]).size)
            if saved != size:
                raise FormatError(f"{path}: {where}.generator: {saved} bytes, the layer's generator has a state of "
                                  f"{size}")
            with _applying(path, f"{where}.generator"):
                generator.set_state(torch.as_tensor(entry["generator"], dtype=torch.uint8))


def _train_state(solver: Solver, feeds: dict) -> dict:
    losses, smoothed, start = solver.loss_window()
    return {"format": TRAINSTATE_FORMAT, "version": TRAINSTATE_VERSION, "iter": int(solver.iter),
            "rng": rng_states(),
            "nets": {"train": _net_states(solver.net),
                     **{f"test{i}": _net_states(net) for i, net in enumerate(solver.test_nets)}},
            "data": {name: feed.state_dict() for name, feed in feeds.items()},
            "loss_window": {"losses": losses, "smoothed_loss": smoothed, "start": start},
            "grad_scaler": solver.grad_scaler.state_dict() if solver.grad_scaler is not None else None}


class TrainStateWriter:
    """Solver observer: writes ``<prefix>_iter_N.trainstate`` after each snapshot's ``.solverstate``
    (``feeds``: ``{"train": Feed, "test0": ...}``, the data iterables' positions)."""

    def __init__(self, feeds: dict):
        self.feeds = feeds

    def on_snapshot(self, solver: Solver, model_path, state_path) -> str:
        path = train_state_path(state_path)
        log.info("Snapshotting the data streams and RNG states to %s", path)
        write_bytes_atomic(path, serialize_train_state(_train_state(solver, self.feeds)))
        return path


def load_train_state(solver: Solver, resume, feeds: dict | None = None) -> bool:
    """Restore the ``.trainstate`` beside the solverstate ``resume`` into ``solver`` (after
    ``solver.restore(resume)``) and the ``feeds`` (``{"train": Feed, "test0": ...}``).  Returns False (with
    a warning) when there is none or it belongs to another iteration: the data and RNGs then restart."""
    feeds = feeds or {}
    path = train_state_path(resume)
    if not os.path.exists(path):
        log.warning("resume: %s has no %s beside it (a Caffe snapshot?): only Caffe's state is restored — the "
                    "data stream starts again from its beginning and the RNGs are not restored (as in Caffe), so "
                    "the run will not repeat an uninterrupted one", resume, os.path.basename(path))
        return False
    state = read_train_state(path)
    if state["iter"] != solver.iter:
        log.warning("resume: %s is of iteration %s, the solverstate of iteration %d: ignored (the data stream and "
                    "RNGs restart)", path, state["iter"], solver.iter)
        return False
    nets = state["nets"]
    _load_net_states(solver.net, nets.get("train", {}), "train", path, "train")
    for i, net in enumerate(solver.test_nets):
        _load_net_states(net, nets.get(f"test{i}", {}), f"test #{i}", path, f"test{i}")
    window = state["loss_window"]
    if window is not None:
        solver.resumed_loss_window = ([float(v) for v in window["losses"]], float(window["smoothed_loss"]),
                                      int(window["start"]))
    if state["grad_scaler"] is not None and solver.grad_scaler is not None:
        with _applying(path, "grad_scaler"):
            solver.grad_scaler.load_state_dict(state["grad_scaler"])
    saved = state["data"]
    for name, feed in feeds.items():
        if name in saved:
            with _applying(path, f"data.{name}"):
                feed.load_state_dict(saved[name], name)
        else:
            log.warning("resume: the snapshotted run had no %s data iterable: this one starts from its beginning",
                        name)
    for name in saved:
        if name not in feeds and saved[name]["started"]:
            log.warning("resume: the snapshotted run read %s data from an iterable that is not given now", name)
    with _applying(path, "rng"):
        set_rng_states(state["rng"])  # last: restarting the iterables above drew from them
    log.info("resume: data streams and RNG states restored from %s", path)
    return True

