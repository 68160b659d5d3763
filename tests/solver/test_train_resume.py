"""Resume through ``train(resume=...)`` / ``caffe-compat train --resume``: with the ``.trainstate`` written
beside each snapshot, 3 iterations + a resume for 3 more equal 6 uninterrupted iterations bit for bit
(losses, smoothed losses, weights) in deterministic mode, with Dropout and a data source that advances:
the net's own data layers (the LabelShufflingLayer port, ImageData with shuffle/crop/mirror) and the
``data=`` iterable (a sampler-driven DataLoader, a shuffling DataLoader, a plain list)."""

from __future__ import annotations

import csv
import json
import logging

import numpy as np
import pytest
import torch

from caffe_compat.data.samplers import CategoryHardSampler, LabelShufflingSampler, MPerClassSampler
from caffe_compat.solver import Solver, SolverObserver
from caffe_compat.solver.train import train, train_state_path

BATCH = 6
HIDDEN = """
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
        inner_product_param { num_output: 16 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "drop1" type: "Dropout" bottom: "ip1" top: "ip1" dropout_param { dropout_ratio: 0.5 } }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
        inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "flat_label" type: "Reshape" bottom: "label" top: "flat_label" reshape_param { shape { dim: -1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "flat_label" top: "loss" }
"""


def _images(tmp_path, n: int = 24) -> str:
    import cv2

    images = tmp_path / "images"
    images.mkdir(exist_ok=True)
    g = np.random.RandomState(0)
    lines = []
    for i in range(n):
        cv2.imwrite(str(images / f"{i}.png"), g.randint(0, 256, (6, 6, 3)).astype(np.uint8))
        lines.append(f"{i}.png {i % 4}")
    (images / "list.txt").write_text("\n".join(lines) + "\n")
    return str(images)


def _data_layer(kind: str, images: str) -> str:
    if kind == "label_shuffling":
        return ('layer { name: "data" type: "Python" top: "data" top: "label" python_param { module: '
                '"label_shuffling_layer" layer: "LabelShufflingLayer" param_str: "source: %s/list.txt\\nroot_folder: '
                '%s/\\nbatch_size: %d\\nscales: [0.00390625, 1.]\\nmax_number_object_per_label: 2" } }'
                % (images, images, BATCH))
    if kind == "image_data":
        return ('layer { name: "data" type: "ImageData" top: "data" top: "label" include { phase: TRAIN } '
                'transform_param { crop_size: 4 mirror: true scale: 0.00390625 } image_data_param { source: '
                '"%s/list.txt" root_folder: "%s/" batch_size: %d shuffle: true } }' % (images, images, BATCH))
    assert kind == "input"
    return ('layer { name: "data" type: "Input" top: "data" top: "label" '
            'input_param { shape { dim: %d dim: 3 dim: 6 dim: 6 } shape { dim: %d } } }' % (BATCH, BATCH))


def _solver_file(tmp_path, kind: str, name: str) -> str:
    images = _images(tmp_path)
    net = f'name: "resume_{kind}"\n{_data_layer(kind, images)}\n{HIDDEN}'
    (tmp_path / f"{kind}_net.prototxt").write_text(net)
    (tmp_path / f"{name}_solver.prototxt").write_text(
        f'net: "{tmp_path / (kind + "_net.prototxt")}"\nbase_lr: 0.1\nlr_policy: "fixed"\nmomentum: 0.9\n'
        f'weight_decay: 0.001\naverage_loss: 4\nmax_iter: 6\nsnapshot: 3\n'
        f'snapshot_prefix: "{tmp_path / name / "snap"}"\nsolver_mode: CPU\n')
    return str(tmp_path / f"{name}_solver.prototxt")


def _weights(solver: Solver) -> dict[str, np.ndarray]:
    return {f"{layer}:{i}": blob.detach().cpu().numpy().copy()
            for layer, blobs in solver.net.params.items() for i, blob in enumerate(blobs)}


def _run(path, data=None, *, resume=None, seed=1, iters=None, csv_log=None, disturb=False):
    """Train with a fresh Solver; returns (losses, smoothed losses, weights)."""
    solver = Solver(path, device="cpu")
    if disturb:  # a different process would be elsewhere in every stream: prove train restores them
        torch.manual_seed(12345)
        np.random.seed(54321)
        try:
            solver.net.layer("data").forward()
        except Exception:  # Input layers have nothing to advance
            pass
    losses, smoothed = [], []
    solver.observers.append(SolverObserver(
        on_iteration=lambda s: (losses.append(s.last_loss), smoothed.append(s.smoothed_loss))))
    train(solver, data, iters=iters, resume=resume, deterministic=True, seed=seed, progress=False, csv_log=csv_log)
    return losses, smoothed, _weights(solver)


