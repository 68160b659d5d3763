"""The ``.trainstate`` JSON's schema: decoding the tagged values (arrays, tensors, tuples, bytes) and
checking every key, type and range before anything is used (a hostile file cannot make resume crash with
a KeyError/TypeError/ValueError or allocate without bound).  A violation is a :class:`SchemaError` naming
the JSON path; :func:`caffe_compat.solver.trainstate.read_train_state` adds the file."""

from __future__ import annotations

import base64

import numpy as np
import torch

from caffe_compat.errors import FormatError

_UINT32 = 1 << 32
_ARRAY_KINDS = "biuf"  # bool, signed and unsigned integers, floats: what RNG states and orders hold
_MAX_DEPTH = 64  # nesting of the JSON values (our own files nest a handful of levels)
_MAX_DIMS = 32


class SchemaError(Exception):
    """A schema violation: ``where`` (a JSON path) and what is wrong; :func:`read_train_state` adds the file."""

    def __init__(self, where: str, what: str):
        super().__init__(f"{where}: {what}" if where else what)


_Bad = SchemaError  # the short name the checks use


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
