"""Caffe's blob-shape layers: Concat, Slice, Split, Flatten, Reshape, Crop, Tile, Silence.

They only move values, so their gradients are autograd's (sums for Split's copies, zero-padding for
Slice/Crop).  Tops are views or new tensors; no port writes its bottom.  Output shapes follow the
bottom shapes given at build time; ``forward`` recomputes them from the actual bottoms (Caffe
reshapes every pass), so a different batch size works.
"""

from __future__ import annotations

import torch

from caffe_compat.errors import FormatError
from caffe_compat.layers.blob_axes import canonical_axis, check_bottoms, count
from caffe_compat.layers.registry import CaffeLayer, register_layer


@register_layer("Concat")
class Concat(CaffeLayer):
    """Concatenate the bottoms along ``concat_param.axis`` (default 1; the legacy ``concat_dim``, if
    set, wins as in Caffe).  All other axes must agree."""

    def __init__(self, param, bottom_shapes, phase: str = "test"):
        super().__init__(param, bottom_shapes, phase)
        check_bottoms(self.layer_name, self.bottom_shapes, 1, 1 << 30)
        p = param.concat_param
        ndim = len(self.bottom_shapes[0])
        axis = int(p.concat_dim) if p.HasField("concat_dim") else int(p.axis)
        self.axis = canonical_axis(axis, ndim, self.layer_name, "concat_param.axis")
        first = self.bottom_shapes[0]
        for shape in self.bottom_shapes[1:]:
            if len(shape) != ndim or any(a != b for i, (a, b) in enumerate(zip(shape, first)) if i != self.axis):
                raise FormatError(f"layer '{self.layer_name}': cannot concatenate shapes {first} and {shape} "
                                  f"along axis {self.axis}")

    def output_shapes(self):
        shape = list(self.bottom_shapes[0])
        shape[self.axis] = sum(s[self.axis] for s in self.bottom_shapes)
        return [tuple(shape)]

    def forward(self, *bottoms):
        if len(bottoms) == 1:
            return (bottoms[0],)
        return (torch.cat(bottoms, dim=self.axis),)


