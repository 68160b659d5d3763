"""Our paper nets and solvers (prototxt/) against the FAPPY authors' files, layer by layer.

The authors' prototxt and solvers are committed in ``tests/fixtures/authors`` (copied unchanged from
the team's shared folder).  Differences allowed: the data layer's file paths, and the
solver's ``net`` / ``snapshot_prefix`` (ours names the net beside the solver); everything else must be the
identical protobuf message.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from google.protobuf import text_format

from caffe_compat.io import read_net, read_solver
from caffe_compat.net_shapes import infer_shapes
from caffe_compat.proto import caffe_pb2
from caffe_compat.zoo.data_layers import parse_param_str
from caffe_compat.zoo.loss_heads import BASELINES
from caffe_compat.zoo.paper import PAPER_SETUPS, paper_files
from caffe_compat.zoo.write_prototxt import main as write_main
from caffe_compat.zoo.write_prototxt import rendered_files, stale_files
from tests.conftest import AUTHORS, REPO, fixture_path
PROTOTXT = REPO / "prototxt"

# our folder -> (authors' train prototxt, authors' solver)
AUTHORS_FILES = {
    "cub200": ("cub200/train.prototxt", "cub200/solver.prototxt"),
    "sop": ("StanfordProducts/train.prototxt", "StanfordProducts/solver.prototxt"),
    "vehicleid": ("vehicleID/VGG1024_CCL_train.prototxt", "vehicleID/experiment_solver.prototxt"),
}
PATH_KEYS = {"source", "mean_file"}
FOLDERS = ("cub200", "sop", "vehicleid", "digits")


def ours(folder: str, name: str) -> caffe_pb2.NetParameter:
    return read_net(PROTOTXT / folder / name)


def layer_text(layer) -> str:
    return text_format.MessageToString(layer)


def assert_same_layers(expected, actual, what: str) -> None:
    assert [l.name for l in actual] == [l.name for l in expected], f"{what}: layer names/order differ"
    for want, got in zip(expected, actual):
        assert got == want, (f"{what}: layer '{want.name}' differs\n"
                             f"--- expected\n{layer_text(want)}--- ours\n{layer_text(got)}")


def without_head(net) -> list:
    return [l for l in net.layer if l.name not in ("cosine", "loss")]


@pytest.mark.parametrize("folder", sorted(AUTHORS_FILES))
def test_train_net_equals_the_authors_apart_from_data_paths(folder):
    theirs = read_net(AUTHORS / AUTHORS_FILES[folder][0])
    mine = ours(folder, "train_fappy.prototxt")
    assert mine.name == theirs.name
    # every layer after the data layer: the identical message (type, bottoms, tops, params, fillers, ...)
    assert_same_layers(theirs.layer[1:], mine.layer[1:], folder)
    # net-level fields (none but name and layers in these files)
    strip = [caffe_pb2.NetParameter(), caffe_pb2.NetParameter()]
    for out, net in zip(strip, (theirs, mine)):
        out.CopyFrom(net)
        del out.layer[:]
    assert strip[0] == strip[1]

    their_data, my_data = theirs.layer[0], mine.layer[0]
    assert (my_data.name, my_data.type, list(my_data.top)) == (their_data.name, their_data.type, ["data", "label"])
    if their_data.type == "Python":
        assert (my_data.python_param.module, my_data.python_param.layer) == \
               (their_data.python_param.module, their_data.python_param.layer)
        their_cfg = parse_param_str(their_data.python_param.param_str)
        my_cfg = parse_param_str(my_data.python_param.param_str)
        assert set(my_cfg) == set(their_cfg)
        for key in set(their_cfg) - PATH_KEYS:
            assert my_cfg[key] == their_cfg[key], key
        assert Path(my_cfg["mean_file"]).name == Path(their_cfg["mean_file"]).name
    else:
        a, b = caffe_pb2.LayerParameter(), caffe_pb2.LayerParameter()
        a.CopyFrom(their_data)
        b.CopyFrom(my_data)
        for layer in (a, b):
            layer.data_param.ClearField("source")
            layer.transform_param.ClearField("mean_file")
        assert a == b, f"{layer_text(a)}\n{layer_text(b)}"


def test_authors_batch_settings_reach_our_data_layers():
    """The numbers the paper states: batch 128 with 10 per label (CUB), 150 with 16 (VehicleID)."""
    cub = parse_param_str(ours("cub200", "train_fappy.prototxt").layer[0].python_param.param_str)
    veh = parse_param_str(ours("vehicleid", "train_fappy.prototxt").layer[0].python_param.param_str)
    assert (cub["batch_size"], cub["max_number_object_per_label"], cub["scales"]) == (128, 10, [1.0, 1.0])
    assert (veh["batch_size"], veh["max_number_object_per_label"]) == (150, 16)
    sop = ours("sop", "train_fappy.prototxt").layer[0]
    assert (sop.data_param.batch_size, sop.transform_param.crop_size, sop.transform_param.mirror) == (128, 227, True)


@pytest.mark.parametrize("folder", sorted(AUTHORS_FILES))
def test_solver_equals_the_authors_apart_from_paths(folder):
    theirs = read_solver(AUTHORS / AUTHORS_FILES[folder][1])
    mine = read_solver(PROTOTXT / folder / "solver.prototxt")
    # our net path names the file beside the solver (works from any working directory), theirs is theirs
    assert mine.net == "train_fappy.prototxt" and (PROTOTXT / folder / mine.net).is_file()
    for solver in (theirs, mine):
        solver.ClearField("net")
        solver.ClearField("snapshot_prefix")
    assert mine == theirs, f"{text_format.MessageToString(theirs)}\n{text_format.MessageToString(mine)}"


def test_solvers_hold_the_papers_learning_rates():
    rates = {f: read_solver(PROTOTXT / f / "solver.prototxt") for f in AUTHORS_FILES}
    for folder, expected in {"cub200": (1e-5, 32000), "sop": (1e-4, 160000), "vehicleid": (5e-4, 32000)}.items():
        s = rates[folder]
        assert s.base_lr == pytest.approx(expected[0], rel=1e-6) and s.stepsize == expected[1]
        assert (s.type, s.lr_policy, s.gamma, s.momentum) == ("SGD", "step", pytest.approx(0.7), pytest.approx(0.9))
        assert s.weight_decay == pytest.approx(2e-4)


@pytest.mark.parametrize("folder", FOLDERS)
def test_every_solver_names_the_net_beside_it(folder):
    solver = read_solver(PROTOTXT / folder / "solver.prototxt")
    assert solver.net == "train_fappy.prototxt" and "/" not in solver.net
    assert (PROTOTXT / folder / solver.net).is_file()


@pytest.mark.parametrize("where", ["elsewhere", "solver_folder", "repository_root"])
def test_train_finds_the_solvers_net_from_any_working_directory(where, tmp_path, monkeypatch):
    """``caffe-compat train /abs/path/prototxt/digits/solver.prototxt`` from another folder: the Solver
    (what ``train`` builds) reads ``net`` relative to the solver's folder when the CWD does not hold it."""
    from caffe_compat.solver import Solver

    solver_path = (PROTOTXT / "digits" / "solver.prototxt").resolve()
    monkeypatch.chdir({"elsewhere": tmp_path, "solver_folder": solver_path.parent, "repository_root": REPO}[where])
    solver = Solver(str(solver_path), device="cpu")
    assert solver.base_dir == solver_path.parent
    assert solver.net.name == read_net(PROTOTXT / "digits" / "train_fappy.prototxt").name == "digits_embedding_fappy"
    assert "fc_embedding" in solver.net.params
    assert list(tmp_path.iterdir()) == []  # construction writes nothing


