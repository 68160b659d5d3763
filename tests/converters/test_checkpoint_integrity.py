"""Checkpoint integrity: ``save_checkpoint`` records the SHA-256 of the content and ``load_checkpoint``
refuses a file whose tensors, prototxt or phase were changed (PyTorch's zip reader does not check its
records' CRCs: a flipped byte used to load as a different weight), a truncated file, and a payload with
unknown, missing or mistyped keys; a checkpoint without a digest (an older caffe-compat's) loads with a
warning.  Through ``caffe-compat convert --to-caffe`` such a file exits 2 without a traceback."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from caffe_compat.checkpoint import FORMAT, content_digest, load_checkpoint
from caffe_compat.cli import main
from caffe_compat.errors import CaffeCompatWarning, FormatError, ShapeMismatchError
from converters import convert_caffe_to_torch
from tests.conftest import fixture_path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "zoo.pt"
    convert_caffe_to_torch(str(fixture_path("layer_zoo/deploy.prototxt")),
                           str(fixture_path("layer_zoo/weights.caffemodel")), path)
    return path


def _weight_offset(data: bytes, payload: dict) -> tuple[str, int]:
    """A state_dict entry and the offset of its raw bytes in the file (the zip stores them uncompressed)."""
    for name, tensor in payload["state_dict"].items():
        raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        if tensor.dtype == torch.float32 and len(raw) >= 64 and data.count(raw) == 1:
            return name, data.index(raw) + len(raw) // 2
    raise AssertionError("no tensor found in the file")


def test_the_digest_is_recorded_and_the_file_stays_a_plain_torch_load(checkpoint):
    payload = torch.load(checkpoint, weights_only=True)
    assert payload["format"] == FORMAT and payload["sha256"] == content_digest(payload)
    load_checkpoint(checkpoint)


def test_a_flipped_byte_in_a_tensor_is_a_digest_mismatch(checkpoint, tmp_path):
    data = checkpoint.read_bytes()
    name, offset = _weight_offset(data, torch.load(checkpoint, weights_only=True))
    bad = tmp_path / "flipped.pt"
    bad.write_bytes(data[:offset] + bytes([data[offset] ^ 0x40]) + data[offset + 1:])
    changed = torch.load(bad, weights_only=True)["state_dict"][name]  # torch itself does not notice
    assert not torch.equal(changed, torch.load(checkpoint, weights_only=True)["state_dict"][name])
    with pytest.raises(FormatError, match=r"flipped\.pt: digest mismatch: the file was truncated or modified"):
        load_checkpoint(bad)
    status = main(["convert", "--to-caffe", str(bad), "-o", str(tmp_path / "out" / "x")])
    assert status == 2 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("edit", ["prototxt", "phase", "tensor", "renamed", "digest_garbage"])
def test_an_edited_payload_is_a_digest_mismatch(checkpoint, tmp_path, edit):
    payload = torch.load(checkpoint, weights_only=True)
    if edit == "prototxt":
        payload["net_prototxt"] = payload["net_prototxt"].replace("name:", "name:", 1) + "\n"
    elif edit == "phase":
        payload["phase"] = "train"
    elif edit == "tensor":
        key = next(iter(payload["state_dict"]))
        payload["state_dict"][key] = payload["state_dict"][key].clone().add_(1)
    elif edit == "renamed":
        first = next(iter(payload["state_dict"]))
        payload["state_dict"] = {("x" + k if k == first else k): v for k, v in payload["state_dict"].items()}
    else:
        payload["sha256"] = "not a digest"
    torch.save(payload, tmp_path / "edited.pt")
    with pytest.raises(FormatError, match=r"edited\.pt: digest mismatch: the file was truncated or modified"):
        load_checkpoint(tmp_path / "edited.pt")


@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.9, 0.999])
def test_a_truncated_file_is_a_typed_error(checkpoint, tmp_path, fraction):
    data = checkpoint.read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(FormatError, match=r"cut\.pt: not a readable PyTorch checkpoint \(truncated, modified"):
        load_checkpoint(tmp_path / "cut.pt")


def test_a_checkpoint_without_a_digest_loads_with_a_warning(checkpoint, tmp_path):
    payload = torch.load(checkpoint, weights_only=True)
    del payload["sha256"]
    torch.save(payload, tmp_path / "old.pt")
    with pytest.warns(CaffeCompatWarning, match=r"old\.pt: checkpoint without a digest"):
        net = load_checkpoint(tmp_path / "old.pt")
    reference = load_checkpoint(checkpoint)
    for (name, a), (_, b) in zip(net.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("case, message", [
    ("unknown_key", r"checkpoint has unknown key 'optimizer'"),
    ("prototxt_bytes", r"checkpoint 'net_prototxt': expected the net as prototxt text, got bytes"),
    ("bad_phase", r"checkpoint 'phase': expected 'train' or 'test', got 'deploy'"),
    ("state_list", r"checkpoint 'state_dict': expected a dict of tensors, got list"),
    ("state_value", r"checkpoint 'state_dict' entry 'layers.x': expected a tensor named by a string, got int"),
])
def test_a_payload_of_the_wrong_shape_is_refused_by_key(checkpoint, tmp_path, case, message):
    payload = torch.load(checkpoint, weights_only=True)
    del payload["sha256"]
    if case == "unknown_key":
        payload["optimizer"] = {"lr": torch.tensor(0.1)}
    elif case == "prototxt_bytes":
        payload["net_prototxt"] = payload["net_prototxt"].encode()
    elif case == "bad_phase":
        payload["phase"] = "deploy"
    elif case == "state_list":
        payload["state_dict"] = list(payload["state_dict"].values())
    else:
        payload["state_dict"]["layers.x"] = 3
    torch.save(payload, tmp_path / "odd.pt")
    with pytest.raises(FormatError, match=message):
        load_checkpoint(tmp_path / "odd.pt")


def test_a_checkpoint_larger_than_the_memory_budget_is_refused_before_loading(checkpoint, monkeypatch):
    monkeypatch.setenv("CAFFE_COMPAT_MEMORY_BUDGET", "1K")
    size = checkpoint.stat().st_size
    with pytest.raises(FormatError, match=fr"zoo\.pt: {size} bytes, more than the memory budget of 1024"):
        load_checkpoint(checkpoint)


def test_a_tensor_of_another_shape_with_a_valid_digest_is_a_shape_error(checkpoint, tmp_path):
    """Found by the fuzzer (tests/fuzz target 'checkpoint'): load_state_dict's RuntimeError escaped."""
    payload = torch.load(checkpoint, weights_only=True)
    key = next(k for k, v in payload["state_dict"].items() if v.ndim == 2)
    payload["state_dict"][key] = torch.zeros(*payload["state_dict"][key].shape, 1)
    payload["sha256"] = content_digest(payload)
    torch.save(payload, tmp_path / "reshaped.pt")
    with pytest.raises(ShapeMismatchError, match=fr"reshaped\.pt: state_dict '{re.escape(key)}' has shape"):
        load_checkpoint(tmp_path / "reshaped.pt")


