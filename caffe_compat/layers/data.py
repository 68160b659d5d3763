"""Caffe's input layers: Input, DummyData, MemoryData, and the data-set readers Data (LMDB), ImageData
(list file) and HDF5Data (with h5py); each data-set layer's class docstring states its parameters.

* **Input**: tops with the shapes of ``input_param.shape`` (one shape for every top, or one per top).
  The net feeds them from ``CaffeNet.forward(**inputs)``; run on its own the layer yields zeros, what
  a freshly allocated Caffe blob holds.
* **DummyData**: tops of ``dummy_data_param.shape`` (or the legacy ``num/channels/height/width``), one
  for all tops or one per top, filled by ``data_filler`` (none: constant 0; one: used for every top;
  else one per top).  As in Caffe, a constant filler fills once; any other filler refills at every
  forward, drawing from the layer's own generator (seeded from the net's generator at ``fill``).
* **MemoryData**: tops ``data`` ``(batch_size, channels, height, width)`` and ``label`` ``(batch_size,)``
  served from arrays given to :meth:`MemoryData.set_input_arrays` (pycaffe's ``set_input_arrays``,
  Caffe's ``MemoryDataLayer::Reset``): the number of rows must be a multiple of ``batch_size``; each
  forward serves the next ``batch_size`` rows and wraps around to the start after the last batch.  Like
  ``Reset``, no ``transform_param`` is applied to these arrays.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import torch

from caffe_compat.errors import CaffeCompatError, DataError, FormatError, ShapeMismatchError
from caffe_compat.io.safe_open import check_regular_file, read_regular_text
from caffe_compat.layers.fillers import fill_blob
from caffe_compat.layers.registry import CaffeLayer, register_layer
from caffe_compat.proto import caffe_pb2


class _SourceLayer(CaffeLayer):
    """A layer without bottoms; a non-persistent empty buffer tracks the device the net was moved to."""

    def __init__(self, param, bottom_shapes, phase="test"):
        super().__init__(param, bottom_shapes, phase)
        if self.bottom_shapes:
            raise FormatError(f"layer '{self.layer_name}' ({param.type}) takes no bottom blobs, got "
                              f"{len(self.bottom_shapes)}")
        self.register_buffer("_device_anchor", torch.zeros(0), persistent=False)

    @property
    def device(self) -> torch.device:
        return self._device_anchor.device

    @property
    def dtype(self) -> torch.dtype:
        return self._device_anchor.dtype


def _per_top(values: list, num_top: int, what: str, layer: str) -> list:
    if len(values) == 1:
        return values * num_top
    if len(values) != num_top:
        raise FormatError(f"layer '{layer}': {what} must be given once or once per top ({num_top}), "
                          f"got {len(values)}")
    return values


@register_layer("Input")
class Input(_SourceLayer):
    """Caffe Input: declares the shapes of net inputs (see module docstring)."""

    def __init__(self, param, bottom_shapes, phase="test"):
        super().__init__(param, bottom_shapes, phase)
        shapes = [tuple(int(d) for d in s.dim) for s in param.input_param.shape]
        if not shapes:
            raise FormatError(f"layer '{self.layer_name}' (Input): input_param.shape is required")
        self.shapes = _per_top(shapes, len(param.top), "input_param.shape", self.layer_name)

    def output_shapes(self):
        return list(self.shapes)

    def forward(self):
        return tuple(torch.zeros(s, dtype=self.dtype, device=self.device) for s in self.shapes)


@register_layer("DummyData")
class DummyData(_SourceLayer):
    """Caffe DummyData: filler-generated tops (see module docstring)."""

    def __init__(self, param, bottom_shapes, phase="test"):
        super().__init__(param, bottom_shapes, phase)
        p = param.dummy_data_param
        num_top = len(param.top)
        if p.shape and (p.num or p.channels or p.height or p.width):
            raise FormatError(f"layer '{self.layer_name}' (DummyData): give either shape or num/channels/height/"
                              f"width, not both")
        if p.shape:
            shapes = [tuple(int(d) for d in s.dim) for s in p.shape]
        else:
            legacy = [list(p.num), list(p.channels), list(p.height), list(p.width)]
            if any(len(v) == 0 for v in legacy):
                raise FormatError(f"layer '{self.layer_name}' (DummyData): shape (or num, channels, height and "
                                  f"width) is required")
            legacy = [_per_top(v, num_top, name, self.layer_name)
                      for v, name in zip(legacy, ("num", "channels", "height", "width"))]
            shapes = [tuple(int(v[i]) for v in legacy) for i in range(num_top)]
        self.shapes = _per_top(shapes, num_top, "shape", self.layer_name)
        fillers = list(p.data_filler) or [caffe_pb2.FillerParameter(type="constant", value=0.0)]
        self.fillers = _per_top(fillers, num_top, "data_filler", self.layer_name)
        self.refill = [f.type != "constant" for f in self.fillers]
        self._generator = torch.Generator().manual_seed(0)

    def output_shapes(self):
        return list(self.shapes)

    def fill(self, generator=None):
        seed_source = generator if generator is not None else None
        seed = int(torch.randint(0, 2 ** 62, (1,), generator=seed_source).item())
        self._generator = torch.Generator().manual_seed(seed)

    # resume (caffe_compat.solver.train saves this beside each snapshot; arrays and numbers only)
    def stream_state(self) -> dict:
        return {"generator": self._generator.get_state()}

    def load_stream_state(self, state: dict) -> None:
        self._generator.set_state(torch.as_tensor(state["generator"], dtype=torch.uint8))

    def forward(self):
        tops = []
        for shape, filler in zip(self.shapes, self.fillers):
            top = torch.empty(shape, dtype=self.dtype)
            fill_blob(top, filler, self._generator)
            tops.append(top.to(self.device))
        return tuple(tops)


@register_layer("MemoryData")
class MemoryData(_SourceLayer):
    """Caffe MemoryData fed by :meth:`set_input_arrays` (see module docstring)."""

    def __init__(self, param, bottom_shapes, phase="test"):
        super().__init__(param, bottom_shapes, phase)
        p = param.memory_data_param
        self.batch_size, self.channels, self.height, self.width = (int(p.batch_size), int(p.channels),
                                                                  int(p.height), int(p.width))
        if min(self.batch_size, self.channels, self.height, self.width) < 1:
            raise FormatError(f"layer '{self.layer_name}' (MemoryData): batch_size, channels, height and width "
                              f"must all be positive, got {self.batch_size}, {self.channels}, {self.height}, "
                              f"{self.width}")
        if len(param.top) not in (1, 2):
            raise FormatError(f"layer '{self.layer_name}' (MemoryData): has tops data and label, got "
                              f"{len(param.top)} tops")
        self._data: torch.Tensor | None = None
        self._labels: torch.Tensor | None = None
        self.position = 0

    def output_shapes(self):
        return [(self.batch_size, self.channels, self.height, self.width), (self.batch_size,)][:len(self.param.top)]

    def set_input_arrays(self, data, labels) -> None:
        """Serve ``data`` (n × C × H × W) and ``labels`` (n, or n × 1 × 1 × 1) from the next forward on,
        starting at row 0; n must be a multiple of ``batch_size``."""
        data = torch.as_tensor(np.asarray(data) if not torch.is_tensor(data) else data).detach()
        labels = torch.as_tensor(np.asarray(labels) if not torch.is_tensor(labels) else labels).detach()
        expected = (self.channels, self.height, self.width)
        if data.dim() != 4 or tuple(data.shape[1:]) != expected:
            raise ShapeMismatchError(f"layer '{self.layer_name}' (MemoryData): data must be n × {expected[0]} × "
                                     f"{expected[1]} × {expected[2]}, got {tuple(data.shape)}")
        if labels.dim() not in (1, 4) or labels.shape[0] != data.shape[0] or math.prod(labels.shape) != data.shape[0]:
            raise ShapeMismatchError(f"layer '{self.layer_name}' (MemoryData): labels must have one value per data "
                                     f"row ({data.shape[0]}), got shape {tuple(labels.shape)}")
        if data.shape[0] == 0 or data.shape[0] % self.batch_size:
            raise ShapeMismatchError(f"layer '{self.layer_name}' (MemoryData): the number of rows {data.shape[0]} "
                                     f"must be a positive multiple of batch_size {self.batch_size}")
        self._data = data.to(torch.float32).contiguous()
        self._labels = labels.reshape(-1).to(torch.float32).contiguous()
        self.position = 0

    # resume: the cursor only (the arrays are the caller's, set again before resuming)
    def stream_state(self) -> dict:
        return {"position": int(self.position)}

    def load_stream_state(self, state: dict) -> None:
        self.position = int(state["position"])

    def forward(self):
        if self._data is None:
            raise DataError(f"layer '{self.layer_name}' (MemoryData): no arrays; call set_input_arrays(data, labels) "
                            f"first (Caffe: 'MemoryDataLayer needs to be initialized by calling Reset')")
        start, stop = self.position, self.position + self.batch_size
        data = self._data[start:stop].to(device=self.device, dtype=self.dtype)
        labels = self._labels[start:stop].to(device=self.device, dtype=self.dtype)
        self.position = stop % self._data.shape[0]
        return (data, labels)[:len(self.param.top)]


# ---------------------------------------------------------------------------------------------- data sets
#
# Data, ImageData and HDF5Data read records from files named (relative to the working directory, as
# Caffe opens them) in the prototxt.  Their state (``position``: the next record; ``_generator``: the
# numpy RandomState of crops, mirrors and shuffles) lives on the layer, so successive forwards advance.
# The transform's phase (random crop in TRAIN, centre crop in TEST) is the layer's *mode* at call time
# (``mode_phase``: the torch ``training`` flag, initialised from the phase), like Dropout and BatchNorm:
# ``.eval()`` gives Caffe's TEST transform, ``.train()`` Caffe's TRAIN transform.  Caffe's TEST transform
# still mirrors at random when ``mirror: true`` (kept quirk), so ``.eval()`` makes the data deterministic
# only without ``mirror``.


def _transformer(param, phase: str):
    """Caffe's DataTransformer for ``param.transform_param`` (mean file read relative to the working dir)."""
    from caffe_compat.data.transformer import DataTransformer
    from caffe_compat.io import read_blob

    t = param.transform_param
    if t.force_color and t.force_gray:
        raise FormatError(f"layer '{param.name}' ({param.type}): cannot set both force_color and force_gray")
    mean = None
    if t.HasField("mean_file"):
        path = Path(t.mean_file)
        check_regular_file(path, f"layer '{param.name}' ({param.type}) transform_param.mean_file")
        if not path.is_file():
            raise DataError(f"layer '{param.name}' ({param.type}): mean_file '{t.mean_file}' not found (Caffe opens "
                            f"it relative to the working directory {Path.cwd()})")
        mean = read_blob(path)
    try:
        return DataTransformer(crop_size=int(t.crop_size), mirror=bool(t.mirror), mean_file=mean,
                               mean_value=list(t.mean_value), scale=float(t.scale), phase=phase.upper())
    except CaffeCompatError as exc:
        raise type(exc)(f"layer '{param.name}' ({param.type}): {exc}") from None


