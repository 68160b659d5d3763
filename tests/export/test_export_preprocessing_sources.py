"""Where an export's preprocessing comes from (given, the TEST-phase data layer, or assumed with a warning),
``mean_file`` support, data layers never opened (training prototxts export without their data), and the
ONNX Runtime provider fallback warning."""

from __future__ import annotations

import warnings

import cv2
import numpy as np
import onnxruntime as ort
import pytest

from caffe_compat.cli import main
from caffe_compat.data import DataTransformer, load_image_bgr
from caffe_compat.errors import CaffeCompatError, FormatError
from caffe_compat.export import export_onnx, read_metadata
from caffe_compat.export.metadata import decode_mean_image
from caffe_compat.export.notices import PreprocessingAssumedWarning, ProviderFallbackWarning
from caffe_compat.export.preprocess import ImagePreprocessor
from caffe_compat.export.runtime import make_session
from caffe_compat.io import write_blob
from tests.conftest import REPO
from tests.export.helpers import TINY_PROTOTXT, write_tiny_net

BODY = TINY_PROTOTXT.split('layer { name: "conv1"', 1)[1]
BODY = 'layer { name: "conv1"' + BODY.split('layer { name: "label"', 1)[0]  # conv1 .. fc_embedding
LOSS = 'layer { name: "loss" type: "EuclideanLoss" bottom: "fc_embedding" bottom: "fc_embedding" top: "loss" }\n'


def train_net(directory, data_layer: str, name: str = "train.prototxt"):
    """The tiny embedder fed by ``data_layer`` (tops data, label) with a loss head."""
    path = directory / name
    path.write_text(f'name: "tiny_train"\n{data_layer}\n{BODY}{LOSS}')
    return path


