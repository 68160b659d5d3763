"""Training one (data set, loss, seed) run from our prototxt with Caffe's solver, fed by the native
data set readers, Caffe's DataTransformer and the authors' label-shuffling sampler.

The train net's data layer (the authors' Python LabelShufflingLayer or an LMDB Data layer) is replaced
by two ``Input`` layers, ``data`` (B×3×crop×crop) and ``label`` (B), fed batch by batch: the sampler
and transformer reproduce what those layers did, from the images in their native layout.  A run is
resumable: it snapshots (caffemodel + solverstate) every ``snapshot_every`` iterations and at the end,
and a restarted run restores the latest snapshot and skips the batches already consumed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from caffe_compat.errors import CaffeCompatError
from caffe_compat.io import read_net, read_solver
from caffe_compat.proto import caffe_pb2

REPO_PROTOTXT = Path(__file__).resolve().parents[2] / "prototxt"


def input_layers(batch: int, crop: int) -> list[caffe_pb2.LayerParameter]:
    data = caffe_pb2.LayerParameter(name="data", type="Input", top=["data"])
    data.input_param.shape.add().dim.extend([batch, 3, crop, crop])
    label = caffe_pb2.LayerParameter(name="label", type="Input", top=["label"])
    label.input_param.shape.add().dim.extend([batch])
    return [data, label]


def train_net_param(setup, loss: str, delta_min: float | None = None) -> caffe_pb2.NetParameter:
    """Our ``train_<loss>.prototxt`` with its data layer replaced by fed Input layers."""
    path = REPO_PROTOTXT / setup.prototxt_dir / f"train_{loss}.prototxt"
    if not path.exists():
        known = sorted(p.stem[len("train_"):] for p in path.parent.glob("train_*.prototxt"))
        raise CaffeCompatError(f"no {loss!r} net for {setup.name} (known: {', '.join(known)})")
    net = read_net(path)
    data_tops = {"data", "label"}
    layers = [layer for layer in net.layer if not set(layer.top) & data_tops or layer.bottom]
    del net.layer[:]
    net.layer.extend(input_layers(setup.batch_size, setup.crop) + layers)
    if delta_min is not None:
        for layer in net.layer:
            if layer.type == "FAPPYLoss":
                layer.fappy_loss_param.delta = float(delta_min)
    return net


def solver_param(setup, net: caffe_pb2.NetParameter, seed: int, max_iter: int, run_dir: Path,
                 device: str) -> caffe_pb2.SolverParameter:
    param = read_solver(REPO_PROTOTXT / setup.prototxt_dir / "solver.prototxt")
    for name in ("net", "train_net", "net_param", "train_net_param"):
        param.ClearField(name)
    param.net_param.CopyFrom(net)
    param.max_iter = int(max_iter)
    param.random_seed = int(seed)
    param.snapshot = 0
    param.snapshot_prefix = str(run_dir / "snapshot")
    param.display = 0
    del param.test_iter[:]
    param.test_interval = 0
    param.solver_mode = caffe_pb2.SolverParameter.GPU if device.startswith("cuda") else caffe_pb2.SolverParameter.CPU
    return param


def batches(setup, records, seed: int, start: int, workers: int):
    """Endless ``{"data", "label"}`` batches from the label-shuffling sampler, from batch ``start`` on."""
    from torch.utils.data import DataLoader

    from caffe_compat.data import DataTransformer, ImageRecordDataset, LabelShufflingSampler

    transformer = DataTransformer(crop_size=setup.crop if setup.resize else 0, mirror=setup.mirror,
                                  mean_value=setup.mean_value, scale=setup.scale, phase="TRAIN", seed=seed)
    dataset = ImageRecordDataset(records, transformer, new_height=setup.resize, new_width=setup.resize, seed=seed)
    sampler = LabelShufflingSampler(dataset.labels, setup.batch_size, setup.per_label, seed=seed)

    def index_batches():
        epoch, position = 0, 0
        while True:
            sampler.set_epoch(epoch)
            for batch in sampler:
                if position >= start:
                    yield batch
                position += 1
            epoch += 1

    loader = DataLoader(dataset, batch_sampler=index_batches(), num_workers=workers,
                        persistent_workers=workers > 0, pin_memory=torch.cuda.is_available())
    for images, labels in loader:
        yield {"data": images, "label": labels.to(torch.float32)}


def latest_snapshot(run_dir: Path) -> Path | None:
    states = sorted(run_dir.glob("snapshot_iter_*.solverstate"), key=lambda p: int(p.stem.rsplit("_", 1)[1]))
    return states[-1] if states else None


def train_run(setup, loss: str, seed: int, records, run_dir: Path, *, device: str = "cpu", max_iter: int,
              weights: str | None = None, delta_min: float | None = None, workers: int = 0,
              snapshot_every: int = 0, progress: bool = True) -> dict:
    """Train one run with :func:`caffe_compat.solver.train.train`; returns ``{"caffemodel",
    "iterations", "final_loss", "seconds", "log"}``."""
    from caffe_compat.solver import Solver
    from caffe_compat.solver.train import train

    run_dir.mkdir(parents=True, exist_ok=True)
    np.random.seed(seed)
    param = solver_param(setup, train_net_param(setup, loss, delta_min), seed, max_iter, run_dir, device)
    param.snapshot = int(snapshot_every)
    solver = Solver(param, weights=weights, device=device)
    resume = latest_snapshot(run_dir)
    if resume is not None:
        solver.restore(str(resume))
    log_path = run_dir / "train_log.csv"
    if resume is None and log_path.exists():
        log_path.unlink()
    summary = train(solver, data=batches(setup, records, seed, solver.iter, workers), progress=progress,
                    csv_log=str(log_path), seed=seed)
    caffemodel = Path(f"{param.snapshot_prefix}_iter_{solver.iter}.caffemodel")
    if not caffemodel.exists():
        caffemodel, _ = solver.snapshot()
    return {"caffemodel": str(caffemodel), "iterations": solver.iter, "final_loss": summary.last_loss,
            "seconds": summary.seconds, "log": str(log_path)}
