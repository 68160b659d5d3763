"""The facts a layer port declares about its Caffe type (torch-free value types).

A port (:class:`~caffe_compat.layers.registry.CaffeLayer` subclass) is the single home of its type's
facts; everything else (``inspect``'s shape inference, the distributed trainer's list of layers that
couple the batch, export's data-layer stand-ins, the Caffe 1.0 type list) reads them from the registry:

* :class:`BlobCount`: how many bottoms / tops the type takes, as Caffe's ``ExactNumBottomBlobs`` /
  ``MinBottomBlobs`` / ``MaxBottomBlobs`` (and the ``Top`` forms) declare it; checked once, by the
  registry, with the same message for every type;
* :class:`Shapes`: what a type's shape rule returns (the port's ``infer`` classmethod): the top shapes
  (``None`` where they depend on data), the learnable blob shapes in Caffe's order and the multiply-adds;
* :class:`InputFacts`: what a data layer says about the image it feeds (channels, crop, resize, mean,
  scale, where the images come from), from which export builds the ``Input`` stand-in and the
  preprocessing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from caffe_compat.errors import FormatError

Shape = tuple[int, ...]


@dataclass(frozen=True)
class BlobCount:
    """Caffe's blob-count declaration: between ``minimum`` and ``maximum`` blobs (``None``: no upper bound)."""

    minimum: int = 0
    maximum: int | None = None

    @classmethod
    def exact(cls, n: int) -> "BlobCount":
        return cls(n, n)

    @classmethod
    def at_least(cls, n: int) -> "BlobCount":
        return cls(n, None)

    def accepts(self, n: int) -> bool:
        return n >= self.minimum and (self.maximum is None or n <= self.maximum)

    def describe(self) -> str:
        if self.maximum is None:
            return f"at least {self.minimum}"
        if self.maximum == self.minimum:
            return str(self.minimum)
        return f"{self.minimum} to {self.maximum}"

    def check(self, n: int, where: str, kind: str) -> None:
        """FormatError (``where``: the layer and its type) unless ``n`` blobs of ``kind`` are accepted."""
        if not self.accepts(n):
            raise FormatError(f"{where}: needs {self.describe()} {kind} blob(s), got {n}")


ANY = BlobCount()
ONE = BlobCount.exact(1)
NONE = BlobCount.exact(0)


@dataclass
class Shapes:
    """A shape rule's answer: top shapes (``None`` when data decides), learnable blob shapes, multiply-adds."""

    tops: list[Shape | None]
    params: list[Shape] = field(default_factory=list)
    macs: int = 0


def count(shape, start: int = 0, end: int | None = None) -> int:
    """Product of ``shape[start:end]`` (1 for an empty range), Caffe's ``Blob::count(start, end)``."""
    return int(math.prod(shape[start:end]))


def canonical_axis(axis: int, num_axes: int, layer: str, field: str = "axis") -> int:
    """``axis`` mapped into ``[0, num_axes)`` (negative counts from the end), Caffe's ``CanonicalAxisIndex``;
    a FormatError naming the layer and the field when it is out of range (Caffe's CHECK)."""
    if not -num_axes <= axis < num_axes:
        raise FormatError(f"layer '{layer}': {field} {axis} is out of range for a {num_axes}-axis blob "
                          f"(expected -{num_axes} <= {field} < {num_axes})")
    return axis + num_axes if axis < 0 else axis


def legacy_shape(shape, where: str) -> tuple[int, int, int, int]:
    """Caffe's legacy ``(num(), channels(), height(), width())`` of a blob: 1 for a missing axis; more than 4
    axes fail the legacy accessors' CHECK (a FormatError; ``where`` names the layer)."""
    shape = tuple(int(d) for d in shape)
    if len(shape) > 4:
        raise FormatError(f"{where}: cannot use legacy accessors on blobs with > 4 axes, got shape {shape}")
    return shape + (1,) * (4 - len(shape))


@dataclass(frozen=True)
class InputFacts:
    """What a data layer tells about the images it feeds (export replaces it by an ``Input`` of that shape).

    ``channels`` 3, or 1 for gray; ``crop`` the square crop (0: none); ``resize`` the ``(H, W)`` the layer
    resizes to (None: the stored size, or the mean file's size when there is one); ``mean_file`` /
    ``mean_value`` / ``scale`` Caffe's ``(x − mean) · scale``; ``source`` where images come from (a path
    or a description, for messages); ``stored_size_by`` what decides the stored size (for notes);
    ``preprocessing`` False when the layer declares no preprocessing at all (no ``transform_param``)."""

    channels: int = 3
    crop: int = 0
    resize: tuple[int, int] | None = None
    mean_file: str | None = None
    mean_value: tuple[float, ...] = ()
    scale: float = 1.0
    source: str = "its data source"
    stored_size_by: str = "the layer's data source"
    preprocessing: bool = True


def transform_input_facts(layer, source_fields=("data_param", "image_data_param", "hdf5_data_param",
                                                "window_data_param")) -> InputFacts:
    """:class:`InputFacts` from a layer's ``transform_param`` (Caffe's DataTransformer): gray with
    ``force_gray``, ``crop_size``, ``mean_file``, ``mean_value``, ``scale``; the source from the first
    ``<kind>_param.source`` set."""
    source = next((getattr(layer, f).source for f in source_fields
                   if layer.HasField(f) and getattr(layer, f).source), "its data source")
    if not layer.HasField("transform_param"):
        return InputFacts(source=source, preprocessing=False)
    t = layer.transform_param
    return InputFacts(channels=1 if t.force_gray else 3, crop=int(t.crop_size), mean_file=t.mean_file or None,
                      mean_value=tuple(float(v) for v in t.mean_value), scale=float(t.scale), source=source)


def same_as_bottom(cls, layer, bottoms) -> Shapes:
    """The shape rule of a layer whose one top has bottom 0's shape (use as ``infer = classmethod(...)``)."""
    return Shapes([tuple(bottoms[0])])


def broadcast_view(param_shape, ndim: int, axis: int) -> list[int]:
    """Shape that lines a blob of ``param_shape`` up with axes ``axis .. axis+len-1`` of an ``ndim``-axis
    tensor (ones elsewhere), for broadcasting Scale/Bias/PReLU parameters."""
    return [1] * axis + list(param_shape) + [1] * (ndim - axis - len(param_shape))
