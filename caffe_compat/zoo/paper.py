"""The FAPPY paper's setups as files: every net and solver under ``prototxt/``, in one table.

==========  ==============================  ==================================  =====  =========
folder      net (authors' name)             data layer                          batch  deploy in
==========  ==============================  ==================================  =====  =========
cub200      GoogLeNet, fc_embedding 512     LabelShufflingLayer, 10 per label   128    224x224
sop         GoogLeNet, fc_embedding 512     Data (LMDB), mirror, crop 227       128    227x227
vehicleid   VGG_CNN_M_1024, fc7 1024        LabelShufflingLayer, 16 per label   150    224x224
digits      3 conv blocks, fc_embedding 64  Input data + label (sampler)        64     32x32
==========  ==============================  ==================================  =====  =========

Each folder holds ``train_fappy.prototxt`` (the authors' net, FAPPY delta 1e-4), one
``train_<baseline>.prototxt`` per baseline the paper reports for that data set (Table 1: contrastive,
triplet, lifted, histogram for CUB and SOP; Table 2: triplet, histogram for VehicleID, whose lifted
structure row is empty), ``deploy.prototxt`` (the train net without data and loss layers, with an
``Input`` layer ``data``) and ``solver.prototxt`` (training ``train_fappy``).  ``digits`` has every head.

A solver names its net by file name alone (``net: "train_fappy.prototxt"``), the net beside it:
``caffe-compat train /any/path/prototxt/cub200/solver.prototxt`` finds it from any working directory
(:class:`caffe_compat.solver.Solver` opens a relative ``net`` against the working directory first, as
Caffe does, then against the solver's folder; real Caffe needs to be run from that folder).  The
snapshot prefixes (``snapshots/<set>/fappy``) stay relative to the working directory, as in Caffe.

Data paths are ours (``db/...``); everything else is the authors'.  CUB caveat: the authors' Python
layer subtracts the whole mean file without cropping, so their CUB LMDB images had the mean file's
size; with the usual 256x256 ImageNet mean, ``pool5`` would be 2x2 and fc_embedding 4096-wide.  Our
deploy uses 224x224 (as the BVLC GoogLeNet and the project's real-Caffe reference nets do).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from caffe_compat.zoo.data_layers import InputData, LabelShufflingData, LmdbData
from caffe_compat.zoo.digits import digits_embedding
from caffe_compat.zoo.googlenet import googlenet_embedding
from caffe_compat.zoo.loss_heads import LOSSES
from caffe_compat.zoo.solvers import digits_solver, paper_solver
from caffe_compat.zoo.vgg_cnn_m_1024 import vgg_cnn_m_1024_embedding


@dataclass(frozen=True)
class PaperSetup:
    folder: str
    net_name: str
    build: Callable  # googlenet_embedding or vgg_cnn_m_1024_embedding
    train_data: object
    deploy_shape: tuple[int, int, int, int]
    baselines: tuple[str, ...]


PAPER_SETUPS = {
    "cub200": PaperSetup(
        "cub200", "GoogleNet_CUB_200_2011", googlenet_embedding,
        LabelShufflingData("db/cub200_train_lmdb", "db/imagenet_mean.binaryproto", batch_size=128, max_per_label=10),
        (1, 3, 224, 224), ("contrastive", "triplet", "lifted", "histogram")),
    "sop": PaperSetup(
        "sop", "GoogleNet_Products", googlenet_embedding,
        LmdbData("db/products_train_lmdb", batch_size=128, crop_size=227, mean_file="db/imagenet_mean.binaryproto"),
        (1, 3, 227, 227), ("contrastive", "triplet", "lifted", "histogram")),
    "vehicleid": PaperSetup(
        "vehicleid", "VGG1024_CCL_train.prototxt", vgg_cnn_m_1024_embedding,
        LabelShufflingData("db/vehicleID_train_lmdb", "db/VGG_mean.binaryproto", batch_size=150, max_per_label=16),
        (1, 3, 224, 224), ("triplet", "histogram")),
}

#: Where the solvers write snapshots (relative to the working directory, as Caffe opens them).
SNAPSHOT_ROOT = "snapshots"


def train_file_name(loss: str) -> str:
    return f"train_{loss}.prototxt"


def setup_files(setup: PaperSetup) -> dict:
    """``{relative path: message}`` for one data set's nets and solver."""
    files = {}
    for loss in ("fappy",) + setup.baselines:
        name = setup.net_name if loss == "fappy" else f"{setup.net_name}_{loss}"
        files[f"{setup.folder}/{train_file_name(loss)}"] = setup.build(setup.train_data, name=name, loss=loss)
    files[f"{setup.folder}/deploy.prototxt"] = setup.build(
        InputData(setup.deploy_shape), name=f"{setup.net_name}_deploy", loss=None)
    files[f"{setup.folder}/solver.prototxt"] = paper_solver(
        setup.folder, net=train_file_name("fappy"),  # beside the solver (module docstring)
        snapshot_prefix=f"{SNAPSHOT_ROOT}/{setup.folder}/fappy")
    return files


def digits_files(batch_size: int = 64, image_size: int = 32) -> dict:
    """The toy digits nets (every head), deploy net and solver."""
    files = {f"digits/{train_file_name(loss)}": digits_embedding(batch_size, image_size, loss=loss,
                                                                 name=f"digits_embedding_{loss}")
             for loss in LOSSES}
    deploy = digits_embedding(1, image_size, loss=None, name="digits_embedding_deploy")
    files["digits/deploy.prototxt"] = deploy
    files["digits/solver.prototxt"] = digits_solver(train_file_name("fappy"), f"{SNAPSHOT_ROOT}/digits/fappy")
    return files


def paper_files() -> dict:
    """Every file of ``prototxt/``: ``{path relative to prototxt/: NetParameter or SolverParameter}``."""
    files = {}
    for setup in PAPER_SETUPS.values():
        files.update(setup_files(setup))
    files.update(digits_files())
    return files
