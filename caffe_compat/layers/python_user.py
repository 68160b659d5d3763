"""User Python layers (Caffe's ``type: "Python"``) run inside a CaffeNet, without ever importing a module
because a model file names it.

A ``Python`` layer's ``python_param { module: M layer: C }`` resolves, in this order, to

1. a native port registered as ``Python:M.C`` (:mod:`caffe_compat.layers.python_ports`);
2. a class the running program registered: :func:`register_python_layer` ``(M, C, cls)``;
3. a class ``C`` defined in a module ``M`` the program has **already imported** (``sys.modules``), that
   derives from :class:`Layer` (pycaffe's ``caffe.Layer``): looked up with ``vars(module)``, so no module
   ``__getattr__`` runs either;
4. only after the user opted in with :func:`allow_python_imports` ``(folders)`` (the CLI's
   ``--python-path DIR``): module ``M`` imported from one of those folders (any class ``C``, as Caffe
   accepts), logged at WARNING when allowed and at INFO for each import.

Otherwise building the net raises :class:`~caffe_compat.errors.UnknownLayerError` naming the layer, ``M.C``
and both ways to allow it; the CLI exits 2 with that message.

The adapter (:class:`UserPythonLayer`) gives the user's class pycaffe's semantics, as Caffe's
``PythonLayer`` does:

* the class is instantiated with the LayerParameter (Caffe calls ``cls(param)``; a class whose constructor
  takes no argument is called without it); ``param_str`` and ``phase`` (0 TRAIN, 1 TEST) are set, then
  ``setup(bottom, top)`` runs once (a net rebuilt for new input shapes keeps the object, its ``param_str``
  included: :func:`keeping_user_objects`) and ``reshape(bottom, top)`` before every forward (and once at build,
  with zero bottoms of the build shapes, as Caffe's ``SetUp``: the tops' shapes then are the net's
  ``blob_shapes``; the type's torch-free shape rule says "unknown": the shapes are the user's code's);
* ``bottom[i].data``, ``top[i].data``, ``top[i].diff``, ``bottom[i].diff`` are numpy arrays (float32, or
  float64 in a double net) of :class:`HostBlob` s; ``reshape(*shape)`` is Caffe's ``Blob::Reshape`` (memory
  and values kept within the capacity, else zeros); ``shape``, ``count``, ``num``/``channels``/``height``/
  ``width`` as pycaffe's;
* ``self.blobs.add_blob(*shape)`` in ``setup`` adds a learnable blob: after setup each becomes an
  ``nn.Parameter`` of the port (Caffe order), updated by the solver with the layer's ``param { lr_mult
  decay_mult }``, saved in caffemodels; before each forward ``self.blobs[i].data`` holds the parameter's
  value; when ``backward`` starts ``self.blobs[i].diff`` holds the parameter's diff as Caffe's blob does
  (accumulated since it was last cleared: zeros after the solver's clear), and what ``backward`` leaves
  there is the parameter's diff (``+=`` accumulates over ``iter_size`` / repeated ``net.backward()``; an
  assignment overwrites, as in Caffe).  In Caffe ``self.blobs`` *are* the net's parameter
  blobs, so what ``forward`` or ``backward`` writes into ``self.blobs[i].data`` (a running statistic, an
  iteration counter) is the parameter's new value: seen by ``net.params``, the next forward and snapshots;
* the layer runs inside CaffeNet's autograd as a ``torch.autograd.Function``: forward copies the bottoms
  (and blobs) to host numpy arrays, calls the user's ``reshape`` and ``forward`` and moves the tops to the
  bottoms' device (so nets on CUDA work); backward puts the top gradients in ``top[i].diff`` (a loss top's
  is its ``loss_weight``, as Caffe sets it), zeroes the bottom diffs, calls ``backward(top,
  propagate_down, bottom)`` with ``propagate_down[i]`` true when bottom ``i`` needs a gradient, and returns
  the bottom diffs.  Backward pertains to the layer's last forward, as in Caffe.  An in-place top (``top``
  named as a ``bottom``) is that bottom's very blob, as in Caffe: ``top[0].data *= 2`` in forward scales
  the bottom's values, and in backward ``bottom[0].diff`` starts as the top's diff (not zeroed).

An exception raised by the user's code is a :class:`~caffe_compat.errors.PythonLayerError` naming the
layer and the method (a CaffeCompatError and RuntimeError) that is also an instance of the user's exception
class, which Caffe lets through to the script (``except StopIteration:`` around ``net.forward()``).

Facts: any number of bottoms and tops; no torch-free shape rule (``infer`` gives unknown tops: data
decide); ``couples_batch`` is True, because a Python layer may compute over the whole batch (pair losses),
so a distributed run gathers its bottoms; Python layers are not LossLayers (loss_weight 0 unless the
prototxt sets one).  Not reproduced: a user layer writing its *bottom* data in place changes only its own
copy (other layers do not see it), and ``share_in_parallel`` is ignored.
"""

