"""Legacy upgrades on hand-built V0 / V1 nets with known Caffe results."""

from __future__ import annotations

import pytest

from caffe_compat.errors import FormatError
from caffe_compat.io import read_net
from caffe_compat.proto import caffe_pb2

V0 = """
name: "v0net"
input: "data"
input_dim: 1 input_dim: 3 input_dim: 8 input_dim: 8
layers { layer { name: "pad1" type: "padding" pad: 2 } bottom: "data" top: "pad1" }
layers { layer { name: "conv1" type: "conv" num_output: 4 kernelsize: 3 stride: 2 biasterm: false
                 blobs_lr: 1 blobs_lr: 2 weight_decay: 1 weight_decay: 0 } bottom: "pad1" top: "conv1" }
layers { layer { name: "relu1" type: "relu" } bottom: "conv1" top: "conv1" }
layers { layer { name: "pool1" type: "pool" pool: AVE kernelsize: 3 stride: 2 } bottom: "conv1" top: "pool1" }
layers { layer { name: "norm1" type: "lrn" local_size: 3 alpha: 0.5 beta: 0.7 } bottom: "pool1" top: "norm1" }
layers { layer { name: "fc" type: "innerproduct" num_output: 10 } bottom: "norm1" top: "fc" }
"""

EXPECTED = """
name: "v0net"
layer { name: "input" type: "Input" top: "data" input_param { shape { dim: 1 dim: 3 dim: 8 dim: 8 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        param { lr_mult: 1 decay_mult: 1 } param { lr_mult: 2 decay_mult: 0 }
        convolution_param { num_output: 4 bias_term: false pad: 2 kernel_size: 3 stride: 2 } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1" pooling_param { pool: AVE kernel_size: 3 stride: 2 } }
layer { name: "norm1" type: "LRN" bottom: "pool1" top: "norm1" lrn_param { local_size: 3 alpha: 0.5 beta: 0.7 } }
layer { name: "fc" type: "InnerProduct" bottom: "norm1" top: "fc" inner_product_param { num_output: 10 } }
"""


def test_v0_padding_folds_and_fields_move():
    upgraded = read_net(V0)
    expected = read_net(EXPECTED, upgrade=False)
    assert upgraded == expected


def test_v1_data_layer_transform_params_move_and_blobs_lr_become_param_specs():
    v1 = """
    layers { name: "d" type: DATA top: "data" top: "label"
             data_param { source: "db" batch_size: 4 scale: 0.5 crop_size: 7 mirror: true mean_file: "m.binaryproto" }
             include { phase: TRAIN } }
    layers { name: "ip" type: INNER_PRODUCT bottom: "data" top: "ip" blobs_lr: 10 blobs_lr: 20
             weight_decay: 1 weight_decay: 0 param: "shared_w" inner_product_param { num_output: 3 } }
    layers { name: "loss" type: SOFTMAX_LOSS bottom: "ip" bottom: "label" top: "loss" loss_weight: 2 }
    """
    net = read_net(v1)
    d, ip, loss = net.layer
    assert d.type == "Data" and d.include[0].phase == caffe_pb2.TRAIN
    assert not d.data_param.HasField("scale") and d.data_param.batch_size == 4
    t = d.transform_param
    assert (t.scale, t.crop_size, t.mirror, t.mean_file) == (0.5, 7, True, "m.binaryproto")
    assert [(p.name, p.lr_mult, p.decay_mult) for p in ip.param] == [("shared_w", 10, 1), ("", 20, 0)]
    assert loss.type == "SoftmaxWithLoss" and list(loss.loss_weight) == [2]


def test_batchnorm_three_param_specs_get_zero_multipliers_and_keep_their_names():
    net = read_net('layer { name: "bn" type: "BatchNorm" bottom: "x" top: "x" '
                   'param { name: "m" lr_mult: 1 decay_mult: 1 } param { lr_mult: 1 } param { name: "f" } }')
    assert [(p.name, p.lr_mult, p.decay_mult) for p in net.layer[0].param] == [("m", 0, 0), ("", 0, 0), ("f", 0, 0)]


def test_batchnorm_with_other_param_counts_is_left_alone():
    net = read_net('layer { name: "bn" type: "BatchNorm" bottom: "x" top: "x" param { lr_mult: 0 } }')
    assert [(p.lr_mult, p.HasField("decay_mult")) for p in net.layer[0].param] == [(0, False)]


