"""One net using each of the types ported last (WindowData, Im2col, RNN, LSTM, LSTMUnit, Filter,
HDF5Output): ``inspect``'s shape inference and ``load_net`` accept it and a forward runs."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
import torch

from caffe_compat.io import read_net
from caffe_compat.net import load_net
from caffe_compat.net_report import inspect_net

h5py = pytest.importorskip("h5py")


def test_a_net_with_every_newly_ported_type(tmp_path):
    cv2.imwrite(str(tmp_path / "a.png"), np.random.default_rng(0).integers(0, 256, (12, 12, 3), dtype=np.uint8))
    (tmp_path / "windows.txt").write_text("# 0\na.png\n3 12 12\n2\n1 0.9 0 0 7 7\n0 0.0 2 2 11 11\n")
    text = f'''
layer {{ name: "win" type: "WindowData" top: "data" top: "label" window_data_param {{ source: "{tmp_path}/windows.txt"
  root_folder: "{tmp_path}/" batch_size: 4 }} transform_param {{ crop_size: 8 }} }}
layer {{ name: "col" type: "Im2col" bottom: "data" top: "col" convolution_param {{ kernel_size: 3 dilation: 2 }} }}
layer {{ name: "seq" type: "Input" top: "x" top: "cont" top: "c0" top: "gates" top: "cont1"
  input_param {{ shape {{ dim: 4 dim: 2 dim: 5 }} shape {{ dim: 4 dim: 2 }} shape {{ dim: 1 dim: 2 dim: 3 }}
                 shape {{ dim: 1 dim: 2 dim: 12 }} shape {{ dim: 1 dim: 2 }} }} }}
layer {{ name: "lstm" type: "LSTM" bottom: "x" bottom: "cont" top: "h" recurrent_param {{ num_output: 3
  weight_filler {{ type: "uniform" min: -0.1 max: 0.1 }} }} }}
layer {{ name: "rnn" type: "RNN" bottom: "x" bottom: "cont" top: "o" recurrent_param {{ num_output: 4 }} }}
layer {{ name: "unit" type: "LSTMUnit" bottom: "c0" bottom: "gates" bottom: "cont1" top: "c1" top: "h1" }}
layer {{ name: "keep" type: "Filter" bottom: "col" bottom: "label" top: "fg_col" }}
layer {{ name: "dump" type: "HDF5Output" bottom: "data" bottom: "label"
  hdf5_output_param {{ file_name: "{tmp_path}/dump.h5" }} }}
'''
    report = inspect_net(read_net(text))
    shapes = {r["name"]: r["top_shapes"] for r in report["layers"]}
    assert shapes["col"] == [[4, 27, 4, 4]] and shapes["lstm"] == [[4, 2, 3]] and shapes["rnn"] == [[4, 2, 4]]
    assert shapes["unit"] == [[1, 2, 3], [1, 2, 3]] and shapes["keep"] == [[4, 27, 4, 4]] and shapes["dump"] == []
    assert report["types_without_shape_rule"] == []
    net = load_net(text)
    blobs = net.forward(x=torch.randn(4, 2, 5), cont=torch.ones(4, 2), c0=torch.zeros(1, 2, 3),
                        gates=torch.randn(1, 2, 12), cont1=torch.ones(1, 2))
    assert tuple(blobs["h"].shape) == (4, 2, 3) and tuple(blobs["o"].shape) == (4, 2, 4)
    kept = int((blobs["label"] != 0).sum())
    assert kept == 1 and tuple(blobs["fg_col"].shape) == (kept, 27, 4, 4)  # fg_fraction 0.25 of 4
    with h5py.File(tmp_path / "dump.h5", "r") as fh:
        assert fh["data"].shape == (4, 3, 8, 8) and fh["label"].shape == (4, 1, 1, 1)