from __future__ import annotations

import contextvars
import importlib
import importlib.machinery
import inspect
import logging
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from torch import nn

from caffe_compat.errors import CaffeCompatError, DataError, PythonLayerError
from caffe_compat.layers.blob_memory import shape_argument, within_capacity
from caffe_compat.layers.facts import ANY, Shapes
from caffe_compat.layers.registry import CaffeLayer

log = logging.getLogger("caffe_compat.layers.python_user")

__all__ = ["Layer", "HostBlob", "BlobVec", "UserPythonLayer", "register_python_layer", "unregister_python_layer",
           "allow_python_imports", "disallow_python_imports", "allowed_python_paths", "user_layer_port",
           "unresolved_message", "keeping_user_objects"]

TRAIN, TEST = 0, 1

_REGISTERED: dict[str, type] = {}  # "module.layer" -> class registered by the program
_ALLOWED: list[str] = []  # folders the user opted in to import layer modules from
_ADDED_TO_PATH: list[str] = []
_PORTS: dict[type, type] = {}  # user class -> its adapter subclass
#: layer name -> the user object a rebuild keeps (:func:`keeping_user_objects`); per thread and context
_KEPT_USERS: contextvars.ContextVar[dict] = contextvars.ContextVar("caffe_compat_kept_python_layers", default={})


class HostBlob:
    """pycaffe's Blob as a Python layer sees it: numpy ``data`` and ``diff`` on the host."""

    def __init__(self, shape=(), dtype=np.float32):
        self._dtype = np.dtype(dtype)
        self.data = np.zeros(tuple(int(d) for d in shape), dtype=self._dtype)
        self.diff = np.zeros_like(self.data)

    def reshape(self, *shape, **kwargs) -> None:
        """Caffe's ``Blob::Reshape`` (``blob.reshape(n, c, h, w)`` or ``blob.reshape((n, c, h, w))``): ``data``
        and ``diff`` keep their memory and values, seen in the new shape, while the new count fits in the
        blob's capacity (the largest count it had); a larger count gives new zeros.  A keyword argument is
        pycaffe's RuntimeError."""
        shape = shape_argument(repr(self), shape, kwargs)
        if shape == self.data.shape:
            return
        bases = self.__dict__.setdefault("_bases", {})  # "data"/"diff" -> the largest memory it had
        for kind in ("data", "diff"):
            view, bases[kind] = within_capacity(torch.from_numpy(getattr(self, kind)), shape, bases.get(kind))
            setattr(self, kind, view.numpy())

    def _set(self, array: np.ndarray) -> None:
        if array.shape != self.data.shape or array.dtype != self.data.dtype:
            self._dtype = array.dtype
            self.data = np.empty(array.shape, dtype=array.dtype)
            self.diff = np.zeros(array.shape, dtype=array.dtype)
        self.data[...] = array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def count(self) -> int:
        return int(self.data.size)

    def _legacy(self, axis: int) -> int:
        shape = self.shape
        if len(shape) > 4:
            raise CaffeCompatError(f"blob has {len(shape)} axes; the legacy accessors need <= 4")
        return (shape + (1,) * (4 - len(shape)))[axis]  # Caffe's LegacyShape: missing axes count 1

    num = property(lambda self: self._legacy(0))
    channels = property(lambda self: self._legacy(1))
    height = property(lambda self: self._legacy(2))
    width = property(lambda self: self._legacy(3))

    def __repr__(self) -> str:
        return f"HostBlob(shape={self.shape})"