def test_input_shape_form_upgrades():
    net = read_net('input: "a" input_shape { dim: 2 dim: 5 } input: "b" input_shape { dim: 2 }')
    layer = net.layer[0]
    assert list(layer.top) == ["a", "b"]
    assert [list(s.dim) for s in layer.input_param.shape] == [[2, 5], [2]]


def test_input_names_without_dims_are_stripped_like_an_old_caffemodel(tmp_path):
    # Old Caffe's Net::ToProto wrote the input names into a caffemodel but not their dims; Caffe's
    # UpgradeNetInput only strips them (no Input layer), so such a caffemodel loads.
    old = caffe_pb2.NetParameter(name="old")
    old.input.extend(["data", "label"])
    ip = old.layer.add(name="ip", type="InnerProduct", bottom=["data"], top=["ip"])
    ip.blobs.add(shape=caffe_pb2.BlobShape(dim=[2, 3]), data=[0.5] * 6)
    path = tmp_path / "old.caffemodel"
    path.write_bytes(old.SerializeToString())
    for source in (path, 'input: "data" input: "label" layer { name: "ip" type: "InnerProduct" bottom: "data" }'):
        net = read_net(source)
        assert not net.input and not net.input_dim and not net.input_shape
        assert [layer.name for layer in net.layer] == ["ip"]


def test_v0_infogain_loss_source_moves_to_infogain_loss_param():
    # Caffe's V0 upgrade sends `source` to infogain_loss_param for an infogain_loss layer (the H matrix file).
    net = read_net('input: "prob" input: "label" '
                   'layers { layer { name: "loss" type: "infogain_loss" source: "H.binaryproto" } '
                   'bottom: "prob" bottom: "label" top: "loss" }')
    assert net.layer[0].type == "InfogainLoss"
    assert net.layer[0].infogain_loss_param.source == "H.binaryproto"


@pytest.mark.parametrize("layers, message", [
    # padding -> padding -> conv: Caffe's padding fold refuses a padding layer fed by another padding layer
    ('layers { layer { name: "p1" type: "padding" pad: 1 } bottom: "data" top: "p1" } '
     'layers { layer { name: "p2" type: "padding" pad: 2 } bottom: "p1" top: "p2" } '
     'layers { layer { name: "c" type: "conv" num_output: 1 kernelsize: 3 } bottom: "p2" top: "c" }',
     "padding layer 'p2' reads the output of another padding layer"),
    # a conv absorbing padding must read that one blob only (the pad would apply to every bottom)
    ('layers { layer { name: "p1" type: "padding" pad: 1 } bottom: "data" top: "p1" } '
     'layers { layer { name: "c" type: "conv" num_output: 1 kernelsize: 3 } bottom: "p1" bottom: "data" top: "c" }',
     "padding feeds layer 'c', which has 2 bottoms"),
], ids=["padding_reads_padding", "conv_with_two_bottoms"])
def test_v0_padding_fold_refuses_what_caffe_refuses(layers, message):
    with pytest.raises(FormatError, match=message):
        read_net('input: "data" input_dim: 1 input_dim: 1 input_dim: 5 input_dim: 5 ' + layers)


def test_unnamed_legacy_layers_stay_unnamed():
    # Caffe's V0->V1 and V1->V2 upgrades copy a layer's name only when it has one, so the upgraded file
    # carries no `name: ""`.
    for legacy in ('input: "x" layers { type: RELU bottom: "x" top: "x" }',
                   'input: "x" layers { layer { type: "relu" } bottom: "x" top: "x" }'):
        layer = read_net(legacy).layer[0]
        assert layer.type == "ReLU" and not layer.HasField("name")
        assert "name" not in str(layer)


def test_v0_transformation_fields_go_to_transform_param_for_every_layer_type():
    # Caffe's V0 upgrade puts scale / meanfile / cropsize / mirror into transform_param whatever the type
    # (for an hdf5_data layer they were dropped); data layers keep the other fields in their own param.
    net = read_net("""
    layers { layer { name: "h" type: "hdf5_data" source: "h.txt" batchsize: 2 scale: 0.5 meanfile: "m" } top: "h" }
    layers { layer { name: "d" type: "data" source: "db" batchsize: 4 rand_skip: 3 cropsize: 7 mirror: true }
             top: "d" }
    layers { layer { name: "w" type: "window_data" source: "w.txt" batchsize: 8 meanfile: "m" det_crop_mode: "square" }
             top: "w" }
    """)
    expected = read_net("""
    layer { name: "h" type: "HDF5Data" top: "h" transform_param { scale: 0.5 mean_file: "m" }
            hdf5_data_param { source: "h.txt" batch_size: 2 } }
    layer { name: "d" type: "Data" top: "d" transform_param { crop_size: 7 mirror: true }
            data_param { source: "db" batch_size: 4 rand_skip: 3 } }
    layer { name: "w" type: "WindowData" top: "w" transform_param { mean_file: "m" }
            window_data_param { source: "w.txt" batch_size: 8 crop_mode: "square" } }
    """, upgrade=False)
    assert net == expected