def _legacy_transform_fields(param, message, names=("scale", "mean_file", "crop_size", "mirror")) -> None:
    """V2 layers with the deprecated data_param/image_data_param transform fields: Caffe ignores them."""
    used = [n for n in names if message.HasField(n)]
    if used:
        warnings.warn(f"layer '{param.name}' ({param.type}): {', '.join(used)} outside transform_param are ignored "
                      f"by Caffe (V1 nets get them moved by the upgrade); put them in transform_param", stacklevel=3)


class _RecordLayer(_SourceLayer):
    """Shared machinery: ``batch_size`` records from ``position`` on, transformed and stacked."""

    def __init__(self, param, bottom_shapes, phase="test"):
        super().__init__(param, bottom_shapes, phase)
        if len(param.top) not in (1, 2):
            raise FormatError(f"layer '{self.layer_name}' ({param.type}): has tops data and (optionally) label, got "
                              f"{len(param.top)} tops")
        self.position = 0
        self._generator = np.random.RandomState(0)

    def fill(self, generator=None):
        """Seed the layer's RandomState from the net's generator (Caffe seeds it from its own RNG)."""
        self._generator = np.random.RandomState(int(torch.randint(0, 2 ** 31, (1,), generator=generator).item()))

    def output_shapes(self):
        return [(self.batch_size, *self.image_shape), (self.batch_size,)][:len(self.param.top)]

    def _record(self, index: int) -> tuple[np.ndarray, int]:
        raise NotImplementedError

    def _advance(self) -> None:
        self.position = (self.position + 1) % self.num_records

    # resume (caffe_compat.solver.train saves this beside each snapshot; arrays and numbers only)
    def stream_state(self) -> dict:
        """The next record and the RandomState of crops, mirrors and shuffles."""
        return {"position": int(self.position), "rng": self._generator.get_state(legacy=False)}

    def load_stream_state(self, state: dict) -> None:
        self.position = int(state["position"])
        self._generator.set_state(state["rng"])

    def forward(self):
        images, labels, shape = [], [], None
        for _ in range(self.batch_size):
            image, label = self._record(self.position)
            if shape is None:
                shape = image.shape
            elif image.shape != shape:
                raise DataError(f"layer '{self.layer_name}' ({self.caffe_type}): record {self.position} transforms to "
                                f"{image.shape}, the batch's first one to {shape}; Caffe needs equal sizes in a "
                                f"batch (use crop_size or resize)")
            images.append(image)
            labels.append(label)
            self._advance()
        data = torch.from_numpy(np.stack(images)).to(device=self.device, dtype=self.dtype)
        if len(self.param.top) == 1:
            return (data,)
        label = torch.tensor(labels, dtype=torch.float64).to(device=self.device, dtype=self.dtype)
        return data, label


