"""Caffe's in-memory input layers: Input, DummyData, MemoryData, and their base :class:`SourceLayer`.

(The data-set readers Data, ImageData and HDF5Data are in :mod:`caffe_compat.layers.datasets`.)
* **Input**: tops with the shapes of ``input_param.shape`` (one shape for every top, or one per top).
  The net feeds them from ``CaffeNet.forward(**inputs)``; run on its own the layer yields zeros, what
  a freshly allocated Caffe blob holds.
* **DummyData**: tops of ``dummy_data_param.shape`` (or the legacy ``num/channels/height/width``), one
  for all tops or one per top, filled by ``data_filler`` (none: constant 0; one: used for every top;
  else one per top).  As in Caffe, a constant filler fills once; any other filler refills at every
  forward, drawing from the layer's own generator (seeded from the net's generator at ``fill``).
* **MemoryData**: exactly two tops (Caffe's ``ExactNumTopBlobs() == 2``: a net giving it only ``data``
  fails at setup), ``data`` ``(batch_size, channels, height, width)`` and ``label`` ``(batch_size,)``
  served from arrays given to :meth:`MemoryData.set_input_arrays` (pycaffe's ``set_input_arrays``,
  Caffe's ``MemoryDataLayer::Reset``): the number of rows must be a multiple of ``batch_size``; each
  forward serves the next ``batch_size`` rows and wraps around to the start after the last batch.
  Caffe quirk kept: the label top is ``(batch_size,)`` as set up (the net's shapes), but every forward
  reshapes it to ``(batch_size, 1, 1, 1)`` (``Forward_cpu``), so that is what a forward yields.  Like
  ``Reset``, no ``transform_param`` is applied to these arrays.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from caffe_compat.errors import DataError, FormatError, ShapeMismatchError
from caffe_compat.layers.facts import NONE, BlobCount, Shapes
from caffe_compat.layers.fillers import fill_blob
from caffe_compat.layers.registry import CaffeLayer, register_layer
from caffe_compat.proto import caffe_pb2


class SourceLayer(CaffeLayer):
    """A layer without bottoms; a non-persistent empty buffer tracks the device the net was moved to."""

    bottoms = NONE
    tops = BlobCount.at_least(1)
    in_caffe_1_0 = True

    def __init__(self, param, bottom_shapes, phase="test"):
        super().__init__(param, bottom_shapes, phase)
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
class Input(SourceLayer):
    """Caffe Input: declares the shapes of net inputs (see module docstring)."""

    @classmethod
    def infer(cls, layer, bottoms):
        """``input_param.shape``: one for every top, or one per top."""
        shapes = [tuple(int(d) for d in s.dim) for s in layer.input_param.shape]
        if not shapes:
            raise FormatError(f"layer '{layer.name}' (Input): input_param.shape is required")
        for shape in shapes:
            if min(shape, default=0) < 0:  # Blob::Reshape CHECK_GE(shape[i], 0)
                raise FormatError(f"layer '{layer.name}' (Input): input_param.shape {shape} has a negative "
                                  f"dimension (Caffe CHECKs every dimension >= 0)")
        return Shapes(_per_top(shapes, len(layer.top), "input_param.shape", layer.name))

    def __init__(self, param, bottom_shapes, phase="test"):
        super().__init__(param, bottom_shapes, phase)
        self.shapes = self.rule().tops

    def forward(self):
        return tuple(torch.zeros(s, dtype=self.dtype, device=self.device) for s in self.shapes)


@register_layer("DummyData")
class DummyData(SourceLayer):
    """Caffe DummyData: filler-generated tops (see module docstring)."""

    @classmethod
    def infer(cls, layer, bottoms):
        """``dummy_data_param.shape`` (or the legacy num/channels/height/width), once or once per top."""
        p = layer.dummy_data_param
        num_top = len(layer.top)
        if p.shape and (p.num or p.channels or p.height or p.width):
            raise FormatError(f"layer '{layer.name}' (DummyData): give either shape or num/channels/height/"
                              f"width, not both")
        if p.shape:
            shapes = [tuple(int(d) for d in s.dim) for s in p.shape]
        else:
            legacy = [list(p.num), list(p.channels), list(p.height), list(p.width)]
            if any(len(v) == 0 for v in legacy):
                raise FormatError(f"layer '{layer.name}' (DummyData): shape (or num, channels, height and "
                                  f"width) is required")
            legacy = [_per_top(v, num_top, name, layer.name)
                      for v, name in zip(legacy, ("num", "channels", "height", "width"))]
            shapes = [tuple(int(v[i]) for v in legacy) for i in range(num_top)]
        return Shapes(_per_top(shapes, num_top, "shape", layer.name))

    def __init__(self, param, bottom_shapes, phase="test"):
        super().__init__(param, bottom_shapes, phase)
        p = param.dummy_data_param
        num_top = len(param.top)
        self.shapes = self.rule().tops
        fillers = list(p.data_filler) or [caffe_pb2.FillerParameter(type="constant", value=0.0)]
        self.fillers = _per_top(fillers, num_top, "data_filler", self.layer_name)
        self.refill = [f.type != "constant" for f in self.fillers]
        self._generator = torch.Generator().manual_seed(0)

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
class MemoryData(SourceLayer):
    """Caffe MemoryData fed by :meth:`set_input_arrays` (see module docstring)."""

    tops = BlobCount.exact(2)  # memory_data_layer.hpp: ExactNumTopBlobs() 2

    @classmethod
    def infer(cls, layer, bottoms):
        """``data (batch_size, channels, height, width)`` and ``label (batch_size,)``, all positive."""
        p = layer.memory_data_param
        dims = (int(p.batch_size), int(p.channels), int(p.height), int(p.width))
        if min(dims) < 1:
            raise FormatError(f"layer '{layer.name}' (MemoryData): batch_size, channels, height and width "
                              f"must all be positive, got {', '.join(map(str, dims))}")
        return Shapes([dims, dims[:1]][:len(layer.top)])

    def __init__(self, param, bottom_shapes, phase="test"):
        super().__init__(param, bottom_shapes, phase)
        p = param.memory_data_param
        self.rule()
        self.batch_size, self.channels, self.height, self.width = (int(p.batch_size), int(p.channels),
                                                                  int(p.height), int(p.width))
        self._data: torch.Tensor | None = None
        self._labels: torch.Tensor | None = None
        self.position = 0


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
        # Caffe's Forward_cpu reshapes the label top to (batch_size, 1, 1, 1); setup shaped it (batch_size,)
        labels = self._labels[start:stop].to(device=self.device, dtype=self.dtype).reshape(-1, 1, 1, 1)
        self.position = stop % self._data.shape[0]
        return (data, labels)[:len(self.param.top)]
