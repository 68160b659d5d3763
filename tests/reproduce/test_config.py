"""ReproduceConfig: the data set's defaults filled in by ``resolve``, and a bad option refused before
anything is written, whether the config is given as an object or as keywords."""

from __future__ import annotations

from pathlib import Path

import pytest

from caffe_compat.errors import CaffeCompatError
from caffe_compat.reproduce.config import ReproduceConfig, resolve
from caffe_compat.reproduce.pipeline import reproduce
from caffe_compat.reproduce.setups import SETUPS


def test_resolve_fills_in_the_data_sets_defaults():
    config, setup = resolve(ReproduceConfig("digits"))
    assert setup == SETUPS["digits"]
    assert config.losses == list(setup.losses) and config.seeds == [0, 1, 2] and config.workers == 0
    assert config.max_iter == setup.max_iter and config.out_dir == Path("runs") / "digits" and config.device == "cpu"
    config, setup = resolve(ReproduceConfig("digits", batch_size=8, per_label=4, seeds=[3], losses=["fappy"]))
    assert (setup.batch_size, setup.per_label) == (8, 4) and config.seeds == [3] and config.losses == ["fappy"]


@pytest.mark.parametrize("options, message", [
    (dict(batch_size=4, per_label=5), "need 2 <= --per-label <= --batch-size"),
    (dict(losses=["nope"]), "no prototxt for loss"),
    (dict(max_iter=-1), "--max-iter must be >= 1"),
    (dict(weights="missing.caffemodel"), "no such file"),
])
def test_bad_options_are_refused_before_anything_is_written(tmp_path, options, message):
    out = tmp_path / "run"
    with pytest.raises(CaffeCompatError, match=message):
        reproduce(ReproduceConfig("digits", out_dir=out, progress=False, **options))
    with pytest.raises(CaffeCompatError, match=message):
        reproduce("digits", out_dir=out, progress=False, **options)
    with pytest.raises(CaffeCompatError, match=message):  # keywords replace a config's fields
        reproduce(ReproduceConfig("digits", out_dir=out, progress=False), **options)
    assert not out.exists()


@pytest.mark.parametrize("options, message", [
    (dict(max_iter=0), "--max-iter must be >= 1, got 0"),
    (dict(batch_size=0), "got 0 and 0"),
    (dict(per_label=0), "got 0 and 64"),
])
def test_a_zero_option_is_refused_not_taken_for_the_default(options, message):
    """``--max-iter 0``, ``--batch-size 0``, ``--per-label 0``: refused, not silently the data set's default."""
    with pytest.raises(CaffeCompatError, match=message):
        resolve(ReproduceConfig("digits", **options))


@pytest.mark.parametrize("options, message", [
    (dict(seeds=[0, -1]), r"--seeds must be in 0\.\.4294967295, got \[-1\]"),
    (dict(seeds=[2 ** 32]), r"--seeds must be in 0\.\.4294967295, got \[4294967296\]"),
    (dict(workers=-1), "--workers must be >= 0, got -1"),
    (dict(snapshot_every=-5), "--snapshot-every must be >= 0, got -5"),
    (dict(delta_min=-1.0), r"--delta-min must be a finite number > 0 .*, got -1\.0"),
    (dict(delta_min=float("nan")), "--delta-min must be a finite number > 0"),
])
def test_an_out_of_range_option_is_refused_before_training(tmp_path, options, message):
    """Numpy's seed range, a DataLoader's worker count: one line (exit 2) before anything runs, not a
    traceback from inside the first run; a negative snapshot interval is no interval."""
    out = tmp_path / "run"
    with pytest.raises(CaffeCompatError, match=message):
        resolve(ReproduceConfig("digits", out_dir=out, **options))
    assert not out.exists()


@pytest.mark.parametrize("options, message", [
    (dict(seeds=[0, 1, 0]), "--seeds names 0 more than once"),
    (dict(losses=["fappy", "triplet", "fappy"]), "--loss names fappy more than once"),
])
def test_a_repeated_loss_or_seed_is_refused(options, message):
    """A (loss, seed) named twice would be trained twice into one directory and counted twice in the
    spread over seeds (n = 2 of one run)."""
    with pytest.raises(CaffeCompatError, match=message):
        resolve(ReproduceConfig("digits", **options))


def test_unknown_data_set():
    with pytest.raises(CaffeCompatError, match="unknown data set 'mnist'"):
        reproduce(ReproduceConfig("mnist"))


@pytest.mark.parametrize("cpus, device, expected", [
    (1, "cuda", 2), (2, "cuda", 2), (6, "cuda", 5), (64, "cuda:1", 8), (64, "cpu", 2)])
def test_real_data_loader_workers_follow_the_machine_on_cuda(monkeypatch, cpus, device, expected):
    from caffe_compat.reproduce import config as config_module

    monkeypatch.setattr(config_module, "usable_cpus", lambda: cpus)
    assert config_module.loader_workers(device) == expected
    assert resolve(ReproduceConfig("cub200"))[0].workers == 2  # the CPU default
    assert resolve(ReproduceConfig("digits"))[0].workers == 0  # the toy set: in this process