@register_layer("Data")
class Data(_RecordLayer):
    """Caffe's Data layer over an LMDB of Datums.

    ``data_param { source batch_size backend: LMDB force_encoded_color }`` and ``transform_param``.
    Tops: ``data`` (batch, C, h, w) float32 and optionally ``label`` (batch,).  Record ``position``
    (key order) through ``position + batch_size - 1`` fill one batch; after the last record the
    cursor goes back to the first (Caffe's ``SeekToFirst``), also within a batch.  The shape comes
    from the first record (Caffe's ``InferBlobShape``); every record of a batch must transform to it.
    Each record goes through :class:`~caffe_compat.data.transformer.DataTransformer`:
    ``(pixel[c, h_off+h, w_off+w] - mean[c, h_off+h, w_off+w]) * scale``, centre crop in TEST, random
    crop in TRAIN (TRAIN/TEST = the layer's mode, ``self.training``, initialised from the phase:
    ``.eval()`` gives the centre crop, ``.train()`` the random one), mirror (drawn in every phase and
    mode, Caffe's quirk) from the layer's seeded RandomState;
    TEST without mirror is bit-identical to Caffe.  Encoded records decode with OpenCV:
    ``transform_param.force_color`` or ``data_param.force_encoded_color`` (older Caffe's name) ->
    colour, ``force_gray`` -> grey, else native channels.  ``source`` is relative to the working
    directory (Caffe opens the DB at construction, so does this layer).  Only ``backend: LMDB``
    (LEVELDB, the proto default, is refused); ``rand_skip`` is ignored like in BVLC master's
    DataLayer (warned); multi-GPU striding (``Skip()``) is left to DDP samplers.
    """

    def __init__(self, param, bottom_shapes, phase="test"):
        super().__init__(param, bottom_shapes, phase)
        from caffe_compat.data.lmdb_source import DatumSource

        p = param.data_param
        if p.backend != caffe_pb2.DataParameter.LMDB:
            raise FormatError(f"layer '{self.layer_name}' (Data): backend LEVELDB (the proto default) is not "
                              f"supported; convert the database to LMDB and set data_param {{ backend: LMDB }}")
        if not p.source:
            raise FormatError(f"layer '{self.layer_name}' (Data): data_param.source is required")
        self.batch_size = int(p.batch_size)
        if self.batch_size < 1:
            raise FormatError(f"layer '{self.layer_name}' (Data): data_param.batch_size must be positive")
        _legacy_transform_fields(param, p)
        if p.rand_skip:
            warnings.warn(f"layer '{self.layer_name}' (Data): rand_skip is ignored (as in BVLC master's DataLayer)",
                          stacklevel=2)
        self.transformer = _transformer(param, phase)
        t = param.transform_param
        try:
            self.source = DatumSource(p.source, force_color=bool(t.force_color or p.force_encoded_color),
                                      force_gray=bool(t.force_gray))
        except CaffeCompatError as exc:
            raise type(exc)(f"layer '{self.layer_name}' (Data): {exc}") from None
        self.num_records = len(self.source)
        first, _ = self.source.image(0)
        self.image_shape = self.transformer.output_shape(*first.shape)

    def _record(self, index):
        pixels, label = self.source.image(index)
        try:
            return self.transformer.transform_chw(pixels, self._generator, phase=self.mode_phase), label
        except CaffeCompatError as exc:
            raise type(exc)(f"layer '{self.layer_name}' (Data), record {index}: {exc}") from None