def test_train_cli_opens_a_solvers_net_from_another_directory(tmp_path, monkeypatch, capsys):
    """Through the CLI: the net is found (the digits net is then refused for its Input-only data, exit 2,
    which names the net it read: not a missing-file error)."""
    from caffe_compat.cli import main

    monkeypatch.chdir(tmp_path)
    status = main(["train", str((PROTOTXT / "digits" / "solver.prototxt").resolve()), "--device", "cpu"])
    err = capsys.readouterr().err
    assert status == 2
    assert "('digits_embedding_fappy') reads its batches only from Input layers" in err and "not found" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("folder", FOLDERS)
def test_deploy_is_the_train_net_minus_data_and_loss_plus_input(folder):
    deploy = ours(folder, "deploy.prototxt")
    train = ours(folder, "train_fappy.prototxt")
    data_layers = {"Python", "Data", "Input"}
    trunk = [l for l in without_head(train) if l.type not in data_layers]
    assert deploy.layer[0].type == "Input" and list(deploy.layer[0].top) == ["data"]
    assert_same_layers(trunk, deploy.layer[1:], f"{folder} deploy")
    shape = tuple(deploy.layer[0].input_param.shape[0].dim)
    expected = {"cub200": (1, 3, 224, 224), "sop": (1, 3, 227, 227), "vehicleid": (1, 3, 224, 224),
                "digits": (1, 3, 32, 32)}[folder]
    assert shape == expected
    assert {l.type for l in deploy.layer} & {"CosineSimilarityBatch", "FAPPYLoss", "Python", "Data"} == set()


