"""The one registry mapping a Caffe layer type to its PyTorch port.

A port is a subclass of :class:`CaffeLayer` decorated with ``@register_layer("TypeName")``.
``Python`` layers are looked up by ``"Python:<module>.<layer>"`` (their ``python_param``), so a model
file can never make us import a module: only ports registered here run.

Contract of a port (``caffe_compat.net.CaffeNet`` relies on it):

* ``__init__(self, param, bottom_shapes, phase)``: ``param`` is the layer's ``caffe_pb2.LayerParameter``
  (already upgraded to V2), ``bottom_shapes`` the list of input shapes (tuples of ints) known at net
  build time, ``phase`` ``"train"`` or ``"test"``.  Learnable blobs are created here as
  ``nn.Parameter`` and listed, in Caffe's blob order, by :meth:`caffe_blobs` (non-learnable state such
  as BatchNorm statistics are registered buffers but are still Caffe blobs, so they are listed too).
* ``forward(self, *bottoms) -> tuple[Tensor, ...]``: one tensor per top, in top order.
* ``output_shapes(self) -> list[tuple[int, ...]]``: shapes of the tops for the bottom shapes given at
  construction (used for shape checks and by nets that chain layers).
* ``fill(self, generator)``: initialise blobs with Caffe's fillers (see ``layers/fillers.py``).
* ``is_loss``: True for loss layers (their top 0 gets loss_weight 1 by default, as in Caffe).
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

from typing import Callable

import torch
from torch import nn

from caffe_compat.errors import UnknownLayerError

_REGISTRY: dict[str, type["CaffeLayer"]] = {}


class CaffeLayer(nn.Module):
    """Base class of every layer port."""

    #: Caffe's type string, set by :func:`register_layer`.
    caffe_type: str = ""
    #: Loss layers get ``loss_weight`` 1 on their first top unless the prototxt says otherwise.
    is_loss: bool = False

    def __init__(self, param, bottom_shapes, phase: str = "test"):
        super().__init__()
        self.param = param
        self.layer_name = param.name
        self.bottom_shapes = [tuple(int(d) for d in s) for s in bottom_shapes]
        self.phase = phase  # also sets the torch training flag (see the ``phase`` property)

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

    def caffe_blobs(self) -> list[torch.Tensor]:
        """The layer's blobs in Caffe order (what a caffemodel stores for it)."""
        return []

    def output_shapes(self) -> list[tuple[int, ...]]:
        raise NotImplementedError(f"{type(self).__name__} does not report its output shapes")

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


def register_layer(type_name: str) -> Callable[[type[CaffeLayer]], type[CaffeLayer]]:
    """Class decorator: ``@register_layer("Convolution")``.  ``"Python:module.Layer"`` registers a native
    port of a Caffe ``Python`` layer."""

    def decorate(cls: type[CaffeLayer]) -> type[CaffeLayer]:
        if type_name in _REGISTRY and _REGISTRY[type_name] is not cls:
            raise ValueError(f"layer type {type_name!r} is already registered by {_REGISTRY[type_name].__name__}")
        cls.caffe_type = type_name
        _REGISTRY[type_name] = cls
        return cls

    return decorate


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
        if param.type == "Python":
            what = (f"Python layer '{param.python_param.module}.{param.python_param.layer}' has no native port "
                    f"(caffe-compat never imports modules named by a model file)")
        else:
            what = f"unknown layer type '{param.type}'"
        raise UnknownLayerError(
            f"layer '{param.name}': {what}. Register a port with "
            f"@caffe_compat.layers.register_layer({key!r}) on a CaffeLayer subclass "
            f"(see caffe_compat/layers/registry.py)") from None


def registered_types() -> list[str]:
    _load_builtin_ports()
    return sorted(_REGISTRY)


def _load_builtin_ports() -> None:
    # Importing the family modules registers their ports (done lazily to keep imports cheap).
    import caffe_compat.layers  # noqa: F401
