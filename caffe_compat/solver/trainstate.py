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
load.  Resuming from a ``.solverstate`` without its ``.trainstate`` (a real Caffe snapshot, or one taken
by ``Solver.snapshot()`` outside ``train``) restores what Caffe restores and logs a warning that the data
stream and the RNGs restart; a ``.trainstate`` of another iteration is ignored with a warning.  Under
torchrun rank 0 writes the file and every rank reads it (the ranks' data layers are seeded alike; their
RNG streams are rank 0's after the resume).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import random

import numpy as np
import torch

from caffe_compat.errors import CaffeCompatError, FormatError
from caffe_compat.io.atomic import write_text_atomic
from caffe_compat.solver.solver import Solver

__all__ = ["TRAINSTATE_FORMAT", "TRAINSTATE_VERSION", "TrainStateWriter", "decode_state", "encode_state",
           "load_train_state", "rng_states", "set_rng_states", "train_state_path"]

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


def decode_state(obj):
    """The inverse of :func:`encode_state` (on the parsed JSON); nothing executed, no pickle."""
    if isinstance(obj, list):
        return [decode_state(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__items__" in obj:
        return {decode_state(k): decode_state(v) for k, v in obj["__items__"]}
    if "__tuple__" in obj:
        return tuple(decode_state(v) for v in obj["__tuple__"])
    if "__bytes__" in obj:
        return base64.b64decode(obj["__bytes__"])
    for tag in ("__ndarray__", "__tensor__"):
        if tag in obj:
            dtype = np.dtype(obj["dtype"])
            if dtype.hasobject:
                raise FormatError("train state: object arrays are not read")
            array = np.frombuffer(base64.b64decode(obj[tag]), dtype=dtype).reshape(obj["shape"]).copy()
            return torch.from_numpy(array) if tag == "__tensor__" else array
    return {k: decode_state(v) for k, v in obj.items()}


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


def _load_net_states(net, states: dict, what: str) -> None:
    for key, entry in states.items():
        if key not in net.layers:
            log.warning("resume: the train state has layer '%s' of the %s net, which this net lacks", key, what)
            continue
        module = _unwrap(net.layers[key])
        if "stream" in entry:
            if not callable(getattr(module, "load_stream_state", None)):
                log.warning("resume: layer '%s' of the %s net cannot take its saved data state", key, what)
            else:
                module.load_stream_state(entry["stream"])
        generator = getattr(module, "generator", None)
        if "generator" in entry and isinstance(generator, torch.Generator):
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
        write_text_atomic(path, json.dumps(encode_state(_train_state(solver, self.feeds)), separators=(",", ":")))
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
    try:
        with open(path, encoding="utf-8") as fh:
            state = decode_state(json.load(fh))
    except (OSError, ValueError) as exc:
        raise FormatError(f"{path}: not a readable train state ({exc})") from None
    if not isinstance(state, dict) or state.get("format") != TRAINSTATE_FORMAT:
        raise FormatError(f"{path}: not a caffe-compat train state")
    if int(state.get("version", 0)) > TRAINSTATE_VERSION:
        raise FormatError(f"{path}: train state version {state.get('version')} is newer than this caffe-compat's "
                          f"({TRAINSTATE_VERSION})")
    if int(state["iter"]) != solver.iter:
        log.warning("resume: %s is of iteration %s, the solverstate of iteration %d: ignored (the data stream and "
                    "RNGs restart)", path, state["iter"], solver.iter)
        return False
    nets = state.get("nets", {})
    _load_net_states(solver.net, nets.get("train", {}), "train")
    for i, net in enumerate(solver.test_nets):
        _load_net_states(net, nets.get(f"test{i}", {}), f"test #{i}")
    window = state.get("loss_window")
    if window is not None:
        solver.resumed_loss_window = ([float(v) for v in window["losses"]], float(window["smoothed_loss"]),
                                      int(window["start"]))
    if state.get("grad_scaler") is not None and solver.grad_scaler is not None:
        solver.grad_scaler.load_state_dict(state["grad_scaler"])
    saved = state.get("data", {})
    for name, feed in feeds.items():
        if name in saved:
            feed.load_state_dict(saved[name], name)
        else:
            log.warning("resume: the snapshotted run had no %s data iterable: this one starts from its beginning",
                        name)
    for name in saved:
        if name not in feeds and saved[name].get("started"):
            log.warning("resume: the snapshotted run read %s data from an iterable that is not given now", name)
    set_rng_states(state["rng"])  # last: restarting the iterables above drew from them
    log.info("resume: data streams and RNG states restored from %s", path)
    return True

