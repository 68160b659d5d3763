"""The one registry mapping a Caffe layer type to its PyTorch port.

A port is a subclass of :class:`CaffeLayer` decorated with ``@register_layer("TypeName")``.
``Python`` layers are looked up by ``"Python:<module>.<layer>"`` (their ``python_param``); a key without a
native port resolves to a class the program registered or imported (:mod:`caffe_compat.layers.python_user`),
so a model file never makes us import a module unless the user opted in (``--python-path``).

Contract of a port (``caffe_compat.net.CaffeNet`` relies on it):

* ``__init__(self, param, bottom_shapes, phase)``: ``param`` is the layer's ``caffe_pb2.LayerParameter``
  (already upgraded to V2), ``bottom_shapes`` the list of input shapes (tuples of ints) known at net
  build time, ``phase`` ``"train"`` or ``"test"``.  Learnable blobs are created here as
  ``nn.Parameter`` and listed, in Caffe's blob order, by :meth:`caffe_blobs` (non-learnable state such
  as BatchNorm statistics are registered buffers but are still Caffe blobs, so they are listed too).
* ``forward(self, *bottoms) -> tuple[Tensor, ...]``: one tensor per top, in top order.
* ``output_shapes(self) -> list[tuple[int, ...]]``: shapes of the tops for the bottom shapes given at
  construction (used for shape checks and by nets that chain layers).
* ``fill(self, generator)``: initialise blobs with Caffe's fillers (see ``layers/fillers.py``).  Blobs are
  created with :meth:`CaffeLayer.new_blob`, which leaves them uninitialised when the net is about to
  copy a caffemodel's values over all of them (:func:`blobs_overwritten`).
* ``is_loss``: True for loss layers (their top 0 gets loss_weight 1 by default, as in Caffe).

The type's facts are class attributes and classmethods of the port, read through the registry by
everything else (no table restates them; see :mod:`caffe_compat.layers.facts`):

* ``bottoms`` / ``tops``: :class:`~caffe_compat.layers.facts.BlobCount`, Caffe's ``ExactNumBottomBlobs``
  etc.; checked here, once, for every port (:meth:`CaffeLayer.check_blob_counts`);
* ``infer(layer, bottom_shapes)``: the type's shape rule, torch-free (tuples in, a
  :class:`~caffe_compat.layers.facts.Shapes` out): ``inspect``'s shape inference calls it without building
  the port, and the default :meth:`CaffeLayer.output_shapes` calls it with the port's own parameter, so a
  rule is written once; ``None`` (the default) means the type has no rule;
* ``couples_batch``: its output depends on the whole batch (pair cosines, a loss over all pairs), so a
  distributed run gathers its bottoms across ranks;
* ``reads_source``: a bottomless layer reading a data set (export stands an ``Input`` in for it), with
  ``input_facts(layer)`` describing its image input;
* ``breaks_graph``: its forward runs code ``torch.compile`` cannot take into a graph (a user's Python
  layer, HDF5Output's file write), so a net holding it is compiled as graphs around it;
* ``sizes_follow_values``: its tops' sizes depend on its bottoms' values (Filter), which a CUDA graph,
  replaying fixed sizes, cannot hold: the solver names it and trains eagerly (``torch.compile`` holds it);
* ``refuses_in_place``: Caffe CHECKs that no top is the bottom (``"<type> Layer does not allow in-place
  computation"``: AbsVal, Reshape, Flatten, Split); checked with the blob counts, by blob name;
* ``in_caffe_1_0``: BVLC Caffe 1.0 registers this type;
* ``refuses_forced_backward``: the bottoms whose diff ``force_backward`` does not ask for (Caffe's
  ``AllowForceBackward``: a ``LossLayer``'s labels, bottom 1);
* ``param_message``: the LayerParameter field holding its parameters (by Caffe's naming convention,
  ``Convolution`` → ``convolution_param``, unless the port names another, e.g. Deconvolution's
  ``convolution_param``); what pycaffe's ``NetSpec`` keyword arguments fill.
* ``share_caffe_blob(index, tensor)``: make blob ``index`` the given tensor (weight sharing through
  ``ParamSpec.name``).  The default finds the attribute holding ``caffe_blobs()[index]`` (a parameter or
  buffer of the layer or of a submodule) and rebinds it; override it only if a port stores blobs in an
  unusual way.

Phase and mode: the phase (``"train"``/``"test"``, the layer's ``phase`` field, else the net's) is fixed
at construction; it is what chose the layer *set* (include/exclude NetStateRules), and ``.train()`` /
``.eval()`` never change that set.  A port whose behaviour depends on the phase (Dropout, BatchNorm
without an explicit ``use_global_stats``, the data layers' crop) follows the torch ``training`` flag
instead, read at call time through :attr:`CaffeLayer.mode_phase` (``"train"`` if ``self.training`` else
``"test"``).  The flag is initialised from the phase (TRAIN -> training, TEST -> eval) when the port is
built and whenever ``phase`` is assigned, so with the default flags a port computes exactly Caffe's
phase; ``.eval()`` then gives Caffe's TEST behaviour and ``.train()`` Caffe's TRAIN behaviour, as PyTorch
users expect.  Settings a prototxt makes explicit keep their value in both modes, as in Caffe
(``batch_norm_param { use_global_stats: ... }``; a layer whose own ``phase`` differs from the net's is
kept in that phase by ``CaffeNet.train``/``eval``, see :mod:`caffe_compat.net`).  New ports must not
read ``self.phase`` for behaviour: use ``self.mode_phase`` (or ``self.training``).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable

import torch
from torch import nn

from caffe_compat.errors import CaffeCompatError, FormatError, UnknownLayerError
from caffe_compat.layers.facts import ANY, BlobCount, InputFacts, Shapes

_REGISTRY: dict[str, type["CaffeLayer"]] = {}
_BLOBS_OVERWRITTEN = contextvars.ContextVar("caffe_compat_blobs_overwritten", default=False)


@contextlib.contextmanager
def blobs_overwritten():
    """Within it, the ports being built allocate their blobs uninitialised (:meth:`CaffeLayer.new_blob`):
    the caller overwrites every one of them before use (a net copying in a caffemodel that holds all of
    the layer's blobs), so filling them first would write every value twice."""
    token = _BLOBS_OVERWRITTEN.set(True)
    try:
        yield
    finally:
        _BLOBS_OVERWRITTEN.reset(token)


class CaffeLayer(nn.Module):
    """Base class of every layer port."""

    #: Caffe's type string, set by :func:`register_layer`.
    caffe_type: str = ""
    #: Loss layers get ``loss_weight`` 1 on their first top unless the prototxt says otherwise.
    is_loss: bool = False
    #: Caffe's bottom / top blob counts (``ExactNumBottomBlobs``, ``MinTopBlobs``, ...).
    bottoms: BlobCount = ANY
    tops: BlobCount = ANY
    #: The output depends on the whole batch (DDP gathers the bottoms across ranks).
    couples_batch: bool = False
    #: A bottomless layer that reads a data set (export replaces it by an Input; see ``input_facts``).
    reads_source: bool = False
    #: ``torch.compile`` cannot take its forward into a graph (see ``net_run.graph_breaking_step``).
    breaks_graph: bool = False
    #: Its tops' sizes depend on its bottoms' values: a CUDA graph cannot hold it (``step_graphs.refusal``).
    sizes_follow_values: bool = False
    #: Caffe refuses a top that is the bottom ("Layer does not allow in-place computation").
    refuses_in_place: bool = False
    #: BVLC Caffe 1.0 registers this type.
    in_caffe_1_0: bool = False
    #: The LayerParameter field of its parameters (None: none; set from the type name by convention).
    param_message: str | None = None
    #: Bottoms ``force_backward`` gives no diff (Caffe's ``AllowForceBackward`` false: a LossLayer's labels).
    refuses_forced_backward: tuple[int, ...] = ()

    @classmethod
    def build(cls, param, bottom_shapes, phase: str = "test", rule: Shapes | None = None) -> "CaffeLayer":
        """``cls(param, bottom_shapes, phase)``, with the type's shape rule for these bottoms already known
        (``rule``: what :meth:`infer` returned for them, e.g. from the net's memory-budget inference), so
        that building a net runs each layer's rule once."""
        port = cls.__new__(cls)
        if rule is not None:
            port.__dict__["_rule"] = _nonnegative(param, rule)
        port.__init__(param, bottom_shapes, phase)
        return port

    def __init__(self, param, bottom_shapes, phase: str = "test"):
        super().__init__()
        shapes = [tuple(map(int, s)) for s in bottom_shapes]
        self.check_blob_counts(param, len(shapes), check_tops=bool(param.top))
        # plain values, set as nn.Module.__setattr__ would (no parameter, buffer or submodule exists yet), and
        # the torch training flag from the phase (see the ``phase`` property): a net builds hundreds of ports
        self.__dict__.update(param=param, layer_name=param.name, bottom_shapes=shapes, _phase=phase,
                             training=phase == "train")

    @property
    def phase(self) -> str:
        """The phase the layer was built for (fixed by the net; it chose the layer set).  Assigning it
        re-initialises the torch ``training`` flag from it (``phase == "train"``), as at construction."""
        return self._phase

    @phase.setter
    def phase(self, value: str) -> None:
        self._phase = value
        self.train(value == "train")

    @property
    def mode_phase(self) -> str:
        """The Caffe phase whose behaviour the port computes now: ``"train"`` if ``self.training`` else
        ``"test"`` (what phase-dependent ports read at call time)."""
        return "train" if self.training else "test"

    @classmethod
    def check_blob_counts(cls, layer, num_bottoms: int, check_tops: bool = True) -> None:
        """FormatError naming the layer and type unless Caffe accepts its bottom and top counts (a port
        built on its own, outside a net, may leave its tops unnamed: ``check_tops=False``)."""
        where = f"layer '{layer.name}' ({layer.type})"
        cls.bottoms.check(num_bottoms, where, "bottom")
        if check_tops:
            cls.tops.check(len(layer.top), where, "top")
        if cls.refuses_in_place and set(layer.top) & set(layer.bottom[:1]):
            raise FormatError(f"{where}: {layer.type} Layer does not allow in-place computation (top "
                              f"'{layer.bottom[0]}' is its bottom)")

    @classmethod
    def infer(cls, layer, bottoms) -> Shapes | None:
        """The type's shape rule: top shapes, learnable blob shapes and multiply-adds for a
        LayerParameter and its bottom shapes (tuples; none is None), or None when the type has no rule."""
        return None

    @classmethod
    def input_facts(cls, layer) -> InputFacts | None:
        """For a ``reads_source`` layer: what it tells about the images it feeds (None otherwise)."""
        return None

    def caffe_blobs(self) -> list[torch.Tensor]:
        """The layer's blobs in Caffe order (what a caffemodel stores for it)."""
        return []

    @staticmethod
    def new_blob(shape, value: float = 0.0) -> torch.Tensor:
        """A new float32 blob of ``shape`` holding ``value`` (what a port creates its blobs with, before
        ``fill``), or left uninitialised within :func:`blobs_overwritten`."""
        if _BLOBS_OVERWRITTEN.get():
            return torch.empty(shape)
        return torch.full(shape, value) if value else torch.zeros(shape)

    def rule(self) -> Shapes | None:
        """The type's shape rule (:meth:`infer`) for the bottom shapes given at construction, computed once
        (its checks raise on the first call) and kept."""
        known = self.__dict__.get("_rule")
        if known is None:
            try:
                known = self.infer(self.param, self.bottom_shapes)
            except CaffeCompatError:
                raise
            except (ArithmeticError, IndexError, TypeError, ValueError) as exc:  # as net_shapes.layer_shapes does
                raise FormatError(f"layer '{self.layer_name}' ({self.caffe_type}): cannot infer its output shapes "
                                  f"from the input shapes {self.bottom_shapes}: {exc}") from None
            known = self.__dict__["_rule"] = _nonnegative(self.param, known)
        return known

    def output_shapes(self) -> list[tuple[int, ...]]:
        """The tops' shapes for the bottom shapes given at construction: the type's shape rule."""
        shapes = self.rule()
        if shapes is None:
            raise NotImplementedError(f"{type(self).__name__} has no shape rule (define infer or output_shapes)")
        return list(shapes.tops)

    def fill(self, generator: torch.Generator | None = None) -> None:
        """Initialise the blobs with the layer's Caffe fillers (no-op for layers without blobs)."""

    def forward_inplace(self, x: torch.Tensor) -> torch.Tensor | None:
        """Overwrite ``x`` with the (single) top and return it, or return None when this layer cannot.

        Called by :class:`~caffe_compat.net.CaffeNet` only without autograd, for a layer that is in-place
        in the prototxt (top = bottom) and a bottom no other blob, input or view shares: it saves an
        allocation and a memory pass, exactly as Caffe's in-place layers do.  Values equal ``forward``'s."""
        return None

    def share_caffe_blob(self, index: int, tensor: torch.Tensor) -> None:
        """Rebind Caffe blob ``index`` to ``tensor`` (another layer's blob: weight sharing)."""
        current = self.caffe_blobs()[index]
        for module in self.modules():
            for store in (module._parameters, module._buffers):
                for name, value in store.items():
                    if value is current:
                        store[name] = tensor
                        return
        raise TypeError(f"{type(self).__name__} (layer '{self.layer_name}'): blob {index} is not a parameter or "
                        f"buffer attribute; override share_caffe_blob")

    def extra_repr(self) -> str:
        return f"name={self.layer_name!r}, type={self.caffe_type!r}"


def _nonnegative(layer, rule: Shapes | None) -> Shapes | None:
    """``rule``, or a FormatError naming the layer when a top or learnable blob of it has a negative dimension
    (Caffe's Blob::Reshape CHECK_GE(shape[i], 0)), before anything is allocated."""
    if rule is not None:
        for what, shapes in (("top", rule.tops), ("learnable blob", rule.params)):
            for shape in shapes:
                if shape is not None and min(shape, default=0) < 0:
                    raise FormatError(f"layer '{layer.name}' ({layer.type}): a {what} would have the negative "
                                      f"shape {tuple(shape)} (Caffe's Blob::Reshape CHECKs every dimension >= 0)")
    return rule


def register_layer(type_name: str) -> Callable[[type[CaffeLayer]], type[CaffeLayer]]:
    """Class decorator: ``@register_layer("Convolution")``.  ``"Python:module.Layer"`` registers a native
    port of a Caffe ``Python`` layer."""

    def decorate(cls: type[CaffeLayer]) -> type[CaffeLayer]:
        if type_name in _REGISTRY and _REGISTRY[type_name] is not cls:
            raise ValueError(f"layer type {type_name!r} is already registered by {_REGISTRY[type_name].__name__}")
        cls.caffe_type = type_name
        if cls.param_message is None:
            cls.param_message = conventional_param_message(type_name)
        _REGISTRY[type_name] = cls
        return cls

    return decorate


def conventional_param_message(type_name: str) -> str | None:
    """Caffe's convention: the LayerParameter field whose message is ``<type>Parameter`` (None if none)."""
    from caffe_compat.proto import caffe_pb2

    for field in caffe_pb2.LayerParameter.DESCRIPTOR.fields:
        if field.message_type is not None and field.message_type.name == f"{type_name}Parameter":
            return field.name
    return None


def registry_key(param) -> str:
    """The registry key of a LayerParameter: its type, or ``Python:<module>.<layer>``."""
    if param.type == "Python":
        return f"Python:{param.python_param.module}.{param.python_param.layer}"
    return param.type


def layer_class(param) -> type[CaffeLayer]:
    """The registered port for ``param``; raises :class:`UnknownLayerError` naming layer and type."""
    _load_builtin_ports()
    key = registry_key(param)
    try:
        return _REGISTRY[key]
    except KeyError:
        if param.type == "Python":  # a class the program registered or imported, or (opted in) may import
            from caffe_compat.layers.python_user import unresolved_message, user_layer_port

            port = user_layer_port(param)
            if port is None:
                raise UnknownLayerError(unresolved_message(param)) from None
            return port
        raise UnknownLayerError(
            f"layer '{param.name}': unknown layer type '{param.type}'. Register a port with "
            f"@caffe_compat.layers.register_layer({key!r}) on a CaffeLayer subclass "
            f"(see caffe_compat/layers/registry.py)") from None


def registered_types() -> list[str]:
    _load_builtin_ports()
    return sorted(_REGISTRY)


def registered_ports() -> dict[str, type[CaffeLayer]]:
    """Registry key -> port class, for the tables derived from the ports' facts."""
    _load_builtin_ports()
    return dict(sorted(_REGISTRY.items()))


def port_for(layer) -> type[CaffeLayer] | None:
    """The registered port of a LayerParameter, or None (no error: for tools that accept unported types)."""
    _load_builtin_ports()
    port = _REGISTRY.get(registry_key(layer))
    if port is None and layer.type == "Python":
        from caffe_compat.layers.python_user import user_layer_port

        port = user_layer_port(layer)
    return port


#: Caffe 1.0 types without a port yet (each leaves this list when its port is registered; a test checks
#: that no type here is registered).  ``Python`` is Caffe 1.0's too: its ports are keyed by module.layer.
CAFFE_1_0_UNPORTED = ("Python",)


def caffe_1_0_types() -> frozenset[str]:
    """The layer types Caffe 1.0 registers (its LayerRegistry): the ports that say so, and the unported."""
    return frozenset({key for key, cls in registered_ports().items() if cls.in_caffe_1_0}
                     | set(CAFFE_1_0_UNPORTED))


def couples_batch_types() -> tuple[str, ...]:
    """Registry keys of the ports whose output couples the batch (gathered across ranks by DDP)."""
    return tuple(key for key, cls in registered_ports().items() if cls.couples_batch)


def _load_builtin_ports() -> None:
    # The family modules register their ports when caffe_compat.layers is imported.
    import caffe_compat.layers  # noqa: F401
