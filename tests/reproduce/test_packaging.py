"""The paper's prototxt files and the model cards are package data: an installed (non-editable)
caffe-compat finds every net and solver `reproduce` uses, and every card `models verify/list` reads,
inside the package, not in a source checkout."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, as the tomli backport (the dev extra)
    import tomli as tomllib

import caffe_compat
import caffe_compat.models as models
from caffe_compat.io import read_net, read_solver
from caffe_compat.reproduce.setups import SETUPS
from caffe_compat.reproduce.training import packaged_prototxt_root, prototxt_root
from tests.conftest import REPO


def needed_files() -> list[str]:
    """Every prototxt the reproduce pipeline opens, relative to the prototxt root."""
    names = []
    for setup in SETUPS.values():
        names += [f"{setup.prototxt_dir}/{n}" for n in ("deploy.prototxt", "solver.prototxt")]
        names += [f"{setup.prototxt_dir}/train_{loss}.prototxt" for loss in setup.losses]
    return names


def test_lookup_finds_every_prototxt_inside_the_package():
    package = Path(caffe_compat.__file__).parent
    root = packaged_prototxt_root()
    assert root is not None and root == package / "reproduce" / "prototxt" and prototxt_root() == root
    for name in needed_files():
        path = root / name
        assert path.is_file(), name
        (read_solver if name.endswith("solver.prototxt") else read_net)(path)
    # the package-data globs of pyproject.toml cover each of them (so a wheel ships them)
    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = {str(p.relative_to(package)) for pattern in patterns["caffe_compat"] for p in package.glob(pattern)}
    assert {f"reproduce/prototxt/{n}" for n in needed_files()} <= shipped
    # the packaged files are the top-level prototxt/ (one source of truth)
    for name in needed_files():
        assert (root / name).read_bytes() == (REPO / "prototxt" / name).read_bytes()


def card_files() -> list[str]:
    """Every model card of the checkout (models/*.json)."""
    return sorted(p.name for p in (REPO / "models").glob("*.json"))


def test_lookup_finds_every_model_card_inside_the_package():
    package = Path(caffe_compat.__file__).parent
    assert len(card_files()) >= 6
    assert models.CARDS_DIR == package / "model_cards" == models.PACKAGED_CARDS
    for name in card_files():
        assert (models.CARDS_DIR / name).read_bytes() == (REPO / "models" / name).read_bytes()
    assert len(models.load_cards()) == len(card_files())
    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = {str(p.relative_to(package)) for pattern in patterns["caffe_compat"] for p in package.glob(pattern)}
    assert {f"model_cards/{n}" for n in card_files()} <= shipped


def test_wheel_ships_the_prototxt_and_the_installed_package_uses_them(tmp_path):
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for name in ("prototxt", "converters", "models"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "caffe_compat", src / "caffe_compat", symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("caffe_compat-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        z.extractall(site)
    missing = [n for n in needed_files() if f"caffe_compat/reproduce/prototxt/{n}" not in names]
    assert missing == []
    missing_cards = [n for n in card_files() if f"caffe_compat/model_cards/{n}" not in names]
    assert missing_cards == []
    code = ("import caffe_compat, caffe_compat.reproduce.training as t; r = t.prototxt_root(); "
            "print(caffe_compat.__file__); print(r); print((r / 'digits' / 'train_fappy.prototxt').is_file())")
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr[-2000:]
    module, root, found = run.stdout.split()
    assert Path(module).is_relative_to(site) and Path(root) == site / "caffe_compat" / "reproduce" / "prototxt"
    assert found == "True" and not Path(root).is_symlink()
    # the installed package reads its own cards: `models list` lists them, and `models verify` of a file no
    # card names says where it looked (the package, not a checkout)
    code = ("import caffe_compat.models as m; print(m.CARDS_DIR); print(len(m.load_cards())); "
            "import sys; from caffe_compat.cli import main; sys.exit(main(['models', 'list']))")
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr[-2000:]
    cards_dir, count, *table = run.stdout.splitlines()
    assert Path(cards_dir) == site / "caffe_compat" / "model_cards" and not Path(cards_dir).is_symlink()
    assert int(count) == len(card_files())
    assert any(line.startswith("bvlc_googlenet ") and "sha1" in line for line in table), table
