"""WindowData: R-CNN's data layer, windows of images named by a window file, warped to a square crop.

Window file (``window_data_param.source``, whitespace-separated tokens, Caffe's ``infile >>``)::

    # <image_index>
    <image path>            (``root_folder`` prepended)
    <channels> <height> <width>
    <num_windows>
    <label> <overlap> <x1> <y1> <x2> <y2>      (num_windows lines; inclusive pixel corners)
    # <image_index>
    ...
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from caffe_compat.data.prefetch import PrefetchingLayer
from caffe_compat.errors import DataError, FormatError
from caffe_compat.io.safe_open import check_regular_file, read_list_text
from caffe_compat.layers.data import SourceLayer
from caffe_compat.layers.datasets import legacy_mean_blob, random_state_from
from caffe_compat.layers.facts import BlobCount, InputFacts, Shapes, transform_input_facts
from caffe_compat.layers.registry import register_layer


def c_round(value) -> int:
    """C's ``round``: halves away from zero (Python's ``round`` would take them to even)."""
    value = float(value)
    return int(math.copysign(math.floor(abs(value) + 0.5), value))


@dataclasses.dataclass
class Window:
    image_index: int
    label: int
    overlap: float
    x1: int
    y1: int
    x2: int
    y2: int


def parse_window_file(text: str, root_folder: str, fg_threshold: float, bg_threshold: float, where: str):
    """``(images, foreground windows, background windows)``: ``images`` a list of ``(path, (C, H, W))`` in file
    order; a window with ``overlap >= fg_threshold`` is foreground (its label must be > 0), else one with
    ``overlap < bg_threshold`` is background with label and overlap set to 0, else it is dropped."""
    tokens = text.split()
    position = 0

    def take(kind, what):
        nonlocal position
        if position >= len(tokens):
            raise DataError(f"{where}: the window file ends where {what} was expected")
        token = tokens[position]
        position += 1
        try:
            return kind(token)
        except ValueError:
            raise DataError(f"{where}: expected {what}, got {token!r} (token {position})") from None

    if len(tokens) < 2:
        raise DataError(f"{where}: window file is empty")
    images, foreground, background = [], [], []
    while position < len(tokens):
        if tokens[position] != "#":
            raise DataError(f"{where}: expected '#' before an image index, got {tokens[position]!r} (token "
                            f"{position + 1})")
        position += 1
        index = take(int, "an image index")
        path = root_folder + take(str, "an image path")
        size = (take(int, "the image's channels"), take(int, "the image's height"), take(int, "the image's width"))
        images.append((path, size))
        for _ in range(take(int, "the number of windows")):
            label, overlap = take(int, "a window label"), np.float32(take(float, "a window overlap"))
            window = Window(index, label, float(overlap), *(take(int, "a window corner") for _ in range(4)))
            if overlap >= np.float32(fg_threshold):
                if label <= 0:
                    raise DataError(f"{where}: image {index}: a foreground window (overlap {float(overlap)}) needs a "
                                    f"label > 0, got {label}")
                foreground.append(window)
            elif overlap < np.float32(bg_threshold):
                background.append(dataclasses.replace(window, label=0, overlap=0.0))
    return images, foreground, background


@register_layer("WindowData")
class WindowData(PrefetchingLayer, SourceLayer):
    """Caffe's WindowDataLayer (R-CNN fine-tuning): tops ``data (B, C, S, S)`` and ``label (B,)``.

    ``window_data_param``: ``source`` (the window file, see the module docstring), ``batch_size`` B,
    ``fg_threshold`` 0.5, ``bg_threshold`` 0.5, ``fg_fraction`` 0.25, ``context_pad`` 0, ``crop_mode``
    ``"warp"`` (or ``"square"``; like Caffe, any other value warps, with a warning here), ``scale`` 1,
    ``root_folder`` "", ``cache_images`` (accepted: the pixels are the same); ``transform_param`` gives
    ``crop_size`` S (required, > 0), ``mirror``, ``mean_file`` or ``mean_value`` (one, or one per channel).
    C is the channel count the window file gives its last image.

    Each batch holds ``B − int(B·fg_fraction)`` background windows, then ``int(B·fg_fraction)`` foreground
    ones, each drawn uniformly (``rand % count``) from the layer's seeded RandomState; with ``mirror`` a
    second draw flips it (in TEST too: the layer ignores the phase).  A window ``[x1, x2] × [y1, y2]`` of
    the image (read in colour, BGR) is cut out and resized (``cv2.resize``, bilinear) to S × S.  With
    ``context_pad`` p > 0 or ``square``, the box is first grown about its centre by ``S / (S − 2p)``
    (square: its shorter half-side set to the longer), corners rounded half away from zero; the part
    outside the image is clipped and becomes zero padding in the crop (scaled by ``S / box size``, rounded;
    mirrored with the window), and the clipped part is resized to fit.  Pixel
    ``(v − mean) · scale`` (``mean_file`` read at ``h + (W_mean − S)/2 + pad_h``, likewise w); the padding
    stays 0.  Labels: a foreground window's, 0 for background.  Quirks kept: C's ``round`` and float32
    arithmetic of the box; ``scale`` is ``window_data_param.scale`` (``transform_param.scale`` is not read);
    a window's image is the ``image_index`` its header gives, counted in file order.  An empty window set
    that a batch must draw from raises a DataError (Caffe divides by zero).  Prefetching as Caffe's
    (:mod:`caffe_compat.data.prefetch`): a batch's windows and mirrors are drawn in order on the prefetch
    thread, their warps run on the decode workers.
    """

    tops = BlobCount.exact(2)
    reads_source = True

    @classmethod
    def infer(cls, layer, bottoms):
        p, crop = layer.window_data_param, int(layer.transform_param.crop_size)
        where = f"layer '{layer.name}' (WindowData)"
        if crop <= 0:
            raise FormatError(f"{where}: transform_param.crop_size must be > 0")
        if p.batch_size <= 0:
            raise FormatError(f"{where}: window_data_param.batch_size must be > 0")
        if 2 * p.context_pad >= crop:
            raise FormatError(f"{where}: window_data_param.context_pad {p.context_pad} leaves nothing of crop_size "
                              f"{crop}")
        if layer.transform_param.HasField("mean_file") and len(layer.transform_param.mean_value):
            raise FormatError(f"{where}: cannot specify mean_file and mean_value at the same time")
        return Shapes([(int(p.batch_size), 3, crop, crop), (int(p.batch_size),)])

    @classmethod
    def input_facts(cls, layer) -> InputFacts:
        facts = transform_input_facts(layer, ("window_data_param",))
        return dataclasses.replace(facts, scale=float(layer.window_data_param.scale), channels=3)

    def __init__(self, param, bottom_shapes, phase="test"):
        super().__init__(param, bottom_shapes, phase)
        self.rule()
        p, t = param.window_data_param, param.transform_param
        self.where = f"layer '{self.layer_name}' (WindowData)"
        if p.crop_mode not in ("warp", "square"):  # Caffe: use_square = (crop_mode == "square"), else warp
            warnings.warn(f"{self.where}: window_data_param.crop_mode {p.crop_mode!r} is neither 'warp' nor 'square'; "
                          f"Caffe warps for every value other than 'square', and so does this layer", stacklevel=2)
        try:
            text = read_list_text(p.source, f"{self.where} window_data_param.source")
        except OSError:
            raise DataError(f"{self.where}: failed to open window file '{p.source}' (relative to {Path.cwd()})") from None
        self.images, self.foreground, self.background = parse_window_file(
            text, p.root_folder, p.fg_threshold, p.bg_threshold, self.where)
        self.channels = self.images[-1][1][0]
        if self.channels != 3:
            raise DataError(f"{self.where}: the window file gives {self.channels} channels; Caffe reads every image in "
                            f"colour (3 channels)")
        self.batch_size, self.crop = int(p.batch_size), int(t.crop_size)
        self.mean = None
        if t.HasField("mean_file"):
            from caffe_compat.io import read_blob

            check_regular_file(t.mean_file, f"{self.where} transform_param.mean_file")
            # Caffe indexes data_mean_ with its legacy height()/width() over the first values: N > 1 means use
            # the first (a reshape to the last three axes raised a ValueError), a 3-D blob is H x W x 1
            self.mean = legacy_mean_blob(np.asarray(read_blob(t.mean_file), dtype=np.float32),
                                         f"{self.where} transform_param.mean_file '{t.mean_file}'")
        elif len(t.mean_value):
            values = [float(v) for v in t.mean_value]
            if len(values) not in (1, self.channels):
                raise FormatError(f"{self.where}: specify either 1 mean_value or as many as channels: {self.channels}")
            self.mean_values = np.asarray(values * (self.channels if len(values) == 1 else 1), dtype=np.float32)
        self._generator = np.random.RandomState(0)
        self._init_prefetch()

    def fill(self, generator=None):
        """Seed the layer's RandomState from the net's generator (Caffe seeds its prefetch RNG from its own)."""
        self.reset_prefetch()
        self._generator = random_state_from(generator)

    def output_shapes(self):
        return [(self.batch_size, self.channels, self.crop, self.crop), (self.batch_size,)]

    def stream_state(self) -> dict:
        return {"rng": self._generator.get_state(legacy=False)}

    def load_stream_state(self, state: dict) -> None:
        self.reset_prefetch()
        self._generator.set_state(state["rng"])

    @staticmethod
    def _rand(rng) -> int:
        return int(rng.randint(0, 2 ** 32, dtype=np.uint64))

    # prefetching (caffe_compat.data.prefetch): the cursor is the RandomState
    def _cursor(self):
        from caffe_compat.layers.datasets import copy_rng

        return SimpleNamespace(_generator=copy_rng(self._generator))

    def _snapshot(self, cur) -> dict:
        return {"rng": cur._generator.get_state(legacy=False)}

    def _restore(self, snapshot: dict) -> None:
        self._generator.set_state(snapshot["rng"])

    def _prefetch_depth(self):
        from caffe_compat.layers.datasets import data_param_prefetch

        return data_param_prefetch(self.param)

    def _decode(self, key) -> np.ndarray:
        foreground, index, mirror = key
        return self.warp((self.foreground if foreground else self.background)[index], mirror)

    def _produce(self, cur, phase, fetch) -> list:
        """Every window and mirror of the batch drawn in Caffe's order (the warps draw nothing), then warped."""
        p = self.param.window_data_param
        num_fg = int(np.float32(self.batch_size) * np.float32(p.fg_fraction))
        keys, labels, missing = [], np.zeros(self.batch_size, dtype=np.float32), None
        for foreground, pool, count in ((False, self.background, self.batch_size - num_fg),
                                        (True, self.foreground, num_fg)):
            if count and not pool:  # raised after the warps before it, as the sequential loop does
                kind = "foreground" if foreground else "background"
                missing = DataError(f"{self.where}: a batch needs {count} {kind} windows and the window file has none")
                break
            for _ in range(count):
                index = self._rand(cur._generator) % len(pool)
                mirror = bool(self.param.transform_param.mirror) and self._rand(cur._generator) % 2 == 1
                labels[len(keys)] = pool[index].label
                keys.append((foreground, index, mirror))
        data = np.zeros((self.batch_size, self.channels, self.crop, self.crop), dtype=np.float32)
        for item, key in enumerate(keys):
            data[item] = fetch(key, lambda n, item=item: keys[item:item + n])
        if missing is not None:
            raise missing
        return [data, labels]

    def forward(self):
        return self._to_device(self._next_arrays())

    def box(self, window: Window, rows: int, cols: int, mirror: bool):
        """``((x1, y1, x2, y2) clipped, (crop width, crop height), (pad_w, pad_h))`` as Caffe computes them."""
        p, size = self.param.window_data_param, self.crop
        x1, y1, x2, y2 = window.x1, window.y1, window.x2, window.y2
        if not (p.context_pad > 0 or p.crop_mode == "square"):
            return (x1, y1, x2, y2), (size, size), (0, 0)
        f32 = np.float32
        context_scale = f32(size) / f32(size - 2 * p.context_pad)
        half_h, half_w = f32((y2 - y1 + 1) / 2.0), f32((x2 - x1 + 1) / 2.0)
        center_x, center_y = f32(x1) + half_w, f32(y1) + half_h
        if p.crop_mode == "square":
            half_h = half_w = max(half_h, half_w)
        x1, x2 = c_round(center_x - half_w * context_scale), c_round(center_x + half_w * context_scale)
        y1, y2 = c_round(center_y - half_h * context_scale), c_round(center_y + half_h * context_scale)
        unclipped_h, unclipped_w = y2 - y1 + 1, x2 - x1 + 1
        pad_x1, pad_y1 = max(0, -x1), max(0, -y1)
        pad_x2, pad_y2 = max(0, x2 - cols + 1), max(0, y2 - rows + 1)
        x1, x2, y1, y2 = x1 + pad_x1, x2 - pad_x2, y1 + pad_y1, y2 - pad_y2
        scale_x, scale_y = f32(size) / f32(unclipped_w), f32(size) / f32(unclipped_h)
        width, height = c_round(f32(x2 - x1 + 1) * scale_x), c_round(f32(y2 - y1 + 1) * scale_y)
        pad_h = c_round(f32(pad_y1) * scale_y)
        pad_w = c_round(f32(pad_x2) * scale_x) if mirror else c_round(f32(pad_x1) * scale_x)
        height, width = min(height, size - pad_h), min(width, size - pad_w)
        return (x1, y1, x2, y2), (width, height), (pad_w, pad_h)

    def warp(self, window: Window, mirror: bool) -> np.ndarray:
        """One ``(C, S, S)`` item: the window cut, resized, flipped, placed at its padding, mean-subtracted."""
        import cv2

        from caffe_compat.data.image import load_image_bgr

        if not 0 <= window.image_index < len(self.images):
            raise DataError(f"{self.where}: a window names image {window.image_index}; the file lists "
                            f"{len(self.images)} images")
        path = self.images[window.image_index][0]
        image = load_image_bgr(path, color=True, what=f"{self.where} window file")
        rows, cols = image.shape[:2]
        (x1, y1, x2, y2), (width, height), (pad_w, pad_h) = self.box(window, rows, cols, mirror)
        if not (0 <= x1 <= x2 < cols and 0 <= y1 <= y2 < rows) or width <= 0 or height <= 0:
            raise DataError(f"{self.where}: window ({window.x1}, {window.y1}, {window.x2}, {window.y2}) of {path} "
                            f"({cols} x {rows}) lies outside the image")
        try:
            patch = cv2.resize(image[y1:y2 + 1, x1:x2 + 1], (width, height), interpolation=cv2.INTER_LINEAR)
        except cv2.error as exc:
            raise DataError(f"{self.where}: {path}: OpenCV could not resize the window: {exc}") from None
        if mirror:
            patch = patch[:, ::-1]
        pixels = patch.transpose(2, 0, 1).astype(np.float32)  # (C, height, width)
        scale = np.float32(self.param.window_data_param.scale)
        if self.mean is not None:
            off = (self.mean.shape[-1] - self.crop) // 2
            region = self.mean[:, off + pad_h:off + pad_h + height, off + pad_w:off + pad_w + width]
            if region.shape != pixels.shape:
                raise DataError(f"{self.where}: the mean file {self.mean.shape} is too small for crop_size {self.crop}")
            pixels = (pixels - region) * scale
        elif hasattr(self, "mean_values"):
            pixels = (pixels - self.mean_values[:, None, None]) * scale
        else:
            pixels = pixels * scale
        item = np.zeros((self.channels, self.crop, self.crop), dtype=np.float32)
        item[:, pad_h:pad_h + height, pad_w:pad_w + width] = pixels
        return item