@register_layer("ImageData")
class ImageData(_RecordLayer):
    """Caffe's ImageData layer: images listed in a text file.

    ``image_data_param { source root_folder new_height new_width is_color shuffle rand_skip batch_size }``
    (defaults: batch 1, colour, no resize, no shuffle) and ``transform_param``.  Each line of
    ``source`` is ``path label`` (the label is after the last space); the image is
    ``root_folder + path`` -- plain string concatenation, as Caffe does it, so ``root_folder`` needs its
    trailing ``/`` -- read with ``cv::imread`` (BGR or grey) and, when both ``new_height`` and
    ``new_width`` are positive, ``cv::resize``'d (bilinear), then transformed like the Data layer.
    Setting only one of ``new_height``/``new_width`` is a FormatError naming the layer (Caffe's
    ``image_data_layer.cpp`` CHECK-fails: "Current implementation requires new_height and new_width to be
    set at the same time").
    Tops ``data`` (batch, C, h, w) and optionally ``label`` (batch,).  ``shuffle`` permutes the lines at
    setup and again each time the list wraps around; ``rand_skip`` starts at line
    ``Rand() % rand_skip``.  Shuffles and skips draw from the layer's RandomState (seeded at ``fill``
    from the net's generator), so they are reproducible here but not Caffe's sequence; without
    shuffle/rand_skip the order is the file's, like Caffe's.
    """

    def __init__(self, param, bottom_shapes, phase="test"):
        super().__init__(param, bottom_shapes, phase)
        from caffe_compat.data.imageset import read_list_file

        p = param.image_data_param
        if not p.source:
            raise FormatError(f"layer '{self.layer_name}' (ImageData): image_data_param.source is required")
        self.batch_size = int(p.batch_size)
        if self.batch_size < 1:
            raise FormatError(f"layer '{self.layer_name}' (ImageData): image_data_param.batch_size must be positive")
        _legacy_transform_fields(param, p)
        self.transformer = _transformer(param, phase)
        self.root_folder, self.shuffle, self.rand_skip = p.root_folder, bool(p.shuffle), int(p.rand_skip)
        self.new_height, self.new_width, self.is_color = int(p.new_height), int(p.new_width), bool(p.is_color)
        if (self.new_height > 0) != (self.new_width > 0):
            raise FormatError(f"layer '{self.layer_name}' (ImageData): new_height ({self.new_height}) and new_width "
                              f"({self.new_width}) must be set together or both left 0 (Caffe CHECKs: 'Current "
                              f"implementation requires new_height and new_width to be set at the same time.')")
        try:
            self.lines = read_list_file(p.source, "image_data_param.source")
        except CaffeCompatError as exc:
            raise type(exc)(f"layer '{self.layer_name}' (ImageData): {exc} (relative to {Path.cwd()})") from None
        if not self.lines:
            raise DataError(f"layer '{self.layer_name}' (ImageData): {p.source} lists no images")
        self.num_records = len(self.lines)
        self.order = np.arange(self.num_records)
        self._restart()
        first = self._image(self.position)
        self.image_shape = self.transformer.output_shape(*first.shape)

    def fill(self, generator=None):
        super().fill(generator)
        self.order = np.arange(self.num_records)
        self._restart()

    def _restart(self) -> None:
        """Caffe's setup: shuffle the lines if asked, then skip ``Rand() % rand_skip`` of them."""
        if self.shuffle:
            self._generator.shuffle(self.order)
        self.position = int(self._generator.randint(self.rand_skip)) if self.rand_skip else 0
        self.position %= self.num_records

    def _image(self, index: int) -> np.ndarray:
        from caffe_compat.data.image import load_image_bgr

        name = self.lines[self.order[index]][0]
        image = load_image_bgr(self.root_folder + name, color=self.is_color, new_height=self.new_height,
                               new_width=self.new_width,
                               what=f"layer '{self.layer_name}' (ImageData) {self.param.image_data_param.source} "
                                    f"entry {self.order[index] + 1}")
        return np.ascontiguousarray(image.transpose(2, 0, 1))

    def _advance(self) -> None:
        self.position += 1
        if self.position >= self.num_records:
            self.position = 0
            if self.shuffle:
                self._generator.shuffle(self.order)

    def stream_state(self) -> dict:
        return {**super().stream_state(), "order": self.order.copy()}

    def load_stream_state(self, state: dict) -> None:
        order = np.asarray(state["order"], dtype=self.order.dtype)
        if order.shape != self.order.shape:
            raise DataError(f"layer '{self.layer_name}' (ImageData): saved state of {order.size} lines, the list "
                            f"has {self.num_records}")
        super().load_stream_state(state)
        self.order = order.copy()

    def _record(self, index):
        try:
            image = self.transformer.transform_chw(self._image(index), self._generator, phase=self.mode_phase)
            return image, self.lines[self.order[index]][1]
        except CaffeCompatError as exc:
            raise type(exc)(f"layer '{self.layer_name}' (ImageData), line {self.order[index] + 1}: {exc}") from None


