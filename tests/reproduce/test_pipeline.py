"""`reproduce` end to end on CPU with tiny iteration counts: train -> snapshot -> ONNX -> ONNX Runtime
evaluation -> table, plots and run.json; resume; the full-size paper nets on toy trees."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from caffe_compat.cli import main
from caffe_compat.data import make_toy_data, read_cub200
from caffe_compat.evaluate import evaluate_cub200
from caffe_compat.reproduce.pipeline import reproduce
from caffe_compat.reproduce.setups import SETUPS


def test_digits_writes_every_artifact(digits_run):
    out, summary = digits_run
    for name in ("results.md", "results.json", "run.json", "training_loss.png", "recall_at_k.png"):
        assert (out / name).stat().st_size > 0, name
    run = json.loads((out / "run.json").read_text())
    assert run["max_iter"] == 6 and run["seeds"] == [0, 1] and run["losses"] == ["fappy", "triplet"]
    assert set(run["versions"]) >= {"torch", "onnx", "onnxruntime", "protobuf"}
    # the preprocessing the training batches went through, and the evaluation's input
    pre = run["preprocessing"]
    assert (pre["resize"], pre["crop"], pre["mirror"], pre["mean_value"], pre["scale"]) == \
        (0, 0, False, [128.0, 128.0, 128.0], 1 / 64)
    assert pre["channel_order"] == "BGR" and pre["input_size"] == 32 and "toy" in pre["note"]
    assert pre["test"]["crop_size"] == 32 and pre["test"]["mean_value"] == [128.0, 128.0, 128.0]
    table = (out / "results.md").read_text()
    assert "| fappy |" in table and "| triplet |" in table
    assert "evaluated with the CUB-200-2011 protocol" in table and "It is not CUB-200-2011" in table
    for loss in ("fappy", "triplet"):
        per_seed = run["figures"][loss]["per_seed"]
        assert len(per_seed) == 2 and all(0.0 <= v <= 1.0 for v in per_seed)
        assert run["figures"][loss]["mean"] == pytest.approx(np.mean(per_seed))


def test_onnx_metrics_equal_the_torch_embedder_on_the_test_split(digits_run):
    """The figures in metrics.json are what the trained caffemodel gives through PyTorch."""
    from caffe_compat.data import DataTransformer, ImageRecordDataset
    from caffe_compat.net import load_net
    from caffe_compat.reproduce.training import REPO_PROTOTXT

    out, _ = digits_run
    setup = SETUPS["digits"]
    run = json.loads((out / "fappy" / "seed0" / "metrics.json").read_text())
    assert run["train"]["iterations"] == 6
    net = load_net(REPO_PROTOTXT / "digits" / "deploy.prototxt", weights=run["train"]["caffemodel"])
    records = read_cub200(out / "data" / "CUB_200_2011", "test")
    transformer = DataTransformer(mean_value=setup.mean_value, scale=setup.scale, phase="TEST")
    dataset = ImageRecordDataset(records, transformer)
    images = torch.stack([dataset[i][0] for i in range(len(dataset))])
    with torch.no_grad():
        features = net.forward(data=images)[setup.embedding_blob]
    expected = evaluate_cub200(features, dataset.labels)
    for k, value in expected["recall_at_k"].items():
        assert run["metrics"]["recall_at_k"][k] == pytest.approx(value, abs=1.5 / len(records))
    assert run["metrics"]["map_at_r"] == pytest.approx(expected["map_at_r"], abs=1e-3)


def test_rerun_reuses_finished_runs(digits_run, capsys):
    out, summary = digits_run
    before = (out / "fappy" / "seed0" / "metrics.json").stat().st_mtime_ns
    again = reproduce("digits", losses=["fappy", "triplet"], seeds=[0, 1], max_iter=6, out_dir=out, progress=False)
    assert (out / "fappy" / "seed0" / "metrics.json").stat().st_mtime_ns == before
    assert again["figures"] == summary["figures"]


def _interrupted_at(count: int):
    """A stand-in for ``training.batches`` whose stream raises when batch ``count`` (0-based) is asked for."""
    from caffe_compat.reproduce import training

    class Interrupted(training.TrainingBatches):
        def __iter__(self):
            for k, batch in enumerate(super().__iter__()):
                if k == count:
                    raise RuntimeError("interrupted")
                yield batch

    return Interrupted


def test_interrupted_run_resumes_from_its_snapshot(tmp_path, monkeypatch):
    """A run interrupted during iteration 5, after its iteration-4 snapshot, continues to the same weights
    as an uninterrupted one; the log holds each iteration once and the time of both segments counts."""
    import csv

    from caffe_compat.io import read_net
    from caffe_compat.reproduce import training
    from caffe_compat.reproduce.pipeline import data_root_for
    from caffe_compat.reproduce.training import train_run

    setup = SETUPS["digits"]
    root = data_root_for(setup, None, tmp_path)
    records = setup.read(root, "train")
    whole = train_run(setup, "contrastive", 3, records, tmp_path / "whole", max_iter=6, progress=False)
    assert whole["resumed_from"] is None and len(whole["segments"]) == 1

    monkeypatch.setattr(training, "batches", _interrupted_at(4))  # iteration 4 snapshotted, 5 never finishes
    with pytest.raises(RuntimeError, match="interrupted"):
        train_run(setup, "contrastive", 3, records, tmp_path / "parts", max_iter=6, snapshot_every=4, progress=False)
    monkeypatch.undo()
    resumed = train_run(setup, "contrastive", 3, records, tmp_path / "parts", max_iter=6, progress=False)
    assert resumed["iterations"] == 6 and resumed["resumed_from"] == 4
    first, second = resumed["segments"]
    assert (first["from_iter"], first["to_iter"], first["finished"]) == (0, 4, False)
    assert (second["from_iter"], second["to_iter"], second["finished"]) == (4, 6, True)
    assert resumed["seconds"] == pytest.approx(first["seconds"] + second["seconds"])
    with open(resumed["log"], newline="") as f:
        assert [int(row["iter"]) for row in csv.DictReader(f)] == [0, 1, 2, 3, 4, 5]
    a, b = read_net(whole["caffemodel"]), read_net(resumed["caffemodel"])
    for la, lb in zip(a.layer, b.layer):
        for ba, bb in zip(la.blobs, lb.blobs):
            np.testing.assert_allclose(np.asarray(bb.data), np.asarray(ba.data), rtol=1e-5, atol=1e-7)


def test_training_batches_are_the_same_after_a_resume_and_for_any_worker_count(tmp_path):
    """The real data sets crop and mirror at random: batch k is the same whether the stream started at 0
    or resumed at k, with 0 or 2 DataLoader workers (before, a resumed run drew other crops than the
    uninterrupted one, and the worker count changed every batch)."""
    import itertools

    from caffe_compat.reproduce.training import batches

    setup = replace(SETUPS["cub200"], resize=40, crop=24, batch_size=8, per_label=2)
    records = read_cub200(make_toy_data("cub", tmp_path / "cub", seed=0, size=48), "train")

    def stream(start, workers, n):
        return [b["data"] for b in itertools.islice(batches(setup, records, 5, start, workers), n)]

    whole = stream(0, 0, 5)
    for got in (stream(3, 0, 2), stream(3, 2, 2)):
        assert all(torch.equal(a, b) for a, b in zip(whole[3:], got))
    assert all(torch.equal(a, b) for a, b in zip(whole, stream(0, 2, 5)))


def test_an_interrupted_paper_net_run_resumes_exactly(tmp_path, monkeypatch):
    """GoogLeNet on a toy CUB tree (random crops and mirrors, dropout): interrupted after its iteration-2
    snapshot and resumed, it ends on the uninterrupted run's weights (measured: identical).  Before, the
    resume restored only Caffe's solverstate: the crops restarted, the DataLoader drew from the global RNG
    and the dropout masks followed other draws (weights 8.5% apart, relative)."""
    from caffe_compat.io import read_net
    from caffe_compat.reproduce import training
    from caffe_compat.reproduce.training import train_run

    setup = replace(SETUPS["cub200"], batch_size=4, per_label=2)
    records = read_cub200(make_toy_data("cub", tmp_path / "cub", size=16, num_classes=6, images_per_class=4), "train")
    weights = str(random_init("cub200", tmp_path / "init.caffemodel"))
    whole = train_run(setup, "fappy", 0, records, tmp_path / "whole", max_iter=4, weights=weights, progress=False)
    monkeypatch.setattr(training, "batches", _interrupted_at(3))
    with pytest.raises(RuntimeError, match="interrupted"):
        train_run(setup, "fappy", 0, records, tmp_path / "parts", max_iter=4, weights=weights, snapshot_every=2,
                  progress=False)
    monkeypatch.undo()
    resumed = train_run(setup, "fappy", 0, records, tmp_path / "parts", max_iter=4, weights=weights, progress=False)
    assert resumed["resumed_from"] == 2 and resumed["iterations"] == 4
    a, b = read_net(whole["caffemodel"]), read_net(resumed["caffemodel"])
    for la, lb in zip(a.layer, b.layer):
        for ba, bb in zip(la.blobs, lb.blobs):
            np.testing.assert_allclose(np.asarray(bb.data), np.asarray(ba.data), rtol=1e-5, atol=1e-7)


def random_init(dataset: str, path):
    """A stand-in for the ImageNet initialisation (VGG_CNN_M_1024's prototxt has no fillers, so Caffe
    would start it from all-zero weights): He-normal weights, zero biases, saved as a caffemodel."""
    from caffe_compat.net import load_net
    from caffe_compat.reproduce.training import REPO_PROTOTXT

    net = load_net(REPO_PROTOTXT / dataset / "deploy.prototxt")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for blobs in net.params.values():
            for blob in blobs:
                if blob.dim() >= 2:
                    fan_in = blob[0].numel()
                    blob.copy_(torch.randn(blob.shape, generator=generator) * (2.0 / fan_in) ** 0.5)
                else:
                    blob.zero_()
    net.save_caffemodel(path)
    return path


@pytest.mark.parametrize("dataset, kind", [("cub200", "cub"), ("vehicleid", "vehicleid")])
def test_paper_nets_run_end_to_end_on_toy_trees(dataset, kind, tmp_path, capsys):
    """The full-size GoogLeNet / VGG_CNN_M_1024 setups: 2 iterations at batch 4 on the toy trees."""
    root = make_toy_data(kind, tmp_path / kind, size=16, num_classes=26 if kind == "vehicleid" else 6,
                         images_per_class=4)
    out = tmp_path / "run"
    code = main(["reproduce", dataset, "--data-root", str(root), "--loss", "fappy", "--max-iter", "2",
                 "--batch-size", "4", "--per-label", "2", "--device", "cpu", "--out", str(out),
                 "--weights", str(random_init(dataset, tmp_path / "init.caffemodel"))])
    assert code == 0
    run = json.loads((out / "run.json").read_text())
    assert run["setup"]["batch_size"] == 4 and run["max_iter"] == 2
    # our training preprocessing is recorded, with the authors' (different) data layer beside it
    pre = run["preprocessing"]
    assert (pre["resize"], pre["crop"], pre["mirror"], pre["mean_value"], pre["scale"]) == \
        (256, 224, True, [104.0, 117.0, 123.0], 1.0)
    assert pre["note"].startswith("differs from the authors' training input")
    assert "LabelShufflingLayer" in pre["authors"] and "no mean subtracted" in pre["authors"]
    assert pre["test"]["resize"] == 256 and pre["test"]["crop_size"] == 224
    metrics = json.loads((out / "fappy" / "seed0" / "metrics.json").read_text())["metrics"]
    if dataset == "vehicleid":
        assert set(metrics["splits"]) == {"small", "medium", "large"}
        assert (out / "cmc.png").exists()
    else:
        assert set(metrics["recall_at_k"]) == {"1", "2", "4", "8", "16", "32"}
        assert (out / "recall_at_k.png").exists()
    assert "wrote" in capsys.readouterr().out


def test_bad_arguments_exit_2_without_traceback(tmp_path, capsys):
    assert main(["reproduce", "cub200", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "--data-root is required" in err and "Traceback" not in err
    assert main(["reproduce", "digits", "--loss", "nosuch", "--out", str(tmp_path / "y")]) == 2
    assert "nosuch" in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["missing root", "empty root", "missing test list"])
def test_bad_data_root_exits_2_before_creating_the_run_folder(damage, tmp_path, capsys):
    """`reproduce vehicleid --data-root BAD --out r`: the data set is read first, so no r/ is left."""
    root = tmp_path / "VehicleID"
    if damage != "missing root":
        root.mkdir()
    if damage == "missing test list":
        root = make_toy_data("vehicleid", root, size=16, num_classes=26, images_per_class=4)
        (root / "train_test_split" / "test_list_2400.txt").unlink()
    out = tmp_path / "r"
    assert main(["reproduce", "vehicleid", "--data-root", str(root), "--max-iter", "1", "--device", "cpu",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err
    if damage == "missing test list":
        assert "test_list_2400.txt" in err
    assert not out.exists()


def test_an_out_that_is_a_file_exits_2(tmp_path, capsys):
    """`reproduce ... --out FILE` (or a folder under a file): one line naming it (FileExistsError traceback)."""
    root = make_toy_data("cub", tmp_path / "cub", size=16, num_classes=6, images_per_class=4)
    taken = tmp_path / "taken"
    taken.write_text("")
    for out in (taken, taken / "sub"):
        assert main(["reproduce", "cub200", "--data-root", str(root), "--max-iter", "1", "--device", "cpu",
                     "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err == f"caffe-compat reproduce: error: {out}: cannot write (--out: not a folder)\n", err


def test_cuda_graphs_off_a_gpu_warn_and_train_the_same_runs(digits_run, tmp_path, capsys):
    """``reproduce --cuda-graphs`` on the CPU: the reason on stderr, then the runs eager training makes
    (the same weights, hence the same metrics as the shared digits run's)."""
    out, _ = digits_run
    code = main(["reproduce", "digits", "--loss", "fappy", "--seeds", "0", "--max-iter", "6", "--device", "cpu",
                 "--out", str(tmp_path / "graphs"), "--cuda-graphs"])
    assert code == 0
    err = capsys.readouterr().err
    assert "cuda_graphs: the device is cpu, CUDA graphs need a CUDA device; the iterations run eagerly" in err
    ours = json.loads((tmp_path / "graphs" / "fappy" / "seed0" / "metrics.json").read_text())["metrics"]
    shared = json.loads((out / "fappy" / "seed0" / "metrics.json").read_text())["metrics"]
    assert ours.pop("onnx") != shared.pop("onnx")  # (each run's own file)
    assert ours == shared and ours["recall_at_k"]