class BlobVec(list):
    """pycaffe's ``layer.blobs``: a list of blobs with ``add_blob(*shape)``."""

    def add_blob(self, *shape, **kwargs) -> HostBlob:
        """A new zero blob of that shape (a keyword argument is pycaffe's RuntimeError)."""
        blob = HostBlob(shape_argument("add_blob", shape, kwargs, "BlobVec.add_blob"))
        self.append(blob)
        return blob


class Layer:
    """pycaffe's ``caffe.Layer``, the base class of Python layers: ``setup``, ``reshape``, ``forward``,
    ``backward`` over lists of :class:`HostBlob`, with ``param_str``, ``phase`` and ``blobs`` set by the
    net (see the module docstring).  Caffe constructs it with the LayerParameter.  ``type`` is
    ``"Python"``, what pycaffe's ``Layer.type`` (``PythonLayer::type()``) gives."""

    type = "Python"

    def __init__(self, param=None, param_str: str | None = None, phase: int = TEST):
        self.layer_param = param if param is not None and not isinstance(param, str) else None
        if param_str is None:
            param_str = param if isinstance(param, str) else (
                self.layer_param.python_param.param_str if self.layer_param is not None else "")
        self.param_str, self.phase, self.blobs = param_str, phase, BlobVec()

    def setup(self, bottom, top):
        pass

    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        raise NotImplementedError(f"{type(self).__name__}.forward is not implemented")

    def backward(self, top, propagate_down, bottom):
        raise NotImplementedError(f"{type(self).__name__}.backward is not implemented")


@contextmanager
def keeping_user_objects(users: dict):
    """While a net is rebuilt for new input shapes (pycaffe's ``net.reshape()``), its Python layers named
    in ``users`` (layer name -> the user object) take that object, already set up, instead of a new one:
    Caffe's ``Net::Reshape`` calls each layer's ``reshape``, never ``setup`` again, so the object keeps its
    state (a data layer's position, what the script set on ``net.layers[i]``)."""
    token = _KEPT_USERS.set(dict(users))
    try:
        yield
    finally:
        _KEPT_USERS.reset(token)


# --------------------------------------------------------------------------------------------- resolution

def register_python_layer(module_name: str, layer_name: str, cls: type) -> None:
    """Make ``python_param { module: module_name layer: layer_name }`` run ``cls`` (a ``caffe.Layer``
    subclass or any class with pycaffe's four methods).  A native port of the same key is refused."""
    from caffe_compat.layers.registry import registered_ports

    key = f"{module_name}.{layer_name}"
    if not inspect.isclass(cls) or not callable(getattr(cls, "forward", None)):
        raise CaffeCompatError(f"register_python_layer({module_name!r}, {layer_name!r}, ...): expected a class with "
                               f"setup/reshape/forward/backward, got {cls!r}")
    if f"Python:{key}" in registered_ports():
        raise CaffeCompatError(f"Python layer '{key}' has a native port; it cannot be replaced by a user class")
    _REGISTERED[key] = cls


def unregister_python_layer(module_name: str, layer_name: str) -> None:
    """Forget a class registered with :func:`register_python_layer`."""
    _REGISTERED.pop(f"{module_name}.{layer_name}", None)


