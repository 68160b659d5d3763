"""The ``.trainstate`` file's integrity and schema: a SHA-256 digest of its content, verified on load (a
truncated or edited file is a FormatError naming the file), and a schema checked before anything is used,
so that a hostile file ends a resume with a typed error naming the JSON path, never a KeyError, a
TypeError, an IndexError, a silently wrong stream or an unbounded allocation.  A file without a digest
(written before the digest was recorded) is accepted with a warning."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import re

import numpy as np
import pytest

from caffe_compat.errors import CaffeCompatError, FormatError
from caffe_compat.solver import Solver
from caffe_compat.solver.trainstate import load_train_state
from tests.solver.test_train_resume import _run, _solver_file

TRAILER = re.compile(rb',"sha256":"([0-9a-f]{64})"\}\s*\Z')


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    """A 3-iteration run of the LabelShufflingLayer net: (solver file, solverstate, trainstate bytes)."""
    tmp = tmp_path_factory.mktemp("trainstate")
    part = _solver_file(tmp, "label_shuffling", "part")
    _run(part, iters=3)
    state = tmp / "part" / "snap_iter_3.solverstate"
    return part, state, state.with_suffix(".trainstate").read_bytes()


@pytest.fixture(scope="module")
def solver(snapshot):
    part, state, _ = snapshot
    solver = Solver(part, device="cpu")
    solver.restore(str(state))
    return solver


def _raw(data: bytes) -> dict:
    return json.loads(data)


def _with_digest(raw: dict) -> bytes:
    """``raw`` written as the writer does: compact JSON, then its SHA-256 as the last key."""
    raw = {k: v for k, v in raw.items() if k != "sha256"}
    body = json.dumps(raw, separators=(",", ":")).encode()
    return body[:-1] + b',"sha256":"' + hashlib.sha256(body).hexdigest().encode() + b'"}'


def _resume(solver, snapshot, tmp_path, data: bytes):
    _, state, _ = snapshot
    target = tmp_path / "snap_iter_3.solverstate"
    target.write_bytes(state.read_bytes())
    (tmp_path / "snap_iter_3.trainstate").write_bytes(data)
    return load_train_state(solver, str(target))


def test_the_written_file_carries_the_digest_of_its_content(snapshot):
    data = snapshot[2]
    trailer = TRAILER.search(data)
    assert trailer is not None
    assert hashlib.sha256(data[:trailer.start()] + b"}").hexdigest() == trailer[1].decode()
    assert _raw(data)["format"] == "caffe-compat trainstate"  # still one JSON document


def test_a_valid_file_resumes(solver, snapshot, tmp_path):
    assert _resume(solver, snapshot, tmp_path, snapshot[2]) is True


def _flip_in_array(data: bytes) -> bytes:
    """Change one base64 character of the torch RNG state: still valid JSON, valid base64, right size."""
    raw = _raw(data)
    text = raw["rng"]["torch"]["__tensor__"]
    i = len(text) // 2
    raw["rng"]["torch"]["__tensor__"] = text[:i] + ("A" if text[i] != "A" else "B") + text[i + 1:]
    body = json.dumps({k: v for k, v in raw.items() if k != "sha256"}, separators=(",", ":")).encode()
    return body[:-1] + data[TRAILER.search(data).start():]  # the old digest


@pytest.mark.parametrize("damage", ["truncated", "edited_value", "one_byte", "digest_edited", "digest_moved"])
def test_a_truncated_or_modified_file_is_a_digest_mismatch(solver, snapshot, tmp_path, damage):
    data = snapshot[2]
    if damage == "truncated":
        data = data[: len(data) * 2 // 3]
    elif damage == "edited_value":  # loads as a different RNG state without the digest
        data = _flip_in_array(data)
    elif damage == "one_byte":
        i = data.index(b'"iter":3') + 7
        data = data[:i] + b"4" + data[i + 1:]
    elif damage == "digest_edited":
        i = TRAILER.search(data).start(1)
        data = data[:i] + (b"0" if data[i:i + 1] != b"0" else b"1") + data[i + 1:]
    else:  # the sha256 key present, but not where the writer puts it
        raw = _raw(data)
        data = json.dumps({"sha256": raw.pop("sha256"), **raw}).encode()
    with pytest.raises(FormatError, match=r"snap_iter_3\.trainstate: digest mismatch: the file was truncated or "
                                          r"modified"):
        _resume(solver, snapshot, tmp_path, data)


def test_a_file_without_a_digest_is_accepted_with_a_warning(solver, snapshot, tmp_path, caplog):
    raw = _raw(snapshot[2])
    del raw["sha256"]
    with caplog.at_level(logging.WARNING, logger="caffe_compat.solver.train"):
        assert _resume(solver, snapshot, tmp_path, json.dumps(raw).encode()) is True
    assert any("has no digest" in r.getMessage() for r in caplog.records)
    # but it is still checked against the schema
    raw["rng"]["python"] = {"__tuple__": [3, {"__tuple__": [1, 2]}, None]}
    with pytest.raises(FormatError, match=r"rng\.python\[1\]: expected 625 integers"):
        _resume(solver, snapshot, tmp_path, json.dumps(raw).encode())


def _b64(array: np.ndarray) -> str:
    return base64.b64encode(array.tobytes()).decode()


def _edit(path: str, value):
    """An edit of the raw JSON at a dotted ``path`` (``None`` value with ``del:`` prefix deletes)."""
    def apply(raw):
        keys = path.removeprefix("del:").split(".")
        node = raw
        for key in keys[:-1]:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if path.startswith("del:"):
            del node[keys[-1]]
        else:
            node[keys[-1]] = value
    return apply


def _layer_stream(raw) -> tuple[str, dict]:
    (name, entry), = raw["nets"]["train"].items()
    return name, entry["stream"]["stream"]


HOSTILE = {
    # key: (edit of the raw JSON, the JSON path the error names, what old code raised)
    "missing_rng": (_edit("del:rng", None), r"missing key 'rng'"),
    "unknown_key": (_edit("surprise", 1), r"unknown key 'surprise'"),
    "iter_string": (_edit("iter", "3"), r"iter: expected an integer"),
    "iter_negative": (_edit("iter", -1), r"iter: expected an integer in \[0, "),
    "version_string": (_edit("version", "one"), r"version: expected a positive integer"),
    "nets_list": (_edit("nets", [1, 2]), r"nets: expected an object"),
    "python_rng_short": (_edit("rng.python", {"__tuple__": [3, {"__tuple__": [0] * 10}, None]}),
                         r"rng\.python\[1\]: expected 625 integers"),
    "python_rng_word_huge": (lambda raw: raw["rng"]["python"]["__tuple__"][1]["__tuple__"].__setitem__(0, 2 ** 40),
                             r"rng\.python\[1\]\[0\]: expected an integer in \[0, 4294967295\]"),
    "numpy_rng_short_key": (_edit("rng.numpy.state.key", {"__ndarray__": _b64(np.zeros(3, "<u4")), "dtype": "<u4",
                                                           "shape": [3]}), r"rng\.numpy\.state\.key: expected 624 values"),
    "numpy_rng_pos": (_edit("rng.numpy.state.pos", 10 ** 6), r"rng\.numpy\.state\.pos: expected an integer in \[0, 624\]"),
    "torch_rng_short": (_edit("rng.torch", {"__tensor__": _b64(np.zeros(7, np.uint8)), "dtype": "|u1", "shape": [7]}),
                        r"rng\.torch: expected 5056 values"),
    "object_dtype": (_edit("rng.torch.dtype", "O"), r"rng\.torch\.dtype: 'O' is not a boolean, integer or float"),
    "garbage_dtype": (_edit("rng.torch.dtype", "not a dtype"), r"rng\.torch\.dtype"),
    "shape_negative": (_edit("rng.torch.shape", [-1]), r"rng\.torch\.shape: expected a list of at most 32"),
    "shape_huge": (_edit("rng.torch.shape", [2 ** 40, 2 ** 40]), r"rng\.torch: shape .* needs \d+ bytes, the data holds 5056"),
    "not_base64": (_edit("rng.torch.__tensor__", "!!!!"), r"rng\.torch\.__tensor__: not base64"),
    "unknown_tag": (_edit("nets.train", {"__pickle__": "x"}), r"nets\.train\.__pickle__: unknown tag"),
    "items_malformed": (_edit("data", {"__items__": [[1]]}), r"data: '__items__' must be a list of \[key, value\] pairs"),
    "deep_nesting": (_edit("data", json.loads("[" * 500 + "]" * 500)), r"nested deeper than 64 levels"),
    "loss_window_start": (_edit("loss_window.start", 99), r"loss_window\.start: expected an integer in \[0, 3\]"),
    "loss_window_losses": (_edit("loss_window.losses", ["x"]), r"loss_window\.losses\[0\]: expected a number"),
    "grad_scaler_keys": (_edit("grad_scaler", {"scale": 1.0}), r"grad_scaler: missing keys"),
    "layer_unknown_part": (lambda raw: raw["nets"]["train"][next(iter(raw["nets"]["train"]))].update(x=1),
                           r"nets\.train\.\w+: unknown key 'x'"),
    "stream_label_index": (lambda raw: _layer_stream(raw)[1].update(label_index=10 ** 9),
                           r"nets\.train\.data\.stream: stream\.label_index 1000000000 is not below the 4 labels"),
    "stream_label_order": (lambda raw: _layer_stream(raw)[1].update(
        label_order={"__ndarray__": _b64(np.array([0, 0, 0, 0], "<i8")), "dtype": "<i8", "shape": [4]}),
        r"stream\.label_order is not a permutation"),
    "stream_image_lists": (lambda raw: _layer_stream(raw)[1].update(
        image_lists={"__ndarray__": _b64(np.full(24, 10 ** 6, "<i8")), "dtype": "<i8", "shape": [24]}),
        r"stream\.image_lists do not hold each label's records"),
    "stream_image_lists_size": (lambda raw: _layer_stream(raw)[1].update(
        image_lists={"__ndarray__": _b64(np.zeros(2, "<i8")), "dtype": "<i8", "shape": [2]}),
        r"nets\.train\.data\.stream \(layer 'data' of the train net\): label-shuffling state of 2 images"),
    "stream_missing_key": (lambda raw: _layer_stream(raw)[1].pop("rng"),
                           r"nets\.train\.data\.stream\.stream: missing key 'rng'"),
    "data_feed_kind": (_edit("data", {"train": {"kind": 5, "consumed": 0, "pass_state": None, "pass_rng": None,
                                                "started": True}}), r"data\.train\.kind: expected null"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_file_is_a_typed_error_naming_the_json_path(solver, snapshot, tmp_path, case):
    edit, message = HOSTILE[case]
    raw = _raw(snapshot[2])
    edit(raw)
    with pytest.raises(CaffeCompatError, match=message) as info:  # FormatError, DataError
        _resume(solver, snapshot, tmp_path, _with_digest(raw))
    assert "snap_iter_3.trainstate" in str(info.value)


def test_the_read_is_bounded_and_only_regular_files_are_read(solver, snapshot, tmp_path, monkeypatch):
    import os

    _, state, _ = snapshot
    target = tmp_path / "snap_iter_3.solverstate"
    target.write_bytes(state.read_bytes())
    os.mkfifo(tmp_path / "snap_iter_3.trainstate")
    with pytest.raises(CaffeCompatError, match="FIFO"):
        load_train_state(solver, str(target))
    os.unlink(tmp_path / "snap_iter_3.trainstate")
    monkeypatch.setenv("CAFFE_COMPAT_MEMORY_BUDGET", "8M")  # the limit is 64 MiB at least
    (tmp_path / "snap_iter_3.trainstate").write_bytes(b" " * (65 << 20))
    with pytest.raises(CaffeCompatError, match="more than the 67108864 this format allows"):
        load_train_state(solver, str(target))


def test_cli_resume_from_a_modified_trainstate_exits_2_without_a_traceback(snapshot, tmp_path, capsys):
    from caffe_compat.cli import main

    part, state, data = snapshot
    (state.with_suffix(".trainstate")).write_bytes(_flip_in_array(data))
    try:
        status = main(["train", part, "--resume", str(state), "--iters", "1", "--device", "cpu"])
    finally:
        state.with_suffix(".trainstate").write_bytes(data)
    err = capsys.readouterr().err
    assert status == 2 and "digest mismatch" in err and "Traceback" not in err
