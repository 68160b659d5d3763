"""A newcomer's first commands: ``caffe-compat --version``, ``models fetch NAME``, ``models list`` (whole
addresses at any terminal width, ``--json``) and the CI entry point ``python -m caffe_compat.models
fetch-nsfw``.  Nothing here downloads: open_nsfw is fetched into a cache that already holds it."""

from __future__ import annotations

import json
from importlib import metadata

import pytest

import caffe_compat
from caffe_compat.cli import package_version
from caffe_compat.models import download_addresses, load_cards
from tests.cli.test_cli_errors import assert_usage_error, run_cli


def test_version_prints_the_package_version():
    done = run_cli("--version")
    assert done.returncode == 0 and done.stderr == ""
    assert done.stdout == f"caffe-compat {metadata.version('caffe-compat')}\n"


def test_version_falls_back_to_the_module_attribute(monkeypatch):
    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    assert package_version() == caffe_compat.__version__
    monkeypatch.delattr(caffe_compat, "__version__")
    assert package_version() == "unknown"


@pytest.fixture
def nsfw_cache(nsfw_dir, tmp_path):
    """A cache folder whose ``nsfw/`` links the open_nsfw files already fetched (verified, not downloaded)."""
    folder = tmp_path / "cache" / "nsfw"
    folder.mkdir(parents=True)
    for path in nsfw_dir.iterdir():
        (folder / path.name).symlink_to(path)
    return folder.parent


def test_fetch_open_nsfw_prints_its_folder(nsfw_cache):
    done = run_cli("models", "fetch", "open_nsfw", "--cache", nsfw_cache)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{nsfw_cache / 'nsfw'}\n"


def test_fetch_of_a_card_without_fetcher_says_where_to_download_it(tmp_path):
    obtain = load_cards()["bvlc_googlenet"]["obtain"]
    done = run_cli("models", "fetch", "bvlc_googlenet", "--cache", tmp_path / "cache")
    assert_usage_error(done, "models", f"'bvlc_googlenet' cannot be fetched automatically; download it by hand: "
                                       f"{obtain}")
    assert "http://dl.caffe.berkeleyvision.org/bvlc_googlenet.caffemodel" in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_fetch_of_an_unknown_name_lists_the_cards(tmp_path):
    done = run_cli("models", "fetch", "googlenet", "--cache", tmp_path)
    assert_usage_error(done, "models", "no model card named 'googlenet' (known: bvlc_googlenet, fappy_cub200, "
                                       "fappy_sop, fappy_vehicleid, open_nsfw, vgg_cnn_m_1024)")


def _module_fetch(*args, cwd):
    return run_cli(*args, cwd=cwd, module="caffe_compat.models")


def test_module_fetch_nsfw_help_prints_help_and_downloads_nothing(tmp_path):
    done = _module_fetch("fetch-nsfw", "--help", cwd=tmp_path)
    assert done.returncode == 0 and done.stderr == ""
    assert done.stdout.startswith("usage: python -m caffe_compat.models fetch-nsfw [-h] [--cache DIR]")
    assert "--cache DIR" in done.stdout and "default .cache" in done.stdout
    assert list(tmp_path.iterdir()) == []


def test_module_fetch_nsfw_still_fetches_into_the_cache(nsfw_cache):
    done = _module_fetch("fetch-nsfw", "--cache", nsfw_cache, cwd=nsfw_cache)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{nsfw_cache / 'nsfw'}\n"
    assert _module_fetch(cwd=nsfw_cache).returncode == 2  # no verb: usage, nothing fetched


def test_list_shows_whole_addresses_on_a_narrow_terminal():
    done = run_cli("models", "list", env={"COLUMNS": "40"})
    assert done.returncode == 0 and done.stderr == ""
    cards = load_cards()
    for name, card in cards.items():
        assert f"  {name}: {card['obtain']}\n" in done.stdout
    addresses = [a for card in cards.values() for a in download_addresses(card)]
    assert "http://www.robots.ox.ac.uk/~vgg/software/deep_eval/releases/bvlc/VGG_CNN_M_1024.caffemodel" in addresses
    assert "https://pan.baidu.com/s/1c15SJgk" in addresses
    assert all(address in done.stdout for address in addresses)
    assert "caffe-compat models fetch open_nsfw" in done.stdout


def test_list_json_gives_each_card_with_its_addresses():
    done = run_cli("models", "list", "--json")
    assert done.returncode == 0
    listed = {entry["card"]: entry for entry in json.loads(done.stdout)}
    assert set(listed) == set(load_cards())
    assert listed["bvlc_googlenet"] == {
        "card": "bvlc_googlenet", "files": ["bvlc_googlenet.caffemodel"], "digests": ["sha1"], "fetch": None,
        "addresses": ["http://dl.caffe.berkeleyvision.org/bvlc_googlenet.caffemodel"],
        "obtain": load_cards()["bvlc_googlenet"]["obtain"]}
    assert listed["open_nsfw"]["fetch"] == "caffe-compat models fetch open_nsfw"
    assert listed["open_nsfw"]["digests"] == ["sha256"] and listed["open_nsfw"]["addresses"] == []