def allow_python_imports(paths) -> list[str]:
    """Opt in: Python layers may import their ``python_param.module`` from these folders (added to
    ``sys.path``).  Code named by model files then runs: logged at WARNING.  Returns the allowed folders."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    for path in paths:
        folder = Path(path).expanduser().resolve()
        if not folder.is_dir():
            raise DataError(f"--python-path {path}: not a folder")
        text = str(folder)
        if text not in _ALLOWED:
            _ALLOWED.append(text)
            if text not in sys.path:
                sys.path.insert(0, text)
                _ADDED_TO_PATH.append(text)
            log.warning("Python layers may import their modules from %s: code named by model files will run", text)
    return list(_ALLOWED)


def disallow_python_imports() -> None:
    """Withdraw :func:`allow_python_imports` (modules already imported stay in ``sys.modules``)."""
    for text in _ADDED_TO_PATH:
        if text in sys.path:
            sys.path.remove(text)
    _ADDED_TO_PATH.clear()
    _ALLOWED.clear()


def allowed_python_paths() -> list[str]:
    return list(_ALLOWED)


def _from_loaded_module(module_name: str, layer_name: str):
    module = sys.modules.get(module_name)
    if module is None:
        return None
    candidate = vars(module).get(layer_name)
    return candidate if inspect.isclass(candidate) and issubclass(candidate, Layer) else None


def _from_allowed_folders(param):
    module_name, layer_name = param.python_param.module, param.python_param.layer
    if not _ALLOWED or not module_name:
        return None
    if module_name not in sys.modules:
        spec = importlib.machinery.PathFinder.find_spec(module_name.split(".")[0], list(_ALLOWED))
        if spec is None:
            return None
        log.info("layer '%s': importing Python layer module '%s' from %s (allowed by --python-path)",
                 param.name, module_name, spec.origin)
        try:
            importlib.import_module(module_name)
        except ImportError as exc:
            raise DataError(f"layer '{param.name}': importing Python layer module '{module_name}' failed: {exc}") \
                from None
    candidate = getattr(sys.modules.get(module_name), layer_name, None)
    return candidate if inspect.isclass(candidate) else None


def user_layer_port(param) -> type | None:
    """The adapter port for a ``Python`` LayerParameter whose class the program registered, already
    imported or (opted in) may import; None otherwise."""
    module_name, layer_name = param.python_param.module, param.python_param.layer
    cls = (_REGISTERED.get(f"{module_name}.{layer_name}") or _from_loaded_module(module_name, layer_name)
           or _from_allowed_folders(param))
    if cls is None:
        return None
    port = _PORTS.get(cls)
    if port is None:
        port = type(f"UserPython_{cls.__name__}", (UserPythonLayer,),
                    {"user_class": cls, "caffe_type": f"Python:{module_name}.{layer_name}", "__module__": __name__})
        _PORTS[cls] = port
    return port


def unresolved_message(param) -> str:
    """The UnknownLayerError text for a Python layer nothing resolves (names the ways to allow it)."""
    module_name, layer_name = param.python_param.module, param.python_param.layer
    key = f"{module_name}.{layer_name}"
    where = f" (not found in the --python-path folders {', '.join(_ALLOWED)})" if _ALLOWED else ""
    return (f"layer '{param.name}': Python layer '{key}' has no native port and no class the program registered "
            f"or imported{where} (caffe-compat never imports modules named by a model file unless allowed). "
            f"Allow it with caffe_compat.register_python_layer({module_name!r}, {layer_name!r}, cls) in your "
            f"program, or let it be imported from a folder with `caffe-compat train --python-path DIR` "
            f"(caffe_compat.allow_python_imports([DIR])), or register a native port with "
            f"@caffe_compat.layers.register_layer('Python:{key}') on a CaffeLayer subclass")


# --------------------------------------------------------------------------------------------- the adapter

_USER_ERRORS: dict[type, type] = {}  # the user's exception class -> PythonLayerError that is also one


def _user_error(message: str, exc: Exception) -> PythonLayerError:
    """The PythonLayerError for ``exc`` raised by the user's code, also an instance of ``exc``'s class.

    Caffe's PythonLayer calls the user's methods through boost.python without catching: the user's own
    exception reaches the script (``except StopIteration`` around ``net.forward()`` for a data layer that
    ran out, ``except KeyError``...).  Ours names the layer and stays a CaffeCompatError/RuntimeError, and
    is also of the user's class (its attributes copied); a class that cannot be combined so (a layout
    conflict) gives a plain PythonLayerError."""
    cls = type(exc)
    try:
        combined = _USER_ERRORS.get(cls)
        if combined is None:
            combined = type(f"PythonLayerError_{cls.__name__}", (PythonLayerError, cls),
                            {"__module__": __name__, "__str__": PythonLayerError.__str__})
            _USER_ERRORS[cls] = combined
        error = combined(message)
        error.__dict__.update(getattr(exc, "__dict__", {}))
        return error
    except Exception:
        return PythonLayerError(message)


class _UserLayerFunction(torch.autograd.Function):
    """Forward and backward of a user layer on host copies (see the module docstring)."""

    @staticmethod
    def forward(ctx, adapter, num_bottoms, *tensors):
        ctx.adapter, ctx.num_bottoms = adapter, num_bottoms
        bottoms, params = tensors[:num_bottoms], tensors[num_bottoms:]
        ctx.devices = [(t.device, t.dtype) for t in bottoms]
        ctx.param_devices = [(p.device, p.dtype) for p in params]
        return adapter._host_forward(bottoms, params)

    @staticmethod
    def backward(ctx, *top_grads):
        adapter = ctx.adapter
        needs = ctx.needs_input_grad[2:]
        bottom_diffs, param_diffs = adapter._host_backward(top_grads, list(needs[:ctx.num_bottoms]))
        grads = []
        for k, (device, dtype) in enumerate(ctx.devices):
            grads.append(torch.from_numpy(np.ascontiguousarray(bottom_diffs[k])).to(device=device, dtype=dtype)
                         if needs[k] else None)
        for k, (device, dtype) in enumerate(ctx.param_devices):
            grads.append(torch.from_numpy(np.ascontiguousarray(param_diffs[k])).to(device=device, dtype=dtype)
                         if needs[ctx.num_bottoms + k] else None)
        return (None, None, *grads)


def _host_dtype(tensor: torch.Tensor):
    return np.float64 if tensor.dtype == torch.float64 else np.float32


class UserPythonLayer(CaffeLayer):
    """A user's ``caffe.Layer`` subclass (``user_class``) as a CaffeLayer port (see the module docstring)."""

    user_class: type | None = None
    bottoms = ANY
    tops = ANY
    couples_batch = True  # a Python layer may compute over the whole batch
    breaks_graph = True  # the user's NumPy code, through an autograd adapter
    param_message = "python_param"

    @classmethod
    def infer(cls, layer, bottoms) -> Shapes:
        """Unknown tops: the user's ``reshape`` decides them, from data."""
        return Shapes([None] * len(layer.top))

    def __init__(self, param, bottom_shapes, phase="test"):
        super().__init__(param, bottom_shapes, phase)
        kept = _KEPT_USERS.get().get(param.name)
        self.user = kept if kept is not None else self._instantiate(param)
        if kept is None:  # Caffe's LayerSetUp sets them once; a reshape leaves what the script set since
            self.user.param_str = param.python_param.param_str
            self.user.phase = TRAIN if phase == "train" else TEST
        if not isinstance(getattr(self.user, "blobs", None), list):
            self.user.blobs = BlobVec()
        elif not isinstance(self.user.blobs, BlobVec):
            self.user.blobs = BlobVec(self.user.blobs)
        self.bottom_blobs = [HostBlob(s) for s in self.bottom_shapes]
        # an in-place top (named as a bottom) is that bottom's blob, as in Caffe's net
        self.top_blobs = [self.bottom_blobs[list(param.bottom).index(name)] if name in param.bottom else HostBlob()
                          for name in param.top]
        if kept is None:
            self._call("setup", self.bottom_blobs, self.top_blobs)
        self._call("reshape", self.bottom_blobs, self.top_blobs)
        self._built_shapes = [blob.shape for blob in self.top_blobs]
        self.user_blobs = nn.ParameterList(
            [nn.Parameter(torch.from_numpy(np.array(b.data, dtype=np.float32, copy=True))) for b in self.user.blobs])

    def _instantiate(self, param):
        cls = self.user_class
        try:
            takes_param = any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
                              for p in inspect.signature(cls).parameters.values())
        except (TypeError, ValueError):
            takes_param = True
        return cls(param) if takes_param else cls()

    def _call(self, method: str, *args):
        try:
            return getattr(self.user, method)(*args)
        except CaffeCompatError:
            raise
        except NotImplementedError:
            raise
        except Exception as exc:  # the user's code failed: say which layer and method
            raise _user_error(f"layer '{self.layer_name}' ({self.caffe_type}): {type(self.user).__name__}."
                              f"{method} raised {type(exc).__name__}: {exc}", exc) from exc

    def caffe_blobs(self) -> list[torch.Tensor]:
        return list(self.user_blobs)

    def output_shapes(self) -> list[tuple[int, ...]]:
        return list(self._built_shapes)

    def fill(self, generator=None) -> None:
        """No filler: the blobs hold what the user's ``setup`` wrote (as in Caffe)."""

    # ---- host side, called by _UserLayerFunction
    def _host_forward(self, bottoms, params) -> tuple:
        for blob, tensor in zip(self.bottom_blobs, bottoms):
            blob._set(tensor.detach().to("cpu").numpy())
        for blob, tensor in zip(self.user.blobs, params):
            blob._set(tensor.detach().to("cpu").numpy())
        self.user.phase = TRAIN if self.mode_phase == "train" else TEST
        loaded = [np.array(blob.data, copy=True) for blob in self.user.blobs]
        self._call("reshape", self.bottom_blobs, self.top_blobs)
        self._call("forward", self.bottom_blobs, self.top_blobs)
        self._keep_blob_writes(params, loaded)
        device = bottoms[0].device if bottoms else (params[0].device if params else self._device_hint())
        dtype = bottoms[0].dtype if bottoms and bottoms[0].is_floating_point() else torch.float32
        return tuple(torch.from_numpy(np.array(blob.data, copy=True)).to(device=device, dtype=dtype)
                     for blob in self.top_blobs)

    def _host_backward(self, top_grads, propagate_down: list[bool]):
        for blob, grad in zip(self.top_blobs, top_grads):
            value = np.zeros(blob.shape, dtype=blob.data.dtype) if grad is None else \
                grad.detach().to("cpu").numpy().astype(blob.data.dtype, copy=False).reshape(blob.shape)
            blob.diff = np.array(value, copy=True)
        tops = {id(blob) for blob in self.top_blobs}
        for blob in self.bottom_blobs:
            if id(blob) not in tops:  # an in-place bottom's diff is its top's
                blob.diff = np.zeros(blob.data.shape, dtype=blob.data.dtype)
        starts = [self._current_diff(blob, param) for blob, param in zip(self.user.blobs, self.user_blobs)]
        for blob, start in zip(self.user.blobs, starts):
            blob.diff = np.array(start, copy=True)
        loaded = [np.array(blob.data, copy=True) for blob in self.user.blobs]
        self._call("backward", self.top_blobs, list(propagate_down), self.bottom_blobs)
        self._keep_blob_writes(list(self.user_blobs), loaded)
        # autograd adds what is returned to the parameter's diff: return the change, so the diff becomes
        # what the user's backward left in self.blobs[i].diff (exactly: start + (new - start) == new)
        return [b.diff for b in self.bottom_blobs], [b.diff - start for b, start in zip(self.user.blobs, starts)]

    @staticmethod
    def _current_diff(blob: HostBlob, param: torch.Tensor) -> np.ndarray:
        """The parameter's diff as Caffe's blob holds it when Backward starts: accumulated since the last
        clear (zeros when there is no gradient yet)."""
        grad = param.grad
        if grad is None or tuple(grad.shape) != blob.data.shape:
            return np.zeros(blob.data.shape, dtype=blob.data.dtype)
        return grad.detach().to("cpu").numpy().astype(blob.data.dtype, copy=True)

    def _keep_blob_writes(self, params, loaded) -> None:
        """What the user's code wrote into ``self.blobs[i].data`` becomes parameter ``i``'s value (Caffe's
        Python layer blobs are the parameter blobs); blobs left unchanged are not touched."""
        for blob, param, before in zip(self.user.blobs, params, loaded):
            if blob.data.shape == tuple(param.shape) and not np.array_equal(blob.data, before):
                with torch.no_grad():
                    param.data.copy_(torch.from_numpy(np.ascontiguousarray(blob.data)).to(param.dtype))

    def _device_hint(self) -> torch.device:
        return getattr(self, "_device", torch.device("cpu"))

    def _apply(self, fn, *args, **kwargs):
        result = super()._apply(fn, *args, **kwargs)
        self._device = fn(torch.zeros(())).device  # where a bottomless layer without blobs puts its tops
        return result

    def forward(self, *bottoms):
        if bottoms and len(bottoms) != len(self.bottom_blobs):
            raise CaffeCompatError(f"layer '{self.layer_name}': {len(bottoms)} bottoms given, built with "
                                   f"{len(self.bottom_blobs)}")
        return _UserLayerFunction.apply(self, len(bottoms), *bottoms, *self.user_blobs)
