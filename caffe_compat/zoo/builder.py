"""NetBuilder: a tiny NetSpec-like writer of ``caffe_pb2.NetParameter`` messages (no torch here).

Each helper appends one V2 ``layer { ... }`` and returns the name of its top blob, so a net reads as
a chain of calls::

    b = NetBuilder("toy")
    x = b.conv("conv1", "data", 32, kernel=3, pad=1, weight_filler=filler("xavier"))
    x = b.relu("relu1", x)                      # in place: returns x again
    x = b.pool("pool1", x, "MAX", kernel=2, stride=2)
    net = b.net

Only the fields passed are set (``stride=None`` leaves ``stride`` unset, which is not the same
message as ``stride: 1``): the nets must equal the authors' prototxt field for field, and protobuf
message equality distinguishes an unset field from one set to its default.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from caffe_compat.errors import FormatError
from caffe_compat.proto import caffe_pb2

#: The ParamSpec pair used by GoogLeNet and most BVLC nets: weights lr×1 decay×1, bias lr×2 decay×0.
WEIGHT_BIAS_MULTS = ((1, 1), (2, 0))


def filler(type_: str, **fields) -> caffe_pb2.FillerParameter:
    """A FillerParameter, e.g. ``filler("xavier", std=0.1)`` or ``filler("constant", value=0.2)``."""
    message = caffe_pb2.FillerParameter(type=type_)
    for key, value in fields.items():
        setattr(message, key, value)
    return message


class NetBuilder:
    """Appends layers to ``self.net`` (a NetParameter named ``name``)."""

    def __init__(self, name: str):
        self.net = caffe_pb2.NetParameter(name=name)

    # -- generic ---------------------------------------------------------------------------------
    def add(self, name: str, type_: str, bottoms: Sequence[str] = (), tops: Sequence[str] | None = None):
        """Append a layer of Caffe type ``type_``; its tops default to ``[name]``.  Returns it."""
        known = {top for layer in self.net.layer for top in layer.top}
        for bottom in bottoms:
            if bottom not in known:
                raise FormatError(f"layer '{name}' ({type_}): bottom blob '{bottom}' is not produced by an "
                                  f"earlier layer of net '{self.net.name}'")
        layer = self.net.layer.add(name=name, type=type_)
        layer.bottom.extend(bottoms)
        layer.top.extend([name] if tops is None else tops)
        return layer

    @staticmethod
    def _mults(layer, mults: Iterable[tuple[float, float]] | None) -> None:
        for lr_mult, decay_mult in mults or ():
            layer.param.add(lr_mult=lr_mult, decay_mult=decay_mult)

    # -- layers ----------------------------------------------------------------------------------
    def conv(self, name: str, bottom: str, num_output: int, kernel: int, stride: int | None = None,
             pad: int | None = None, weight_filler=None, bias_filler=None, mults=None, top: str | None = None) -> str:
        layer = self.add(name, "Convolution", [bottom], [top or name])
        self._mults(layer, mults)
        p = layer.convolution_param
        p.num_output = num_output
        if pad is not None:
            p.pad.append(pad)
        p.kernel_size.append(kernel)
        if stride is not None:
            p.stride.append(stride)
        if weight_filler is not None:
            p.weight_filler.CopyFrom(weight_filler)
        if bias_filler is not None:
            p.bias_filler.CopyFrom(bias_filler)
        return layer.top[0]

    def fc(self, name: str, bottom: str, num_output: int, weight_filler=None, bias_filler=None, mults=None,
           top: str | None = None) -> str:
        layer = self.add(name, "InnerProduct", [bottom], [top or name])
        self._mults(layer, mults)
        p = layer.inner_product_param
        p.num_output = num_output
        if weight_filler is not None:
            p.weight_filler.CopyFrom(weight_filler)
        if bias_filler is not None:
            p.bias_filler.CopyFrom(bias_filler)
        return layer.top[0]

    def pool(self, name: str, bottom: str, method: str, kernel: int, stride: int | None = None,
             pad: int | None = None, top: str | None = None) -> str:
        layer = self.add(name, "Pooling", [bottom], [top or name])
        p = layer.pooling_param
        p.pool = caffe_pb2.PoolingParameter.PoolMethod.Value(method)
        p.kernel_size = kernel
        if stride is not None:
            p.stride = stride
        if pad is not None:
            p.pad = pad
        return layer.top[0]

    def lrn(self, name: str, bottom: str, local_size: int, alpha: float, beta: float, k: float | None = None,
            top: str | None = None) -> str:
        layer = self.add(name, "LRN", [bottom], [top or name])
        p = layer.lrn_param
        p.local_size, p.alpha, p.beta = local_size, alpha, beta
        if k is not None:
            p.k = k
        return layer.top[0]

    def relu(self, name: str, blob: str) -> str:
        """ReLU in place (bottom = top = ``blob``)."""
        self.add(name, "ReLU", [blob], [blob])
        return blob

    def dropout(self, name: str, blob: str, ratio: float) -> str:
        """Dropout in place."""
        self.add(name, "Dropout", [blob], [blob]).dropout_param.dropout_ratio = ratio
        return blob

    def concat(self, name: str, bottoms: Sequence[str], top: str | None = None) -> str:
        return self.add(name, "Concat", list(bottoms), [top or name]).top[0]

    def input(self, name: str, shape: Sequence[int], top: str | None = None) -> str:
        """An ``Input`` layer with one top of the given shape."""
        layer = self.add(name, "Input", [], [top or name])
        layer.input_param.shape.add().dim.extend(int(d) for d in shape)
        return layer.top[0]
