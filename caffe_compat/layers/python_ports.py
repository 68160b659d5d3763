"""Native ports of known Caffe ``Python`` layers (registered as ``Python:<module>.<layer>``).

A model file never makes us import a module: a ``Python`` layer runs only when its ``module.layer``
has a port here (else :func:`caffe_compat.layers.layer_class` raises an UnknownLayerError naming the
layer and how to register one).  Both layers come from madkn/HistogramLoss (Ustinova & Lempitsky,
2016); the FAPPY authors train CUB-200-2011 and VehicleID with the same ``label_shuffling_layer``.

``param_str`` is read as the layers read it (``yaml.load``) for the flat mappings they use: one
``key: value`` per line (the prototxt's ``\\n``), value a number (``1.`` included), a ``[a, b]`` list,
``true``/``false`` or a string.  Python layers are not LossLayers: their tops get loss_weight 0
unless the prototxt sets ``loss_weight`` (madkn's nets set ``loss_weight: 1`` on the loss).

**LabelShufflingLayer** (``label_shuffling_layer.LabelShufflingLayer``): tops ``data``
``(batch_size, C, H, W)`` and ``label`` ``(batch_size, 1, 1, 1)`` (the layer reshapes every top to 4-D).
Batches come from :class:`~caffe_compat.data.samplers.LabelShufflingStream` (runs of at most
``max_number_object_per_label`` images per label, labels in a reshuffled order, default no cap), and
``top[i] = (values_i - subtract[i]) * scales[i]`` in float64, rounded to float32 (``scales`` required,
one per top; ``subtract`` default 0).  The published layer (madkn/HistogramLoss
``label_shuffling_layer.py``, the one the FAPPY authors' prototxts name) reads exactly five keys:
``source`` (LMDB, relative to the working directory), ``scales``, ``subtract``, ``batch_size``,
``max_number_object_per_label``; these keep its meaning here.

``mean_file`` is **ignored by default, as in the published layer**: its ``setup`` never reads the key,
although the FAPPY authors' cub200 and vehicleID prototxts pass one (``imagenet_mean.binaryproto``,
``VGG_mean.binaryproto``), so the authors' nets trained on mean-free pixels (``(x - 0) * 1``).  A
``UserWarning`` says so when the key is present.

Our keys (deviations from the published layer, each opt-in):

* ``apply_mean_file: true``: subtract ``mean_file`` after all, like Caffe's mean file without crop: the
  binaryproto (``1 x C x H x W``) is subtracted element-wise before ``subtract``/``scales``, so the records
  must have the mean's exact size (else a DataError).  Without ``mean_file`` it is a FormatError;
* ``seed`` (else seeded from the net's generator at ``fill``);
* a list-file ``source`` (lines ``path label``) with ``root_folder``/``new_height``/``new_width``/
  ``is_color`` as in ImageData (the published layer reads LMDB only).
* ``dataset: cub200|sop|vehicleid``: ``source`` is then the data set's root in its native layout
  (CUB_200_2011, Stanford_Online_Products, VehicleID_V1.0), read by :mod:`caffe_compat.data`
  (labels as the data set's files write them), ``split`` (default ``train``; CUB/SOP ``train``/``test``,
  VehicleID ``train``/``small``/``medium``/``large``), images decoded like a list-file source
  (``new_height``/``new_width``/``is_color``).

Other ambiguities, decided and documented here:

* Encoded (JPEG/PNG) records: the published layer only handles raw Datums (``datum_to_array``);
  here they are decoded with OpenCV in their native channels (see :mod:`caffe_compat.io.datum_lmdb`).
* Label order: the layer shuffles Python 2's ``dict.keys()``; the stream shuffles the labels in
  ascending order (what Python 2 gives for small integer labels), with ``RandomState(seed)``.
* The run structure (a label's first visit in LMDB key order, reshuffle on leaving it) is the
  stream's; see its module.  The same happens in TRAIN and TEST.
* Prefetching (ours; :mod:`caffe_compat.data.prefetch`): the stream's draws stay in order on the prefetch
  thread, the records decode on its workers; ``prefetch: N`` (queue depth, 0 = off) and
  ``prefetch_workers: N`` in ``param_str`` override the defaults.  The batches are the same either way.

**DistributionLossLayer** (``distribution_loss_layer.DistributionLossLayer``, the histogram loss):
bottoms ``cosine`` and ``pair_label`` (same count; pairs labelled 1 positive, -1 negative, any other
value ignored), top ``loss`` of shape ``(1,)``.  ``param_str``: ``grid_delta`` (required), ``loss``
(``simple`` default, ``linear``, ``exp``), ``margin`` (0), ``alpha`` (1), ``distr_type`` (``hist``; ``beta``
is not ported and raises).  With the grid ``g = numpy.arange(-1, 1 + Δ, Δ)`` and cosines clipped to
[-1, 1], a value x goes to bin ``b = max(1, first k with g[k] >= x)`` and adds ``(x - g[b-1]) / (nΔ)`` to
``p[b]`` and ``(g[b] - x) / (nΔ)`` to ``p[b-1]`` (n: number of values of its kind; a value above the last
node is counted in n but binned nowhere).  ``loss = p⁺ᵀ L p⁻`` in float64 with ``L[i, j] = [g_i <= g_j]``
(simple), ``max(0, margin - g_i + g_j)`` (linear) or ``log(1 + exp(alpha (margin + g_j - g_i)))`` (exp).
The gradient is the layer's: ``dloss/dx = (G[b] - G[b-1]) / (nΔ)`` with ``G = L p⁻`` (positives) or
``p⁺ᵀ L`` (negatives); clipping passes the gradient through, as the layer computes it at the clipped
value.  Quirks not reproduced: the layer clips its bottom blob **in place** (other consumers of the
cosines see the clipped values) and writes its diff without the top diff, i.e. ignores loss_weight in
backward (here the gradient is scaled by loss_weight like any layer's).
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from caffe_compat.data.prefetch import PrefetchingLayer
from caffe_compat.errors import CaffeCompatError, DataError, FormatError
from caffe_compat.io.param_str import parse_param_str  # noqa: F401 (also importable from here)
from caffe_compat.layers.facts import NONE, BlobCount, InputFacts, Shapes
from caffe_compat.layers.registry import CaffeLayer, register_layer
from caffe_compat.losses.static_form import asserted_in_graph


def _required(params: dict, key: str, layer: str):
    if key not in params:
        raise FormatError(f"layer '{layer}': param_str needs '{key}' (got keys {sorted(params)})")
    return params[key]


class _ImageListSource:
    """``(path, label)`` lines (a ``path label`` list file, or a native data set's records) read like
    Caffe's ImageData (OpenCV, optional resize)."""

    def __init__(self, lines: list, where: str, root_folder: str, new_height: int, new_width: int, is_color: bool):
        self.lines = lines
        if not self.lines:
            raise DataError(f"{where}: lists no images")
        self.root_folder, self.new_height, self.new_width, self.is_color = root_folder, new_height, new_width, is_color

    @classmethod
    def from_list_file(cls, path: Path, **image_options) -> "_ImageListSource":
        from caffe_compat.data.imageset import read_list_file

        return cls(read_list_file(path), str(path), **image_options)

    @classmethod
    def from_dataset(cls, dataset: str, root: Path, split: str, **image_options) -> "_ImageListSource":
        from caffe_compat.data.cub200 import read_cub200
        from caffe_compat.data.sop import read_sop
        from caffe_compat.data.vehicleid import read_vehicleid

        readers = {"cub200": read_cub200, "sop": read_sop, "vehicleid": read_vehicleid}
        if dataset not in readers:
            raise FormatError(f"param_str 'dataset' must be one of {sorted(readers)}, got {dataset!r}")
        records = readers[dataset](root, split)
        lines = [(str(r.path), int(r.label)) for r in records]
        return cls(lines, f"{dataset} {split} split of {root}", root_folder="", **image_options)

    def __len__(self) -> int:
        return len(self.lines)

    def labels(self) -> np.ndarray:
        return np.array([label for _, label in self.lines], dtype=np.int64)

    def image(self, index: int) -> tuple[np.ndarray, int]:
        from caffe_compat.data.image import load_image_bgr
        from caffe_compat.io.planes import chw_planes

        name, label = self.lines[index]
        image = load_image_bgr(self.root_folder + name, self.is_color, self.new_height, self.new_width)
        return chw_planes(image), label


@register_layer("Python:label_shuffling_layer.LabelShufflingLayer")
class LabelShufflingLayer(PrefetchingLayer, CaffeLayer):
    """The authors' label-shuffling data layer over an LMDB or a list file.

    Faithful to the published ``label_shuffling_layer.py``: keys ``source``, ``batch_size``, ``scales``,
    ``subtract``, ``max_number_object_per_label``; ``mean_file`` is **ignored** (with a warning), as the
    published layer ignores it.  Deviation, opt-in only: ``apply_mean_file: true`` subtracts ``mean_file``
    (whole, no crop) before ``subtract``/``scales``.  Ours too: ``seed``, a list-file ``source`` with
    ``root_folder``/``new_height``/``new_width``/``is_color``, a native data set (``dataset``, ``split``,
    ``source`` = its root).  Details in the module docstring.
    """

    bottoms = NONE
    tops = BlobCount(1, 2)  # data and (optionally) label
    reads_source = True
    param_message = "python_param"

    @classmethod
    def infer(cls, layer, bottoms):
        """Unknown without opening the source (its records decide the image size)."""
        return Shapes([None] * len(layer.top))

    @classmethod
    def input_facts(cls, layer) -> InputFacts:
        """``mean_file`` (subtracted whole, no crop; its size is the image size), ``scales[0]``."""
        params = parse_param_str(layer.python_param.param_str, layer.name)
        scales = params.get("scales")
        return InputFacts(mean_file=str(params["mean_file"]) if params.get("mean_file") else None, mean_value=None,
                          scale=float(scales[0]) if isinstance(scales, (list, tuple)) and scales else None,
                          source=str(params.get("source") or "its data source"), stored_size_by="the layer's LMDB")

    def __init__(self, param, bottom_shapes, phase="test"):
        super().__init__(param, bottom_shapes, phase)
        name = self.layer_name
        self.register_buffer("_device_anchor", torch.zeros(0), persistent=False)
        params = parse_param_str(param.python_param.param_str, name)
        self.params = params
        self.batch_size = int(_required(params, "batch_size", name))
        if self.batch_size < 1:
            raise FormatError(f"layer '{name}': batch_size must be positive, got {self.batch_size}")
        scales = _required(params, "scales", name)
        scales = list(scales) if isinstance(scales, (list, tuple)) else [scales]
        subtract = params.get("subtract", [0.0] * len(scales))
        subtract = list(subtract) if isinstance(subtract, (list, tuple)) else [subtract]
        if len(scales) < len(param.top) or len(subtract) < len(param.top):
            raise FormatError(f"layer '{name}': scales and subtract need one value per top ({len(param.top)}), got "
                              f"{scales} and {subtract}")
        self.scales = [float(s) for s in scales]
        self.subtract = [float(s) for s in subtract]
        cap = params.get("max_number_object_per_label", math.inf)
        if not (isinstance(cap, (int, float)) and cap >= 1):
            raise FormatError(f"layer '{name}': max_number_object_per_label must be a number >= 1, got {cap!r}")
        self.max_per_label = cap if cap == math.inf else int(cap)
        try:
            self.source = self._open_source(params)
            self.labels = self.source.labels()
            first, _ = self.source.image(0)
            self.mean = self._read_mean(params, first.shape, name)
        except CaffeCompatError as exc:
            raise type(exc)(f"layer '{name}' (LabelShufflingLayer): {exc}") from None
        self.image_shape = tuple(first.shape)
        self.seed = params.get("seed")
        self._start(0 if self.seed is None else int(self.seed))
        self._init_prefetch()
        if "prefetch_workers" in params:
            self.prefetch_workers = max(0, int(params["prefetch_workers"]))

    def _prefetch_depth(self):
        return int(self.params["prefetch"]) if "prefetch" in self.params else None

    @staticmethod
    def _open_source(params: dict):
        from caffe_compat.data.lmdb_source import DatumSource

        source = Path(str(_required(params, "source", "LabelShufflingLayer")))
        image_options = dict(new_height=int(params.get("new_height", 0)), new_width=int(params.get("new_width", 0)),
                             is_color=bool(params.get("is_color", True)))
        if "dataset" in params:
            return _ImageListSource.from_dataset(str(params["dataset"]), source, str(params.get("split", "train")),
                                                 **image_options)
        if source.is_dir():
            return DatumSource(source)
        if source.is_file():
            return _ImageListSource.from_list_file(source, root_folder=str(params.get("root_folder", "")),
                                                   **image_options)
        raise DataError(f"source '{source}' is neither an LMDB directory nor a list file (relative to {Path.cwd()})")

    @staticmethod
    def _read_mean(params: dict, shape: tuple[int, ...], layer: str = "") -> np.ndarray | None:
        """The mean to subtract: None unless ``apply_mean_file: true`` (see the class docstring)."""
        import warnings

        from caffe_compat.io import read_blob

        apply = params.get("apply_mean_file", False)
        if not isinstance(apply, bool):
            raise FormatError(f"apply_mean_file must be true or false, got {apply!r}")
        if not apply:
            if "mean_file" in params:
                warnings.warn(f"layer '{layer}' (LabelShufflingLayer): mean_file '{params['mean_file']}' is "
                              f"ignored, as the published label_shuffling_layer.py ignores it (it never reads "
                              f"the key); set 'apply_mean_file: true' to subtract it (a deviation)", stacklevel=4)
            return None
        if "mean_file" not in params:
            raise FormatError("apply_mean_file: true needs a mean_file")
        path = Path(str(params["mean_file"]))
        if not path.is_file():
            raise DataError(f"mean_file '{path}' not found (relative to {Path.cwd()})")
        mean = read_blob(path).astype(np.float64)
        if mean.ndim == 4 and mean.shape[0] == 1:
            mean = mean[0]
        if mean.shape != tuple(shape):
            raise DataError(f"mean_file {path} has shape {mean.shape}, the records {tuple(shape)}; the mean is "
                            f"subtracted whole (no crop), so they must agree")
        return mean

    def _start(self, seed: int) -> None:
        from caffe_compat.data.samplers import LabelShufflingStream

        self._stream = LabelShufflingStream(self.labels, self.max_per_label, seed)

    def fill(self, generator=None):
        if self.seed is None:
            self.reset_prefetch()
            self._start(int(torch.randint(0, 2 ** 31, (1,), generator=generator).item()))

    # resume (caffe_compat.solver.train saves this beside each snapshot; arrays and numbers only)
    def stream_state(self) -> dict:
        return {"stream": self._stream.state_dict()}

    def load_stream_state(self, state: dict) -> None:
        self.reset_prefetch()
        self._stream.load_state_dict(state["stream"])

    # prefetching (caffe_compat.data.prefetch): the cursor is a copy of the stream
    def _cursor(self):
        return SimpleNamespace(_stream=copy.deepcopy(self._stream))

    def _snapshot(self, cur) -> dict:
        return cur._stream.state_dict()

    def _restore(self, snapshot: dict) -> None:
        self._stream.load_state_dict(snapshot)

    def _decode(self, index: int):
        return self.source.image(index)

    @property
    def dtype(self) -> torch.dtype:
        return self._device_anchor.dtype

    @property
    def device(self) -> torch.device:
        return self._device_anchor.device

    def output_shapes(self):  # the records decide the image shape
        return [(self.batch_size, *self.image_shape), (self.batch_size, 1, 1, 1)][:len(self.param.top)]

    def next_indices(self) -> np.ndarray:
        """The record indices of the next batch (advances the stream; drops the read-ahead)."""
        self.reset_prefetch()
        return self._stream.take(self.batch_size)

    def _produce(self, cur, phase, fetch) -> list:
        keys = [int(i) for i in cur._stream.take(self.batch_size)]
        images, labels = [], []
        for j, i in enumerate(keys):
            image, label = fetch(i, lambda n, j=j: keys[j:j + n])
            if image.shape != self.image_shape:
                raise DataError(f"layer '{self.layer_name}': record {i} has shape {image.shape}, the first "
                                f"record {self.image_shape}; the layer needs equal sizes")
            images.append(image)
            labels.append(label)
        data = np.stack(images).astype(np.float64)
        if self.mean is not None:
            data -= self.mean
        data = (data - self.subtract[0]) * self.scales[0]
        tops = [data.astype(np.float32)]
        if len(self.param.top) == 2:
            label = (np.asarray(labels, dtype=np.float64) - self.subtract[1]) * self.scales[1]
            tops.append(label.astype(np.float32).reshape(-1, 1, 1, 1))
        return tops

    def forward(self):
        return self._to_device(self._next_arrays())


LOSS_KINDS = ("simple", "linear", "exp")


def distribution_loss_matrix(grid: torch.Tensor, kind: str, margin: float, alpha: float) -> torch.Tensor:
    """The layer's ``L[i, j]`` over grid nodes ``g`` (rows: positive bin, columns: negative bin)."""
    gi, gj = grid[:, None], grid[None, :]
    if kind == "simple":
        return (gi <= gj).to(grid.dtype)
    if kind == "linear":
        return (margin - gi + gj).clamp(min=0)
    return torch.log(torch.exp(alpha * (margin + gj - gi)) + 1)


def interpolated_histogram(values: torch.Tensor, grid: torch.Tensor, delta: float, of_kind: torch.Tensor
                           ) -> torch.Tensor:
    """The layer's histogram of the ``values`` (float64, already clipped) where ``of_kind`` (bool) is set, on
    ``grid`` (see the module docstring).  The other values, and those above the last node, add zeros in
    place of being dropped (the same sums: the kept ones are added in the same order), so that no length is
    read on the host (``torch.compile``, CUDA-graph capture)."""
    place = torch.searchsorted(grid, values.detach(), side="left").clamp(min=1)
    binned = of_kind & (place < grid.numel())
    place = place.clamp(max=grid.numel() - 1)  # an index for every value; the unbinned add nothing there
    hist = torch.zeros_like(grid)
    hist = hist.index_add(0, place, torch.where(binned, values - grid[place - 1], 0.0))
    hist = hist.index_add(0, place - 1, torch.where(binned, grid[place] - values, 0.0))
    return hist / (of_kind.sum().to(values.dtype) * delta)


@register_layer("Python:distribution_loss_layer.DistributionLossLayer")
class DistributionLossLayer(CaffeLayer):
    """madkn's histogram-loss Python layer on (cosine, pair_label) (see the module docstring)."""

    bottoms = BlobCount.exact(2)  # cosine and pair_label
    tops = BlobCount.exact(1)
    couples_batch = True
    param_message = "python_param"

    @classmethod
    def infer(cls, layer, bottoms):
        """A ``(1,)`` loss; the two bottoms must have the same count (the layer's check)."""
        counts = [math.prod(s) for s in bottoms]
        if counts[0] != counts[1]:
            raise FormatError(f"layer '{layer.name}' (DistributionLossLayer): inputs must have the same count: "
                              f"{counts}")
        return Shapes([(1,)])

    def __init__(self, param, bottom_shapes, phase="test"):
        super().__init__(param, bottom_shapes, phase)
        name = self.layer_name
        self.rule()
        params = parse_param_str(param.python_param.param_str, name)
        self.delta = float(_required(params, "grid_delta", name))
        if not 0 < self.delta <= 2:
            raise FormatError(f"layer '{name}': grid_delta must be in (0, 2], got {self.delta}")
        self.kind = str(params.get("loss", "simple"))
        if self.kind not in LOSS_KINDS:
            raise FormatError(f"layer '{name}': unknown loss {self.kind!r} (simple, linear or exp)")
        distr = str(params.get("distr_type", "hist"))
        if distr != "hist":
            raise FormatError(f"layer '{name}': distr_type {distr!r} is not ported (only 'hist'; the beta fit is not)")
        self.margin, self.alpha = float(params.get("margin", 0)), float(params.get("alpha", 1))
        # float64 constants kept off the module's buffers, so .half()/.to(dtype) on the net cannot round them
        self.grid = torch.from_numpy(np.arange(-1.0, 1.0 + self.delta, self.delta))
        self.loss_matrix = distribution_loss_matrix(self.grid, self.kind, self.margin, self.alpha)

    def forward(self, cosine, pair_label):
        x = cosine.reshape(-1).to(torch.float64)
        x = x.detach().clamp(-1.0, 1.0) + (x - x.detach())  # the clipped value; the gradient passes through
        labels = pair_label.reshape(-1)
        pos, neg = labels == 1, labels == -1
        both = pos.any() & neg.any()
        where = f"layer '{self.layer_name}' (DistributionLossLayer): needs at least one positive and one negative pair"
        if not asserted_in_graph(both, where) and not bool(both):
            raise DataError(f"{where}, got {int(pos.sum())} and {int(neg.sum())}")
        grid = self.grid.to(x.device)
        hist_pos = interpolated_histogram(x, grid, self.delta, pos)
        hist_neg = interpolated_histogram(x, grid, self.delta, neg)
        loss = hist_pos @ self.loss_matrix.to(x.device) @ hist_neg
        return (loss.reshape(1).to(cosine.dtype),)
