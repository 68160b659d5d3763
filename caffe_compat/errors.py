"""The project's typed errors.

Every error a user can provoke with bad input derives from :class:`CaffeCompatError`; the CLI turns
these into one line on stderr and exit status 2.  Messages name the file (``path:line:col`` for text),
the layer or field, and what was expected.
"""

from __future__ import annotations

import os
import sys


class CaffeCompatWarning(UserWarning):
    """Base class of the project's warnings; the CLI prints each as one line on stderr
    (:func:`caffe_compat.export.notices.cli_warnings`)."""


class CaffeCompatError(Exception):
    """Base class of every error caused by the user's input (files, prototxt, arguments)."""


class ParseError(CaffeCompatError):
    """A text or binary Caffe file could not be parsed (syntax, truncated bytes, unknown field)."""


class FormatError(CaffeCompatError):
    """A file parsed but its content is not what Caffe would accept (wrong message, bad shapes)."""


class ArrayShapeError(FormatError, ValueError):
    """Values that do not fit the shape asked for (a BlobProto whose value count disagrees with its shape, a
    Datum from an array that is not 3-D).  Also a :class:`ValueError`: pycaffe's ``caffe.io`` raised
    numpy's ValueError there, and scripts catch that."""


class LayerNameError(FormatError, ValueError):
    """pycaffe's ``net.forward(start=..., end=...)`` / ``net.backward(...)`` naming a layer the net does not
    have.  Also a :class:`ValueError`, what pycaffe raises there (its ``list(net._layer_names).index(name)``)."""


class ShapeMismatchError(CaffeCompatError):
    """Weights and net disagree: names the layer, the blob index and both shapes."""


class UnknownLayerError(CaffeCompatError):
    """A layer type (or a Python layer's ``module.layer``) has no registered port."""


class PythonLayerError(CaffeCompatError, RuntimeError):
    """A user's Python layer raised: names the layer and the method; a RuntimeError too.  Raised as an
    instance of a subclass that is also the user's exception class (``StopIteration``, ``KeyError``, the
    user's own), which Caffe's PythonLayer lets through to the script
    (:func:`caffe_compat.layers.python_user._user_error`)."""


class InputArraysError(ShapeMismatchError, RuntimeError):
    """pycaffe's ``net.set_input_arrays(data, labels)`` refused (no MemoryData first layer, not float32, not
    C-contiguous, wrong shape or row count): names what is wrong.  Also a :class:`RuntimeError`, what
    pycaffe raises there (``Net_SetInputArrays``/``CheckContiguousArray`` throw ``std::runtime_error``)."""


class NetFileMissingError(ParseError, RuntimeError):
    """pycaffe's ``caffe.Net(...)`` of a net or weights file that cannot be opened: names the file.  Also a
    :class:`RuntimeError`, what pycaffe raises there (its ``CheckFile`` throws ``std::runtime_error`` before
    the net is built), so scripts that catch RuntimeError keep working."""


class LayerSetupError(CaffeCompatError, TypeError):
    """pycaffe's ``net.layers[i].setup(bottom, top)`` of a built-in layer: the port set the layer up when the
    net was built and cannot run Caffe's ``LayerSetUp`` again.  Also a :class:`TypeError`, what pycaffe
    raises when a script passes Python lists there (Boost.Python's ArgumentError: no ``vector<Blob*>``)."""


class DataError(CaffeCompatError):
    """A data set file is missing or malformed: names the file and the line."""


class ImageReadError(DataError, OSError):
    """pycaffe's ``caffe.io.load_image`` could not read the file as an image (undecodable, unsupported,
    unreadable): names the file.  Also an :class:`OSError` (``IOError``), what pycaffe's scikit-image / PIL
    reader raised there, so scripts that skip bad images with ``except IOError`` keep working."""

    def __str__(self) -> str:  # the message, not OSError's "[Errno N] ..." form
        return str(self.args[0]) if self.args else super().__str__()


class ImageNotFoundError(ImageReadError, FileNotFoundError):
    """``caffe.io.load_image`` of a path that does not exist: a :class:`FileNotFoundError`, as pycaffe's."""


class TrainingDiverged(CaffeCompatError):
    """The loss became NaN or infinite: names the iteration."""


class WriteError(CaffeCompatError, OSError):
    """An output file could not be written (missing or read-only directory, a file where a folder is
    expected, disk full): names the path and the operating system's reason.  It is also an
    :class:`OSError`, so callers that caught the raw error keep working."""

    def __str__(self) -> str:  # the message, not OSError's "[Errno N] ..." form built from errno/strerror
        return str(self.args[0]) if self.args else super().__str__()


class NotRegularFileError(ParseError, DataError):
    """A path a model, list, state file or the command line names is not a regular file (a FIFO, a device,
    a socket or a directory), or is larger than its format allows: names the path, what it is, and the
    field or layer that named it.  Checked with ``os.stat`` before anything is opened, so a FIFO never
    blocks and ``/dev/zero`` is never read.  It is both a ParseError and a DataError, so callers that
    caught either for the same file keep catching it."""


class MemoryBudgetError(FormatError, DataError):
    """What a file declares (a net's blobs and parameters, an HDF5 dataset, an ``.npy`` array, an image's
    decoded size, a resize, a list file) needs more memory than the budget
    (:func:`caffe_compat.io.safe_open.memory_budget`, ``CAFFE_COMPAT_MEMORY_BUDGET``): names the file (or
    layer, LMDB key) and the bytes, and is raised before anything is allocated.  Both a FormatError and a
    DataError, the two classes these refusals were raised as before, so callers that caught either keep
    catching it."""


class WeightsMismatchWarning(UserWarning):
    """A caffemodel and the net it is loaded into disagree on layer names: source layers with blobs that
    the net lacks (ignored, as Caffe's "Ignoring source layer X"), and net layers with blobs that the
    caffemodel does not cover (left at their fillers).  ``strict=True`` (``--strict``) makes it a
    :class:`FormatError`."""


def naming_file(exc: CaffeCompatError, *paths) -> CaffeCompatError:
    """``exc`` itself when its message already names one of ``paths`` (None entries skipped), else an error
    of the same type whose message starts with the first path (and ``with weights <path>`` for a second):
    a net's setup error names its layer; the command line and ``load_net`` add the file."""
    named = [str(p) for p in paths if p is not None]
    text = str(exc)
    if not named or any(p in text for p in named):
        return exc
    prefix = named[0] + (f" (with weights {named[1]})" if len(named) > 1 else "")
    try:
        return type(exc)(f"{prefix}: {text}")
    except TypeError:  # a subclass with another constructor: the base class keeps the type's family
        return CaffeCompatError(f"{prefix}: {text}")


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def outside_stacklevel() -> int:
    """The ``stacklevel`` that points a warning raised by the caller of this function at the first frame
    outside caffe_compat (the user's line, whichever public entry point led there: ``CaffeNet(...)``,
    ``load_net``, ``load_caffemodel``, pycaffe's ``Net``)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    return level