@pytest.mark.parametrize("folder", FOLDERS)
def test_baseline_nets_share_the_fappy_trunk_and_swap_the_head(folder):
    train = ours(folder, "train_fappy.prototxt")
    cosine = next(l for l in train.layer if l.type == "CosineSimilarityBatch")
    embedding = cosine.bottom[0]
    assert list(cosine.top) == ["cosine", "pair_label"]
    fappy = next(l for l in train.layer if l.type == "FAPPYLoss")
    assert list(fappy.bottom) == ["cosine", "label"] and fappy.fappy_loss_param.delta == pytest.approx(1e-4)
    files = (PROTOTXT / folder).glob("train_*.prototxt")
    baselines = sorted(p.stem[len("train_"):] for p in files if p.stem != "train_fappy")
    expected = sorted(PAPER_SETUPS[folder].baselines) if folder in PAPER_SETUPS else sorted(BASELINES)
    assert baselines == expected
    for loss in baselines:
        net = ours(folder, f"train_{loss}.prototxt")
        assert_same_layers(without_head(train), net.layer[:-1], f"{folder}/{loss}")
        head = net.layer[-1]
        type_, settings = BASELINES[loss]
        assert (head.type, list(head.bottom), list(head.top)) == (type_, [embedding, "label"], ["loss"])
        for key, value in settings.items():
            assert getattr(head.metric_loss_param, key) == pytest.approx(value) if isinstance(value, float) \
                else getattr(head.metric_loss_param, key) == value


def test_embedding_blobs_and_shapes():
    """Shapes from Caffe's rules, against hand-computed sizes: GoogLeNet reaches 7x7 at inception_5b
    from 224 and from 227 (ceil pooling), VGG_CNN_M_1024 reaches 6x6 at pool5 from 224."""
    for folder, size in (("cub200", 224), ("sop", 227)):
        blobs, _ = infer_shapes(ours(folder, "deploy.prototxt"))
        assert blobs["inception_5b/output"] == (1, 1024, 7, 7)
        assert blobs["pool5/7x7_s1"] == (1, 1024, 1, 1)
        assert blobs["fc_embedding"] == (1, 512)
    blobs, table = infer_shapes(ours("vehicleid", "deploy.prototxt"))
    conv1 = (224 - 7) // 2 + 1                           # 109
    pool1 = math.ceil((conv1 - 3) / 2) + 1               # 54
    conv2 = (pool1 + 2 - 5) // 2 + 1                     # 26
    pool2 = math.ceil((conv2 - 3) / 2) + 1               # 13
    pool5 = math.ceil((pool2 - 3) / 2) + 1               # 6
    assert blobs["conv1"] == (1, 96, conv1, conv1) and blobs["pool5"] == (1, 512, pool5, pool5)
    assert dict((l.name, l.param_shapes) for l in table)["fc6"] == [(4096, 512 * pool5 * pool5), (4096,)]
    assert blobs["fc7"] == (1, 1024)
    blobs, table = infer_shapes(ours("digits", "train_fappy.prototxt"))
    assert blobs["data"] == (64, 3, 32, 32) and blobs["label"] == (64,)
    assert blobs["pool3"] == (64, 64, 4, 4) and blobs["cosine"] == (64 * 63 // 2, 1, 1, 1)


def test_deploy_equals_the_real_caffe_reference_googlenet():
    """The project's full-width reference net (built from the authors' CUB file and loaded by real
    Caffe) is our deploy net apart from the net name, force_backward and the batch of 2."""
    reference = read_net(fixture_path("large/googlenet_full/deploy.prototxt"))
    mine = ours("cub200", "deploy.prototxt")
    assert_same_layers(reference.layer[1:], mine.layer[1:], "googlenet_full")
    assert tuple(reference.layer[0].input_param.shape[0].dim)[1:] == tuple(mine.layer[0].input_param.shape[0].dim)[1:]


def test_committed_files_equal_the_builders_output():
    expected = rendered_files()
    committed = {str(p.relative_to(PROTOTXT)) for p in PROTOTXT.rglob("*.prototxt")}
    assert committed == set(expected), "prototxt/ holds files the builder does not write (or misses some)"
    assert stale_files(PROTOTXT) == [], "regenerate with: python -m caffe_compat.zoo.write_prototxt prototxt/"
    for path, message in paper_files().items():  # and the text reads back as the same message
        reread = (read_solver if path.endswith("solver.prototxt") else read_net)(PROTOTXT / path)
        assert reread == message, path


def test_write_prototxt_writes_and_checks(tmp_path, capsys):
    assert write_main([str(tmp_path)]) == 0
    assert write_main([str(tmp_path), "--check"]) == 0
    target = tmp_path / "vehicleid" / "train_fappy.prototxt"
    target.write_text(target.read_text().replace("delta: 0.0001", "delta: 0.001"))
    assert write_main([str(tmp_path), "--check"]) == 1
    assert "vehicleid/train_fappy.prototxt" in capsys.readouterr().err