@register_layer("Slice")
class Slice(CaffeLayer):
    """Split one bottom along ``slice_param.axis`` (default 1; legacy ``slice_dim`` wins if set) into
    the tops.  ``slice_point`` (strictly increasing, one fewer than the tops) gives the cut positions;
    without points the axis is divided equally (it must be divisible by the number of tops)."""

    def __init__(self, param, bottom_shapes, phase: str = "test"):
        super().__init__(param, bottom_shapes, phase)
        check_bottoms(self.layer_name, self.bottom_shapes, 1)
        p = param.slice_param
        shape = self.bottom_shapes[0]
        axis = int(p.slice_dim) if p.HasField("slice_dim") else int(p.axis)
        self.axis = canonical_axis(axis, len(shape), self.layer_name, "slice_param.axis")
        self.num_tops = max(1, len(param.top))
        self.points = [int(v) for v in p.slice_point]
        self.sizes = self._sizes(shape[self.axis])

    def _sizes(self, length: int) -> list[int]:
        if self.points:
            if len(self.points) != self.num_tops - 1:
                raise FormatError(f"layer '{self.layer_name}': {len(self.points)} slice_point(s) for "
                                  f"{self.num_tops} tops (need {self.num_tops - 1})")
            edges = [0] + self.points + [length]
            sizes = [b - a for a, b in zip(edges, edges[1:])]
            if any(s <= 0 for s in sizes):
                raise FormatError(f"layer '{self.layer_name}': slice_point {self.points} must be strictly "
                                  f"increasing inside (0, {length})")
            return sizes
        if length % self.num_tops:
            raise FormatError(f"layer '{self.layer_name}': axis {self.axis} of size {length} cannot be sliced "
                              f"equally into {self.num_tops} tops")
        return [length // self.num_tops] * self.num_tops

    def output_shapes(self):
        shape = self.bottom_shapes[0]
        return [shape[:self.axis] + (s,) + shape[self.axis + 1:] for s in self.sizes]

    def forward(self, x):
        sizes = self.sizes if x.shape[self.axis] == sum(self.sizes) else self._sizes(x.shape[self.axis])
        return tuple(torch.split(x, sizes, dim=self.axis))


@register_layer("Split")
class Split(CaffeLayer):
    """Every top is the bottom (Caffe shares the data); the bottom's gradient is the sum of the tops'."""

    def __init__(self, param, bottom_shapes, phase: str = "test"):
        super().__init__(param, bottom_shapes, phase)
        check_bottoms(self.layer_name, self.bottom_shapes, 1)
        self.num_tops = len(param.top)

    def output_shapes(self):
        return [self.bottom_shapes[0]] * self.num_tops

    def forward(self, x):
        return (x,) * self.num_tops


@register_layer("Flatten")
class Flatten(CaffeLayer):
    """Merge axes ``axis .. end_axis`` into one (``flatten_param``: axis 1, end_axis -1)."""

    def __init__(self, param, bottom_shapes, phase: str = "test"):
        super().__init__(param, bottom_shapes, phase)
        check_bottoms(self.layer_name, self.bottom_shapes, 1)
        p = param.flatten_param
        ndim = len(self.bottom_shapes[0])
        self.start = canonical_axis(p.axis, ndim, self.layer_name, "flatten_param.axis")
        self.end = canonical_axis(p.end_axis, ndim, self.layer_name, "flatten_param.end_axis")
        if self.end < self.start:
            raise FormatError(f"layer '{self.layer_name}': flatten end_axis {p.end_axis} is before axis {p.axis}")

    def output_shapes(self):
        s = self.bottom_shapes[0]
        return [s[:self.start] + (count(s, self.start, self.end + 1),) + s[self.end + 1:]]

    def forward(self, x):
        return (torch.flatten(x, self.start, self.end),)


@register_layer("Reshape")
class Reshape(CaffeLayer):
    """Replace bottom axes ``[axis, axis+num_axes)`` by ``reshape_param.shape`` (axis 0, num_axes -1 =
    to the end; a negative axis counts from *after* the last axis, so -1 appends).  In the shape,
    ``0`` copies the bottom dimension at the same position and one ``-1`` is inferred from the count."""

    def __init__(self, param, bottom_shapes, phase: str = "test"):
        super().__init__(param, bottom_shapes, phase)
        check_bottoms(self.layer_name, self.bottom_shapes, 1)
        p = param.reshape_param
        self.dims = [int(d) for d in p.shape.dim]
        self.axis, self.num_axes = int(p.axis), int(p.num_axes)
        if self.dims.count(-1) > 1:
            raise FormatError(f"layer '{self.layer_name}': reshape_param.shape has more than one -1")
        if any(d < -1 for d in self.dims):
            raise FormatError(f"layer '{self.layer_name}': reshape_param.shape {self.dims} has a dimension < -1")
        if self.num_axes < -1:
            raise FormatError(f"layer '{self.layer_name}': reshape_param.num_axes must be >= -1")
        self.top_shape = self.shape_for(self.bottom_shapes[0])

    def shape_for(self, bottom_shape) -> tuple[int, ...]:
        bottom_shape = tuple(int(d) for d in bottom_shape)
        ndim = len(bottom_shape)
        start = self.axis if self.axis >= 0 else ndim + self.axis + 1
        if not 0 <= start <= ndim:
            raise FormatError(f"layer '{self.layer_name}': reshape_param.axis {self.axis} out of range for "
                              f"a {ndim}-axis bottom")
        end = ndim if self.num_axes == -1 else start + self.num_axes
        if end > ndim:
            raise FormatError(f"layer '{self.layer_name}': reshape_param.num_axes {self.num_axes} from axis "
                              f"{start} exceeds the bottom's {ndim} axes")
        middle = list(self.dims)
        for i, d in enumerate(self.dims):
            if d == 0:
                if start + i >= ndim:
                    raise FormatError(f"layer '{self.layer_name}': dim {i} is 0 (copy) but the bottom has no "
                                      f"axis {start + i}")
                middle[i] = bottom_shape[start + i]
        top = list(bottom_shape[:start]) + middle + list(bottom_shape[end:])
        total = count(bottom_shape)
        if -1 in self.dims:
            known = count([d for d in top if d != -1])
            if known == 0 or total % known:
                raise FormatError(f"layer '{self.layer_name}': cannot infer the -1 of {self.dims} for bottom "
                                  f"shape {bottom_shape}")
            top[start + self.dims.index(-1)] = total // known
        if count(top) != total:
            raise FormatError(f"layer '{self.layer_name}': reshape {bottom_shape} -> {tuple(top)} changes the "
                              f"count ({total} vs {count(top)})")
        return tuple(top)

    def output_shapes(self):
        return [self.top_shape]

    def forward(self, x):
        return (x.reshape(self.shape_for(x.shape)),)


@register_layer("Crop")
class Crop(CaffeLayer):
    """Crop bottom 0 to the shape of bottom 1 on axes ``>= crop_param.axis`` (default 2), starting at
    ``offset`` (none: 0; one value: for every cropped axis; else one per cropped axis).  Bottom 1 only
    gives the shape and gets no gradient (as Caffe)."""

    def __init__(self, param, bottom_shapes, phase: str = "test"):
        super().__init__(param, bottom_shapes, phase)
        check_bottoms(self.layer_name, self.bottom_shapes, 2)
        p = param.crop_param
        big, ref = self.bottom_shapes
        if len(big) != len(ref):
            raise FormatError(f"layer '{self.layer_name}': Crop bottoms must have the same number of axes, "
                              f"got {big} and {ref}")
        self.axis = canonical_axis(p.axis, len(big), self.layer_name, "crop_param.axis")
        offsets = [int(o) for o in p.offset]
        n_cropped = len(big) - self.axis
        if len(offsets) not in (0, 1, n_cropped):
            raise FormatError(f"layer '{self.layer_name}': crop_param.offset must have 0, 1 or {n_cropped} "
                              f"values, got {len(offsets)}")
        if len(offsets) <= 1:
            offsets = (offsets or [0]) * n_cropped
        self.offsets = offsets
        self._check(big, ref)

    def _check(self, big, ref):
        for i, off in enumerate(self.offsets):
            a = self.axis + i
            if big[a] - off < ref[a]:
                raise FormatError(f"layer '{self.layer_name}': crop of axis {a} (size {big[a]}) at offset {off} "
                                  f"to size {ref[a]} runs past the end")

    def output_shapes(self):
        big, ref = self.bottom_shapes
        return [big[:self.axis] + ref[self.axis:]]

    def forward(self, x, reference):
        self._check(tuple(x.shape), tuple(reference.shape))
        index = [slice(None)] * self.axis + [slice(off, off + reference.shape[self.axis + i])
                                             for i, off in enumerate(self.offsets)]
        return (x[tuple(index)],)


@register_layer("Tile")
class Tile(CaffeLayer):
    """Repeat the bottom ``tile_param.tiles`` times along ``tile_param.axis`` (default 1): the whole
    block of axes ``axis..`` is copied, i.e. ``top = cat([x] * tiles, axis)``."""

    def __init__(self, param, bottom_shapes, phase: str = "test"):
        super().__init__(param, bottom_shapes, phase)
        check_bottoms(self.layer_name, self.bottom_shapes, 1)
        p = param.tile_param
        self.axis = canonical_axis(p.axis, len(self.bottom_shapes[0]), self.layer_name, "tile_param.axis")
        self.tiles = int(p.tiles)
        if self.tiles < 1:
            raise FormatError(f"layer '{self.layer_name}': tile_param.tiles must be >= 1, got {p.tiles}")

    def output_shapes(self):
        s = list(self.bottom_shapes[0])
        s[self.axis] *= self.tiles
        return [tuple(s)]

    def forward(self, x):
        reps = [1] * x.dim()
        reps[self.axis] = self.tiles
        return (x.repeat(*reps),)


@register_layer("Silence")
class Silence(CaffeLayer):
    """Consumes its bottoms and produces no top (keeps Caffe from reporting unused outputs).  Its
    bottoms get no gradient from it (Caffe writes zeros)."""

    def output_shapes(self):
        return []

    def forward(self, *bottoms):
        return ()
