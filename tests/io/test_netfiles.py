"""read_net / write_net on the real-Caffe fixtures, the authors' files and open_nsfw."""

from __future__ import annotations

import glob
from pathlib import Path

import numpy as np
import pytest

from caffe_compat.errors import ParseError
from caffe_compat.io import blob_to_array, blob_to_array_as, read_net, read_solver, write_net
from caffe_compat.proto import caffe_pb2
from tests.conftest import AUTHORS, FIXTURES, fixture_path, shared_reference
NET_PROTOTXTS = sorted(p for p in glob.glob(str(fixture_path("fappy").parent / "**" / "*.prototxt"), recursive=True)
                       if not p.endswith("solver.prototxt"))


@pytest.mark.parametrize("path", NET_PROTOTXTS, ids=lambda p: str(Path(p).relative_to(fixture_path("fappy").parent)))
def test_every_reference_prototxt_parses(path):
    net = read_net(path)
    assert len(net.layer) > 0
    assert not net.layers and not net.input  # upgraded to V2


def test_every_shared_reference_prototxt_parses():
    """The reference prototxts that are not copied into tests/fixtures, in the optional shared folder."""
    root = shared_reference()
    shared_only = sorted(p for p in glob.glob(str(root / "**" / "*.prototxt"), recursive=True)
                         if not p.endswith("solver.prototxt") and not (FIXTURES / Path(p).relative_to(root)).exists())
    for path in shared_only:
        net = read_net(path)
        assert len(net.layer) > 0 and not net.layers and not net.input, path


def test_v1_prototxt_upgrades_to_what_caffe_wrote():
    v1 = read_net(fixture_path("nets/googlenet_small_v1/deploy_v1.prototxt"))
    by_caffe = read_net(fixture_path("nets/googlenet_small_v1/upgraded_by_caffe.prototxt"), upgrade=False)
    assert v1 == by_caffe
    assert v1.layer[0].name == "input" and v1.layer[0].type == "Input"
    assert list(v1.layer[0].input_param.shape[0].dim) == [2, 3, 224, 224]


def test_v1_and_v2_prototxt_are_the_same_net_apart_from_the_input_layer_name():
    v1 = read_net(fixture_path("nets/googlenet_small_v1/deploy_v1.prototxt"))
    v2 = read_net(fixture_path("nets/googlenet_small/deploy.prototxt"))
    assert [l.type for l in v1.layer] == [l.type for l in v2.layer]
    for a, b in zip(v1.layer[1:], v2.layer[1:]):
        a.ClearField("name"), b.ClearField("name")
        assert a == b


def test_v1_caffemodel_carries_the_same_weights_as_v2():
    v1 = read_net(fixture_path("nets/googlenet_small_v1/weights_v1.caffemodel"))
    v2 = read_net(fixture_path("nets/googlenet_small/weights.caffemodel"))
    assert not v1.layers and v1.layer[0].type == "Convolution"  # V1 layers upgraded to V2
    v1_layers = {l.name: l for l in v1.layer}
    compared = 0
    for layer in v2.layer:
        for i, blob in enumerate(layer.blobs):
            expected = blob_to_array(blob)
            legacy = v1_layers[layer.name].blobs[i]
            assert not legacy.HasField("shape")  # num/channels/height/width, as old caffemodels
            np.testing.assert_array_equal(blob_to_array_as(legacy, expected.shape, layer.name), expected)
            compared += 1
    assert compared == 116