def test_v0_padding_folds_only_into_readers_of_the_padding_output():
    # Caffe's padding fold follows each bottom to the last layer that wrote it: after an in-place conv
    # has absorbed the padding, a layer reading the same blob name reads the conv's output.
    net = read_net('input: "data" input_dim: 1 input_dim: 1 input_dim: 5 input_dim: 5 '
                   'layers { layer { name: "p1" type: "padding" pad: 1 } bottom: "data" top: "x" } '
                   'layers { layer { name: "c" type: "conv" num_output: 1 kernelsize: 3 } bottom: "x" top: "x" } '
                   'layers { layer { name: "r" type: "relu" } bottom: "x" top: "x" }')
    _, conv, relu = net.layer
    assert list(conv.bottom) == ["data"] and list(conv.convolution_param.pad) == [1]
    assert relu.type == "ReLU" and list(relu.bottom) == ["x"]


def test_a_v1_layer_in_a_v0_net_is_refused_by_name():
    # Caffe's V0 upgrade keeps only the bottoms and tops of a layer without a V0 `layer` (its name, type and
    # params are lost); the error names that layer instead of "layer '': unknown V0 layer type ''".
    with pytest.raises(FormatError, match=r"layer 'r' is written in the V1 format .* other layers are V0"):
        read_net('input: "data" '
                 'layers { layer { name: "c" type: "conv" num_output: 1 kernelsize: 3 } bottom: "data" top: "c" } '
                 'layers { name: "r" type: RELU bottom: "c" top: "c" }')


def test_v2_layers_beside_v1_layers_are_dropped_like_caffe():
    """Caffe's UpgradeV1Net (upgrade_proto.cpp) logs that a net with V1 'layers' "already specifies 'layer'
    fields; these will be ignored for the upgrade", clears them and goes on with the upgraded V1 layers only;
    we refused the file ("the net mixes V1 'layers' and V2 'layer' fields")."""
    text = ('name: "mixed" input: "data" input_dim: 1 input_dim: 2 input_dim: 1 input_dim: 1 '
            'layer { name: "v2_relu" type: "ReLU" bottom: "data" top: "data" } '
            'layers { name: "ip" type: INNER_PRODUCT bottom: "data" top: "ip" inner_product_param { num_output: 3 } }')
    with pytest.warns(UserWarning, match=r"<text>: the net mixes V1 'layers' and V2 'layer' .* ignored: 'v2_relu'"):
        net = read_net(text)
    assert [(layer.name, layer.type) for layer in net.layer] == [("input", "Input"), ("ip", "InnerProduct")]
    assert not net.layers


def test_the_v0_upgrade_keeps_only_caffes_five_net_fields():
    """Caffe's UpgradeV0Net (upgrade_proto.cpp) clears the net and copies back only name, the layers, input,
    input_dim and force_backward: a V0 file's input_shape, state and debug_info are lost (so its input, left
    without dims, is stripped and the conv's bottom is unknown, as in Caffe); ours kept them."""
    v0 = ('name: "old" input: "data" input_shape { dim: 1 dim: 1 dim: 4 dim: 4 } force_backward: true '
          'debug_info: true state { level: 3 } '
          'layers { layer { name: "c" type: "conv" num_output: 1 kernelsize: 3 } bottom: "data" top: "c" }')
    net = read_net(v0)
    assert net.name == "old" and net.force_backward
    assert not net.HasField("debug_info") and not net.HasField("state") and not net.input_shape
    assert [layer.name for layer in net.layer] == ["c"]
    from caffe_compat.net import load_net

    with pytest.raises(FormatError, match="layer 'c' .*unknown bottom blob 'data'"):
        load_net(v0)


