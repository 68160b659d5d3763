"""caffe.coord_map: coordinate maps of NetSpec graphs and the Crop that aligns an FCN's upsampled scores
with its input, against closed forms (and against the crop the built net computes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from caffe_compat.net import CaffeNet
from caffe_compat.pycaffe.coord_map import (AxisMismatchException, CoordMapError, UndefinedMapException, compose,
                                            conv_params, coord_map, coord_map_from_to, crop, inverse)
from caffe_compat.pycaffe.net_spec import NetSpec, layers as L, params as P


def _data(n: NetSpec, size: int = 16):
    n.data = L.Input(shape=dict(dim=[1, 1, size, size]))
    return n.data


@pytest.mark.parametrize("kernel,pad,dilation", [(3, 5, 1), (5, 2, 1), (3, 4, 2), (7, 100, 1)])
def test_padded_convolution_crops_by_pad_minus_half_the_effective_kernel(kernel, pad, dilation):
    n = NetSpec()
    data = _data(n)
    n.conv = L.Convolution(data, num_output=1, kernel_size=kernel, pad=pad, dilation=dilation)
    axis, a, b = coord_map_from_to(n.conv, data)
    effective = (kernel - 1) * dilation + 1
    assert axis == 1 and a == 1
    assert b == pytest.approx(-(pad - (effective - 1) / 2))  # conv coordinate x -> data x + (k_eff-1)/2 - pad
    n.crop = crop(n.conv, data)
    proto = n.to_proto()
    assert proto.layer[-1].crop_param.axis == 2  # the first spatial axis
    assert list(proto.layer[-1].crop_param.offset) == [pad - (effective - 1) // 2]


def test_fcn_upsampling_path_crop_offset_and_the_built_net_agrees():
    # conv 3x3 pad 1 (same), pool 2/2, deconv k=4 s=2: upsampled size H + 2, shifted by 1.
    n = NetSpec()
    data = _data(n, 12)
    n.conv = L.Convolution(data, num_output=2, kernel_size=3, pad=1, weight_filler=dict(type="gaussian"))
    n.pool = L.Pooling(n.conv, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    n.relu = L.ReLU(n.pool, in_place=True)
    n.up = L.Deconvolution(n.relu, convolution_param=dict(num_output=2, kernel_size=4, stride=2, bias_term=False,
                                                          weight_filler=dict(type="gaussian")))
    axis, a, b = coord_map_from_to(n.up, data)
    # from up back to data: deconv (2, 1.5) then pool (1/2, -1/4) then conv (1, 0) -> (1, 1.0); inverted: b = -1
    assert axis == 1 and list(a) == [1.0] and list(b) == [-1.0]
    n.score = crop(n.up, data)
    proto = n.to_proto()
    assert (proto.layer[-1].crop_param.axis, list(proto.layer[-1].crop_param.offset)) == (2, [1])
    net = CaffeNet(proto)
    x = torch.randn(1, 1, 12, 12, generator=torch.Generator().manual_seed(0))
    blobs = net(data=x)
    assert tuple(blobs["up"].shape) == (1, 2, 14, 14)
    torch.testing.assert_close(blobs["score"], blobs["up"][:, :, 1:13, 1:13])


def test_two_paths_of_different_strides_meet_at_the_common_ancestor():
    n = NetSpec()
    data = _data(n)
    n.c1 = L.Convolution(data, num_output=1, kernel_size=3, stride=2, pad=3)   # (1/2, (3-1)/2)
    n.c2 = L.Convolution(data, num_output=1, kernel_size=1, stride=2)          # (1/2, 0)
    axis, a, b = coord_map_from_to(n.c1, n.c2)
    # c2 = (x)/2, c1 = (x + 2)/2: c1 coordinate y -> x = 2y - 2 -> c2 = y - 1
    assert axis == 1 and list(a) == [1.0] and list(b) == [-1.0]
    n.cropped = crop(n.c1, n.c2)
    assert list(n.to_proto().layer[-1].crop_param.offset) == [1]


def test_maps_and_their_algebra():
    n = NetSpec()
    data = _data(n)
    pool = L.Pooling(data, pooling_param=dict(kernel_size=3, stride=2, pad=1))
    axis, a, b = coord_map(pool.fn)
    assert axis == 1 and list(a) == [0.5] and list(b) == [0.0]  # (pad - (k-1)/2) / s = (1 - 1) / 2
    assert coord_map(L.ReLU(data).fn) == (None, 1, 0)
    cropped = L.Crop(data, data, crop_param=dict(axis=2, offset=[3, 4]))
    axis, a, b = coord_map(cropped.fn)
    assert axis == 1 and a == 1 and list(b) == [-3, -4]  # crop axis 2: the map's axis 1
    axis, stride, kernel, pad = conv_params(L.Convolution(data, kernel_size=[3, 5], dilation=2, stride=2).fn)
    assert list(kernel) == [5, 9] and list(stride) == [2] and list(pad) == [0]
    assert compose((None, 2, 1), (3, 0.5, 4)) == (3, 1.0, 9)
    assert inverse((1, 4.0, 2.0)) == (1, 0.25, -0.5)
    with pytest.raises(AxisMismatchException):
        compose((1, 1, 0), (2, 1, 0))
    with pytest.raises(UndefinedMapException):
        coord_map(L.InnerProduct(data, num_output=3).fn)


def test_crop_refuses_scaled_negative_fractional_and_unconnected_maps():
    n = NetSpec()
    data = _data(n)
    strided = L.Convolution(data, num_output=1, kernel_size=1, stride=2)
    with pytest.raises(CoordMapError, match="scale mismatch"):
        crop(strided, data)
    smaller = L.Convolution(data, num_output=1, kernel_size=5)  # valid conv: data is larger than it
    assert list(crop(data, smaller).fn.params["crop_param"]["offset"]) == [2]  # the larger one crops
    with pytest.raises(CoordMapError, match="negative width"):
        crop(smaller, data)
    half = L.Convolution(data, num_output=1, kernel_size=2)
    with pytest.raises(CoordMapError, match="noninteger"):
        crop(data, half)
    other = L.Input(shape=dict(dim=[1, 1, 4, 4]))
    with pytest.raises(CoordMapError, match="connected"):
        coord_map_from_to(L.ReLU(other), data)
    fc = L.InnerProduct(data, num_output=2)
    with pytest.raises(RuntimeError):  # Caffe's exception type still catches it
        coord_map_from_to(fc, data)
    with pytest.raises(CoordMapError, match="legacy"):
        coord_map(L.Convolution(data, kernel_h=3, kernel_w=3).fn)
    np.testing.assert_array_equal(coord_map_from_to(data, data)[1:], (1, 0))