def _assert_resume_equals_uninterrupted(tmp_path, kind, make_data=lambda: None):
    full = _solver_file(tmp_path, kind, "full")
    losses_a, smoothed_a, weights_a = _run(full, make_data())
    assert len(losses_a) == 6
    part = _solver_file(tmp_path, kind, "part")
    losses_first, _, _ = _run(part, make_data(), iters=3)
    assert losses_first == losses_a[:3]
    state = tmp_path / "part" / "snap_iter_3.solverstate"
    trainstate = tmp_path / "part" / "snap_iter_3.trainstate"
    assert trainstate.is_file() and train_state_path(state) == str(trainstate)
    assert json.loads(trainstate.read_text())["format"] == "caffe-compat trainstate"
    losses_b, smoothed_b, weights_b = _run(part, make_data(), resume=str(state), seed=999, disturb=True)
    assert losses_b == losses_a[3:]  # bitwise
    assert smoothed_b == smoothed_a[3:]
    assert weights_b.keys() == weights_a.keys()
    for key, value in weights_a.items():
        np.testing.assert_array_equal(weights_b[key], value, err_msg=key)
    assert (tmp_path / "part" / "snap_iter_6.trainstate").is_file()
    return losses_a


@pytest.mark.parametrize("kind", ["label_shuffling", "image_data"])
def test_resume_through_the_nets_data_layer_equals_the_uninterrupted_run(tmp_path, kind):
    losses = _assert_resume_equals_uninterrupted(tmp_path, kind)
    assert len(set(losses)) == 6


def test_without_the_trainstate_the_data_restart_and_the_resume_differs(tmp_path, caplog):
    full = _solver_file(tmp_path, "label_shuffling", "full")
    losses_a, _, _ = _run(full)
    part = _solver_file(tmp_path, "label_shuffling", "part")
    _run(part, iters=3)
    state = tmp_path / "part" / "snap_iter_3.solverstate"
    (tmp_path / "part" / "snap_iter_3.trainstate").unlink()  # as a real Caffe snapshot
    with caplog.at_level(logging.WARNING, logger="caffe_compat.solver.train"):
        losses_b, _, _ = _run(part, resume=str(state))
    assert any("data stream starts again" in r.getMessage() for r in caplog.records)
    assert len(losses_b) == 3 and losses_b != losses_a[3:]


# ------------------------------------------------------------------------------------------ data= iterables

def _dataset(n: int = 24):
    g = np.random.RandomState(7)
    data = torch.tensor(g.rand(n, 3, 6, 6), dtype=torch.float32)
    labels = torch.arange(n) % 4
    return [{"data": data[i], "label": labels[i].to(torch.float32)} for i in range(n)], labels.numpy()


def _sampler_loader():
    dataset, labels = _dataset()
    sampler = LabelShufflingSampler(labels, BATCH, max_per_label=2, seed=3, batches_per_epoch=2)
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler)


def _shuffling_loader():  # RandomSampler: the permutation is drawn from torch's RNG at each pass's iter()
    dataset, _ = _dataset()
    return torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=True)


def _list_batches():
    dataset, _ = _dataset(4 * BATCH)
    return [{"data": torch.stack([d["data"] for d in dataset[i:i + BATCH]]),
             "label": torch.stack([d["label"] for d in dataset[i:i + BATCH]])} for i in range(0, 4 * BATCH, BATCH)]


@pytest.mark.parametrize("make_data", [_sampler_loader, _shuffling_loader, _list_batches],
                         ids=["sampler", "shuffling_loader", "list"])
def test_resume_through_the_data_iterable_equals_the_uninterrupted_run(tmp_path, make_data):
    _assert_resume_equals_uninterrupted(tmp_path, "input", make_data)


