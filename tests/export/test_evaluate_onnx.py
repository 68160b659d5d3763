"""``evaluate_onnx`` on toy CUB-200 and VehicleID trees equals evaluating PyTorch features directly.

The PyTorch side uses the data package's own ImageRecordDataset + DataTransformer (TEST phase) and the
CaffeNet forward, then ``caffe_compat.evaluate``; the ONNX side reads its preprocessing from the model's
metadata only.  Same images, same numbers.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from caffe_compat.data import DataTransformer, ImageRecordDataset, make_toy_data, read_cub200, read_vehicleid
from caffe_compat.errors import CaffeCompatError
from caffe_compat.evaluate import evaluate_cub200, evaluate_vehicleid
from caffe_compat.export import evaluate_onnx, export_onnx
from caffe_compat.export.preprocess import ImagePreprocessor
from caffe_compat.export.runtime import make_session
from caffe_compat.net import load_net
from tests.export.helpers import TINY_PREPROCESSING, write_tiny_net


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("evaluate")
    prototxt, weights = write_tiny_net(root)
    model = export_onnx(prototxt, weights=weights, path=root / "tiny.onnx", preprocessing=TINY_PREPROCESSING)
    cub = make_toy_data("cub", root / "cub", size=32)
    vehicles = make_toy_data("vehicleid", root / "vehicleid", size=32, num_classes=26, images_per_class=3)
    return {"prototxt": prototxt, "weights": weights, "model": model, "cub": cub, "vehicleid": vehicles,
            "root": root}


def _torch_features(setup, records) -> tuple[np.ndarray, np.ndarray]:
    p = TINY_PREPROCESSING
    transformer = DataTransformer(crop_size=p["crop_size"], mean_value=p["mean_value"], scale=p["scale"], phase="TEST")
    dataset = ImageRecordDataset(records, transformer, new_height=p["resize"], new_width=p["resize"])
    net = load_net(str(setup["prototxt"]), str(setup["weights"]))
    with torch.no_grad():
        features = net(data=torch.stack([dataset[i][0] for i in range(len(dataset))]))["fc_embedding"]
    return features.numpy(), dataset.labels


def _assert_same_numbers(got, expected):
    if isinstance(expected, dict):
        assert set(got) >= set(expected)
        for key, value in expected.items():
            _assert_same_numbers(got[key], value)
    elif isinstance(expected, list):
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-9)
    elif isinstance(expected, float):
        assert got == pytest.approx(expected, abs=1e-9)
    else:
        assert got == expected


def test_preprocessing_from_metadata_is_the_data_transformer(setup):
    from caffe_compat.export import read_metadata

    records = read_cub200(setup["cub"], "test")[:3]
    p = TINY_PREPROCESSING
    dataset = ImageRecordDataset(records, DataTransformer(crop_size=24, mean_value=p["mean_value"], scale=p["scale"],
                                                          phase="TEST"), new_height=28, new_width=28)
    preprocess = ImagePreprocessor(read_metadata(setup["model"]))
    for i, record in enumerate(records):
        np.testing.assert_array_equal(preprocess(record.path), dataset[i][0].numpy())


def test_cub200_equals_pytorch_features(setup):
    result = evaluate_onnx(setup["model"], "cub200", setup["cub"], batch_size=16, progress=False)
    features, labels = _torch_features(setup, read_cub200(setup["cub"], "test"))
    expected = evaluate_cub200(features, labels)
    assert result["num_images"] == 120 and result["provider"] == "CPUExecutionProvider"
    _assert_same_numbers(result, expected)
    assert 0.0 < result["recall_at_k"]["1"] < 1.0  # a non-trivial ranking: the comparison means something


def test_vehicleid_equals_pytorch_features_on_all_three_lists(setup):
    result = evaluate_onnx(setup["model"], "vehicleid", setup["vehicleid"], batch_size=50, progress=False)
    splits = {}
    for name in ("small", "medium", "large"):
        splits[name] = _torch_features(setup, read_vehicleid(setup["vehicleid"], name))
    expected = evaluate_vehicleid(splits)
    assert sorted(result["splits"]) == ["large", "medium", "small"]
    assert [result["splits"][s]["num_vehicles"] for s in ("small", "medium", "large")] == [8, 16, 24]
    _assert_same_numbers(result, expected)
    assert result["provider"] == "CPUExecutionProvider" and result["split"] == ["small", "medium", "large"]


def test_fixed_batch_model_pads_the_last_batch(setup):
    fixed = export_onnx(setup["prototxt"], weights=setup["weights"], path=setup["root"] / "fixed7.onnx", batch=7,
                        preprocessing=TINY_PREPROCESSING)
    one_split = evaluate_onnx(fixed, "vehicleid", setup["vehicleid"], progress=False, split="small")  # 24 = 3*7 + 3
    reference = evaluate_onnx(setup["model"], "vehicleid", setup["vehicleid"], progress=False, split=["small"])
    assert list(one_split["splits"]) == ["small"]
    _assert_same_numbers(one_split["splits"], reference["splits"])


def test_cuda_request_reports_the_provider_really_used(setup):
    import onnxruntime as ort

    session = make_session(setup["model"], provider="cuda")
    used = session.get_providers()[0]
    assert used in ("CUDAExecutionProvider", "CPUExecutionProvider")
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        assert used == "CPUExecutionProvider"
    result = evaluate_onnx(setup["model"], "cub200", setup["cub"], provider="cuda", progress=False)
    assert result["provider"] == used


def test_bad_inputs_raise_caffe_compat_errors(setup):
    with pytest.raises(CaffeCompatError, match="protocol must be one of"):
        evaluate_onnx(setup["model"], "imagenet", setup["cub"])
    with pytest.raises(CaffeCompatError, match="does not exist"):
        evaluate_onnx(setup["model"], "cub200", setup["root"] / "missing")
    with pytest.raises(CaffeCompatError, match="VehicleID splits must be among"):
        evaluate_onnx(setup["model"], "vehicleid", setup["vehicleid"], split="huge")
    with pytest.raises(CaffeCompatError, match="no such ONNX file"):
        evaluate_onnx(setup["root"] / "none.onnx", "cub200", setup["cub"])
