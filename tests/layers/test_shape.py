"""Concat, Slice, Split, Flatten, Reshape, Crop, Tile, Silence against real Caffe and Caffe's rules."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from caffe_compat.errors import FormatError
from tests.layers.zoo_single_layer import Zoo, make_layer, run_and_compare


@pytest.fixture(scope="module")
def zoo():
    return Zoo("layer_zoo")


@pytest.mark.parametrize("layer", ["concat_c", "concat_h", "slice", "split", "flatten", "reshape", "crop", "tile"])
def test_layer_matches_caffe_exactly(zoo, layer):
    errors = run_and_compare(zoo, layer)
    assert max(errors.values()) == 0.0  # pure data movement: bit-identical, diffs included


def test_crop_second_bottom_gets_no_gradient(zoo):
    assert not np.any(zoo.grads[f"diff:{zoo.bottom_keys('crop')[1]}"])
    port = zoo.build("crop")
    big, ref = zoo.bottoms("crop")
    (out,) = port(big, ref)
    assert torch.autograd.grad(out.sum(), ref, allow_unused=True)[0] is None


def test_legacy_concat_dim_and_slice_dim_choose_the_axis():
    a, b = torch.arange(6.0).reshape(1, 2, 3), torch.arange(6.0, 10.0).reshape(1, 2, 2)
    concat = make_layer('type: "Concat" concat_param { concat_dim: 2 }', [a.shape, b.shape])
    assert concat.output_shapes() == [(1, 2, 5)]
    assert torch.equal(concat(a, b)[0], torch.cat([a, b], 2))
    x = torch.arange(12.0).reshape(2, 6)
    sl = make_layer('type: "Slice" top: "p" top: "q" top: "r" slice_param { slice_dim: 1 }', [x.shape])
    parts = sl(x)
    assert sl.output_shapes() == [(2, 2)] * 3
    assert [p.tolist() for p in parts] == [[[0, 1], [6, 7]], [[2, 3], [8, 9]], [[4, 5], [10, 11]]]
    with pytest.raises(FormatError, match="cannot be sliced equally"):
        make_layer('type: "Slice" top: "p" top: "q" top: "r" top: "s"', [(2, 6)])
    with pytest.raises(FormatError, match="slice_point"):
        make_layer('type: "Slice" top: "p" top: "q" slice_param { slice_point: 1 slice_point: 2 }', [(2, 6)])


def test_slice_point_at_the_axis_end_gives_an_empty_last_top():
    # SliceLayer::Reshape: each point > the previous one, the last part is length - last point (0 allowed:
    # Blob::Reshape takes a 0 dim), and CHECK_LE(tops, length).
    x = torch.arange(8.0).reshape(2, 4)
    sl = make_layer('type: "Slice" top: "p" top: "q" top: "r" slice_param { slice_point: 1 slice_point: 4 }',
                    [x.shape])
    assert sl.output_shapes() == [(2, 1), (2, 3), (2, 0)]
    p, q, r = sl(x)
    assert p.tolist() == [[0.0], [4.0]] and q.tolist() == [[1.0, 2.0, 3.0], [5.0, 6.0, 7.0]] and r.shape == (2, 0)
    with pytest.raises(FormatError, match="slice_point"):
        make_layer('type: "Slice" top: "p" top: "q" slice_param { slice_point: 5 }', [(2, 4)])
    with pytest.raises(FormatError, match="tops for an axis of size 2"):
        make_layer('type: "Slice" top: "p" top: "q" top: "r" slice_param { slice_point: 1 slice_point: 2 }',
                   [(3, 2)])


def test_legacy_dim_together_with_axis_is_refused_as_caffe():
    # Concat/SliceLayer::LayerSetUp: CHECK(!(has_axis() && has_concat_dim())) "Either axis or concat_dim
    # should be specified; not both." (and the same for slice_dim); even when the two agree.
    with pytest.raises(FormatError, match="not both"):
        make_layer('type: "Concat" concat_param { concat_dim: 2 axis: 1 }', [(1, 2, 3), (1, 2, 2)])
    with pytest.raises(FormatError, match="not both"):
        make_layer('type: "Concat" concat_param { concat_dim: 1 axis: 1 }', [(1, 2, 3), (1, 2, 3)])
    with pytest.raises(FormatError, match="not both"):
        make_layer('type: "Slice" top: "p" top: "q" top: "r" slice_param { slice_dim: 1 axis: 0 }', [(2, 6)])
    with pytest.raises(FormatError, match="not both"):
        make_layer('type: "Slice" top: "p" top: "q" slice_param { slice_dim: 1 axis: 1 }', [(2, 6)])


def test_flatten_with_end_axis_just_before_axis_inserts_a_unit_axis():
    # FlattenLayer::Reshape: shape[:axis] + (count(axis, end_axis + 1),) + shape[end_axis + 1:]; with end_axis =
    # axis - 1 the count is over an empty range (1), so a unit axis is inserted; Blob::count CHECKs start <= end.
    x = torch.arange(6.0).reshape(2, 3)
    port = make_layer('type: "Flatten" flatten_param { axis: 1 end_axis: 0 }', [x.shape])
    assert port.output_shapes() == [(2, 1, 3)]
    (y,) = port(x)
    assert y.shape == (2, 1, 3) and torch.equal(y.flatten(), x.flatten())
    last = make_layer('type: "Flatten" flatten_param { axis: -1 end_axis: -2 }', [(2, 3, 4)])
    assert last.output_shapes() == [(2, 3, 1, 4)]
    with pytest.raises(FormatError, match="end_axis"):
        make_layer('type: "Flatten" flatten_param { axis: 2 end_axis: 0 }', [(2, 3, 4)])


@pytest.mark.parametrize("layer, shape", [
    ('type: "Reshape" bottom: "x" top: "x" reshape_param { shape { dim: 0 dim: -1 } }', (2, 3, 4)),
    ('type: "Flatten" bottom: "x" top: "x"', (2, 3, 4)),
    ('type: "Split" bottom: "x" top: "x" top: "y"', (2, 3)),
    ('type: "AbsVal" bottom: "x" top: "x"', (2, 3)),
])
def test_layers_caffe_refuses_to_run_in_place(layer, shape):
    # CHECK_NE(top[0], bottom[0]) << type() << " Layer does not allow in-place computation." in Reshape's and
    # AbsVal's LayerSetUp and Flatten's and Split's Reshape (Split: for every top).
    with pytest.raises(FormatError, match="does not allow in-place computation"):
        make_layer(layer, [shape])
    from caffe_compat.io import read_net
    from caffe_compat.net_shapes import infer_shapes
    net = read_net('layer { name: "in" type: "Input" top: "x" input_param { shape { %s } } }\n'
                        'layer { name: "l" %s }' % (" ".join(f"dim: {d}" for d in shape), layer))
    with pytest.raises(FormatError, match="does not allow in-place computation"):
        infer_shapes(net)


def test_out_of_place_reshape_flatten_split_absval_still_build():
    for layer, shape in [('type: "Reshape" bottom: "x" top: "y" reshape_param { shape { dim: 0 dim: -1 } }', (2, 3, 4)),
                         ('type: "Flatten" bottom: "x" top: "y"', (2, 3, 4)),
                         ('type: "Split" bottom: "x" top: "y" top: "z"', (2, 3)),
                         ('type: "AbsVal" bottom: "x" top: "y"', (2, 3))]:
        make_layer(layer, [shape])


@pytest.mark.parametrize("text, bottom, expected", [
    # Examples from Caffe's ReshapeParameter documentation and reshape_layer tests.
    ('shape { dim: 0 dim: -1 }', (2, 3, 4, 5), (2, 60)),
    ('shape { dim: 0 dim: 2 dim: 3 dim: 10 }', (2, 3, 4, 5), (2, 2, 3, 10)),
    ('axis: 1 num_axes: 1 shape { dim: 3 dim: 1 }', (2, 3, 4, 5), (2, 3, 1, 4, 5)),
    ('axis: 0 num_axes: 0 shape { dim: 1 }', (2, 3, 4, 5), (1, 2, 3, 4, 5)),
    ('axis: -1 num_axes: 0 shape { dim: 1 }', (2, 3, 4, 5), (2, 3, 4, 5, 1)),
    ('axis: 1 num_axes: 2 shape { dim: -1 }', (2, 3, 4, 5), (2, 12, 5)),
    ('axis: -2 shape { dim: 0 dim: -1 }', (2, 3, 4), (2, 3, 4, 1)),  # start = 3 - 2 + 1
    ('shape { dim: -1 }', (2, 3), (6,)),
])
def test_reshape_rules(text, bottom, expected):
    port = make_layer(f'type: "Reshape" reshape_param {{ {text} }}', [bottom])
    assert port.output_shapes() == [expected]
    x = torch.arange(float(np.prod(bottom))).reshape(bottom)
    (y,) = port(x)
    assert tuple(y.shape) == expected and torch.equal(y.flatten(), x.flatten())


def test_reshape_rejects_bad_shapes():
    with pytest.raises(FormatError, match="more than one -1"):
        make_layer('type: "Reshape" reshape_param { shape { dim: -1 dim: -1 } }', [(2, 3)])
    with pytest.raises(FormatError, match="cannot infer"):
        make_layer('type: "Reshape" reshape_param { shape { dim: 4 dim: -1 } }', [(2, 3)])
    with pytest.raises(FormatError, match="changes the count"):
        make_layer('type: "Reshape" reshape_param { shape { dim: 5 } }', [(2, 3)])


def test_reshape_follows_the_batch_size_at_run_time():
    port = make_layer('type: "Reshape" reshape_param { shape { dim: 0 dim: -1 } }', [(2, 3, 4)])
    assert tuple(port(torch.zeros(5, 3, 4))[0].shape) == (5, 12)


def test_crop_single_offset_applies_to_every_cropped_axis():
    x = torch.arange(2 * 3 * 6 * 7.0).reshape(2, 3, 6, 7)
    port = make_layer('type: "Crop" bottom: "a" bottom: "b" crop_param { offset: 2 }', [x.shape, (1, 1, 3, 4)])
    (y,) = port(x, torch.zeros(1, 1, 3, 4))
    assert port.output_shapes() == [(2, 3, 3, 4)]
    assert torch.equal(y, x[:, :, 2:5, 2:6])
    with pytest.raises(FormatError, match="runs past the end"):
        make_layer('type: "Crop" bottom: "a" bottom: "b" crop_param { offset: 4 }', [x.shape, (1, 1, 3, 4)])


def test_crop_reference_with_more_axes_is_read_along_bottom_0s_axes():
    # crop_layer.cpp reads bottom[1]->shape(i) for i < bottom[0]->num_axes() only: extra axes are ignored;
    # a reference with fewer axes makes Blob::shape(i) abort
    x = torch.arange(2 * 3 * 6 * 7.0).reshape(2, 3, 6, 7)
    port = make_layer('type: "Crop" bottom: "a" bottom: "b" crop_param { axis: 1 offset: 1 offset: 2 offset: 3 }',
                      [x.shape, (5, 2, 3, 4, 9)])
    assert port.output_shapes() == [(2, 2, 3, 4)]
    (y,) = port(x, torch.zeros(5, 2, 3, 4, 9))
    assert torch.equal(y, x[:, 1:3, 2:5, 3:7])
    with pytest.raises(FormatError, match="fewer axes"):
        make_layer('type: "Crop" bottom: "a" bottom: "b"', [x.shape, (2, 3, 4)])


def test_flatten_end_axis_and_tile_block_order():
    flat = make_layer('type: "Flatten" flatten_param { axis: 1 end_axis: -2 }', [(2, 3, 4, 5)])
    assert flat.output_shapes() == [(2, 12, 5)]
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    tile = make_layer('type: "Tile" tile_param { axis: 0 tiles: 2 }', [x.shape])
    assert tile(x)[0].tolist() == [[1, 2], [3, 4], [1, 2], [3, 4]]
    tile1 = make_layer('type: "Tile" tile_param { tiles: 3 }', [x.shape])
    assert tile1(x)[0].tolist() == [[1, 2, 1, 2, 1, 2], [3, 4, 3, 4, 3, 4]]


def test_split_tops_sum_their_gradients_and_silence_has_no_top():
    x = torch.randn(3, 2, requires_grad=True)
    split = make_layer('type: "Split" top: "a" top: "b" top: "c"', [x.shape])
    a, b, c = split(x)
    (g,) = torch.autograd.grad((a * 1.0 + b * 2.0 + c * 3.0).sum(), x)
    assert torch.equal(g, torch.full((3, 2), 6.0))
    silence = make_layer('type: "Silence" bottom: "x"', [x.shape])
    assert silence(x) == () and silence.output_shapes() == []


def test_concat_rejects_mismatched_shapes():
    with pytest.raises(FormatError, match="cannot concatenate"):
        make_layer('type: "Concat" bottom: "a" bottom: "b"', [(2, 3, 4), (2, 3, 5)])