def test_cli_resume_equals_the_uninterrupted_cli_run(tmp_path, monkeypatch, capsys):
    from caffe_compat.cli import main
    from caffe_compat.io import read_weights

    monkeypatch.chdir(tmp_path)
    full = _solver_file(tmp_path, "label_shuffling", "full")
    part = _solver_file(tmp_path, "label_shuffling", "part")
    common = ["--deterministic", "--seed", "5", "--device", "cpu"]
    assert main(["train", full, "--log", str(tmp_path / "full.csv"), *common]) == 0
    assert main(["train", part, "--iters", "3", *common]) == 0
    state = str(tmp_path / "part" / "snap_iter_3.solverstate")
    assert main(["train", part, "--resume", state, "--log", str(tmp_path / "part.csv"), "--seed", "6",
                 "--deterministic", "--device", "cpu"]) == 0
    assert "trained 3 iterations" in capsys.readouterr().out
    full_rows = list(csv.DictReader(open(tmp_path / "full.csv")))
    part_rows = list(csv.DictReader(open(tmp_path / "part.csv")))
    columns = ("iter", "loss", "smoothed_loss", "lr")
    assert [[r[c] for c in columns] for r in part_rows] == [[r[c] for c in columns] for r in full_rows[3:]]
    a = dict(read_weights(tmp_path / "full" / "snap_iter_6.caffemodel"))
    b = dict(read_weights(tmp_path / "part" / "snap_iter_6.caffemodel"))
    assert a.keys() == b.keys()
    for layer, blobs in a.items():
        for x, y in zip(blobs, b[layer]):
            np.testing.assert_array_equal(np.array(y.values), np.array(x.values), err_msg=layer)


# ------------------------------------------------------------------------------------------ sampler state


@pytest.mark.parametrize("make", [
    lambda labels: LabelShufflingSampler(labels, 6, max_per_label=2, seed=4, batches_per_epoch=3),
    lambda labels: MPerClassSampler(labels, m=2, batch_size=6, seed=4),
    lambda labels: CategoryHardSampler(labels, labels // 2, batch_size=4, seed=4, batches_per_pair=2),
], ids=["label_shuffling", "m_per_class", "category_hard"])
@pytest.mark.parametrize("taken", [0, 1, 2])
def test_sampler_state_dict_continues_mid_epoch(make, taken):
    labels = np.arange(24) % 4
    reference = make(labels)
    epochs = [list(reference) for _ in range(3)]
    flat = [b for epoch in epochs for b in epoch]
    sampler = make(labels)
    list(sampler)  # epoch 0
    it = iter(sampler)  # epoch 1
    for _ in range(taken):
        next(it)
    state = sampler.state_dict()
    assert state["epoch"] == 2  # iter() already advanced it: the consumer adds the batches it took
    state = {**state, "epoch": 1, "batch": taken}
    resumed = make(labels)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert len(resumed) == len(epochs[1]) - taken
    rest = list(resumed) + list(resumed)
    assert rest == flat[len(epochs[0]) + taken:]
    assert resumed.state_dict() == {"epoch": 3, "batch": 0, "seed": 4}


def test_a_trainstate_of_another_iteration_is_ignored_with_a_warning(tmp_path, caplog):
    part = _solver_file(tmp_path, "label_shuffling", "part")
    _run(part, iters=6)
    snaps = tmp_path / "part"
    (snaps / "snap_iter_3.trainstate").write_bytes((snaps / "snap_iter_6.trainstate").read_bytes())
    with caplog.at_level(logging.WARNING, logger="caffe_compat.solver.train"):
        losses, _, _ = _run(part, resume=str(snaps / "snap_iter_3.solverstate"), iters=1)
    assert len(losses) == 1 and any("is of iteration 6" in r.getMessage() for r in caplog.records)


def test_train_state_codec_round_trips_without_pickle():
    from caffe_compat.solver.trainstate import decode_state as _decode, encode_state as _encode

    value = {"a": (1, 2.5, None), "b": np.arange(5, dtype=np.uint32), "t": torch.arange(3, dtype=torch.uint8),
             "raw": b"\x00\x01", 3: "int key", "__x": [np.int64(4), np.float32(0.5)],
             "rng": np.random.RandomState(1).get_state(legacy=False)}
    back = _decode(json.loads(json.dumps(_encode(value))))
    assert back["a"] == (1, 2.5, None) and back[3] == "int key" and back["raw"] == b"\x00\x01"
    assert back["__x"] == [4, 0.5]
    np.testing.assert_array_equal(back["b"], value["b"])
    assert back["b"].dtype == np.uint32
    assert torch.equal(back["t"], value["t"])
    g = np.random.RandomState(0)
    g.set_state(back["rng"])
    assert g.randint(1 << 30) == np.random.RandomState(1).randint(1 << 30)
    with pytest.raises(Exception, match="cannot save"):
        _encode({"x": object()})
