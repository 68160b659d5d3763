"""Caffe's blob-shape layers: Concat, Slice, Split, Flatten, Reshape, Crop, Tile, Silence, BatchReindex,
Filter.

They only move values, so their gradients are autograd's (sums for Split's copies, zero-padding for
Slice/Crop).  Tops are views or new tensors; no port writes its bottom.  Output shapes follow the
bottom shapes given at build time; ``forward`` recomputes them from the actual bottoms (Caffe
reshapes every pass), so a different batch size works.
"""

from __future__ import annotations

import torch

from caffe_compat.errors import DataError, FormatError, ShapeMismatchError
from caffe_compat.layers.facts import NONE, ONE, BlobCount, Shapes, canonical_axis, count
from caffe_compat.layers.registry import CaffeLayer, register_layer
from caffe_compat.losses.static_form import asserted_in_graph


@register_layer("Concat")
class Concat(CaffeLayer):
    """Concatenate the bottoms along ``concat_param.axis`` (default 1; or the legacy ``concat_dim``, but
    not both, as in Caffe).  All other axes must agree."""

    bottoms = BlobCount.at_least(1)
    tops = ONE
    in_caffe_1_0 = True

    @staticmethod
    def concat_axis(layer, ndim: int) -> int:
        """``concat_dim`` (legacy, no negative values) or ``axis``; setting both is an error (Caffe's CHECK in
        LayerSetUp: "Either axis or concat_dim should be specified; not both")."""
        p = layer.concat_param
        if p.HasField("axis") and p.HasField("concat_dim"):
            raise FormatError(f"layer '{layer.name}': either concat_param.axis or concat_dim should be specified; "
                              f"not both")
        axis = int(p.concat_dim) if p.HasField("concat_dim") else int(p.axis)
        return canonical_axis(axis, ndim, layer.name, "concat_param.axis")

    @classmethod
    def infer(cls, layer, bottoms):
        """Bottom 0's shape with the axis summed; every other axis must agree (Caffe's CHECKs)."""
        first = tuple(bottoms[0])
        axis = cls.concat_axis(layer, len(first))
        for shape in bottoms[1:]:
            if len(shape) != len(first) or any(a != b for i, (a, b) in enumerate(zip(shape, first)) if i != axis):
                raise FormatError(f"layer '{layer.name}': cannot concatenate shapes {first} and {tuple(shape)} "
                                  f"along axis {axis}")
        out = list(first)
        out[axis] = sum(s[axis] for s in bottoms)
        return Shapes([tuple(out)])

    def __init__(self, param, bottom_shapes, phase: str = "test"):
        super().__init__(param, bottom_shapes, phase)
        self.axis = self.concat_axis(param, len(self.bottom_shapes[0]))
        self.rule()

    def forward(self, *bottoms):
        if len(bottoms) == 1:
            return (bottoms[0],)
        return (torch.cat(bottoms, dim=self.axis),)


