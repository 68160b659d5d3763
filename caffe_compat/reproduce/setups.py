"""What `caffe-compat reproduce` needs to know per data set: where the nets are, how images are read
and preprocessed, how batches are sampled, which protocol evaluates the embedder.

Preprocessing follows Caffe's DataTransformer (BGR, resize with OpenCV, random crop + mirror in TRAIN,
centre crop in TEST, mean values subtracted, then scale).  For the real data sets we use the ImageNet
BGR mean values (104, 117, 123) that the BVLC GoogLeNet / VGG_CNN_M_1024 initialisations expect.

This is *not* what the authors' training data layers did (:data:`AUTHORS_PREPROCESSING`): their
LabelShufflingLayer (CUB-200-2011, VehicleID) feeds the LMDB images as stored, with no resize, crop,
mirror or mean (it never reads its ``mean_file``; ``scales`` 1), and their Stanford Online Products net
uses Caffe's Data layer with mirror, crop 227 and a mean *file*.  :func:`training_preprocessing` is the
record of what a run used (``run.json``'s ``preprocessing``), with that difference spelled out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from caffe_compat.data import read_cub200, read_sop, read_vehicleid


@dataclass(frozen=True)
class ReproduceSetup:
    name: str                      # cub200 | sop | vehicleid | digits
    prototxt_dir: str              # folder under prototxt/
    read: Callable                 # (root, split) -> records
    train_split: str
    test_splits: tuple[str, ...]   # one for retrieval; small/medium/large for VehicleID
    protocol: str                  # cub200 | sop | vehicleid (caffe_compat.evaluate.protocols)
    embedding_blob: str
    resize: int                    # images resized to resize x resize before cropping (0: as stored)
    crop: int                      # network input side
    batch_size: int
    per_label: int                 # label-shuffling cap per label visit
    max_iter: int
    mean_value: tuple[float, ...] = (104.0, 117.0, 123.0)
    scale: float = 1.0
    mirror: bool = True
    losses: tuple[str, ...] = ("fappy", "contrastive", "triplet", "lifted", "histogram")
    toy_kind: str | None = None    # make_toy_data kind when the data set is generated
    title: str | None = None       # the data set's name in tables and plots (default: the protocol's)
    notes: dict = field(default_factory=dict)

    @property
    def display_name(self) -> str:
        """What tables and plots call the data set: ``title``, else the real data set's name."""
        from caffe_compat.evaluate.protocols import DATASET_TITLES

        return self.title or DATASET_TITLES[self.protocol]


SETUPS = {
    "cub200": ReproduceSetup("cub200", "cub200", read_cub200, "train", ("test",), "cub200", "fc_embedding",
                             resize=256, crop=224, batch_size=128, per_label=10, max_iter=30000),
    "sop": ReproduceSetup("sop", "sop", read_sop, "train", ("test",), "sop", "fc_embedding",
                          resize=256, crop=227, batch_size=128, per_label=10, max_iter=30000),
    "vehicleid": ReproduceSetup("vehicleid", "vehicleid", read_vehicleid, "train", ("small", "medium", "large"),
                                "vehicleid", "fc7", resize=256, crop=224, batch_size=150, per_label=16,
                                max_iter=30000, losses=("fappy", "triplet", "histogram")),
    # The embedded default: a CUB-layout tree of scikit-learn's digits, trained from scratch on CPU.
    "digits": ReproduceSetup("digits", "digits", read_cub200, "train", ("test",), "cub200", "fc_embedding",
                             resize=0, crop=32, batch_size=64, per_label=8, max_iter=200,
                             mean_value=(128.0, 128.0, 128.0), scale=1 / 64, mirror=False,
                             losses=("fappy", "contrastive", "triplet", "histogram"), toy_kind="cub",
                             title="digits, CUB layout"),
}


#: What the authors' own training data layer did, per data set (see the module docstring).
AUTHORS_PREPROCESSING = {
    "cub200": ("the authors' LabelShufflingLayer (label_shuffling_layer.py) feeds the LMDB images as stored: no "
               "resize, no crop, no mirror and no mean subtracted (it never reads the mean_file its prototxt "
               "names; scales [1, 1])"),
    "vehicleid": ("the authors' LabelShufflingLayer (label_shuffling_layer.py) feeds the LMDB images as stored: no "
                  "resize, no crop, no mirror and no mean subtracted (it never reads the mean_file its prototxt "
                  "names; scales [1, 1])"),
    "sop": ("the authors' Caffe Data layer: the LMDB images as stored (their size is not published), random crop "
            "227 and mirror, minus the mean file imagenet_mean.binaryproto (not per-channel mean values)"),
    "digits": "no authors' counterpart (the embedded toy data set)",
}


def training_preprocessing(setup: ReproduceSetup) -> dict:
    """The training preprocessing a run of ``setup`` uses (what
    :func:`caffe_compat.reproduce.training.batches` gives Caffe's DataTransformer and the image reader),
    and how it differs from the authors' data layer: the ``preprocessing`` entry of ``run.json``."""
    crop = setup.crop if setup.resize else 0  # without a resize the images are stored at the input size
    record = {
        "channel_order": "BGR",
        "resize": int(setup.resize),  # 0: as stored
        "crop": int(crop),  # 0: none
        "crop_mode": "random (TRAIN phase)" if crop else "none",
        "mirror": bool(setup.mirror),
        "mean_value": [float(v) for v in setup.mean_value],
        "scale": float(setup.scale),
        "input_size": int(setup.crop),
        "authors": AUTHORS_PREPROCESSING.get(setup.name, "unknown"),
    }
    if setup.toy_kind is not None:
        record["note"] = "the toy data set's own preprocessing; the paper has no counterpart"
    else:
        ours = (f"resize to {setup.resize}x{setup.resize}, random crop {crop}, "
                f"{'mirror' if setup.mirror else 'no mirror'}, minus the ImageNet BGR mean values "
                f"{tuple(int(v) if float(v).is_integer() else v for v in setup.mean_value)}, scale {setup.scale:g}")
        record["note"] = (f"differs from the authors' training input (see 'authors'): this run uses {ours}, "
                          f"the usual input of the ImageNet initialisation")
    return record