def test_loading_runs_no_filler_and_gives_the_stored_values(checkpoint, monkeypatch):
    """The state_dict supplies every blob, so no filler runs (found by the fuzzer: a stored net with a
    large blob spent seconds drawing initial values before its state_dict was found not to fit)."""
    from caffe_compat.net import CaffeNet

    payload = torch.load(checkpoint, weights_only=True)

    def no_filler(self, *args, **kwargs):
        raise AssertionError("a filler ran")

    monkeypatch.setattr(CaffeNet, "reinitialize", no_filler)
    net = load_checkpoint(checkpoint)
    for name, value in net.state_dict().items():
        assert torch.equal(value, payload["state_dict"][name]), name


def test_digest_covers_dtype_shape_and_order():
    base = {"format": FORMAT, "net_prototxt": "x", "phase": "test",
            "state_dict": {"a": torch.zeros(4), "b": torch.ones(2)}}
    digests = {content_digest(base)}
    for state in ({"a": torch.zeros(2, 2), "b": torch.ones(2)},                    # shape
                  {"a": torch.zeros(4, dtype=torch.int32), "b": torch.ones(2)},    # dtype, same bytes
                  {"b": torch.ones(2), "a": torch.zeros(4)},                        # order
                  {"a": torch.zeros(4), "b": torch.ones(2), "c": torch.empty(0)}):  # one more (empty) entry
        digests.add(content_digest({**base, "state_dict": state}))
    assert len(digests) == 5
    assert np.all(base["state_dict"]["a"].numpy() == 0)  # not modified by hashing
