"""What `caffe-compat reproduce` needs to know per data set: where the nets are, how images are read
and preprocessed, how batches are sampled, which protocol evaluates the embedder.

Preprocessing follows Caffe's DataTransformer (BGR, resize with OpenCV, random crop + mirror in TRAIN,
centre crop in TEST, mean values subtracted, then scale).  For the real data sets we use the ImageNet
BGR mean values (104, 117, 123) that the BVLC GoogLeNet / VGG_CNN_M_1024 initialisations expect.
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
    notes: dict = field(default_factory=dict)


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
                             losses=("fappy", "contrastive", "triplet", "histogram"), toy_kind="cub"),
}
