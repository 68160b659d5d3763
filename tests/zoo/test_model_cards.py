"""models/*.json cards: expected blob shapes agree with our prototxt (Caffe's shape rules) and with
weights saved by real Caffe; hashes are either published ones or absent."""

from __future__ import annotations

import json
import math
import re

import pytest

from caffe_compat.io import read_net
from caffe_compat.net_shapes import infer_shapes
from caffe_compat.models import CARDS_DIR, load_cards, verify_caffemodel
from tests.conftest import REPO, fixture_path, shared_reference

#: Cards whose deploy net is not one of our prototxt (it ships with the published model).
EXTERNAL_DEPLOY = {"open_nsfw"}
CARDS = load_cards()


def test_every_card_file_loads_and_is_named_uniquely():
    files = sorted(CARDS_DIR.glob("*.json"))
    names = [json.loads(p.read_text())["name"] for p in files]
    assert len(names) == len(set(names)) == len(CARDS)
    expected = {"bvlc_googlenet", "vgg_cnn_m_1024", "fappy_cub200", "fappy_sop", "fappy_vehicleid", "open_nsfw"}
    assert expected <= set(CARDS)


@pytest.mark.parametrize("name", sorted(CARDS))
def test_expected_blobs_agree_with_our_prototxt(name):
    card = CARDS[name]
    if name in EXTERNAL_DEPLOY:
        assert "prototxt" not in card and card["deploy"] in card["files"]
        return
    _, table = infer_shapes(read_net(REPO / card["prototxt"]))
    inferred = {layer.name: [list(s) for s in layer.param_shapes] for layer in table if layer.param_shapes}
    for layer, shapes in card["expected_blobs"].items():
        assert layer in inferred, f"{name}: layer '{layer}' has no learnable blobs in {card['prototxt']}"
        assert shapes == inferred[layer], f"{name}: {layer}"
    assert card["parameters"] == sum(math.prod(s) for shapes in card["expected_blobs"].values() for s in shapes)
    ignored = set(inferred) - set(card["expected_blobs"])
    assert ignored <= {"fc_embedding"}, f"{name}: learnable layers of our net missing from the card: {ignored}"


@pytest.mark.parametrize("name", sorted(CARDS))
def test_hashes_are_published_ones_or_absent(name):
    for meta in CARDS[name]["files"].values():
        assert meta.get("sha256") is None or re.fullmatch(r"[0-9a-f]{64}", meta["sha256"])
        assert meta.get("sha1") is None or re.fullmatch(r"[0-9a-f]{40}", meta["sha1"])
        assert meta.get("md5") is None or re.fullmatch(r"[0-9a-f]{32}", meta["md5"])
        assert set(meta) <= {"sha256", "sha1", "md5", "bytes"}, f"{name}: unknown file fields {set(meta)}"


def test_googlenet_card_shapes_are_those_real_caffe_saved():
    """large/googlenet_full (the authors' CUB net at full width, saved by real Caffe): its blob shapes,
    recorded in the committed params_summary.json, are the card's."""
    summary = json.loads(fixture_path("large/googlenet_full/params_summary.json").read_text())
    caffe_shapes = {}
    for key, entry in summary.items():
        layer, index = key.rsplit(":", 1)
        caffe_shapes.setdefault(layer, {})[int(index)] = entry["shape"]
    card = CARDS["bvlc_googlenet"]
    assert len(card["expected_blobs"]) == 57
    for layer, shapes in card["expected_blobs"].items():
        assert [caffe_shapes[layer][i] for i in sorted(caffe_shapes[layer])] == shapes, layer


def test_googlenet_cards_match_weights_saved_by_real_caffe():
    """The full-width caffemodel itself (26 MB, in the optional shared references) passes every card."""
    weights = shared_reference("large/googlenet_full/weights.caffemodel")
    for name in ("bvlc_googlenet", "fappy_cub200", "fappy_sop"):
        result = verify_caffemodel(weights, CARDS[name])
        assert result["ok"], result["problems"]


def test_vgg_card_rejects_the_eighth_width_reference_net():
    """vgg_cnn_m_1024_small (real Caffe, every num_output / 8) must fail every layer of the card."""
    result = verify_caffemodel(fixture_path("nets/vgg_cnn_m_1024_small/weights.caffemodel"), CARDS["vgg_cnn_m_1024"])
    assert not result["ok"]
    assert len(result["problems"]) == 7
    assert any("'fc6'" in p and "[4096, 18432]" in p for p in result["problems"])