def test_v1_transformation_fields_move_only_from_the_param_of_the_layer_type():
    """Caffe's UpgradeNetDataTransformation (CONVERT_LAYER_TRANSFORM_PARAM in upgrade_proto.cpp) moves
    scale/mean_file/crop_size/mirror of a DATA layer's data_param, an IMAGE_DATA layer's image_data_param and a
    WINDOW_DATA layer's window_data_param; ours moved them out of any of the three a layer carried, so an
    IMAGE_DATA layer's stray data_param mean_file became a mean subtraction Caffe never applies."""
    net = read_net('layers { name: "img" type: IMAGE_DATA top: "d" top: "l" '
                   'image_data_param { source: "list.txt" batch_size: 1 scale: 0.5 } '
                   'data_param { mean_file: "m.binaryproto" crop_size: 3 } }')
    (layer,) = net.layer
    assert layer.transform_param.scale == 0.5
    assert not layer.transform_param.HasField("mean_file") and not layer.transform_param.HasField("crop_size")
    assert layer.data_param.mean_file == "m.binaryproto" and layer.data_param.crop_size == 3


def test_extra_input_dims_and_shapes_are_ignored_like_caffe():
    """Caffe's UpgradeNetInput (upgrade_proto.cpp) reads input_shape(i), or input_dim(4i) .. input_dim(4i+3), for
    each input i and nothing else (input_shape wins when both are given); we refused a net with more entries
    than inputs ("1 inputs need 4 input_dim values, found 5")."""
    for text, dims in [('input: "data" input_dim: 1 input_dim: 3 input_dim: 4 input_dim: 5 input_dim: 9', [1, 3, 4, 5]),
                       ('input: "data" input_shape { dim: 2 dim: 3 } input_shape { dim: 7 }', [2, 3]),
                       ('input: "data" input_shape { dim: 6 } input_dim: 1 input_dim: 2', [6])]:
        (layer,) = read_net(text).layer
        assert list(layer.top) == ["data"] and [list(s.dim) for s in layer.input_param.shape] == [dims]
    with pytest.raises(FormatError, match="2 inputs need 8 input_dim values, found 4"):
        read_net('input: "a" input: "b" input_dim: 1 input_dim: 1 input_dim: 1 input_dim: 1')
    with pytest.raises(FormatError, match="2 inputs but 1 input_shape entries"):
        read_net('input: "a" input: "b" input_shape { dim: 1 }')


def test_v0_padding_checks_are_made_where_the_padding_is_read():
    """Caffe's UpgradeV0PaddingLayers (upgrade_proto.cpp) checks a padding layer's single bottom and top only
    when a conv/pool layer reads its output (CHECK_EQ(source_layer.bottom_size(), 1) ...); a padding layer
    nobody reads is dropped whatever its blobs.  Ours refused any padding layer of two bottoms or tops."""
    head = 'input: "data" input: "more" input_dim: 1 input_dim: 1 input_dim: 5 input_dim: 5 ' \
           'input_dim: 1 input_dim: 1 input_dim: 5 input_dim: 5 '
    unread = ('layers { layer { name: "p" type: "padding" pad: 1 } bottom: "data" bottom: "more" top: "p" } '
              'layers { layer { name: "c" type: "conv" num_output: 1 kernelsize: 3 } bottom: "data" top: "c" }')
    net = read_net(head + unread)
    assert [layer.name for layer in net.layer] == ["input", "c"] and not net.layer[1].convolution_param.pad
    with pytest.raises(FormatError, match="V0 padding layer 'p' \\(read by 'c'\\) must have one bottom and one top"):
        read_net(head + unread.replace('bottom: "data" top: "c"', 'bottom: "p" top: "c"'))


def test_a_v0_bottom_nobody_produces_is_refused_by_the_upgrade():
    """Caffe's UpgradeV0PaddingLayers (upgrade_proto.cpp) LOG(FATAL)s "Unknown blob input" for a V0 layer
    bottom that is neither a net input nor an earlier layer's top, so even a V0 caffemodel (where no net is
    built) or upgrade_net_proto_text fails on it; ours upgraded such a net."""
    v0 = ('input: "data" input_dim: 1 input_dim: 1 input_dim: 5 input_dim: 5 '
          'layers { layer { name: "c" type: "conv" num_output: 1 kernelsize: 3 } bottom: "data" top: "c" } '
          'layers { layer { name: "r" type: "relu" } bottom: "nowhere" top: "r" }')
    with pytest.raises(FormatError, match="V0 layer 'r' reads blob 'nowhere', which no earlier layer"):
        read_net(v0)
    assert [layer.name for layer in read_net(v0.replace("nowhere", "c")).layer] == ["input", "c", "r"]