LMDB_LAYER = """layer {{ name: "data" type: "Data" top: "data" top: "label"
  transform_param {{ {transform} }}
  data_param {{ source: "no_such_lmdb" batch_size: 8 backend: LMDB }} }}"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("prep")
    return write_tiny_net(root)


def _no_caffe_compat_warnings(record):
    return [w for w in record if issubclass(w.category, (PreprocessingAssumedWarning, ProviderFallbackWarning))]


def test_transform_param_with_mean_file_gives_the_defaults_and_never_opens_the_lmdb(tiny, tmp_path, monkeypatch):
    _, weights = tiny
    monkeypatch.chdir(tmp_path)
    mean = np.random.RandomState(1).uniform(90, 130, (1, 3, 28, 28)).astype(np.float32)
    write_blob(mean, tmp_path / "mean.binaryproto")
    prototxt = train_net(tmp_path, LMDB_LAYER.format(transform='crop_size: 24 mean_file: "mean.binaryproto" '
                                                               'scale: 0.0078125 mirror: true'))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        meta = read_metadata(export_onnx(prototxt, weights=weights, path=tmp_path / "m.onnx"))
    assert _no_caffe_compat_warnings(record) == []
    assert meta["preprocessing_source"] == "data layer 'data' (Data)" and meta["preprocessing_assumed"] == []
    assert meta["preprocessing_derived"] is True
    assert meta["crop_size"] == 24 and meta["resize"] == [28, 28]  # the stored images have the mean's size
    assert meta["mean_value"] == [] and meta["mean_file"] == "mean.binaryproto" and meta["scale"] == 0.0078125
    np.testing.assert_array_equal(decode_mean_image(meta["mean_image"]), mean[0])
    assert meta["input_shape"] == [3, 24, 24]
    # inference applies exactly Caffe's TEST transform with that mean file (mirror off)
    image = np.random.RandomState(2).randint(0, 256, (40, 33, 3)).astype(np.uint8)
    cv2.imwrite(str(tmp_path / "img.png"), image)
    expected = DataTransformer(crop_size=24, mean_file=mean, scale=0.0078125, phase="TEST").transform(
        load_image_bgr(tmp_path / "img.png", True, 28, 28))
    np.testing.assert_array_equal(ImagePreprocessor(meta)(tmp_path / "img.png"), expected)


def test_image_data_layer_gives_its_resize_and_mean_values(tiny, tmp_path):
    _, weights = tiny
    prototxt = train_net(tmp_path, """layer { name: "images" type: "ImageData" top: "data" top: "label"
      transform_param { crop_size: 24 mean_value: 104 mean_value: 117 mean_value: 123 }
      image_data_param { source: "no_such_list.txt" batch_size: 4 new_height: 30 new_width: 28 } }""")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        meta = read_metadata(export_onnx(prototxt, weights=weights, path=tmp_path / "m.onnx"))
    assert _no_caffe_compat_warnings(record) == []
    assert meta["resize"] == [30, 28] and meta["crop_size"] == 24 and meta["mean_value"] == [104.0, 117.0, 123.0]
    assert meta["preprocessing_source"] == "data layer 'images' (ImageData)" and meta["mean_image"] is None


def test_unknown_stored_size_is_recorded_and_warned(tiny, tmp_path):
    _, weights = tiny
    prototxt = train_net(tmp_path, LMDB_LAYER.format(transform="crop_size: 24 mean_value: 128"))
    with pytest.warns(PreprocessingAssumedWarning, match="resize: none"):
        meta = read_metadata(export_onnx(prototxt, weights=weights, path=tmp_path / "m.onnx"))
    assert meta["preprocessing_source"] == "data layer 'data' (Data)"
    assert meta["crop_size"] == 24 and meta["resize"] is None and meta["mean_value"] == [128.0]
    assert len(meta["preprocessing_assumed"]) == 1 and meta["preprocessing_assumed"][0].startswith("resize: none")


def test_deploy_net_without_preprocessing_is_recorded_as_assumed_and_warned_on_stderr(tiny, tmp_path, capsys):
    prototxt, weights = tiny
    with pytest.warns(PreprocessingAssumedWarning, match=r"resize to 24x24 \(the net's input size\); no crop"):
        meta = read_metadata(export_onnx(prototxt, weights=weights, path=tmp_path / "m.onnx"))
    assert meta["preprocessing_source"] == "assumed" and meta["preprocessing_derived"] is True
    assert meta["preprocessing_assumed"] == ["resize to 24x24 (the net's input size)", "no crop",
                                             "no mean subtraction", "scale 1", "BGR channel order"]
    assert main(["export", str(prototxt), "--weights", str(weights), "-o", str(tmp_path / "c.onnx")]) == 0
    err = capsys.readouterr().err
    assert err.count("caffe-compat export: warning:") == 1 and "no crop" in err and "--preprocessing" in err
    assert "Traceback" not in err and "warnings.warn" not in err
    # a given preprocessing: nothing assumed, no warning
    assert main(["export", str(prototxt), "--weights", str(weights), "-o", str(tmp_path / "d.onnx"),
                 "--preprocessing", '{"resize": 28, "crop_size": 24}']) == 0
    assert "warning" not in capsys.readouterr().err
    given = read_metadata(tmp_path / "d.onnx")
    assert given["preprocessing_source"] == "given" and given["preprocessing_assumed"] == []


def test_given_mean_file_is_stored_and_applied(tiny, tmp_path, monkeypatch):
    prototxt, weights = tiny
    monkeypatch.chdir(tmp_path)
    mean = np.random.RandomState(3).uniform(0, 255, (3, 28, 28)).astype(np.float32)
    write_blob(mean, tmp_path / "m.binaryproto")
    path = export_onnx(prototxt, weights=weights, path=tmp_path / "m.onnx",
                       preprocessing={"resize": 28, "crop_size": 24, "mean_file": "m.binaryproto", "scale": 0.5})
    meta = read_metadata(path)
    assert meta["mean_file"] == "m.binaryproto" and meta["mean_value"] == [] and meta["scale"] == 0.5
    (tmp_path / "m.binaryproto").unlink()  # inference needs no side file
    image = np.random.RandomState(4).randint(0, 256, (20, 50, 3)).astype(np.uint8)
    cv2.imwrite(str(tmp_path / "img.png"), image)
    expected = DataTransformer(crop_size=24, mean_file=mean, scale=0.5, phase="TEST").transform(
        load_image_bgr(tmp_path / "img.png", True, 28, 28))
    got = ImagePreprocessor(read_metadata(path))(tmp_path / "img.png")
    np.testing.assert_array_equal(got, expected)
    # the centre crop of the mean is what is subtracted: pixel (0, 0) of channel 0
    resized = load_image_bgr(tmp_path / "img.png", True, 28, 28)
    assert got[0, 0, 0] == pytest.approx((float(resized[2, 2, 0]) - mean[0, 2, 2]) * 0.5, abs=1e-4)


@pytest.mark.parametrize("spec, message", [
    ({"crop_size": 24, "resize": 28, "mean_file": "none.binaryproto"}, r"mean_file 'none.binaryproto' not found"),
    ({"crop_size": 24, "resize": 28, "mean_file": "m.binaryproto", "mean_value": [1]},
     r"give mean_file or mean_value, not both"),
    ({"crop_size": 24, "resize": 30, "mean_file": "m.binaryproto"}, r"is 28x28, the resized images 30x30"),
])
def test_bad_mean_file_is_refused_and_nothing_written(tiny, tmp_path, monkeypatch, spec, message):
    prototxt, weights = tiny
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.chdir(tmp_path)
    write_blob(np.zeros((3, 28, 28), np.float32), tmp_path / "m.binaryproto")
    with pytest.raises(FormatError, match=message):
        export_onnx(prototxt, weights=weights, path=out / "m.onnx", preprocessing=spec)
    assert list(out.iterdir()) == []


def test_data_layer_of_unknown_size_asks_for_it(tiny, tmp_path, capsys):
    _, weights = tiny
    prototxt = train_net(tmp_path, LMDB_LAYER.format(transform="mean_value: 128"))
    out = tmp_path / "out"
    out.mkdir()
    status = main(["export", str(prototxt), "--weights", str(weights), "-o", str(out / "m.onnx")])
    err = capsys.readouterr().err
    assert status == 2 and "data layer 'data' (Data) takes its image size from no_such_lmdb" in err
    assert "crop_size or resize" in err and "Traceback" not in err
    assert list(out.iterdir()) == []
    # the size through the preprocessing: exported, the LMDB never opened
    assert main(["export", str(prototxt), "--weights", str(weights), "-o", str(out / "m.onnx"),
                 "--preprocessing", '{"resize": 24, "mean_value": [128]}']) == 0
    assert read_metadata(out / "m.onnx")["input_shape"] == [3, 24, 24]


@pytest.fixture(scope="module")
def googlenet_weights(tmp_path_factory):
    from caffe_compat.net import load_net

    path = tmp_path_factory.mktemp("googlenet") / "cub200.caffemodel"
    load_net(str(REPO / "prototxt" / "cub200" / "deploy.prototxt")).save_caffemodel(path)
    return path


CUB_PREPROCESSING = '{"resize": 256, "crop_size": 224, "mean_value": [104, 117, 123]}'


def test_cub200_training_prototxt_exports_without_its_lmdb(googlenet_weights, tmp_path, monkeypatch, capsys):
    """prototxt/cub200/train_fappy.prototxt reads db/cub200_train_lmdb (absent): the export cuts the net at
    fc_embedding, stands an Input in for the data layer and gives the deploy net's model."""
    monkeypatch.chdir(tmp_path)  # no db/ here
    train = REPO / "prototxt" / "cub200" / "train_fappy.prototxt"
    status = main(["export", str(train), "--weights", str(googlenet_weights), "-o", str(tmp_path / "train.onnx"),
                   "--normalize", "--preprocessing", CUB_PREPROCESSING, "--verify"])
    out = capsys.readouterr()
    assert status == 0, out.err
    assert "verification passed" in out.out and "warning" not in out.err
    assert main(["export", str(REPO / "prototxt" / "cub200" / "deploy.prototxt"), "--weights", str(googlenet_weights),
                 "-o", str(tmp_path / "deploy.onnx"), "--normalize", "--preprocessing", CUB_PREPROCESSING]) == 0
    meta = read_metadata(tmp_path / "train.onnx")
    assert meta["input_shape"] == [3, 224, 224] and meta["embedding_dim"] == 512
    assert meta["crop_size"] == 224 and meta["resize"] == [256, 256] and meta["preprocessing_source"] == "given"
    x = np.random.RandomState(0).randn(2, 3, 224, 224).astype(np.float32) * 50
    outputs = [ort.InferenceSession(str(tmp_path / name), providers=["CPUExecutionProvider"]).run(None, {"data": x})[0]
               for name in ("train.onnx", "deploy.onnx")]
    assert outputs[0].shape == (2, 512)
    np.testing.assert_allclose(outputs[0], outputs[1], rtol=0, atol=1e-6)
    assert np.abs(outputs[0]).max() > 0.01  # not a degenerate all-zero embedding
    # without --preprocessing the data layer's mean file is needed: named, exit 2, nothing written
    status = main(["export", str(train), "--weights", str(googlenet_weights), "-o", str(tmp_path / "x.onnx")])
    err = capsys.readouterr().err
    assert status == 2 and "mean_file 'db/imagenet_mean.binaryproto' not found" in err and "param_str" in err
    assert not (tmp_path / "x.onnx").exists()


