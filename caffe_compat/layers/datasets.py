"""Caffe's data-set reader layers: Data (LMDB of Datums), ImageData (a list file of images) and HDF5Data
(with h5py); each class docstring states its parameters.

These layers ``reads_source``: export stands an ``Input`` in for them, from what ``input_facts`` says of
the images (the DataTransformer's crop, mean and scale; ImageData's resize and colour).  Their shape
rule cannot know the image size without opening the data set, so ``inspect`` reports their tops as
unknown unless ``--input-shape`` gives them.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from caffe_compat.data.prefetch import PrefetchingLayer
from caffe_compat.errors import CaffeCompatError, DataError, FormatError
from caffe_compat.io.safe_open import read_list_text, require_regular_file
from caffe_compat.layers.data import SourceLayer
from caffe_compat.layers.facts import BlobCount, InputFacts, Shapes, legacy_shape, transform_input_facts
from caffe_compat.layers.registry import register_layer
from caffe_compat.proto import caffe_pb2


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
#
# Prefetching (caffe_compat.data.prefetch, as Caffe's BasePrefetchingDataLayer): the batch code runs on
# a *cursor* (``_produce(cursor, phase, fetch)``), the layer itself when not prefetching, a copy of its
# stream state on the prefetch thread otherwise; the layer's attributes always hold the consumed stream.


def _transformer(param, phase: str):
    """Caffe's DataTransformer for ``param.transform_param`` (mean file read relative to the working dir)."""
    from caffe_compat.data.transformer import DataTransformer
    from caffe_compat.io import read_blob

    t = param.transform_param  # force_color + force_gray: refused only where an encoded Datum is decoded (Caffe)
    mean = None
    if t.HasField("mean_file"):
        path = Path(t.mean_file)
        require_regular_file(path, f"layer '{param.name}' ({param.type}) transform_param.mean_file", error=DataError,
                             missing=lambda: f"layer '{param.name}' ({param.type}): mean_file '{t.mean_file}' not "
                                             f"found (Caffe opens it relative to the working directory {Path.cwd()})")
        mean = legacy_mean_blob(read_blob(path), f"layer '{param.name}' ({param.type}) transform_param.mean_file "
                                             f"'{t.mean_file}'")
    try:
        return DataTransformer(crop_size=int(t.crop_size), mirror=bool(t.mirror), mean_file=mean,
                               mean_value=list(t.mean_value), scale=float(t.scale), phase=phase.upper())
    except CaffeCompatError as exc:
        raise type(exc)(f"layer '{param.name}' ({param.type}): {exc}") from None


def legacy_mean_blob(blob: np.ndarray, where: str) -> np.ndarray:
    """The mean blob as Caffe's DataTransformer sees it: through the legacy accessors ``channels()``,
    ``height()``, ``width()`` (axes 1, 2, 3, a missing axis counting 1) over the blob's first C·H·W values.
    So ``1 x C x H x W`` (what compute_image_mean writes) is ``C x H x W``; a 3-D ``C x H x W`` blob (pycaffe's
    ``array_to_blobproto`` of a 3-D array) reads as ``H x W x 1`` and fails the size check against the images
    (Caffe: "Check failed: datum_channels == data_mean_.channels()", BVLC/caffe#6087); a blob of N > 1 means
    uses the first; more than 4 axes fail the accessors' CHECK."""
    _, channels, height, width = legacy_shape(blob.shape, where)
    count = channels * height * width
    if blob.size < count or count == 0:
        raise DataError(f"{where}: a blob of shape {blob.shape} holds no {channels} x {height} x {width} mean")
    return np.ascontiguousarray(blob).reshape(-1)[:count].reshape(channels, height, width)


def _legacy_transform_fields(param, message, names=("scale", "mean_file", "crop_size", "mirror")) -> None:
    """V2 layers with the deprecated data_param/image_data_param transform fields: Caffe ignores them."""
    used = [n for n in names if message.HasField(n)]
    if used:
        warnings.warn(f"layer '{param.name}' ({param.type}): {', '.join(used)} outside transform_param are ignored "
                      f"by Caffe (V1 nets get them moved by the upgrade); put them in transform_param", stacklevel=3)


def copy_rng(rng: np.random.RandomState) -> np.random.RandomState:
    """An independent RandomState in the same state."""
    copy = np.random.RandomState()
    copy.set_state(rng.get_state(legacy=False))
    return copy


