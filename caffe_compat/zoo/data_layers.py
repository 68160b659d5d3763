"""The three kinds of data layer our nets start with; each adds tops ``data`` (and ``label``).

* :class:`LabelShufflingData`: the FAPPY authors' Python layer ``label_shuffling_layer.LabelShufflingLayer``
  (CUB-200-2011 and VehicleID).  Its settings travel in ``python_param.param_str``, a YAML mapping the
  layer reads with ``yaml.load``: ``source`` (LMDB), ``batch_size``, ``scales`` (one multiplier per
  top) and ``max_number_object_per_label`` (consecutive images per label, 10 for CUB, 16 for
  VehicleID).  The authors' prototxts also name a ``mean_file``, which the published layer never reads
  (our port ignores it too, with a warning; ``apply_mean_file: true`` subtracts it, a deviation).  Our
  sampler port is :class:`caffe_compat.data.LabelShufflingSampler`.
* :class:`LmdbData`: Caffe's ``Data`` layer on an LMDB with a ``transform_param`` (Stanford Online
  Products: mirror, crop 227, mean file).
* :class:`InputData`: ``Input`` layers (deploy nets; nets fed from a Python sampler): ``data`` of the
  given shape and, when ``label`` is true, a second ``Input`` layer ``label`` of shape ``(B,)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from caffe_compat.io.param_str import parse_param_str  # noqa: F401 (the param_str parser, importable from here)
from caffe_compat.zoo.builder import NetBuilder


def _yaml_number(value: float) -> str:
    return repr(float(value)) if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class LabelShufflingData:
    source: str
    mean_file: str
    batch_size: int
    max_per_label: int
    scales: tuple[float, float] = (1.0, 1.0)

    def param_str(self) -> str:
        scales = ", ".join(_yaml_number(s) for s in self.scales)
        return (f"source: {self.source}\nmean_file: {self.mean_file}\nbatch_size: {self.batch_size}\n"
                f"scales: [{scales}]\nmax_number_object_per_label: {self.max_per_label}\n")

    def add_to(self, b: NetBuilder) -> tuple[str, str]:
        layer = b.add("data", "Python", [], ["data", "label"])
        p = layer.python_param
        p.module, p.layer, p.param_str = "label_shuffling_layer", "LabelShufflingLayer", self.param_str()
        return "data", "label"


@dataclass(frozen=True)
class LmdbData:
    source: str
    batch_size: int
    crop_size: int
    mean_file: str
    mirror: bool = True

    def add_to(self, b: NetBuilder) -> tuple[str, str]:
        layer = b.add("data", "Data", [], ["data", "label"])
        t = layer.transform_param
        t.mirror, t.crop_size, t.mean_file = self.mirror, self.crop_size, self.mean_file
        d = layer.data_param
        d.source, d.batch_size, d.backend = self.source, self.batch_size, layer.data_param.LMDB
        return "data", "label"


@dataclass(frozen=True)
class InputData:
    shape: Sequence[int]
    label: bool = False

    def add_to(self, b: NetBuilder) -> tuple[str, str | None]:
        data = b.input("data", self.shape)
        label = b.input("label", (self.shape[0],)) if self.label else None
        return data, label