def test_cuda_provider_fallback_is_warned_with_the_provider_used(tiny, tmp_path, monkeypatch):
    prototxt, weights = tiny
    model = export_onnx(prototxt, weights=weights, path=tmp_path / "m.onnx",
                        preprocessing={"resize": 24})
    session = make_session(model, provider="cpu")
    assert session.get_providers()[0] == "CPUExecutionProvider"
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        session = make_session(model, provider="cuda")
    used = session.get_providers()[0]
    fallbacks = [w for w in record if issubclass(w.category, ProviderFallbackWarning)]
    if used == "CUDAExecutionProvider":
        assert fallbacks == []
    else:
        assert len(fallbacks) == 1 and f"runs on {used}" in str(fallbacks[0].message)
    # an onnxruntime without the CUDA provider: always a fallback, and the warning says why
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    with pytest.warns(ProviderFallbackWarning, match="runs on CPUExecutionProvider: the installed onnxruntime has no "
                                                     "CUDAExecutionProvider"):
        assert make_session(model, provider="cuda").get_providers() == ["CPUExecutionProvider"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProviderFallbackWarning)
        make_session(model, provider=None)  # auto: the CPU is an acceptable answer, no warning


def test_evaluate_cli_prints_the_provider_fallback(tiny, tmp_path, monkeypatch, capsys):
    from caffe_compat.data import make_toy_data

    prototxt, weights = tiny
    model = export_onnx(prototxt, weights=weights, path=tmp_path / "m.onnx", preprocessing={"resize": 24})
    cub = make_toy_data("cub", tmp_path / "cub", size=24, num_classes=4, images_per_class=3)
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    status = main(["evaluate", str(model), "--dataset", "cub200", "--data-root", str(cub), "--provider", "cuda",
                   "--device", "cpu", "--no-progress"])
    captured = capsys.readouterr()
    assert status == 0
    assert ("caffe-compat evaluate: warning: ONNX Runtime was asked for CUDAExecutionProvider but runs on "
            "CPUExecutionProvider") in captured.err
    assert "features: ONNX Runtime CPUExecutionProvider; k-NN on cpu" in captured.out


def test_checkpoint_and_weights_together_are_refused(tiny, tmp_path):
    prototxt, weights = tiny
    with pytest.raises(CaffeCompatError, match="not both"):
        export_onnx(prototxt, weights=weights, checkpoint=weights, path=tmp_path / "m.onnx")