def _h5py():
    try:
        import h5py
    except ImportError:
        return None
    return h5py


@register_layer("HDF5Data")
class HDF5Data(_SourceLayer):
    """Caffe's HDF5Data layer (needs the optional ``h5py`` package; without it: a DataError saying so).

    ``hdf5_data_param { source batch_size shuffle }``: ``source`` is a text file naming HDF5 files
    (whitespace-separated, relative to the working directory); every top reads the dataset of its
    own name, converted to float32; all tops of a file have the same number of rows.  A batch is the
    next ``batch_size`` rows; after a file's last row the next file is loaded (the file list wraps
    around).  ``shuffle`` permutes the file order at setup and on each wrap, and the rows of each
    loaded file, from the layer's seeded RandomState.  Top shapes: ``(batch_size, *dataset.shape[1:])``.
    """

    def __init__(self, param, bottom_shapes, phase="test"):
        super().__init__(param, bottom_shapes, phase)
        if _h5py() is None:
            raise DataError(f"layer '{self.layer_name}' (HDF5Data): reading HDF5 needs the h5py package, which is not "
                            f"installed (pip install h5py)")
        p = param.hdf5_data_param
        self.batch_size, self.shuffle = int(p.batch_size), bool(p.shuffle)
        if self.batch_size < 1:
            raise FormatError(f"layer '{self.layer_name}' (HDF5Data): hdf5_data_param.batch_size must be positive")
        try:
            self.files = read_regular_text(p.source, f"layer '{self.layer_name}' (HDF5Data) hdf5_data_param.source"
                                           ).split()
        except OSError:
            raise DataError(f"layer '{self.layer_name}' (HDF5Data): cannot read source list '{p.source}' (relative "
                            f"to {Path.cwd()})") from None
        if not self.files:
            raise DataError(f"layer '{self.layer_name}' (HDF5Data): {p.source} names no HDF5 files")
        self._generator = np.random.RandomState(0)
        self._start()

    def fill(self, generator=None):
        self._generator = np.random.RandomState(int(torch.randint(0, 2 ** 31, (1,), generator=generator).item()))
        self._start()

    def _start(self) -> None:
        self.file_order = np.arange(len(self.files))
        if self.shuffle:
            self._generator.shuffle(self.file_order)
        self.file_index = 0
        self._load(self.files[self.file_order[0]])

    def _load(self, path: str) -> None:
        from caffe_compat.data.hdf5 import read_hdf5_tops

        arrays = read_hdf5_tops(path, self.param.top, f"layer '{self.layer_name}' (HDF5Data)",
                                self.param.hdf5_data_param.source)  # typed errors, memory budget (data/hdf5.py)
        rows = {a.shape[0] if a.ndim else 0 for a in arrays}
        if len(rows) != 1 or 0 in rows:
            raise DataError(f"layer '{self.layer_name}' (HDF5Data): {path}: every dataset needs the same positive "
                            f"number of rows, got {[a.shape for a in arrays]}")
        self.arrays = arrays
        self.rows = np.arange(arrays[0].shape[0])
        if self.shuffle:
            self._generator.shuffle(self.rows)
        self.position = 0

    def output_shapes(self):
        return [(self.batch_size, *a.shape[1:]) for a in self.arrays]

    # resume (caffe_compat.solver.train saves this beside each snapshot; arrays and numbers only)
    def stream_state(self) -> dict:
        return {"file_order": self.file_order.copy(), "file_index": int(self.file_index), "rows": self.rows.copy(),
                "position": int(self.position), "rng": self._generator.get_state(legacy=False)}

    def load_stream_state(self, state: dict) -> None:
        self.file_order = np.asarray(state["file_order"], dtype=np.int64)
        self.file_index = int(state["file_index"])
        self._load(self.files[self.file_order[self.file_index]])  # may draw: the RandomState is set after
        self.rows = np.asarray(state["rows"], dtype=self.rows.dtype)
        self.position = int(state["position"])
        self._generator.set_state(state["rng"])

    def forward(self):
        picked = [[] for _ in self.arrays]
        for _ in range(self.batch_size):
            row = self.rows[self.position]
            for store, array in zip(picked, self.arrays):
                store.append(array[row])
            self.position += 1
            if self.position == len(self.rows):
                if len(self.files) > 1:
                    self.file_index += 1
                    if self.file_index == len(self.files):
                        self.file_index = 0
                        if self.shuffle:
                            self._generator.shuffle(self.file_order)
                    self._load(self.files[self.file_order[self.file_index]])
                else:
                    self.position = 0
                    if self.shuffle:
                        self._generator.shuffle(self.rows)
        return tuple(torch.from_numpy(np.stack(p)).to(device=self.device, dtype=self.dtype) for p in picked)