def test_caffemodel_blobs_match_params_summary():
    import json

    summary = json.loads(fixture_path("nets/vgg_cnn_m_1024_small/params_summary.json").read_text())
    net = read_net(fixture_path("nets/vgg_cnn_m_1024_small/weights.caffemodel"))
    layers = {l.name: l for l in net.layer}
    checked = 0
    for key, entry in summary.items():
        if not isinstance(entry, dict) or "shape" not in entry:
            continue
        name, index = key.rsplit(":", 1)
        array = blob_to_array(layers[name].blobs[int(index)])
        assert list(array.shape) == entry["shape"]
        assert np.isclose(array.astype(np.float64).sum(), entry["sum"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(array.ravel()[:5], entry["first5"], rtol=0, atol=0)
        checked += 1
    assert checked > 0


@pytest.mark.parametrize("name,data_type", [("cub200/train.prototxt", "Python"),
                                             ("StanfordProducts/train.prototxt", "Data"),
                                             ("vehicleID/VGG1024_CCL_train.prototxt", "Python")])
def test_authors_nets_parse(name, data_type):
    net = read_net(AUTHORS / name)
    types = [l.type for l in net.layer]
    assert types[0] == data_type
    if data_type == "Python":
        assert net.layer[0].python_param.layer == "LabelShufflingLayer"
    assert "CosineSimilarityBatch" in types and "FAPPYLoss" in types
    fappy = [l for l in net.layer if l.type == "FAPPYLoss"][0]
    assert fappy.fappy_loss_param.delta == pytest.approx(1e-4)


@pytest.mark.parametrize("name,expected_type,base_lr", [("cub200/solver.prototxt", "SGD", 1e-5),
                                                         ("vehicleID/experiment_solver.prototxt", "SGD", 5e-4)])
def test_authors_solvers_upgrade(name, expected_type, base_lr):
    solver = read_solver(AUTHORS / name)
    assert solver.type == expected_type and not solver.HasField("solver_type")
    assert solver.base_lr == pytest.approx(base_lr)
    assert solver.gamma == pytest.approx(0.7) and solver.momentum == pytest.approx(0.9)


def test_solver_type_enum_upgrade():
    solver = read_solver("net: 'n.prototxt'\nsolver_type: NESTEROV\nbase_lr: 0.1\n")
    assert solver.type == "Nesterov"


@pytest.mark.parametrize("new", ["Nesterov", "Adam"])
def test_solver_with_both_the_enum_and_the_string_type_is_refused_like_caffe(new):
    from caffe_compat.errors import FormatError

    with pytest.raises(FormatError, match=f"sets both solver_type \\(NESTEROV\\) and type \\('{new}'\\)"):
        read_solver(f"net: 'n.prototxt'\nsolver_type: NESTEROV\ntype: '{new}'\n")


def test_written_caffemodel_reads_back_identically(tmp_path):
    net = read_net(fixture_path("nets/vgg_cnn_m_1024_small/weights.caffemodel"))
    out = tmp_path / "copy.caffemodel"
    write_net(net, out)
    again = read_net(out)
    assert again == net
    for a, b in zip(net.layer, again.layer):
        for x, y in zip(a.blobs, b.blobs):
            np.testing.assert_array_equal(blob_to_array(x), blob_to_array(y))


def test_written_prototxt_reads_back_equal(tmp_path):
    net = read_net(AUTHORS / "cub200/train.prototxt")
    out = tmp_path / "net.prototxt"
    write_net(net, out)
    assert out.read_text().startswith("name:")
    assert read_net(out) == net


def test_open_nsfw_reads(nsfw_dir):
    deploy = read_net(nsfw_dir / "deploy.prototxt")
    weights = read_net(nsfw_dir / "resnet_50_1by2_nsfw.caffemodel")
    assert deploy.layer[0].type == "Input" and deploy.layer[-1].name == "prob"
    fc = [l for l in weights.layer if l.name == "fc_nsfw"][0]
    assert blob_to_array(fc.blobs[0]).shape == (2, 1024)


def test_syntax_error_names_file_line_column_and_field(tmp_path):
    bad = tmp_path / "train.prototxt"
    bad.write_text('name: "x"\nlayer {\n  name: "c"\n  type: "Convolution"\n  convolution_param {\n'
                   '    kernal_size: 3\n  }\n}\n')
    with pytest.raises(ParseError) as err:
        read_net(bad)
    assert str(err.value) == f"{bad}:6:5: unknown field 'kernal_size' in ConvolutionParameter"


def test_bad_enum_value_is_named(tmp_path):
    bad = tmp_path / "p.prototxt"
    bad.write_text('layer { name: "p" type: "Pooling" pooling_param { pool: MEDIAN } }\n')
    with pytest.raises(ParseError, match=r"p.prototxt:1:\d+: 'MEDIAN' is not a value of PoolMethod"):
        read_net(bad)


def test_truncated_caffemodel_is_a_typed_error(tmp_path):
    data = fixture_path("nets/vgg_cnn_m_1024_small/weights.caffemodel").read_bytes()
    cut = tmp_path / "cut.caffemodel"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ParseError, match="cut.caffemodel: not a valid binary NetParameter"):
        read_net(cut)


def test_missing_file_is_named():
    with pytest.raises(ParseError, match="nope.prototxt: no such file"):
        read_net("nope.prototxt")


@pytest.mark.parametrize("name", ["layers_v1.prototxt", "input.caffemodel", "name_only.txt"])
def test_missing_file_named_like_prototxt_text_is_still_a_missing_file(name):
    with pytest.raises(ParseError, match=f"^{name}: no such file$"):
        read_net(name)


LATIN1_NET = (b'name: "caf\xc3\xa9"  # UTF-8 in a string\n'
              b'# commentaire \xe9crit en Latin-1\n'
              b'layer { name: "d" type: "Input" top: "data"  # donn\xe9es\n'
              b'  input_param { shape { dim: 1 dim: 3 } } }\n')


def test_latin1_bytes_in_comments_are_skipped_like_caffe_does(tmp_path):
    path = tmp_path / "old.prototxt"
    path.write_bytes(LATIN1_NET)
    net = read_net(path)
    assert net.name == "café" and [layer.name for layer in net.layer] == ["d"]
    assert list(net.layer[0].input_param.shape[0].dim) == [1, 3]


def test_non_utf8_outside_a_comment_names_line_and_offset(tmp_path):
    path = tmp_path / "bad.prototxt"
    path.write_bytes(b'name: "x"\nlayer { name: "d\xe9" # ok \xe9\n}\n')
    with pytest.raises(ParseError, match=r"bad.prototxt: invalid UTF-8 byte 0xe9 at byte offset 26 \(line 2\)"):
        read_net(path)
    # a '#' inside a quoted string does not start a comment
    path.write_bytes(b'name: "a#\xe9"\n')
    with pytest.raises(ParseError, match="invalid UTF-8 byte 0xe9 at byte offset 9 \\(line 1\\)"):
        read_net(path)


def test_fields_147_148_swish_clip_dialect_in_binary(tmp_path):
    net = caffe_pb2.NetParameter()
    swish = net.layer.add(name="s", type="Swish")
    swish.swish_param.beta = 2.5
    clip = net.layer.add(name="c", type="Clip")
    clip.clip_param.min, clip.clip_param.max = -1.0, 3.0
    fappy = net.layer.add(name="f", type="FAPPYLoss")
    fappy.fappy_loss_param.delta = 0.01
    path = tmp_path / "m.caffemodel"
    write_net(net, path)
    # On disk, BVLC master's numbers: Swish's params sit in field 147, Clip's in 148.
    raw = caffe_pb2.NetParameter.FromString(path.read_bytes())
    assert raw.layer[1].HasField("fappy_loss_param") and not raw.layer[1].HasField("clip_param")
    assert raw.layer[1].fappy_loss_param.delta == -1.0  # what a reader blind to the type would see
    back = read_net(path)
    assert back.layer[0].swish_param.beta == 2.5 and not back.layer[0].HasField("cosine_similarity_batch_param")
    assert (back.layer[1].clip_param.min, back.layer[1].clip_param.max) == (-1.0, 3.0)
    assert back.layer[2].fappy_loss_param.delta == pytest.approx(0.01)


def test_large_googlenet_caffemodel_reads():
    path = shared_reference("large/googlenet_full/weights.caffemodel")
    net = read_net(path)
    total = sum(blob_to_array(b).size for l in net.layer for b in l.blobs)
    assert total == 6_498_352


@pytest.mark.parametrize("value, field, message", [
    ("convolution_param { num_output: four }", "num_output", "Couldn't parse integer: four"),
    ("convolution_param { num_output: -4 }", "num_output", "Value out of range: -4"),
    ("relu_param { negative_slope: abc }", "negative_slope", "Couldn't parse float: abc"),
])
def test_bad_value_names_file_position_and_field(tmp_path, value, field, message):
    path = tmp_path / "v.prototxt"
    path.write_text(f'layer {{\n  name: "c"\n  {value}\n}}\n')
    col = 3 + value.index(field) + len(field) + 2
    with pytest.raises(ParseError) as info:
        read_net(path)
    assert str(info.value) == f"{path}:3:{col}: field '{field}': {message}"