def data_param_prefetch(param):
    """``data_param.prefetch`` when the prototxt sets it (Caffe reads it for every prefetching layer), else None."""
    return int(param.data_param.prefetch) if param.HasField("data_param") and \
        param.data_param.HasField("prefetch") else None


def random_state_from(generator) -> np.random.RandomState:
    """A data layer's numpy RandomState seeded from the net's torch generator (at ``fill``; Caffe seeds its
    prefetch RNG from its own), so seeded nets draw the same crops, mirrors and shuffles."""
    return np.random.RandomState(int(torch.randint(0, 2 ** 31, (1,), generator=generator).item()))


class DataSetLayer(PrefetchingLayer, SourceLayer):
    """Base of the layers that read a data set: export stands an Input in for them (``reads_source``,
    ``input_facts`` from the DataTransformer's settings), and their tops' shapes are unknown without opening
    the data set (the records or files decide them).  They prefetch (:mod:`caffe_compat.data.prefetch`)."""

    def _prefetch_depth(self):
        return data_param_prefetch(self.param)

    def forward(self):
        return self._to_device(self._next_arrays())

    reads_source = True

    @classmethod
    def infer(cls, layer, bottoms):
        return Shapes([None] * len(layer.top))

    @classmethod
    def input_facts(cls, layer) -> InputFacts:
        return transform_input_facts(layer)


