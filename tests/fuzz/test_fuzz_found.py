"""Regressions for what the fuzz targets added for issue #19 (onnx, solverstate, cli_*) found: make-lmdb under
an address-space limit (liblmdb's 1 TiB map), a NUL byte in a list entry, a label outside int32, metadata that is not UTF-8, a solverstate whose learned_net
is not UTF-8, and ONNX metadata that ``evaluate`` used as is (a NaN scale, a bad channel order, a huge
resize)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from caffe_compat.errors import CaffeCompatError, DataError, FormatError, MemoryBudgetError, ParseError


def test_make_lmdb_halves_the_map_where_the_address_space_is_limited_and_grows_it_when_full(tmp_path,
                                                                                            monkeypatch):
    lmdb = pytest.importorskip("lmdb")
    from caffe_compat.io import iter_lmdb, make_datum
    from caffe_compat.io.datum_lmdb import LmdbWriter

    real_open = lmdb.open

    def limited_open(path, map_size, **kwargs):  # as under ulimit -v: a large map cannot be reserved
        if map_size > 1 << 22:
            raise lmdb.MemoryError(path, "Cannot allocate memory")
        return real_open(path, map_size=map_size, **kwargs)

    monkeypatch.setattr(lmdb, "open", limited_open)
    with LmdbWriter(tmp_path / "db") as writer:
        for i in range(1500):  # 1500 x ~3 KB: more than the 4 MiB map it opened with
            writer.put(f"{i:08d}", make_datum(np.full((3, 32, 32), i % 251, np.uint8), i))
    assert writer.map_size > 1 << 22
    monkeypatch.setattr(lmdb, "open", real_open)
    records = list(iter_lmdb(tmp_path / "db"))
    assert len(records) == 1500 and int(records[-1][1][0, 0, 0]) == 1499 % 251


def test_nul_byte_in_a_list_entry_is_a_data_error_naming_the_line(tmp_path):
    from caffe_compat.data.imageset import convert_imageset, read_list_file

    (tmp_path / "list.txt").write_bytes(b"a.png 0\nb\x00.png 1\n")
    with pytest.raises(DataError, match=r"list.txt:2: the path 'b\\x00.png' holds a NUL byte"):
        read_list_file(tmp_path / "list.txt")
    with pytest.raises(DataError, match="list.txt:2"):
        convert_imageset(tmp_path / "list.txt", tmp_path, tmp_path / "db", progress=False)


@pytest.mark.parametrize("label", ["2147483648", "-2147483649", "33333333333333333"])
def test_a_label_outside_int32_is_a_data_error_naming_the_line(tmp_path, label):
    """The 30-minute run's make-lmdb finding: protobuf's ValueError setting Datum.label (an int32)."""
    from caffe_compat.data.imageset import convert_imageset, read_list_file

    (tmp_path / "list.txt").write_text(f"a.png 2147483647\nb.png -2147483648\nc.png {label}\n")
    with pytest.raises(DataError, match=f"list.txt:3: label {label} is outside Caffe's 32-bit int range"):
        read_list_file(tmp_path / "list.txt")
    with pytest.raises(DataError, match="list.txt:3"):
        convert_imageset(tmp_path / "list.txt", tmp_path, tmp_path / "db", progress=False)


def test_solverstate_learned_net_not_utf8_is_a_parse_error(tmp_path):
    from caffe_compat.io import read_solverstate
    from caffe_compat.proto import caffe_pb2

    raw = caffe_pb2.SolverState(iter=3, learned_net="x.caffemodel").SerializeToString()
    raw = raw.replace(b"x.caffemodel", b"\xff\xfecaffemodel")  # same length
    (tmp_path / "s.solverstate").write_bytes(raw)
    with pytest.raises(ParseError, match="s.solverstate: field 'learned_net' is not UTF-8"):
        read_solverstate(tmp_path / "s.solverstate")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from caffe_compat.export import export_onnx
    from tests.export.helpers import TINY_PREPROCESSING, write_tiny_net

    tmp = tmp_path_factory.mktemp("onnx")
    prototxt, weights = write_tiny_net(tmp)
    return export_onnx(prototxt, weights=weights, path=tmp / "m.onnx", opset=13, preprocessing=TINY_PREPROCESSING)


def _with_metadata(exported, tmp_path, **values):
    import onnx

    model = onnx.load(str(exported))
    for prop in model.metadata_props:
        if prop.key in values:
            prop.value = json.dumps(values[prop.key])
    path = tmp_path / "edited.onnx"
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize("values, error, message", [
    ({"scale": float("nan")}, FormatError, r"metadata 'scale' must be a finite number, got nan"),
    ({"scale": "0.5"}, FormatError, r"metadata 'scale' must be a finite number"),
    ({"channel_order": "XYZ"}, FormatError, r"metadata 'channel_order' must be 'BGR' or 'RGB', got 'XYZ'"),
    ({"resize": [100000, 100000]}, MemoryBudgetError, r"metadata 'resize' \[100000, 100000\] needs 30000000000 bytes"),
    ({"resize": [0, 5]}, FormatError, r"resize must be a positive int"),
    ({"mean_value": [float("nan")] * 3}, FormatError, r"metadata 'mean_value' must be a finite number"),
    ({"input_shape": [3, 24]}, FormatError, r"metadata 'input_shape' must be \[C, H, W\]"),
    ({"crop_size": -1}, FormatError, r"metadata 'crop_size' must be an int >= 0"),
    ({"mean_image": {"shape": [3, 2, 2], "base64": "!!"}}, FormatError, r"metadata 'mean_image' is malformed"),
])
def test_onnx_metadata_evaluate_would_use_is_checked_naming_the_model(exported, tmp_path, monkeypatch, values,
                                                                     error, message):
    from caffe_compat.export.evaluate import evaluate_onnx
    from caffe_compat.export.metadata import read_metadata
    from caffe_compat.export.preprocess import ImagePreprocessor

    monkeypatch.setenv("CAFFE_COMPAT_MEMORY_BUDGET", "1G")
    path = _with_metadata(exported, tmp_path, **values)
    with pytest.raises(error, match=f"edited.onnx: .*{message}"):
        ImagePreprocessor(read_metadata(path), str(path))
    with pytest.raises(CaffeCompatError, match=message):  # before the data set or ONNX Runtime is touched
        evaluate_onnx(path, "cub200", tmp_path / "no-such-root", progress=False, device="cpu")


def test_onnx_metadata_not_utf8_is_a_format_error_naming_the_model(exported, tmp_path):
    """The second 30-minute run's finding: protobuf hands an invalid-UTF-8 string over as bytes, which
    ``json.loads`` then failed to decode (a UnicodeDecodeError escaped)."""
    from caffe_compat.export.metadata import read_metadata

    path = _with_metadata(exported, tmp_path, channel_order="QQQ")
    raw = path.read_bytes()
    assert raw.count(b'"QQQ"') == 1
    path.write_bytes(raw.replace(b'"QQQ"', b'"\xff\xfeQ"'))  # same length: the framing stays valid
    with pytest.raises(FormatError, match="edited.onnx: metadata entry 'channel_order' is not valid UTF-8 text"):
        read_metadata(path)


def test_valid_metadata_still_preprocesses(exported, tmp_path):
    import cv2

    from caffe_compat.export.metadata import read_metadata
    from caffe_compat.export.preprocess import ImagePreprocessor

    image = tmp_path / "i.png"
    cv2.imwrite(str(image), np.zeros((30, 32, 3), np.uint8))
    assert ImagePreprocessor(read_metadata(exported), str(exported))(image).shape == (3, 24, 24)


@pytest.mark.parametrize("label", [2 ** 31, -2 ** 31 - 1])
def test_a_datum_label_outside_int32_is_a_format_error(label):
    from caffe_compat.io import make_datum
    from caffe_compat.io.transformer import array_to_datum

    image = np.zeros((1, 2, 2), np.uint8)
    assert make_datum(image, 2 ** 31 - 1).label == 2 ** 31 - 1
    with pytest.raises(FormatError, match="label is an int32"):
        make_datum(image, label)
    with pytest.raises(FormatError, match="label is an int32"):
        array_to_datum(image, label)


_IN_PLACE_LOSS = """
layer { name: "score" type: "Input" top: "score" input_param { shape { dim: 4 dim: 5 dim: 2 dim: 3 } } }
layer { name: "label" type: "Input" top: "label" input_param { shape { dim: 4 dim: 2 dim: 3 } } }
layer { name: "loss_layer" type: "SoftmaxWithLoss" bottom: "score" bottom: "label" top: "score" }
"""


@pytest.mark.parametrize("text", [_IN_PLACE_LOSS,
                                  _IN_PLACE_LOSS.replace("SoftmaxWithLoss", "EuclideanLoss").replace(
                                      "dim: 4 dim: 2 dim: 3", "dim: 4 dim: 5 dim: 2 dim: 3")])
def test_net_target_a_loss_in_place_is_typed(tmp_path, monkeypatch, text):
    """The net target's finding (seed 1, cases 758 and 1555, minimized): a loss layer computed in place, which
    Caffe refuses at setup, was built, and the forward raised IndexError."""
    from tests.fuzz.targets import _run_net

    monkeypatch.setenv("CAFFE_COMPAT_MEMORY_BUDGET", "256M")  # what the reader sets (in its child): restored after
    path = tmp_path / "net.prototxt"
    path.write_text(text)
    with pytest.raises(FormatError, match="layer 'loss_layer' .* computed in place"):
        _run_net(str(path))


def test_net_target_contrastive_features_of_two_legacy_forms_run(tmp_path, monkeypatch):
    """The net target's finding (seed 2, cases 863 and 1293, minimized): ContrastiveLoss on a (8, 5, 1) and a
    (8, 5), which Caffe accepts and subtracts element by element, raised torch's RuntimeError."""
    from tests.fuzz.targets import _run_net

    monkeypatch.setenv("CAFFE_COMPAT_MEMORY_BUDGET", "256M")
    path = tmp_path / "net.prototxt"
    path.write_text("""force_backward: true
    layer { name: "a" type: "Input" top: "a" input_param { shape { dim: 8 dim: 5 dim: 1 } } }
    layer { name: "b" type: "Input" top: "b" input_param { shape { dim: 8 dim: 5 } } }
    layer { name: "sim" type: "Input" top: "sim" input_param { shape { dim: 8 } } }
    layer { name: "loss_layer" type: "ContrastiveLoss" bottom: "a" bottom: "b" bottom: "sim" top: "loss" }""")
    _run_net(str(path))
