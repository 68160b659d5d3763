"""``caffe-compat upgrade``: V1 net files to V2, checked against what read_net gives and what Caffe's
own upgrade_net_proto_text wrote (``upgraded_by_caffe.prototxt``)."""

from __future__ import annotations

from caffe_compat.cli import main
from caffe_compat.io import read_net, read_solver
from caffe_compat.io.blobs import blob_shape, legacy_shape_equals
from tests.conftest import fixture_path

V1 = "nets/googlenet_small_v1"


def test_upgrade_v1_prototxt(tmp_path, capsys):
    source = fixture_path(f"{V1}/deploy_v1.prototxt")
    target = tmp_path / "deploy.prototxt"
    assert main(["upgrade", str(source), str(target)]) == 0
    assert capsys.readouterr().out == f"wrote {target}: 142 layers (upgraded)\n"
    written = target.read_text()
    assert "layers {" not in written and "input_dim" not in written and "blobs_lr" not in written
    upgraded = read_net(target, upgrade=False)
    assert upgraded == read_net(source)
    assert upgraded == read_net(fixture_path(f"{V1}/upgraded_by_caffe.prototxt"), upgrade=False)
    assert upgraded.layer[0].type == "Input" and list(upgraded.layer[0].input_param.shape[0].dim) == [2, 3, 224, 224]


def test_upgrade_v1_caffemodel_to_binary(tmp_path, capsys):
    source = fixture_path(f"{V1}/weights_v1.caffemodel")
    target = tmp_path / "weights.caffemodel"
    assert main(["upgrade", str(source), str(target)]) == 0
    assert capsys.readouterr().out.endswith("(upgraded)\n")
    upgraded = read_net(target, upgrade=False)
    assert not upgraded.layers and upgraded == read_net(source)
    v2 = {layer.name: layer for layer in read_net(fixture_path("nets/googlenet_small/weights.caffemodel")).layer}
    checked = 0
    for layer in upgraded.layer:
        if layer.blobs:
            # blobs keep their legacy 4-D dims, as Caffe's upgrade_net_proto_binary keeps them; they load
            # into the V2 shapes by Caffe's ShapeEquals rule, with the same values
            references = v2[layer.name].blobs
            assert len(layer.blobs) == len(references), layer.name
            for blob, reference in zip(layer.blobs, references):
                assert legacy_shape_equals(blob, blob_shape(reference)), layer.name
                assert list(blob.data) == list(reference.data), layer.name
                checked += 1
    assert checked == sum(len(layer.blobs) for layer in v2.values()) > 0


def test_upgrade_current_net_is_copied(tmp_path, capsys):
    source = fixture_path(f"{V1}/upgraded_by_caffe.prototxt")
    target = tmp_path / "same.prototxt"
    assert main(["upgrade", str(source), str(target)]) == 0
    assert capsys.readouterr().out == f"wrote {target}: 142 layers (already current; copied)\n"
    assert read_net(target, upgrade=False) == read_net(source, upgrade=False)


def test_upgrade_solver_type_enum(tmp_path, capsys):
    old = tmp_path / "old_solver.prototxt"
    old.write_text(fixture_path("solvers/nesterov/solver.prototxt").read_text().replace('type: "Nesterov"',
                                                                                       "solver_type: NESTEROV"))
    target = tmp_path / "solver.prototxt"
    assert main(["upgrade", "--solver", str(old), str(target)]) == 0
    assert capsys.readouterr().out == f"wrote {target} (solver type Nesterov)\n"
    assert "solver_type" not in target.read_text()
    assert read_solver(target, upgrade=False) == read_solver(fixture_path("solvers/nesterov/solver.prototxt"))


def test_caffe_upgrade_tools_by_their_own_names_fix_the_output_format(tmp_path, capsys):
    """upgrade_net_proto_text writes a prototxt and upgrade_net_proto_binary a binary NetParameter whatever
    OUT is called (Caffe's WriteProtoToTextFile / WriteProtoToBinaryFile); upgrade_solver_proto_text a solver;
    an input already current is written too, after Caffe's 'File already in latest proto format' line."""
    from caffe_compat.proto import caffe_pb2

    weights = fixture_path(f"{V1}/weights_v1.caffemodel")
    binary = tmp_path / "weights_upgraded"  # no suffix: the tool, not the name, picks binary
    assert main(["upgrade_net_proto_binary", str(weights), str(binary)]) == 0
    assert capsys.readouterr().out == f"Wrote upgraded NetParameter binary proto to {binary}\n"
    parsed = caffe_pb2.NetParameter()
    parsed.ParseFromString(binary.read_bytes())
    assert not parsed.layers and len(parsed.layer) > 0 and read_net(binary) == read_net(weights)

    deploy = fixture_path(f"{V1}/deploy_v1.prototxt")
    text = tmp_path / "deploy.caffemodel"  # a binary suffix: still a prototxt
    assert main(["upgrade_net_proto_text", str(deploy), str(text)]) == 0
    assert capsys.readouterr().out == f"Wrote upgraded NetParameter text proto to {text}\n"
    assert text.read_text().startswith("name:") and read_net(text, upgrade=False) == read_net(deploy)

    current = fixture_path(f"{V1}/upgraded_by_caffe.prototxt")
    assert main(["upgrade_net_proto_text", str(current), str(tmp_path / "same")]) == 0
    assert capsys.readouterr().out.splitlines() == [f"File already in latest proto format: {current}",
                                                    f"Wrote upgraded NetParameter text proto to {tmp_path / 'same'}"]
    assert read_net(tmp_path / "same", upgrade=False) == read_net(current, upgrade=False)

    old = tmp_path / "old_solver.prototxt"
    old.write_text(fixture_path("solvers/nesterov/solver.prototxt").read_text().replace('type: "Nesterov"',
                                                                                       "solver_type: NESTEROV"))
    assert main(["upgrade_solver_proto_text", str(old), str(tmp_path / "solver.bin")]) == 0
    assert capsys.readouterr().out == f"Wrote upgraded SolverParameter text proto to {tmp_path / 'solver.bin'}\n"
    expected = read_solver(fixture_path("solvers/nesterov/solver.prototxt"))
    assert read_solver(tmp_path / "solver.bin", upgrade=False) == expected