class _RecordLayer(DataSetLayer):
    """Shared machinery: ``batch_size`` records from ``position`` on, transformed and stacked."""

    tops = BlobCount(1, 2)  # data and (optionally) label

    def __init__(self, param, bottom_shapes, phase="test"):
        super().__init__(param, bottom_shapes, phase)
        self.position = 0
        self._generator = np.random.RandomState(0)
        self._init_prefetch()

    def fill(self, generator=None):
        """Seed the layer's RandomState from the net's generator (Caffe seeds it from its own RNG)."""
        self.reset_prefetch()
        self._generator = random_state_from(generator)

    def output_shapes(self):
        return [(self.batch_size, *self.image_shape), (self.batch_size,)][:len(self.param.top)]

    def _record(self, cur, phase: str, fetch) -> tuple[np.ndarray, int]:
        """The transformed record at ``cur.position`` (drawing from ``cur._generator``) and its label."""
        raise NotImplementedError

    def _advance(self, cur) -> None:
        cur.position = (cur.position + 1) % self.num_records

    # resume (caffe_compat.solver.train saves this beside each snapshot; arrays and numbers only)
    def stream_state(self) -> dict:
        """The next record and the RandomState of crops, mirrors and shuffles (of the consumed batches)."""
        return {"position": int(self.position), "rng": self._generator.get_state(legacy=False)}

    def load_stream_state(self, state: dict) -> None:
        self.reset_prefetch()
        self.position = int(state["position"])
        self._generator.set_state(state["rng"])

    # prefetching (caffe_compat.data.prefetch)
    def _cursor(self):
        return SimpleNamespace(position=self.position, _generator=copy_rng(self._generator))

    def _snapshot(self, cur) -> dict:
        return {"position": int(cur.position), "rng": cur._generator.get_state(legacy=False)}

    def _restore(self, snapshot: dict) -> None:
        self.position = snapshot["position"]
        self._generator.set_state(snapshot["rng"])

    def _produce(self, cur, phase: str, fetch) -> list:
        images, labels, shape = [], [], None
        for _ in range(self.batch_size):
            image, label = self._record(cur, phase, fetch)
            if shape is None:
                shape = image.shape
            elif image.shape != shape:
                raise DataError(f"layer '{self.layer_name}' ({self.caffe_type}): record {cur.position} transforms "
                                f"to {image.shape}, the batch's first one to {shape}; Caffe needs equal sizes in a "
                                f"batch (use crop_size or resize)")
            images.append(image)
            labels.append(label)
            self._advance(cur)
        return [np.stack(images), np.asarray(labels, dtype=np.float64)][:len(self.param.top)]


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
    TEST without mirror is bit-identical to Caffe.  The ``mean_file`` blob is seen through Caffe's legacy
    accessors (:func:`legacy_mean_blob`: a 3-D ``C x H x W`` blob does not fit the images, as in Caffe).
    Encoded records decode with OpenCV:
    ``transform_param.force_color`` or ``data_param.force_encoded_color`` (older Caffe's name) ->
    colour, ``force_gray`` -> grey, else native channels; both set is a FormatError at the first encoded
    record, as Caffe CHECKs only there (raw records and ImageData accept both: they never read them).  ``source`` is relative to the working
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

    def _decode(self, index: int):
        return self.source.image(index)

    def _upcoming(self, cur, n: int) -> list[int]:
        return [(cur.position + j) % self.num_records for j in range(n)]

    def _record(self, cur, phase, fetch):
        index = cur.position
        pixels, label = fetch(index, lambda n: self._upcoming(cur, n))
        try:
            return self.transformer.transform_chw(pixels, cur._generator, phase=phase), label
        except CaffeCompatError as exc:
            raise type(exc)(f"layer '{self.layer_name}' (Data), record {index}: {exc}") from None


@register_layer("ImageData")
class ImageData(_RecordLayer):
    """Caffe's ImageData layer: images listed in a text file.

    ``image_data_param { source root_folder new_height new_width is_color shuffle rand_skip batch_size }``
    (defaults: batch 1, colour, no resize, no shuffle) and ``transform_param``.  Each line of
    ``source`` is ``path label``, split at the last space with the label read by ``atoi`` (``1.5`` is 1, a
    line without a space is all path with label 0, a blank line the empty path: Caffe's parsing,
    :func:`~caffe_compat.data.imageset.read_list_entries`); the image is
    ``root_folder + path`` -- plain string concatenation, as Caffe does it, so ``root_folder`` needs its
    trailing ``/`` -- read with ``cv::imread`` (BGR or grey) and, when both ``new_height`` and
    ``new_width`` are positive, ``cv::resize``'d (bilinear), then transformed like the Data layer.
    Setting only one of ``new_height``/``new_width`` is a FormatError naming the layer (Caffe's
    ``image_data_layer.cpp`` CHECK-fails: "Current implementation requires new_height and new_width to be
    set at the same time").
    Tops ``data`` (batch, C, h, w) and ``label`` (batch,): exactly two, as Caffe's ImageDataLayer declares
    (``ExactNumTopBlobs() == 2``; a data-only ImageData fails Caffe's setup).  ``shuffle`` permutes the lines at
    setup and again each time the list wraps around; ``rand_skip`` starts at line
    ``Rand() % rand_skip``, and a drawn skip that is not below the number of lines is a DataError (Caffe's
    ``CHECK_GT(lines_.size(), skip)``: "Not enough points to skip"), not a wrap-around.  Shuffles and skips
    draw from the layer's RandomState (seeded at ``fill`` from the net's generator), so they are reproducible
    here but not Caffe's sequence; without shuffle/rand_skip the order is the file's, like Caffe's.
    """

    tops = BlobCount.exact(2)  # image_data_layer.hpp: ExactNumTopBlobs() 2 (Data keeps MinTop 1, MaxTop 2)

    @classmethod
    def input_facts(cls, layer) -> InputFacts:
        """The DataTransformer's facts, gray with ``is_color: false``, resized to ``new_height × new_width``."""
        facts = transform_input_facts(layer)
        p = layer.image_data_param
        gray = facts.channels == 1 or (p.HasField("is_color") and not p.is_color)
        resize = (int(p.new_height), int(p.new_width)) if p.new_height and p.new_width else None
        return dataclasses.replace(facts, channels=1 if gray else 3, resize=resize)

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
        first = self._decode(int(self.order[self.position]))
        self.image_shape = self.transformer.output_shape(*first.shape)

    def fill(self, generator=None):
        super().fill(generator)  # also drops the read-ahead
        self.order = np.arange(self.num_records)
        self._restart()

    def _restart(self) -> None:
        """Caffe's setup: shuffle the lines if asked, then skip ``Rand() % rand_skip`` of them."""
        if self.shuffle:
            self._generator.shuffle(self.order)
        skip = int(self._generator.randint(self.rand_skip)) if self.rand_skip else 0
        if skip >= self.num_records:
            raise DataError(f"layer '{self.layer_name}' (ImageData): not enough points to skip: rand_skip "
                            f"{self.rand_skip} drew {skip}, the list has {self.num_records} lines (Caffe CHECKs "
                            f"skip < the number of lines)")
        self.position = skip

    def _decode(self, line: int) -> np.ndarray:
        """Line ``line`` of the list file (0-based) as C x H x W pixels."""
        from caffe_compat.data.image import load_image_bgr
        from caffe_compat.io.planes import chw_planes

        image = load_image_bgr(self.root_folder + self.lines[line][0], color=self.is_color,
                               new_height=self.new_height, new_width=self.new_width,
                               what=f"layer '{self.layer_name}' (ImageData) {self.param.image_data_param.source} "
                                    f"entry {line + 1}")
        return chw_planes(image)

    def _upcoming(self, cur, n: int) -> list[int]:
        """The lines of the next ``n`` records, up to the end of the list when a shuffle follows it."""
        stop = self.num_records - cur.position if self.shuffle else n
        return [int(cur.order[(cur.position + j) % self.num_records]) for j in range(min(n, stop))]

    def _advance(self, cur) -> None:
        cur.position += 1
        if cur.position >= self.num_records:
            cur.position = 0
            if self.shuffle:  # a new array: a snapshot may still hold the old one
                order = cur.order.copy()
                cur._generator.shuffle(order)
                cur.order = order

    def stream_state(self) -> dict:
        return {**super().stream_state(), "order": self.order.copy()}

    def load_stream_state(self, state: dict) -> None:
        order = np.asarray(state["order"], dtype=self.order.dtype)
        if order.shape != self.order.shape:
            raise DataError(f"layer '{self.layer_name}' (ImageData): saved state of {order.size} lines, the list "
                            f"has {self.num_records}")
        super().load_stream_state(state)
        self.order = order.copy()

    def _cursor(self):
        cur = super()._cursor()
        cur.order = self.order.copy()
        return cur

    def _snapshot(self, cur) -> dict:
        return {**super()._snapshot(cur), "order": cur.order}  # never shuffled in place (_advance)

    def _restore(self, snapshot: dict) -> None:
        super()._restore(snapshot)
        self.order = snapshot["order"]

    def _record(self, cur, phase, fetch):
        line = int(cur.order[cur.position])
        try:
            image = fetch(line, lambda n: self._upcoming(cur, n))
            return self.transformer.transform_chw(image, cur._generator, phase=phase), self.lines[line][1]
        except CaffeCompatError as exc:
            raise type(exc)(f"layer '{self.layer_name}' (ImageData), line {line + 1}: {exc}") from None


def _h5py():
    try:
        import h5py
    except ImportError:
        return None
    return h5py


@register_layer("HDF5Data")
class HDF5Data(DataSetLayer):
    """Caffe's HDF5Data layer (needs the optional ``h5py`` package; without it: a DataError saying so).

    ``hdf5_data_param { source batch_size shuffle }``: ``source`` is a text file naming HDF5 files
    (whitespace-separated, relative to the working directory); every top reads the dataset of its
    own name, converted to float32; all tops of a file have the same number of rows.  A batch is the
    next ``batch_size`` rows; after a file's last row the next file is loaded (the file list wraps
    around).  ``shuffle`` permutes the file order at setup and on each wrap, and the rows of each
    loaded file, from the layer's seeded RandomState.  Top shapes: ``(batch_size, *dataset.shape[1:])``;
    ``batch_size: 0`` (the proto default, which Caffe does not CHECK) gives empty tops and reads no row.
    A ``transform_param`` (even an empty one) is a FormatError, as Caffe's ``HDF5DataLayer::LayerSetUp``
    CHECK-fails on it ("HDF5Data does not transform data."): HDF5 rows are used as stored.
    """

    def __init__(self, param, bottom_shapes, phase="test"):
        super().__init__(param, bottom_shapes, phase)
        if param.HasField("transform_param"):
            raise FormatError(f"layer '{self.layer_name}' (HDF5Data): HDF5Data does not transform data; remove its "
                              f"transform_param (Caffe CHECK-fails on any transform_param here)")
        if _h5py() is None:
            raise DataError(f"layer '{self.layer_name}' (HDF5Data): reading HDF5 needs the h5py package, which is not "
                            f"installed (pip install h5py)")
        p = param.hdf5_data_param
        self.batch_size, self.shuffle = int(p.batch_size), bool(p.shuffle)  # 0 (the proto default): empty tops
        try:
            self.files = read_list_text(p.source, f"layer '{self.layer_name}' (HDF5Data) hdf5_data_param.source"
                                        ).split()
        except OSError:
            raise DataError(f"layer '{self.layer_name}' (HDF5Data): cannot read source list '{p.source}' (relative "
                            f"to {Path.cwd()})") from None
        if not self.files:
            raise DataError(f"layer '{self.layer_name}' (HDF5Data): {p.source} names no HDF5 files")
        self._generator = np.random.RandomState(0)
        self._start()
        self._init_prefetch()

    def fill(self, generator=None):
        self.reset_prefetch()
        self._generator = random_state_from(generator)
        self._start()

    def _start(self) -> None:
        self.file_order = np.arange(len(self.files))
        if self.shuffle:
            self._generator.shuffle(self.file_order)
        self.file_index = 0
        self._item_shapes = None
        self._load(self, self.files[self.file_order[0]])
        self._item_shapes = [a.shape[1:] for a in self.arrays]

    def _load(self, cur, path: str) -> None:
        """Read ``path`` into ``cur`` (its rows shuffled from ``cur._generator`` when asked).  Caffe shapes the
        tops from the first file at setup and copies ``count / batch_size`` values per row from every later
        file unchecked (another row shape reads the wrong values or past the end): such a file is a DataError."""
        from caffe_compat.data.hdf5 import read_hdf5_tops

        arrays = read_hdf5_tops(path, self.param.top, f"layer '{self.layer_name}' (HDF5Data)",
                                self.param.hdf5_data_param.source)  # typed errors, memory budget (data/hdf5.py)
        rows = {a.shape[0] if a.ndim else 0 for a in arrays}
        if len(rows) != 1 or 0 in rows:
            raise DataError(f"layer '{self.layer_name}' (HDF5Data): {path}: every dataset needs the same positive "
                            f"number of rows, got {[a.shape for a in arrays]}")
        if self._item_shapes is not None and [a.shape[1:] for a in arrays] != self._item_shapes:
            raise DataError(f"layer '{self.layer_name}' (HDF5Data): {path}: rows of shape "
                            f"{[a.shape[1:] for a in arrays]} (tops {list(self.param.top)}), the first file's are "
                            f"{self._item_shapes}; Caffe sizes the tops from the first file and needs every file "
                            f"to match it")
        cur.arrays = arrays
        cur.rows = np.arange(arrays[0].shape[0])
        if self.shuffle:
            cur._generator.shuffle(cur.rows)
        cur.position = 0

    def output_shapes(self):
        return [(self.batch_size, *a.shape[1:]) for a in self.arrays]

    # resume (caffe_compat.solver.train saves this beside each snapshot; arrays and numbers only)
    def stream_state(self) -> dict:
        return {"file_order": self.file_order.copy(), "file_index": int(self.file_index), "rows": self.rows.copy(),
                "position": int(self.position), "rng": self._generator.get_state(legacy=False)}

    def load_stream_state(self, state: dict) -> None:
        self.reset_prefetch()
        self.file_order = np.asarray(state["file_order"], dtype=np.int64)
        self.file_index = int(state["file_index"])
        self._load(self, self.files[self.file_order[self.file_index]])  # may draw: the RandomState is set after
        self.rows = np.asarray(state["rows"], dtype=self.rows.dtype)
        self.position = int(state["position"])
        self._generator.set_state(state["rng"])

    # prefetching (caffe_compat.data.prefetch): the rows are in memory, the file loads run on the prefetch
    # thread; file_order and rows are replaced, never shuffled in place, so snapshots can share them
    decodes = False
    _FIELDS = ("file_order", "file_index", "rows", "position", "arrays")

    def _cursor(self):
        return SimpleNamespace(**{k: getattr(self, k) for k in self._FIELDS}, _generator=copy_rng(self._generator))

    def _snapshot(self, cur) -> dict:
        return {**{k: getattr(cur, k) for k in self._FIELDS}, "rng": cur._generator.get_state(legacy=False)}

    def _restore(self, snapshot: dict) -> None:
        for k in self._FIELDS:
            setattr(self, k, snapshot[k])
        self._generator.set_state(snapshot["rng"])

    def _produce(self, cur, phase, fetch) -> list:
        picked = [[] for _ in cur.arrays]
        for _ in range(self.batch_size):
            row = cur.rows[cur.position]
            for store, array in zip(picked, cur.arrays):
                store.append(array[row])
            cur.position += 1
            if cur.position == len(cur.rows):
                if len(self.files) > 1:
                    cur.file_index += 1
                    if cur.file_index == len(self.files):
                        cur.file_index = 0
                        if self.shuffle:
                            cur.file_order = cur.file_order.copy()
                            cur._generator.shuffle(cur.file_order)
                    self._load(cur, self.files[cur.file_order[cur.file_index]])
                else:
                    cur.position = 0
                    if self.shuffle:
                        cur.rows = cur.rows.copy()
                        cur._generator.shuffle(cur.rows)
        return [np.stack(p) if p else array[:0] for p, array in zip(picked, cur.arrays)]