@register_layer("Slice")
class Slice(CaffeLayer):
    """Split one bottom along ``slice_param.axis`` (default 1; or the legacy ``slice_dim``, not both) into
    the tops.  ``slice_point`` (strictly increasing, one fewer than the tops) gives the cut positions;
    without points the axis is divided equally (it must be divisible by the number of tops)."""

    bottoms = ONE
    tops = BlobCount.at_least(1)
    in_caffe_1_0 = True

    @staticmethod
    def slice_axis(layer, ndim: int) -> int:
        """``slice_dim`` (legacy, no negative values) or ``axis``; setting both is an error (Caffe's CHECK in
        LayerSetUp: "Either axis or slice_dim should be specified; not both")."""
        p = layer.slice_param
        if p.HasField("axis") and p.HasField("slice_dim"):
            raise FormatError(f"layer '{layer.name}': either slice_param.axis or slice_dim should be specified; "
                              f"not both")
        axis = int(p.slice_dim) if p.HasField("slice_dim") else int(p.axis)
        return canonical_axis(axis, ndim, layer.name, "slice_param.axis")

    @staticmethod
    def slice_sizes(layer, axis: int, length: int) -> list[int]:
        """The tops' sizes along the axis: from ``slice_point`` (Caffe's CHECKs: one fewer than the tops, no
        more tops than the axis is long, strictly increasing from above 0; the last part, ``length`` minus the
        last point, may be **empty** (a point equal to the length; Blob::Reshape takes a 0 dim) but not
        negative), else equal parts (the length must divide)."""
        points = [int(v) for v in layer.slice_param.slice_point]
        num_tops = max(1, len(layer.top))
        if points:
            if len(points) != num_tops - 1:
                raise FormatError(f"layer '{layer.name}': {len(points)} slice_point(s) for "
                                  f"{num_tops} tops (need {num_tops - 1})")
            if num_tops > length:
                raise FormatError(f"layer '{layer.name}': {num_tops} tops for an axis of size {length} "
                                  f"(Caffe's CHECK: at most one top per element)")
            edges = [0] + points + [length]
            sizes = [b - a for a, b in zip(edges, edges[1:])]
            if any(s <= 0 for s in sizes[:-1]) or sizes[-1] < 0:
                raise FormatError(f"layer '{layer.name}': slice_point {points} must be strictly "
                                  f"increasing inside (0, {length}]")
            return sizes
        if length % num_tops:
            raise FormatError(f"layer '{layer.name}': axis {axis} of size {length} cannot be sliced "
                              f"equally into {num_tops} tops")
        return [length // num_tops] * num_tops

    @classmethod
    def infer(cls, layer, bottoms):
        shape = tuple(bottoms[0])
        axis = cls.slice_axis(layer, len(shape))
        return Shapes([shape[:axis] + (n,) + shape[axis + 1:] for n in cls.slice_sizes(layer, axis, shape[axis])])

    def __init__(self, param, bottom_shapes, phase: str = "test"):
        super().__init__(param, bottom_shapes, phase)
        shape = self.bottom_shapes[0]
        self.axis = self.slice_axis(param, len(shape))
        self.sizes = self._sizes(shape[self.axis])

    def _sizes(self, length: int) -> list[int]:
        return self.slice_sizes(self.param, self.axis, length)

    def forward(self, x):
        sizes = self.sizes if x.shape[self.axis] == sum(self.sizes) else self._sizes(x.shape[self.axis])
        return tuple(torch.split(x, sizes, dim=self.axis))


@register_layer("Split")
class Split(CaffeLayer):
    """Every top is the bottom (Caffe shares the data); the bottom's gradient is the sum of the tops'.  No top
    may be named as the bottom (Caffe's CHECK: no in-place Split)."""

    refuses_in_place = True
    bottoms = ONE
    tops = BlobCount.at_least(1)
    in_caffe_1_0 = True
    infer = classmethod(lambda cls, layer, bottoms: Shapes([tuple(bottoms[0])] * len(layer.top)))

    def __init__(self, param, bottom_shapes, phase: str = "test"):
        super().__init__(param, bottom_shapes, phase)
        self.num_tops = len(param.top)

    def forward(self, x):
        return (x,) * self.num_tops


@register_layer("Flatten")
class Flatten(CaffeLayer):
    """Merge axes ``axis .. end_axis`` into one (``flatten_param``: axis 1, end_axis -1): the top is
    ``shape[:axis] + (count(axis, end_axis + 1),) + shape[end_axis + 1:]``, as Caffe's FlattenLayer builds it.
    So ``end_axis = axis − 1`` (an empty range, count 1) *inserts* a unit axis before ``axis``, e.g. axis 1,
    end_axis 0: ``(N, D)`` → ``(N, 1, D)``; an ``end_axis`` further before ``axis`` fails Caffe's
    ``Blob::count`` CHECK and is a FormatError.  Not in place (Caffe's CHECK)."""

    refuses_in_place = True
    bottoms = tops = ONE
    in_caffe_1_0 = True

    @staticmethod
    def axes(layer, ndim: int) -> tuple[int, int]:
        p = layer.flatten_param
        start = canonical_axis(p.axis, ndim, layer.name, "flatten_param.axis")
        end = canonical_axis(p.end_axis, ndim, layer.name, "flatten_param.end_axis")
        if end < start - 1:
            raise FormatError(f"layer '{layer.name}': flatten end_axis {p.end_axis} is before axis {p.axis} "
                              f"(Caffe's count({start}, {end + 1}) needs {start} <= {end + 1})")
        return start, end

    @classmethod
    def infer(cls, layer, bottoms):
        s = tuple(bottoms[0])
        start, end = cls.axes(layer, len(s))
        return Shapes([s[:start] + (count(s, start, end + 1),) + s[end + 1:]])

    def __init__(self, param, bottom_shapes, phase: str = "test"):
        super().__init__(param, bottom_shapes, phase)
        self.start, self.end = self.axes(param, len(self.bottom_shapes[0]))

    def forward(self, x):
        if self.end < self.start:  # the empty range: a unit axis inserted at ``start``
            return (x.unsqueeze(self.start),)
        return (torch.flatten(x, self.start, self.end),)


@register_layer("Reshape")
class Reshape(CaffeLayer):
    """Replace bottom axes ``[axis, axis+num_axes)`` by ``reshape_param.shape`` (axis 0, num_axes -1 =
    to the end; a negative axis counts from *after* the last axis, so -1 appends).  In the shape,
    ``0`` copies the bottom dimension at the same position and one ``-1`` is inferred from the count.
    Not in place (Caffe's CHECK in LayerSetUp)."""

    refuses_in_place = True
    bottoms = tops = ONE
    in_caffe_1_0 = True

    @staticmethod
    def reshaped(layer, b0) -> tuple[int, ...]:
        """Caffe's ReshapeLayer with its CHECKs as FormatErrors: ``axis`` in ``[-(n+1), n]`` (negative counts
        from the end, -1 = after the last axis), ``num_axes >= -1``, ``axis + num_axes <= n``; a 0 copies
        the bottom axis at the same position (which must exist), at most one -1 is inferred, and the
        counts agree."""
        p = layer.reshape_param
        where = f"layer '{layer.name}' (Reshape)"
        b0 = tuple(int(d) for d in b0)
        ndim = len(b0)
        start = p.axis if p.axis >= 0 else ndim + p.axis + 1
        if not 0 <= start <= ndim:
            raise FormatError(f"{where}: reshape_param.axis {p.axis} is out of range for the {ndim}-axis input "
                              f"{b0} (expected {-(ndim + 1)} to {ndim})")
        if p.num_axes < -1:
            raise FormatError(f"{where}: reshape_param.num_axes must be >= 0, or -1 for all, got {p.num_axes}")
        end = ndim if p.num_axes == -1 else start + p.num_axes
        if end > ndim:
            raise FormatError(f"{where}: reshape_param.axis + num_axes = {end} is out of range for the {ndim}-axis "
                              f"input {b0}")
        new = []
        for i, d in enumerate(int(d) for d in p.shape.dim):
            if d == 0:
                if start + i >= ndim:
                    raise FormatError(f"{where}: reshape_param.shape dim {i} is 0, but the input {b0} has no "
                                      f"axis {start + i} to copy")
                new.append(b0[start + i])
            elif d < -1:
                raise FormatError(f"{where}: reshape_param.shape dim {i} is {d}; expected -1 (infer), 0 (copy) "
                                  f"or > 0")
            else:
                new.append(d)
        if new.count(-1) > 1:
            raise FormatError(f"{where}: reshape_param.shape has more than one -1 (at most one dim can be inferred)")
        out = list(b0[:start]) + new + list(b0[end:])
        if -1 in out:
            known = count([d for d in out if d != -1])
            if known == 0 or count(b0) % known:
                raise FormatError(f"{where}: cannot infer the -1: the input count {count(b0)} is not divisible by "
                                  f"the product of the given dims ({known})")
            out[out.index(-1)] = count(b0) // known
        if count(out) != count(b0):
            raise FormatError(f"{where}: reshape_param.shape gives {tuple(out)} ({count(out)} values), the input "
                              f"{b0} has {count(b0)}: a reshape never changes the count")
        return tuple(out)

    @classmethod
    def infer(cls, layer, bottoms):
        return Shapes([cls.reshaped(layer, bottoms[0])])

    def __init__(self, param, bottom_shapes, phase: str = "test"):
        super().__init__(param, bottom_shapes, phase)
        self.top_shape = self.shape_for(self.bottom_shapes[0])

    def shape_for(self, bottom_shape) -> tuple[int, ...]:
        if tuple(bottom_shape) == self.bottom_shapes[0] and hasattr(self, "top_shape"):
            return self.top_shape  # the built shape: no protobuf read (a compiled forward cannot trace one)
        return self.reshaped(self.param, bottom_shape)

    def forward(self, x):
        return (x.reshape(self.shape_for(x.shape)),)


@register_layer("Crop")
class Crop(CaffeLayer):
    """Crop bottom 0 to the shape of bottom 1 on axes ``>= crop_param.axis`` (default 2), starting at
    ``offset`` (none: 0; one value: for every cropped axis; else one per cropped axis).  Bottom 1 only
    gives the shape and gets no gradient (as Caffe).  crop_layer.cpp reads ``bottom[1]->shape(i)`` only for
    bottom 0's axes ``i``: a bottom 1 with more axes is accepted (its extra axes are ignored), one with
    fewer aborts (Blob::shape's axis CHECK)."""

    bottoms = BlobCount.exact(2)
    tops = ONE
    in_caffe_1_0 = True

    @staticmethod
    def geometry(layer, big, ref) -> tuple[int, list[int]]:
        """(axis, one offset per cropped axis), with Caffe's CHECKs: bottom 1 has at least bottom 0's axes,
        0, 1 or one offset per cropped axis, and every crop inside bottom 0."""
        p = layer.crop_param
        if len(ref) < len(big):
            raise FormatError(f"layer '{layer.name}': Crop's bottom 1 {tuple(ref)} has fewer axes than bottom 0 "
                              f"{tuple(big)} (Caffe reads bottom 1's shape along each of bottom 0's axes)")
        axis = canonical_axis(p.axis, len(big), layer.name, "crop_param.axis")
        offsets = [int(o) for o in p.offset]
        n_cropped = len(big) - axis
        if len(offsets) not in (0, 1, n_cropped):
            raise FormatError(f"layer '{layer.name}': crop_param.offset must have 0, 1 or {n_cropped} "
                              f"values, got {len(offsets)}")
        if len(offsets) <= 1:
            offsets = (offsets or [0]) * n_cropped
        Crop.check_inside(layer.name, axis, offsets, big, ref)
        return axis, offsets

    @staticmethod
    def check_inside(name: str, axis: int, offsets, big, ref) -> None:
        for i, off in enumerate(offsets):
            a = axis + i
            if big[a] - off < ref[a]:
                raise FormatError(f"layer '{name}': crop of axis {a} (size {big[a]}) at offset {off} "
                                  f"to size {ref[a]} runs past the end")

    @classmethod
    def infer(cls, layer, bottoms):
        big, ref = tuple(bottoms[0]), tuple(bottoms[1])
        axis, _ = cls.geometry(layer, big, ref)
        return Shapes([big[:axis] + ref[axis:len(big)]])

    def __init__(self, param, bottom_shapes, phase: str = "test"):
        super().__init__(param, bottom_shapes, phase)
        self.axis, self.offsets = self.geometry(param, *self.bottom_shapes)

    def _check(self, big, ref):
        self.check_inside(self.layer_name, self.axis, self.offsets, big, ref)

    def forward(self, x, reference):
        self._check(tuple(x.shape), tuple(reference.shape))
        index = [slice(None)] * self.axis + [slice(off, off + reference.shape[self.axis + i])
                                             for i, off in enumerate(self.offsets)]
        return (x[tuple(index)],)


@register_layer("Tile")
class Tile(CaffeLayer):
    """Repeat the bottom ``tile_param.tiles`` times along ``tile_param.axis`` (default 1): the whole
    block of axes ``axis..`` is copied, i.e. ``top = cat([x] * tiles, axis)``."""

    bottoms = tops = ONE
    in_caffe_1_0 = True

    @classmethod
    def infer(cls, layer, bottoms):
        p = layer.tile_param
        out = list(bottoms[0])
        axis = canonical_axis(p.axis, len(out), layer.name, "tile_param.axis")
        if p.tiles < 1:
            raise FormatError(f"layer '{layer.name}': tile_param.tiles must be >= 1, got {p.tiles}")
        out[axis] *= p.tiles
        return Shapes([tuple(out)])

    def __init__(self, param, bottom_shapes, phase: str = "test"):
        super().__init__(param, bottom_shapes, phase)
        p = param.tile_param
        self.axis = canonical_axis(p.axis, len(self.bottom_shapes[0]), self.layer_name, "tile_param.axis")
        self.tiles = int(p.tiles)
        self.rule()

    def forward(self, x):
        reps = [1] * x.dim()
        reps[self.axis] = self.tiles
        return (x.repeat(*reps),)


@register_layer("Silence")
class Silence(CaffeLayer):
    """Consumes its bottoms and produces no top (keeps Caffe from reporting unused outputs).  Its
    bottoms get no gradient from it (Caffe writes zeros)."""

    bottoms = BlobCount.at_least(1)
    tops = NONE
    in_caffe_1_0 = True
    infer = classmethod(lambda cls, layer, bottoms: Shapes([]))

    def forward(self, *bottoms):
        return ()


@register_layer("BatchReindex")
class BatchReindex(CaffeLayer):
    """Caffe's BatchReindexLayer: ``top[k] = bottom0[int(bottom1[k])]``, rows of the batch picked (and
    repeated, or dropped) by an index vector.

    Bottom 1 must have exactly one axis (Caffe's CHECK); the top is ``(K,) + bottom0.shape[1:]`` for K
    indices.  Indices are floats truncated toward zero (``static_cast<int>``) and must lie in
    ``[0, N)``: outside it is a :class:`~caffe_compat.errors.DataError` (Caffe CHECK-fails in
    ``check_batch_reindex``).  Backward: each top row's gradient is added to the bottom row it came from
    (a repeated index accumulates, an unused row gets 0); the index bottom gets none (Caffe refuses to
    backpropagate to it)."""

    bottoms = BlobCount.exact(2)
    tops = ONE
    in_caffe_1_0 = True

    @classmethod
    def infer(cls, layer, bottoms):
        data, index = tuple(bottoms[0]), tuple(bottoms[1])
        if len(index) != 1:
            raise FormatError(f"layer '{layer.name}' (BatchReindex): the index bottom must have one axis, got shape "
                              f"{index}")
        if not data:
            raise FormatError(f"layer '{layer.name}' (BatchReindex): the data bottom needs at least one axis")
        return Shapes([index + data[1:]])

    def __init__(self, param, bottom_shapes, phase: str = "test"):
        super().__init__(param, bottom_shapes, phase)
        self.rule()

    def forward(self, data, index):
        rows = index.detach().to(torch.int64)  # truncation toward zero, like static_cast<int>
        inside = ((rows >= 0) & (rows < data.shape[0])).all()
        if not asserted_in_graph(inside, f"layer '{self.layer_name}' (BatchReindex): an index is outside [0, "
                                 f"{data.shape[0]})") and not bool(inside):
            bad = index[(rows < 0) | (rows >= data.shape[0])].flatten()[0].item()
            raise DataError(f"layer '{self.layer_name}' (BatchReindex): index {bad} is outside [0, {data.shape[0]})")
        return (data.index_select(0, rows),)


@register_layer("Filter")
class Filter(CaffeLayer):
    """Caffe's FilterLayer: bottoms ``b_1..b_k`` and a selector ``s`` (the last bottom), tops ``t_1..t_k``
    holding the rows ``n`` of each ``b_i`` with ``s[n] != 0``, in batch order.

    The selector is ``(N,)`` or ``(N, 1, ...)`` (every axis but the first a singleton) and each bottom
    leads with the same ``N`` (Caffe's CHECKs); there is one top per filtered bottom.  A nonzero float
    (NaN included) keeps its row.  The shape rule gives Caffe's setup shapes, the bottoms' own (its first
    Reshape keeps all ``N`` rows); at run time a top has as many rows as the selector has nonzeros (none:
    an empty top).  Backward: a kept row's gradient is copied back to the row it came from, every other
    row of the bottom gets 0; the selector gets none (Caffe refuses to backpropagate to it).  Caffe divides
    by the top's row count there, so it crashes when nothing is kept; we give the zero gradient.  An empty
    batch (N = 0) is refused (a FormatError at setup, a ShapeMismatchError fed at run time): Caffe's
    Forward divides each bottom's count by N.
    """

    bottoms = BlobCount.at_least(2)
    tops = BlobCount.at_least(1)
    in_caffe_1_0 = True
    sizes_follow_values = True  # as many rows as the selector has nonzeros

    @classmethod
    def check_blob_counts(cls, layer, num_bottoms: int, check_tops: bool = True) -> None:
        """At least 2 bottoms; exactly one top per filtered bottom (Caffe's ``CHECK_EQ(top.size(),
        bottom.size() - 1)``)."""
        super().check_blob_counts(layer, num_bottoms, check_tops)
        if check_tops and len(layer.top) != num_bottoms - 1:
            raise FormatError(f"layer '{layer.name}' (Filter): needs one top per filtered bottom ({num_bottoms - 1}), "
                              f"got {len(layer.top)}")

    @classmethod
    def infer(cls, layer, bottoms):
        selector = tuple(bottoms[-1])
        where = f"layer '{layer.name}' (Filter)"
        if not selector or any(d != 1 for d in selector[1:]):
            raise FormatError(f"{where}: selector blob dimensions must be singletons (1), except the first; got "
                              f"{selector}")
        for i, shape in enumerate(bottoms[:-1]):
            if not shape or shape[0] != selector[0]:
                raise FormatError(f"{where}: bottom {i} {tuple(shape)} must have the selector's 0th dimension "
                                  f"{selector[0]}")
        if not selector[0]:
            raise FormatError(f"{where}: empty batch (selector {selector}): Caffe's Forward divides each bottom's "
                              f"count by its 0th dimension (an integer division by zero)")
        return Shapes([tuple(shape) for shape in bottoms[:-1]])

    def __init__(self, param, bottom_shapes, phase: str = "test"):
        super().__init__(param, bottom_shapes, phase)
        self.rule()

    def forward(self, *bottoms):
        selector = bottoms[-1]
        rows = selector.shape[0] if selector.dim() else -1
        if not rows or any(b.dim() == 0 or b.shape[0] != rows for b in bottoms):  # rows 0: Caffe divides by it
            raise ShapeMismatchError(f"layer '{self.layer_name}' (Filter): every bottom must lead with the selector's "
                                     f"{rows} rows, got {[tuple(b.shape) for b in bottoms]}")
        kept = torch.nonzero(selector.detach().reshape(rows, -1)[:, 0] != 0).flatten()
        return tuple(b.index_select(0, kept) for b in bottoms[:-1])
