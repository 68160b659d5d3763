"""HDF5Output: a layer that writes its two bottoms to an HDF5 file (needs the optional ``h5py``)."""

from __future__ import annotations

import io

import numpy as np
import torch

from caffe_compat.errors import DataError, FormatError, ShapeMismatchError
from caffe_compat.layers.facts import NONE, BlobCount, Shapes
from caffe_compat.layers.registry import CaffeLayer, register_layer


def legacy_4d(shape, where: str, name: str) -> tuple[int, int, int, int]:
    """Caffe's legacy ``(num, channels, height, width)`` of a blob of at most 4 axes (missing axes are 1)."""
    shape = tuple(int(d) for d in shape)
    if len(shape) > 4:
        raise FormatError(f"{where}: cannot use legacy accessors on the {name} bottom {shape}: more than 4 axes "
                          f"(Caffe's HDF5Output stores (num, channels, height, width))")
    return shape + (1,) * (4 - len(shape))


@register_layer("HDF5Output")
class HDF5Output(CaffeLayer):
    """Caffe's HDF5OutputLayer: ``hdf5_output_param { file_name }``; bottoms ``data`` and ``label``, no top.

    A forward writes bottom 0 to the dataset ``data`` and bottom 1 to ``label`` of ``file_name`` (opened
    relative to the working directory, as Caffe does), each reshaped to Caffe's legacy 4-D
    ``(num, channels, height, width)`` (``(N, D)`` is stored as ``(N, D, 1, 1)``; more than 4 axes is
    refused, Caffe's CHECK), as float32 (float64 for a float64 net, Caffe's ``Dtype``).  Both bottoms must
    have the same ``num``.  Backward: nothing (the bottoms get no gradient from it).

    Caffe quirks and where we differ:

    * Caffe creates (truncates) the file when the net is set up and writes the datasets at the first
      forward; a second forward fails there, as the datasets exist (``H5LTmake_dataset``'s CHECK aborts
      the run).  We write the whole file at the first forward, atomically (a temporary file renamed over
      the target, :mod:`caffe_compat.io.atomic`: an interrupted run never leaves a half-written file), and
      a second forward of the same layer raises a :class:`~caffe_compat.errors.DataError` instead of
      aborting; :meth:`reopen` allows one more write, as a newly set-up Caffe net would.
    * Without ``h5py`` installed, the layer is refused when it is built (``pip install h5py``).
    """

    bottoms = BlobCount.exact(2)
    tops = NONE
    in_caffe_1_0 = True
    breaks_graph = True  # it writes a file (h5py): torch.compile runs it eagerly between graphs

    @classmethod
    def infer(cls, layer, bottoms):
        where = f"layer '{layer.name}' (HDF5Output)"
        if not layer.hdf5_output_param.file_name:
            raise FormatError(f"{where}: hdf5_output_param.file_name is required")
        data, label = legacy_4d(bottoms[0], where, "data"), legacy_4d(bottoms[1], where, "label")
        if data[0] != label[0]:
            raise FormatError(f"{where}: data and label bottoms must have the same batch size, got {data[0]} and "
                              f"{label[0]}")
        return Shapes([])

    def __init__(self, param, bottom_shapes, phase="test"):
        super().__init__(param, bottom_shapes, phase)
        self.rule()
        try:
            import h5py  # noqa: F401
        except ImportError:
            raise DataError(f"layer '{self.layer_name}' (HDF5Output): writing HDF5 needs the h5py package, which is "
                            f"not installed (pip install h5py)") from None
        self.file_name = param.hdf5_output_param.file_name
        self.written = False

    def reopen(self) -> None:
        """Allow the next forward to write (and replace) the file again."""
        self.written = False

    def forward(self, data, label):
        import h5py

        from caffe_compat.io.atomic import write_bytes_atomic

        where = f"layer '{self.layer_name}' (HDF5Output)"
        if self.written:
            raise DataError(f"{where}: {self.file_name} already holds this net's 'data' and 'label' datasets; Caffe's "
                            f"HDF5OutputLayer fails on a second forward (call reopen() to replace the file)")
        shapes = legacy_4d(data.shape, where, "data"), legacy_4d(label.shape, where, "label")
        if shapes[0][0] != shapes[1][0]:
            raise ShapeMismatchError(f"{where}: data blob and label blob must have the same batch size, got "
                                     f"{shapes[0][0]} and {shapes[1][0]}")
        dtype = np.float64 if data.dtype == torch.float64 else np.float32
        buffer = io.BytesIO()
        with h5py.File(buffer, "w") as fh:
            for name, blob, shape in (("data", data, shapes[0]), ("label", label, shapes[1])):
                fh.create_dataset(name, data=blob.detach().cpu().to(torch.float64).numpy().astype(dtype).reshape(shape))
        write_bytes_atomic(self.file_name, buffer.getvalue())
        self.written = True
        return ()
