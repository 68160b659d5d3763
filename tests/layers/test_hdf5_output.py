"""HDF5Output: the bottoms as Caffe's legacy 4-D 'data'/'label' datasets, written atomically at the first
forward; a second forward refused (Caffe aborts); h5py optional with a clear error; CHECKs."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from caffe_compat.errors import DataError, FormatError
from caffe_compat.net import load_net
from tests.layers.zoo_single_layer import make_layer

h5py = pytest.importorskip("h5py")


def _layer(path, shapes):
    return make_layer(f'type: "HDF5Output" bottom: "d" bottom: "l" hdf5_output_param {{ file_name: "{path}" }}', shapes)


def test_writes_data_and_label_as_legacy_4d(tmp_path):
    path = tmp_path / "out" / "features.h5"
    data = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    label = torch.tensor([1.0, 0.0, 2.0])
    port = _layer(path, [(3, 4), (3,)])
    assert port(data, label) == ()
    with h5py.File(path, "r") as fh:
        assert sorted(fh) == ["data", "label"]
        assert fh["data"].shape == (3, 4, 1, 1) and fh["data"].dtype == np.float32
        assert fh["label"].shape == (3, 1, 1, 1)
        np.testing.assert_array_equal(fh["data"][:, :, 0, 0], data.numpy())
        np.testing.assert_array_equal(fh["label"][:, 0, 0, 0], label.numpy())
    assert [p.name for p in path.parent.iterdir()] == ["features.h5"]  # no temporary left


def test_a_float64_net_writes_doubles_and_a_second_forward_is_refused(tmp_path):
    path = tmp_path / "f.h5"
    port = _layer(path, [(2, 1, 2, 2), (2, 1)])
    port(torch.ones(2, 1, 2, 2, dtype=torch.float64), torch.zeros(2, 1, dtype=torch.float64))
    with h5py.File(path, "r") as fh:
        assert fh["data"].dtype == np.float64 and fh["data"].shape == (2, 1, 2, 2)
    with pytest.raises(DataError, match="fails on a second forward"):
        port(torch.ones(2, 1, 2, 2), torch.zeros(2, 1))
    port.reopen()
    port(torch.full((2, 1, 2, 2), 5.0), torch.zeros(2, 1))
    with h5py.File(path, "r") as fh:
        assert float(fh["data"][0, 0, 0, 0]) == 5.0


def test_in_a_net_and_no_gradient(tmp_path):
    path = tmp_path / "net.h5"
    text = ('layer { name: "in" type: "Input" top: "d" top: "l" input_param { shape { dim: 2 dim: 3 } '
            'shape { dim: 2 } } }\n'
            f'layer {{ name: "out" type: "HDF5Output" bottom: "d" bottom: "l" hdf5_output_param {{ file_name: "{path}" }} }}\n')
    net = load_net(text)
    net.forward(d=torch.ones(2, 3), l=torch.tensor([3.0, 4.0]))
    with h5py.File(path, "r") as fh:
        assert fh["label"][:, 0, 0, 0].tolist() == [3.0, 4.0]


def test_checks(tmp_path, monkeypatch):
    with pytest.raises(FormatError, match="file_name is required"):
        make_layer('type: "HDF5Output"', [(2, 3), (2,)])
    with pytest.raises(FormatError, match="same batch size"):
        _layer(tmp_path / "x.h5", [(2, 3), (3,)])
    with pytest.raises(FormatError, match="more than 4 axes"):
        _layer(tmp_path / "x.h5", [(2, 1, 1, 1, 1), (2,)])
    with pytest.raises(FormatError, match=r"needs 2 bottom blob\(s\), got 1"):
        make_layer('type: "HDF5Output" hdf5_output_param { file_name: "x.h5" }', [(2, 3)])
    monkeypatch.setitem(sys.modules, "h5py", None)
    with pytest.raises(DataError, match="needs the h5py package"):
        _layer(tmp_path / "x.h5", [(2, 3), (2,)])
