"""``caffe-compat models verify`` and ``models list``: exit 0 when a file matches its card, 1 on a digest
or shape mismatch, 2 when the file is missing, unreadable or unknown (or the cards are missing).

Most cases use a small caffemodel written in ``tmp_path`` and a card in a temporary cards folder
(``caffe_compat.models.CARDS_DIR`` pointed at it); the last ones use the shipped cards."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np
import pytest

import caffe_compat.models as models
from caffe_compat.cli import main
from caffe_compat.io import array_to_blob, write_net
from caffe_compat.proto import caffe_pb2
from tests.conftest import fixture_path, shared_reference

SHAPES = {"conv1": [[4, 3, 3, 3], [4]], "fc": [[2, 36], [2]]}


def write_caffemodel(path, shapes=SHAPES, legacy: bool = False):
    net = caffe_pb2.NetParameter(name="tiny")
    rng = np.random.default_rng(0)
    for name, blob_shapes in shapes.items():
        layer = net.layer.add(name=name, type="Convolution" if name.startswith("conv") else "InnerProduct")
        for shape in blob_shapes:
            layer.blobs.append(array_to_blob(rng.standard_normal(shape).astype(np.float32), legacy=legacy))
    write_net(net, path)
    return path


def digests(path) -> dict:
    data = path.read_bytes()
    return {name: hashlib.new(name, data).hexdigest() for name in ("sha256", "sha1", "md5")}


@pytest.fixture
def cards(tmp_path, monkeypatch):
    """A cards folder with one card, ``tiny``, for ``tiny.caffemodel`` (digests of the file written
    in ``tmp_path/files``); returns ``(file, write_card)``: ``write_card(**changes)`` rewrites the card."""
    folder = tmp_path / "cards"
    folder.mkdir()
    model = write_caffemodel(tmp_path / "files" / "tiny.caffemodel")

    def write_card(files=None, expected_blobs=SHAPES, **extra):
        card = {"name": "tiny", "files": {"tiny.caffemodel": digests(model)} if files is None else files,
                "expected_blobs": expected_blobs, "obtain": "written by the test", **extra}
        (folder / "tiny.json").write_text(json.dumps(card))
        return card

    write_card()
    (folder / "other.json").write_text(json.dumps({"name": "other", "files": {"other.caffemodel": {"sha256": None}},
                                                   "obtain": "nowhere"}))
    monkeypatch.setattr(models, "CARDS_DIR", folder)
    return model, write_card


def verify(*args, capsys):
    status = main(["models", "verify", *map(str, args)])
    out, err = capsys.readouterr()
    return status, out, err


def test_a_consistent_file_exits_0_and_prints_every_digest(cards, capsys):
    model, _ = cards
    status, out, err = verify(model, capsys=capsys)
    assert status == 0 and err == ""
    assert out.splitlines()[0] == f"{model}: card 'tiny': OK"
    expected = digests(model)
    for name in ("sha256", "sha1", "md5"):
        assert f"  {name} {expected[name]}" in out.splitlines()


def test_the_card_is_found_by_file_name_wherever_the_file_is(cards, tmp_path, capsys, monkeypatch):
    model, _ = cards
    elsewhere = tmp_path / "deep" / "down"
    elsewhere.mkdir(parents=True)
    copy = shutil.copy2(model, elsewhere / "tiny.caffemodel")
    monkeypatch.chdir(elsewhere)
    status, out, _ = verify("tiny.caffemodel", capsys=capsys)
    assert status == 0 and "card 'tiny': OK" in out
    assert main(["models", "verify", str(copy), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["card"] == "tiny" and result["ok"] and result["problems"] == []
    assert result["digests"] == digests(model)


@pytest.mark.parametrize("algorithm", ["sha256", "sha1", "md5"])
def test_each_listed_digest_is_checked(cards, capsys, algorithm):
    """A card listing only one digest (e.g. bvlc_googlenet's sha1) is checked on that digest."""
    model, write_card = cards
    wrong = "0" * len(digests(model)[algorithm])
    write_card(files={"tiny.caffemodel": {algorithm: wrong}})
    status, out, _ = verify(model, capsys=capsys)
    assert status == 1
    lines = out.splitlines()
    assert lines[0] == f"{model}: card 'tiny': MISMATCH"
    assert f"  - {algorithm} {digests(model)[algorithm]} differs from the card's {wrong}" in lines
    assert [l for l in lines if l.startswith("  - ")] == [f"  - {algorithm} {digests(model)[algorithm]} differs "
                                                          f"from the card's {wrong}"]  # the shapes still agree
    others = {"sha256", "sha1", "md5"} - {algorithm}
    assert not any(l.startswith(f"  {o} ") for o in others for l in lines)  # only listed digests are computed


def test_a_size_on_the_card_is_checked(cards, capsys):
    model, write_card = cards
    size = model.stat().st_size
    write_card(files={"tiny.caffemodel": {"bytes": size}})
    assert verify(model, capsys=capsys)[0] == 0
    write_card(files={"tiny.caffemodel": {"bytes": size + 1}})
    status, out, _ = verify(model, capsys=capsys)
    assert status == 1 and f"  - size {size} bytes differs from the card's {size + 1}" in out.splitlines()


def test_null_digests_are_skipped_and_a_card_without_digests_checks_shapes(cards, capsys):
    model, write_card = cards
    write_card(files={"tiny.caffemodel": {"sha256": None, "sha1": None}})
    status, out, _ = verify(model, capsys=capsys)
    assert status == 0 and "only the blob shapes were checked" in out


def test_uppercase_digests_on_a_card_match(cards, capsys):
    model, write_card = cards
    write_card(files={"tiny.caffemodel": {"sha1": digests(model)["sha1"].upper()}})
    assert verify(model, capsys=capsys)[0] == 0


@pytest.mark.parametrize("expected_blobs, problem", [
    ({"conv1": [[4, 3, 5, 5], [4]], "fc": [[2, 36], [2]]},
     "layer 'conv1': blob shapes [[4, 3, 3, 3], [4]], card expects [[4, 3, 5, 5], [4]]"),
    ({"conv1": [[4, 3, 3, 3]], "fc": [[2, 36], [2]]},
     "layer 'conv1': blob shapes [[4, 3, 3, 3], [4]], card expects [[4, 3, 3, 3]]"),
    ({**SHAPES, "fc8": [[10, 2], [10]]}, "layer 'fc8' missing"),
])
def test_a_shape_mismatch_exits_1(cards, capsys, expected_blobs, problem):
    model, write_card = cards
    write_card(expected_blobs=expected_blobs)
    status, out, _ = verify(model, capsys=capsys)
    assert status == 1 and "MISMATCH" in out and f"  - {problem}" in out.splitlines()


def test_legacy_4d_dims_match_the_cards_shapes(cards, tmp_path, capsys):
    """A 2014-style caffemodel (legacy num/channels/height/width, bias 1x1x1xN) passes, as in Caffe."""
    _, write_card = cards
    legacy = write_caffemodel(tmp_path / "legacy" / "tiny.caffemodel", legacy=True)
    write_card(files={"tiny.caffemodel": digests(legacy)})
    assert verify(legacy, capsys=capsys)[0] == 0


def test_the_cards_deploy_prototxt_is_checked_by_its_digests_not_by_blob_shapes(cards, tmp_path, capsys):
    """A card listing the deploy prototxt beside the weights (open_nsfw's): verifying the prototxt checks its
    size and digests; the expected blobs are the caffemodel's (the prototxt was a MISMATCH, exit 1)."""
    model, write_card = cards
    deploy = tmp_path / "files" / "deploy.prototxt"
    deploy.write_text('name: "tiny"\nlayer { name: "conv1" type: "Convolution" }\n')
    files = {"deploy.prototxt": {"sha256": digests(deploy)["sha256"], "bytes": deploy.stat().st_size},
             "tiny.caffemodel": digests(model)}
    write_card(files=files, deploy="deploy.prototxt", weights="tiny.caffemodel")
    status, out, _ = verify(deploy, capsys=capsys)
    assert status == 0 and out.splitlines() == [f"{deploy}: card 'tiny': OK",
                                                f"  sha256 {digests(deploy)['sha256']}"]
    assert verify(model, capsys=capsys)[0] == 0  # the weights: digests and shapes
    deploy.write_text('name: "tiny"\n')  # an edited prototxt is still a mismatch
    status, out, _ = verify(deploy, capsys=capsys)
    assert status == 1 and f"  - sha256 {digests(deploy)['sha256']} differs from the card's " \
        f"{files['deploy.prototxt']['sha256']}" in out.splitlines()


def test_unknown_missing_or_unreadable_files_exit_2(cards, tmp_path, capsys):
    model, _ = cards
    stranger = shutil.copy2(model, tmp_path / "stranger.caffemodel")
    status, out, err = verify(stranger, capsys=capsys)
    assert status == 2 and out == ""
    assert err.startswith("caffe-compat models: error: stranger.caffemodel: no model card lists this file name")
    assert "Traceback" not in err
    status, _, err = verify(tmp_path / "absent" / "tiny.caffemodel", capsys=capsys)
    assert status == 2 and "no such file" in err
    garbage = tmp_path / "garbage" / "tiny.caffemodel"
    garbage.parent.mkdir()
    garbage.write_bytes(b"\xff\x00not a caffemodel" * 7)
    status, out, err = verify(garbage, capsys=capsys)
    assert status == 2 and err.startswith("caffe-compat models: error: ") and "Traceback" not in err
    status, _, err = verify(model, "--card", "nosuch", capsys=capsys)
    assert status == 2 and "no model card named 'nosuch' (known: other, tiny)" in err


def test_a_fifo_or_folder_is_named_as_such(cards, tmp_path, capsys):
    """Not 'no such file': what the path is (models verify checked only Path.is_file)."""
    folder = tmp_path / "tiny.caffemodel"
    folder.mkdir()
    status, _, err = verify(folder, capsys=capsys)
    assert status == 2 and err == f"caffe-compat models: error: {folder}: is a directory, expected a regular file\n"
    if hasattr(os, "mkfifo"):
        fifo = tmp_path / "pipe" / "tiny.caffemodel"
        fifo.parent.mkdir()
        os.mkfifo(fifo)
        status, _, err = verify(fifo, capsys=capsys)
        assert status == 2 and err.endswith(f"{fifo}: is a FIFO (named pipe), expected a regular file\n")


def test_card_named_on_the_command_line(cards, tmp_path, capsys):
    """--card checks a file of any name against that card's shapes (its digests are per file name)."""
    model, _ = cards
    renamed = shutil.copy2(model, tmp_path / "renamed.caffemodel")
    status, out, _ = verify(renamed, "--card", "tiny", capsys=capsys)
    assert status == 0 and "only the blob shapes were checked" in out
    status, out, _ = verify(renamed, "--card", "other", capsys=capsys)
    assert status == 0  # a card without expected blobs has nothing to disagree with


def table_rows(out: str) -> dict[str, str]:
    """``{card: its row}`` of the table ``models list`` prints (up to the blank line)."""
    lines = out.split("\n\n")[0].splitlines()
    assert lines[0].split() == ["card", "files", "digests", "fetch"]
    return {line.split()[0]: line for line in lines[2:]}


def test_list_prints_every_card_with_its_digests(cards, capsys):
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    rows = {name: row.split() for name, row in table_rows(out).items()}
    assert set(rows) == {"other", "tiny"}
    assert rows["tiny"][1:3] == ["tiny.caffemodel", "sha256,"] and rows["tiny"][3:] == ["sha1,", "md5", "by", "hand"]
    assert rows["other"][1:] == ["other.caffemodel", "-", "by", "hand"]
    assert out.split("\n\n")[1].splitlines() == ["where to get them:", "  other: nowhere",
                                                 "  tiny: written by the test"]


@pytest.mark.parametrize("state", ["missing", "empty"])
def test_missing_cards_are_an_error_not_an_empty_list(tmp_path, monkeypatch, capsys, state):
    folder = tmp_path / "cards"
    if state == "empty":
        folder.mkdir()
    monkeypatch.setattr(models, "CARDS_DIR", folder)
    model = write_caffemodel(tmp_path / "tiny.caffemodel")
    for argv in (["models", "list"], ["models", "verify", str(model)]):
        assert main(argv) == 2
        out, err = capsys.readouterr()
        assert out == "" and f"the model cards are missing: {folder}" in err
    with pytest.raises(models.CaffeCompatError, match="model cards are missing"):
        models.load_cards()


def test_a_broken_card_exits_2(cards, capsys):
    models.CARDS_DIR.joinpath("broken.json").write_text('{"name": "broken", ')
    assert main(["models", "list"]) == 2
    assert "broken.json:1:" in capsys.readouterr().err
    models.CARDS_DIR.joinpath("broken.json").write_text(json.dumps({"name": "tiny", "files": {}}))
    assert main(["models", "list"]) == 2
    assert "a second card named 'tiny'" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the shipped cards


def test_list_shows_the_shipped_cards(capsys):
    assert main(["models", "list"]) == 0
    rows = table_rows(capsys.readouterr().out)
    assert set(rows) >= {"bvlc_googlenet", "vgg_cnn_m_1024", "fappy_cub200", "fappy_sop", "fappy_vehicleid",
                         "open_nsfw"}
    assert " sha1 " in rows["bvlc_googlenet"] and " sha256 " in rows["open_nsfw"]


def test_shipped_vgg_card_rejects_the_eighth_width_reference_net(capsys):
    """Real Caffe's VGG_CNN_M_1024 at 1/8 width against the real card: every layer differs, exit 1."""
    weights = fixture_path("nets/vgg_cnn_m_1024_small/weights.caffemodel")
    status, out, _ = verify(weights, "--card", "vgg_cnn_m_1024", capsys=capsys)
    assert status == 1
    problems = [l for l in out.splitlines() if l.startswith("  - ")]
    assert len(problems) == 7 and any("'fc6'" in p and "[4096, 18432]" in p for p in problems)


def test_shipped_googlenet_card_checks_its_published_sha1(tmp_path, capsys):
    """bvlc_googlenet's card publishes a sha1 only: a file of that name with other bytes fails on it."""
    impostor = shutil.copy2(fixture_path("nets/googlenet_small/weights.caffemodel"),
                            tmp_path / "bvlc_googlenet.caffemodel")
    status, out, _ = verify(impostor, capsys=capsys)
    assert status == 1 and "card 'bvlc_googlenet': MISMATCH" in out
    sha1 = hashlib.sha1(impostor.read_bytes()).hexdigest()
    assert f"  - sha1 {sha1} differs from the card's 405fc5acd08a3bb12de8ee5e23a96bec22f08204" in out


def test_shipped_googlenet_card_accepts_real_caffes_full_width_net(capsys):
    weights = shared_reference("large/googlenet_full/weights.caffemodel")
    status, out, _ = verify(weights, "--card", "bvlc_googlenet", capsys=capsys)
    assert status == 0 and "card 'bvlc_googlenet': OK" in out


def test_a_file_name_on_several_cards_is_checked_against_each(cards, tmp_path, capsys):
    """Two cards list a 'deploy.prototxt': the file is checked against each in turn and matches the second
    (it was a MISMATCH against the first found); a prototxt neither lists is a mismatch that says the card
    was picked by the file name."""
    model, write_card = cards
    deploy = tmp_path / "files" / "deploy.prototxt"
    deploy.write_text('name: "tiny"\n')
    write_card(files={"deploy.prototxt": {"sha256": "0" * 64}, "tiny.caffemodel": digests(model)},
               weights="tiny.caffemodel")
    (models.CARDS_DIR / "zeta.json").write_text(json.dumps(
        {"name": "zeta", "files": {"deploy.prototxt": {"sha256": digests(deploy)["sha256"]}}, "obtain": "nowhere"}))
    status, out, _ = verify(deploy, capsys=capsys)
    assert status == 0 and out.splitlines()[0] == f"{deploy}: card 'zeta': OK"
    deploy.write_text('name: "another net"\n')
    status, out, _ = verify(deploy, capsys=capsys)
    assert status == 1 and out.splitlines()[0] == f"{deploy}: card 'tiny': MISMATCH"
    assert out.splitlines()[-1] == ("  (the card was picked by the file name 'deploy.prototxt', which 'tiny', 'zeta' "
                                    "list: another net's file of that name is no match; --card NAME checks it "
                                    "against another card)")
    status, out, _ = verify(deploy, "--card", "zeta", capsys=capsys)
    assert status == 1 and "picked by the file name" not in out


def test_fetch_into_a_cache_that_is_a_file_exits_2(tmp_path):
    """``--cache`` naming a file: one line naming the folder it cannot create (was NotADirectoryError's
    traceback, exit 1); nothing is downloaded."""
    from tests.cli.test_cli_errors import assert_usage_error, run_cli

    cache = tmp_path / "cache"
    cache.write_text("x")
    done = run_cli("models", "fetch", "open_nsfw", "--cache", cache)
    assert_usage_error(done, "models", f"{cache}/nsfw: cannot create the cache folder (Not a directory)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]
