"""Converters: Caffe files -> checkpoint -> Caffe files, exact to the bit, and the ``convert`` command."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from caffe_compat.checkpoint import FORMAT, load_checkpoint, save_checkpoint
from caffe_compat.cli import main
from caffe_compat.errors import FormatError, ShapeMismatchError
from caffe_compat.io import blob_to_array, read_net
from caffe_compat.net import load_net
from converters import convert_caffe_to_torch, convert_torch_to_caffe
from tests.conftest import REPO, fixture_path


def _files(directory: str) -> tuple[str, str]:
    return str(fixture_path(f"{directory}/deploy.prototxt")), str(fixture_path(f"{directory}/weights.caffemodel"))


def _blobs_by_layer(path) -> dict[str, list[np.ndarray]]:
    return {layer.name: [blob_to_array(b) for b in layer.blobs] for layer in read_net(str(path)).layer}


def _forward(net, data) -> dict:
    with torch.no_grad():
        return net(data=torch.from_numpy(data))


@pytest.mark.parametrize("directory", ["nets/googlenet_small", "layer_zoo"])
def test_checkpoint_reloads_weights_only_with_identical_outputs(directory, tmp_path):
    proto, weights = _files(directory)
    data = np.load(fixture_path(f"{directory}/blobs.npz"))
    convert_caffe_to_torch(proto, weights, tmp_path / "model.pt")
    payload = torch.load(tmp_path / "model.pt", weights_only=True)  # tensors and strings only
    assert payload["format"] == FORMAT and payload["phase"] == "test"
    assert all(torch.is_tensor(v) for v in payload["state_dict"].values())
    reloaded, original = load_checkpoint(tmp_path / "model.pt"), load_net(proto, weights)
    a, b = _forward(reloaded, data["data"]), _forward(original, data["data"])
    assert list(a) == list(b) == list(data["__blob_order__"])  # same blobs, Split tops included
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert reloaded.layer_names == original.layer_names and dict(reloaded.loss_weights) == dict(original.loss_weights)


def test_reverse_conversion_reads_back_identically_with_batchnorm_factor(tmp_path):
    proto, weights = _files("layer_zoo")
    convert_caffe_to_torch(proto, weights, tmp_path / "zoo.pt")
    prototxt, caffemodel = convert_torch_to_caffe(tmp_path / "zoo.pt", tmp_path / "out" / "zoo")
    source, written = _blobs_by_layer(weights), _blobs_by_layer(caffemodel)
    compared = 0
    for layer, blobs in source.items():
        assert len(written[layer]) == len(blobs), layer
        for got, expected in zip(written[layer], blobs):
            assert got.shape == expected.shape and np.array_equal(got, expected), layer
            compared += 1
    assert compared == sum(len(v) for v in source.values()) > 20
    assert float(written["bn"][2].reshape(-1)[0]) == 0.5  # BatchNorm's stored scale factor kept as is
    assert float(written["bn_zero_factor"][2].reshape(-1)[0]) == 0.0  # Caffe then divides by sqrt(eps)
    ref = np.load(fixture_path("layer_zoo/blobs.npz"))
    again = _forward(load_net(str(prototxt), str(caffemodel)), ref["data"])
    worst = max(float(np.abs(again[n].numpy() - ref[n]).max() / max(np.abs(ref[n]).max(), 1e-30)) for n in again)
    assert list(again) == list(ref["__blob_order__"]) and worst < 1e-4


_SIAMESE = """name: "siamese"
layer { name: "data" type: "Input" top: "data" top: "data_p"
  input_param { shape { dim: 2 dim: 3 } shape { dim: 2 dim: 3 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1" param { name: "ip1_w" } param { name: "ip1_b" }
  inner_product_param { num_output: 4 weight_filler { type: "gaussian" } } }
layer { name: "ip1_p" type: "InnerProduct" bottom: "data_p" top: "ip1_p" param { name: "ip1_w" } param { name: "ip1_b" }
  inner_product_param { num_output: 4 weight_filler { type: "gaussian" } } }
"""


@pytest.mark.parametrize("stored", ["ip1", "ip1_p"])
def test_a_siamese_net_takes_its_shared_blobs_from_either_branch(tmp_path, stored, recwarn):
    """Caffe's shared blobs are one memory: a caffemodel of one branch (the owner's layer name or the
    sharer's) supplies both.  ``convert`` refused it ("no weights for layer(s) ['ip1_p']" / ['ip1']) and,
    with only the sharer stored, load_net warned (strict: refused) that the owner kept its fillers."""
    single = (f'name: "one" layer {{ name: "data" type: "Input" top: "data"'
              f' input_param {{ shape {{ dim: 2 dim: 3 }} }} }}'
              f' layer {{ name: "{stored}" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param {{'
              f' num_output: 4 weight_filler {{ type: "gaussian" }} bias_filler {{ type: "gaussian" }} }} }}')
    (tmp_path / "siamese.prototxt").write_text(_SIAMESE)
    (tmp_path / "one.prototxt").write_text(single)
    one = load_net(str(tmp_path / "one.prototxt"), seed=7)
    one.save_caffemodel(tmp_path / "one.caffemodel")
    net = convert_caffe_to_torch(tmp_path / "siamese.prototxt", tmp_path / "one.caffemodel", tmp_path / "s.pt")
    strict = load_net(str(tmp_path / "siamese.prototxt"), str(tmp_path / "one.caffemodel"), strict=True)
    assert not [w for w in recwarn.list if "weights do not match" in str(w.message)]
    reloaded = load_checkpoint(tmp_path / "s.pt")
    for candidate in (net, strict, reloaded):
        for layer in ("ip1", "ip1_p"):
            for got, expected in zip(candidate.params[layer], one.params[stored]):
                assert torch.equal(got, expected), (layer, stored)
    (tmp_path / "other.prototxt").write_text(single.replace(f'"{stored}"', '"ip9"'))
    load_net(str(tmp_path / "other.prototxt"), seed=7).save_caffemodel(tmp_path / "other.caffemodel")
    with pytest.raises(ShapeMismatchError, match=r"no weights for layer\(s\) \['ip1', 'ip1_p'\]"):
        convert_caffe_to_torch(tmp_path / "siamese.prototxt", tmp_path / "other.caffemodel", tmp_path / "x.pt")


def test_a_float64_net_reloads_from_its_checkpoint_in_float64(tmp_path):
    """The checkpoint stores the tensors in their dtype; the rebuilt net was float32, so a net saved after
    ``.double()`` came back rounded to float32 (a float64 forward no longer the same)."""
    proto, weights = _files("layer_zoo")
    net = load_net(proto, weights).double()
    with torch.no_grad():
        for blobs in net.params.values():
            for blob in blobs:
                blob.add_(2.0 ** -40)  # below float32's resolution around the weights
    save_checkpoint(net, tmp_path / "double.pt")
    again = load_checkpoint(tmp_path / "double.pt")
    assert {t.dtype for t in again.state_dict().values() if t.is_floating_point()} == {torch.float64}
    for name, blobs in net.params.items():
        assert all(torch.equal(a, b) for a, b in zip(blobs, again.params[name])), name
    data = torch.from_numpy(np.load(fixture_path("layer_zoo/blobs.npz"))["data"]).double()
    with torch.no_grad():
        a, b = net(data=data), again(data=data)
    assert all(torch.equal(a[name], b[name]) for name in a)
    save_checkpoint(load_net(proto, weights), tmp_path / "single.pt")  # float32 stays float32
    assert load_checkpoint(tmp_path / "single.pt").params["bn"][0].dtype == torch.float32


def test_double_data_weights_of_a_float64_net_are_written_back_as_double_data(tmp_path):
    """Caffe's Blob<double>::ToProto writes double_data: a float64 net's weights (read from double_data,
    unrounded) went out rounded to float32 ``data``, through save_caffemodel and ``convert --to-caffe``."""
    proto, weights = _files("layer_zoo")
    source = read_net(weights)
    rng = np.random.default_rng(0)
    for layer in source.layer:
        for blob in layer.blobs:
            values = np.asarray(blob.data, np.float64) + rng.uniform(-1, 1, len(blob.data)) * 2.0 ** -40
            del blob.data[:]
            blob.double_data.extend(values.tolist())
    (tmp_path / "double.caffemodel").write_bytes(source.SerializeToString())
    net = load_net(proto).double()
    net.load_caffemodel(tmp_path / "double.caffemodel", strict=True)
    net.save_caffemodel(tmp_path / "saved.caffemodel")
    save_checkpoint(net, tmp_path / "double.pt")
    _, converted = convert_torch_to_caffe(tmp_path / "double.pt", tmp_path / "back")
    expected = {layer.name: [np.asarray(b.double_data, np.float64) for b in layer.blobs] for layer in source.layer}
    for written in (tmp_path / "saved.caffemodel", converted):
        got = {layer.name: layer.blobs for layer in read_net(str(written)).layer}
        for name, blobs in expected.items():
            assert [len(b.data) for b in got[name]] == [0] * len(blobs), name
            assert all(np.array_equal(np.asarray(g.double_data, np.float64), e) for g, e in zip(got[name], blobs)), name
    single = load_net(proto, str(tmp_path / "double.caffemodel")).to_netparameter()  # a float32 net: data
    assert all(len(b.data) and not len(b.double_data) for layer in single.layer for b in layer.blobs)


def test_loss_weight_moved_onto_a_split_survives_the_checkpoint(tmp_path):
    """A weighted top read by another layer: InsertSplits moves its weight to the Split's first top; the
    checkpoint prototxt gives it back to the producer, so the rebuilt net has the same objective."""
    text = """name: "weighted_split"
    layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 } } }
    layer { name: "ip" type: "InnerProduct" bottom: "x" top: "ip" inner_product_param { num_output: 4
            weight_filler { type: "gaussian" std: 1 } } }
    layer { name: "sq" type: "Reduction" bottom: "ip" top: "sq" loss_weight: 2.0
            reduction_param { operation: SUMSQ axis: 1 } }
    layer { name: "tot" type: "Reduction" bottom: "sq" top: "tot" loss_weight: 0.5 }
    """
    net = load_net(text, seed=7)
    assert dict(net.loss_weights) == {"sq_sq_0_split_0": 2.0, "tot": 0.5}
    save_checkpoint(net, tmp_path / "w.pt")
    again = load_checkpoint(tmp_path / "w.pt")
    assert dict(again.loss_weights) == dict(net.loss_weights) and again.layer_names == net.layer_names
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(0))
    a, b = net(x=x), again(x=x)
    assert torch.equal(net.objective(a), again.objective(b))
    ip = a["ip"].detach()
    assert float(net.objective(a).detach()) == pytest.approx(2.5 * float((ip ** 2).sum()), rel=1e-6)


def test_train_phase_checkpoint_keeps_the_phase(tmp_path):
    case = fixture_path("solvers/sgd_step_momentum")
    assert main(["convert", str(case / "net.prototxt"), str(case / "init.caffemodel"), "-o",
                 str(tmp_path / "tiny.pt"), "--phase", "train"]) == 0
    net = load_checkpoint(tmp_path / "tiny.pt")
    assert net.phase == "train" and net.training and net.layer_names[-1] == "loss"
    init = _blobs_by_layer(case / "init.caffemodel")
    assert np.array_equal(net.params["ip1"][0].detach().numpy(), init["ip1"][0])


def test_cli_round_trip_and_exit_codes(tmp_path, capsys):
    proto, weights = _files("nets/googlenet_small")
    assert main(["convert", proto, weights, "-o", str(tmp_path / "g.pt")]) == 0
    assert "409,372 values" in capsys.readouterr().out
    (tmp_path / "back").mkdir()
    assert main(["convert", "--to-caffe", str(tmp_path / "g.pt"), "-o", str(tmp_path / "back" / "g")]) == 0
    assert (tmp_path / "back" / "g.prototxt").is_file() and (tmp_path / "back" / "g.caffemodel").is_file()
    capsys.readouterr()
    # weights of another net: names do not match -> a clear error, status 2
    vgg_weights = _files("nets/vgg_cnn_m_1024_small")[1]
    assert main(["convert", proto, vgg_weights, "-o", str(tmp_path / "x.pt")]) == 2
    assert "no weights for layer(s) ['conv1/7x7_s2'" in capsys.readouterr().err
    assert main(["convert", proto, vgg_weights, "-o", str(tmp_path / "x.pt"), "--allow-missing"]) == 0
    assert main(["convert", proto, "-o", str(tmp_path / "x.pt")]) == 2
    assert main(["convert", "--to-caffe", str(tmp_path / "nope.pt"), "-o", str(tmp_path / "n")]) == 2
    torch.save({"weights": torch.zeros(2)}, tmp_path / "foreign.pt")
    assert main(["convert", "--to-caffe", str(tmp_path / "foreign.pt"), "-o", str(tmp_path / "n")]) == 2
    assert "not a caffe-compat checkpoint" in capsys.readouterr().err
    with pytest.raises(FormatError):
        load_checkpoint(tmp_path / "foreign.pt")
    # a shape mismatch (same names, other widths): the command names the layer
    changed = tmp_path / "wide.prototxt"
    changed.write_text(open(proto).read().replace("num_output: 128", "num_output: 64", 1))
    with pytest.raises(ShapeMismatchError):
        convert_caffe_to_torch(changed, weights, tmp_path / "y.pt")
    process = subprocess.run([sys.executable, "-m", "caffe_compat.cli", "convert", str(changed), weights, "-o",
                              str(tmp_path / "y.pt")], capture_output=True, text=True, cwd=REPO)
    assert process.returncode == 2 and "error:" in process.stderr and "Traceback" not in process.stderr


def test_an_output_that_is_one_of_the_inputs_is_refused_and_the_input_kept(tmp_path, capsys, monkeypatch):
    """``convert NET W.caffemodel -o W.caffemodel`` replaced the caffemodel with the checkpoint (exit 0);
    now exit 2, the input untouched, whichever spelling names it."""
    proto, weights = _files("layer_zoo")
    for name, source in (("zoo.prototxt", proto), ("zoo.caffemodel", weights)):
        (tmp_path / name).write_bytes(open(source, "rb").read())
    monkeypatch.chdir(tmp_path)
    originals = {name: (tmp_path / name).read_bytes() for name in ("zoo.prototxt", "zoo.caffemodel")}
    for output in ("zoo.caffemodel", "./zoo.prototxt", str(tmp_path / "zoo.caffemodel")):
        assert main(["convert", "zoo.prototxt", "zoo.caffemodel", "-o", output]) == 2
        assert "the output is the input" in capsys.readouterr().err
    assert main(["convert", "zoo.prototxt", "zoo.caffemodel", "-o", "zoo.pt"]) == 0
    (tmp_path / "ckpt.caffemodel").write_bytes((tmp_path / "zoo.pt").read_bytes())  # a checkpoint, oddly named
    assert main(["convert", "--to-caffe", "ckpt.caffemodel", "-o", "ckpt"]) == 2
    assert "ckpt.caffemodel: the output is the input" in capsys.readouterr().err
    assert load_checkpoint(tmp_path / "ckpt.caffemodel").name == "layer_zoo_public"
    assert {name: (tmp_path / name).read_bytes() for name in originals} == originals


@pytest.mark.parametrize("target", ["a_file/x.pt", "a_folder"])
def test_checkpoint_that_cannot_be_written_is_a_one_line_error(tmp_path, target):
    """-o under a regular file, or naming a folder: exit 2, the path named, no traceback, nothing left."""
    (tmp_path / "a_file").write_text("not a folder")
    (tmp_path / "a_folder").mkdir()
    proto, weights = _files("nets/googlenet_small")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    process = subprocess.run([sys.executable, "-m", "caffe_compat.cli", "convert", proto, weights, "-o",
                              str(tmp_path / target)], capture_output=True, text=True, cwd=REPO)
    assert process.returncode == 2 and "Traceback" not in process.stderr
    assert process.stderr.count("\n") == 1 and f"{tmp_path / target}: cannot write" in process.stderr
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_to_caffe_writes_nothing_when_the_caffemodel_cannot_be_written(tmp_path, capsys):
    """The caffemodel target is a folder: exit 2 with a one-line error, and no prototxt (nor temporary
    file) is left beside it."""
    case = fixture_path("solvers/sgd_step_momentum")
    convert_caffe_to_torch(case / "net.prototxt", case / "init.caffemodel", tmp_path / "t.pt")
    out = tmp_path / "out"
    (out / "t.caffemodel").mkdir(parents=True)
    capsys.readouterr()
    assert main(["convert", "--to-caffe", str(tmp_path / "t.pt"), "-o", str(out / "t")]) == 2
    err = capsys.readouterr().err
    assert "t.caffemodel: cannot write" in err and "Traceback" not in err
    assert sorted(p.name for p in out.iterdir()) == ["t.caffemodel"] and not any((out / "t.caffemodel").iterdir())


def test_to_caffe_failure_restores_the_previous_pair_and_removes_new_folders(tmp_path, monkeypatch):
    import errno
    import os

    import caffe_compat.io.atomic as module  # where the pair is written
    from caffe_compat.errors import WriteError

    case = fixture_path("solvers/sgd_step_momentum")
    convert_caffe_to_torch(case / "net.prototxt", case / "init.caffemodel", tmp_path / "t.pt")
    convert_caffe_to_torch(*_files("layer_zoo"), tmp_path / "zoo.pt")
    old = convert_torch_to_caffe(tmp_path / "t.pt", tmp_path / "out" / "m")
    before = [p.read_bytes() for p in old]
    real_replace = os.replace

    def disk_full_on_caffemodel(src, dst):
        if str(dst).endswith(".caffemodel"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(module.os, "replace", disk_full_on_caffemodel)
    with pytest.raises(WriteError, match=r"m\.caffemodel: cannot write \(No space left on device\)"):
        convert_torch_to_caffe(tmp_path / "zoo.pt", tmp_path / "out" / "m")  # the prototxt was renamed first
    assert [p.read_bytes() for p in old] == before  # the old pair, as it was
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["m.caffemodel", "m.prototxt"]
    with pytest.raises(WriteError):
        convert_torch_to_caffe(tmp_path / "zoo.pt", tmp_path / "fresh" / "deep" / "m")
    assert not (tmp_path / "fresh").exists()
    monkeypatch.undo()
    new = convert_torch_to_caffe(tmp_path / "zoo.pt", tmp_path / "out" / "m")
    assert [p.read_bytes() for p in new] != before and len(list((tmp_path / "out").iterdir())) == 2
