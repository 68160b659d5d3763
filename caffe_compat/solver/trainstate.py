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


_ARRAY_KINDS = "biuf"  # bool, signed and unsigned integers, floats: what RNG states and orders hold
_MAX_DEPTH = 64  # nesting of the JSON values (our own files nest a handful of levels)
_MAX_DIMS = 32


class _Bad(Exception):
    """A schema violation: ``where`` (a JSON path) and what is wrong; :func:`read_train_state` adds the file."""

    def __init__(self, where: str, what: str):
        super().__init__(f"{where}: {what}" if where else what)


def _join(where: str, key) -> str:
    return f"{where}.{key}" if where else str(key)


def _decode(obj, where: str, depth: int):
    if depth > _MAX_DEPTH:
        raise _Bad(where, f"nested deeper than {_MAX_DEPTH} levels")
    if isinstance(obj, list):
        return [_decode(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(obj)]
    if not isinstance(obj, dict):
        return obj
    if "__items__" in obj:
        items = _only(obj, "__items__", where)
        if not isinstance(items, list) or not all(isinstance(p, list) and len(p) == 2 for p in items):
            raise _Bad(where, "'__items__' must be a list of [key, value] pairs")
        out = {}
        for i, (k, v) in enumerate(items):
            key = _decode(k, f"{where}.__items__[{i}][0]", depth + 1)
            try:
                hash(key)
            except TypeError:
                raise _Bad(f"{where}.__items__[{i}][0]", "a key must be a number, a string or a tuple") from None
            out[key] = _decode(v, f"{where}.__items__[{i}][1]", depth + 1)
        return out
    if "__tuple__" in obj:
        values = _only(obj, "__tuple__", where)
        if not isinstance(values, list):
            raise _Bad(where, "'__tuple__' must be a list")
        return tuple(_decode(v, f"{where}.__tuple__[{i}]", depth + 1) for i, v in enumerate(values))
    if "__bytes__" in obj:
        return _base64(_only(obj, "__bytes__", where), _join(where, "__bytes__"))
    for tag in ("__ndarray__", "__tensor__"):
        if tag in obj:
            array = _array(obj, tag, where)
            return torch.from_numpy(array) if tag == "__tensor__" else array
    for key in obj:
        if key.startswith("__"):
            raise _Bad(_join(where, key), "unknown tag")
    return {k: _decode(v, _join(where, k), depth + 1) for k, v in obj.items()}


def _only(obj: dict, tag: str, where: str):
    if len(obj) != 1:
        raise _Bad(where, f"a '{tag}' value has other keys: {sorted(k for k in obj if k != tag)}")
    return obj[tag]


def _base64(text, where: str) -> bytes:
    if not isinstance(text, str):
        raise _Bad(where, f"expected base64 text, got {_kind(text)}")
    try:
        return base64.b64decode(text, validate=True)
    except ValueError as exc:  # binascii.Error
        raise _Bad(where, f"not base64 ({exc})") from None


def _array(obj: dict, tag: str, where: str) -> np.ndarray:
    extra = set(obj) - {tag, "dtype", "shape"}
    missing = {"dtype", "shape"} - set(obj)
    if extra or missing:
        raise _Bad(where, f"an array needs exactly '{tag}', 'dtype' and 'shape'"
                   + (f"; unknown {sorted(extra)}" if extra else "") + (f"; missing {sorted(missing)}" if missing else ""))
    try:
        dtype = np.dtype(obj["dtype"]) if isinstance(obj["dtype"], str) else None
    except (TypeError, ValueError):
        dtype = None
    if dtype is None or dtype.kind not in _ARRAY_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise _Bad(_join(where, "dtype"), f"{obj['dtype']!r} is not a boolean, integer or float dtype")
    shape = obj["shape"]
    if (not isinstance(shape, list) or len(shape) > _MAX_DIMS
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise _Bad(_join(where, "shape"), f"expected a list of at most {_MAX_DIMS} non-negative integers, got "
                   f"{str(shape)[:80]}")
    raw = _base64(obj[tag], _join(where, tag))
    count = 1
    for d in shape:
        count *= d
    if count * dtype.itemsize != len(raw):
        raise _Bad(where, f"shape {shape} of {dtype} needs {count * dtype.itemsize} bytes, the data holds {len(raw)}")
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()


def _kind(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, np.ndarray):
        return f"an array of {value.dtype} {list(value.shape)}"
    if torch.is_tensor(value):
        return f"a tensor of {value.dtype} {list(value.shape)}"
    return {int: "an integer", float: "a number", str: "a string", list: "a list", dict: "an object",
            tuple: "a tuple", bytes: "bytes"}.get(type(value), type(value).__name__)


def decode_state(obj, where: str = ""):
    """The inverse of :func:`encode_state` (on the parsed JSON); nothing executed, no pickle.  Tagged
    values are checked (dtype, shape against the data's size, base64, nesting): a malformed one is a
    FormatError naming its JSON path."""
    try:
        return _decode(obj, where, 0)
    except _Bad as exc:
        raise FormatError(f"train state: {exc}") from None


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


# -- the schema: every key, type and range checked before anything is used -----------------------------

_UINT32 = 1 << 32


def _keys(obj, where: str, required: tuple, optional: tuple = ()) -> dict:
    if not isinstance(obj, dict):
        raise _Bad(where, f"expected an object, got {_kind(obj)}")
    missing = [k for k in required if k not in obj]
    if missing:
        raise _Bad(where, f"missing key{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))}")
    unknown = [k for k in obj if k not in required and k not in optional]
    if unknown:
        raise _Bad(where, f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(repr(str(k))[:80] for k in unknown[:5])}")
    return obj


def _int(value, where: str, lo: int = 0, hi: int = 2 ** 63 - 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise _Bad(where, f"expected an integer in [{lo}, {hi}], got {_shown(value)}")
    return value


def _number(value, where: str, positive: bool = False) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or (positive and not value > 0):
        raise _Bad(where, f"expected a{' positive' if positive else ''} number, got {_shown(value)}")
    return float(value)


def _shown(value) -> str:
    return repr(value)[:60] if isinstance(value, (int, float, str)) and not isinstance(value, bool) else _kind(value)


def _vector(value, where: str, kinds: str = "iub", size: int | None = None) -> np.ndarray:
    array = value.numpy() if torch.is_tensor(value) else value
    if not isinstance(array, np.ndarray) or array.ndim != 1 or array.dtype.kind not in kinds:
        raise _Bad(where, f"expected a 1-D integer array, got {_kind(value)}")
    if size is not None and array.size != size:
        raise _Bad(where, f"expected {size} values, got {array.size}")
    return array


def _bytes_state(value, where: str, size: int | None = None) -> None:
    array = _vector(value, where, "u", size)
    if array.dtype != np.uint8:
        raise _Bad(where, f"expected uint8 values, got {array.dtype}")


def _numpy_rng(value, where: str) -> None:
    """``RandomState.get_state(legacy=False)``: MT19937's 624 32-bit words, its position, the cached gauss."""
    _keys(value, where, ("bit_generator", "state", "has_gauss", "gauss"))
    if value["bit_generator"] != "MT19937":
        raise _Bad(_join(where, "bit_generator"), f"expected 'MT19937', got {_shown(value['bit_generator'])}")
    state = _keys(value["state"], _join(where, "state"), ("key", "pos"))
    key = _vector(state["key"], _join(where, "state.key"), "iu", 624)
    if key.size and (int(key.min()) < 0 or int(key.max()) >= _UINT32):
        raise _Bad(_join(where, "state.key"), "values must be 32-bit unsigned integers")
    _int(state["pos"], _join(where, "state.pos"), 0, 624)
    _int(value["has_gauss"], _join(where, "has_gauss"), 0, 1)
    _number(value["gauss"], _join(where, "gauss"))


def _python_rng(value, where: str) -> None:
    """``random.getstate()``: (3, 625 words of which the last is the position, gauss or None)."""
    if not isinstance(value, (tuple, list)) or len(value) != 3:
        raise _Bad(where, f"expected (version, words, gauss), got {_kind(value)}")
    _int(value[0], f"{where}[0]", 3, 3)
    words = value[1]
    if not isinstance(words, (tuple, list)) or len(words) != 625:
        raise _Bad(f"{where}[1]", f"expected 625 integers, got {_kind(words)}"
                   + (f" of {len(words)}" if isinstance(words, (tuple, list)) else ""))
    for i, word in enumerate(words):
        _int(word, f"{where}[1][{i}]", 0, _UINT32 - 1 if i < 624 else 624)
    if value[2] is not None:
        _number(value[2], f"{where}[2]")


_TORCH_STATE_SIZE = int(torch.get_rng_state().numel())


def _rng(value, where: str) -> None:
    _keys(value, where, ("torch", "numpy", "python"), ("cuda",))
    _bytes_state(value["torch"], _join(where, "torch"), _TORCH_STATE_SIZE)
    _numpy_rng(value["numpy"], _join(where, "numpy"))
    _python_rng(value["python"], _join(where, "python"))
    if "cuda" in value:
        cuda = value["cuda"]
        if not isinstance(cuda, list) or len(cuda) > 1024:
            raise _Bad(_join(where, "cuda"), f"expected a list of device states, got {_kind(cuda)}")
        for i, state in enumerate(cuda):
            _bytes_state(state, f"{where}.cuda[{i}]")


def _label_stream(value, where: str) -> None:
    _keys(value, where, ("rng", "image_lists", "label_order", "label_index", "image_index"))
    _numpy_rng(value["rng"], _join(where, "rng"))
    _vector(value["image_lists"], _join(where, "image_lists"), "iu")
    _vector(value["label_order"], _join(where, "label_order"), "iu")
    _int(value["label_index"], _join(where, "label_index"))
    _int(value["image_index"], _join(where, "image_index"))


# what our data layers' stream_state() holds (caffe_compat.layers): key -> check
_STREAM_KEYS = {
    "position": _int, "file_index": _int, "rng": _numpy_rng, "stream": _label_stream,
    "order": lambda v, w: _vector(v, w, "iu"), "file_order": lambda v, w: _vector(v, w, "iu"),
    "rows": lambda v, w: _vector(v, w, "iu"), "generator": lambda v, w: _bytes_state(v, w),
}


def _nets(value, where: str) -> None:
    if not isinstance(value, dict):
        raise _Bad(where, f"expected an object, got {_kind(value)}")
    for name, layers in value.items():
        net_where = _join(where, name)
        if not isinstance(name, str) or not (name == "train" or (name.startswith("test") and name[4:].isdigit())):
            raise _Bad(net_where, "unknown net (expected 'train' or 'test<N>')")
        if not isinstance(layers, dict):
            raise _Bad(net_where, f"expected an object of layers, got {_kind(layers)}")
        for layer, entry in layers.items():
            layer_where = _join(net_where, layer)
            if not isinstance(layer, str):
                raise _Bad(layer_where, "a layer name must be a string")
            _keys(entry, layer_where, (), ("stream", "generator"))
            if "generator" in entry:
                _bytes_state(entry["generator"], _join(layer_where, "generator"))
            if "stream" in entry:
                stream = entry["stream"]
                _keys(stream, _join(layer_where, "stream"), (), tuple(_STREAM_KEYS))
                for key, item in stream.items():
                    _STREAM_KEYS[key](item, _join(layer_where, f"stream.{key}"))


def _feed(value, where: str) -> None:
    _keys(value, where, ("kind", "consumed", "pass_state", "pass_rng", "started"), ("data_state",))
    if value["kind"] not in (None, "data", "sampler"):
        raise _Bad(_join(where, "kind"), f"expected null, 'data' or 'sampler', got {_shown(value['kind'])}")
    _int(value["consumed"], _join(where, "consumed"), 0, 2 ** 53)
    if not isinstance(value["started"], bool):
        raise _Bad(_join(where, "started"), f"expected true or false, got {_shown(value['started'])}")
    if value["pass_rng"] is not None:
        _rng(value["pass_rng"], _join(where, "pass_rng"))
    pass_state = value["pass_state"]
    if pass_state is not None:
        if not isinstance(pass_state, dict):
            raise _Bad(_join(where, "pass_state"), f"expected null or an object, got {_kind(pass_state)}")
        for key in ("epoch", "batch"):  # our samplers' positions (caffe_compat.data.samplers)
            if key in pass_state:
                _int(pass_state[key], _join(where, f"pass_state.{key}"), 0, 2 ** 53)


def _validate(state, iteration_bound: int = 2 ** 63 - 1) -> dict:
    """Check ``state`` (decoded) against the schema of :func:`_train_state`; ``_Bad`` names the JSON path."""
    _keys(state, "", ("format", "version", "iter", "rng", "nets", "data", "loss_window", "grad_scaler"), ("sha256",))
    iteration = _int(state["iter"], "iter", 0, iteration_bound)
    _rng(state["rng"], "rng")
    _nets(state["nets"], "nets")
    data = state["data"]
    if not isinstance(data, dict):
        raise _Bad("data", f"expected an object, got {_kind(data)}")
    for name, feed in data.items():
        if not isinstance(name, str):
            raise _Bad("data", "feed names must be strings")
        _feed(feed, _join("data", name))
    window = state["loss_window"]
    if window is not None:
        _keys(window, "loss_window", ("losses", "smoothed_loss", "start"))
        losses = window["losses"]
        if not isinstance(losses, list) or len(losses) > 1 << 24:
            raise _Bad("loss_window.losses", f"expected a list of numbers, got {_kind(losses)}")
        for i, loss in enumerate(losses):
            _number(loss, f"loss_window.losses[{i}]")
        _number(window["smoothed_loss"], "loss_window.smoothed_loss")
        _int(window["start"], "loss_window.start", 0, iteration)
    scaler = state["grad_scaler"]
    if scaler is not None:
        _keys(scaler, "grad_scaler", ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"))
        for key in ("scale", "growth_factor", "backoff_factor"):
            _number(scaler[key], f"grad_scaler.{key}", positive=True)
        _int(scaler["growth_interval"], "grad_scaler.growth_interval", 1)
        _int(scaler["_growth_tracker"], "grad_scaler._growth_tracker")
    return state


# -- the file: JSON with a SHA-256 digest of its content at its end ---------------------------------------

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

