"""pycaffe's net specification (``caffe.NetSpec``, ``caffe.layers``, ``caffe.params``, ``caffe.to_proto``):
nets written as Python calls, serialised to the NetParameter Caffe's ``net_spec.py`` builds for the same calls.

::

    from caffe_compat.pycaffe import NetSpec, layers as L, params as P
    n = NetSpec()
    n.data, n.label = L.DummyData(shape=[dict(dim=[64, 1, 28, 28]), dict(dim=[64, 1, 1, 1])], ntop=2)
    n.conv1 = L.Convolution(n.data, kernel_size=5, num_output=20, weight_filler=dict(type="xavier"))
    n.pool1 = L.Pooling(n.conv1, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    n.relu1 = L.ReLU(n.pool1, in_place=True)
    n.loss = L.SoftmaxWithLoss(n.relu1, n.label)
    str(n.to_proto())

Reproduced from Caffe's ``net_spec.py`` (1.0):

* ``L.<Type>(*bottoms, **kwargs)`` is a :class:`Function` (one layer); it returns its single :class:`Top`,
  the tuple of its tops for ``ntop=k`` (k > 1), or the Function itself for ``ntop=0``.  Every positional
  argument must be a Top (else a ``TypeError``, "<Type> input <i> is not a Top (type is ...)").
* Naming: :meth:`NetSpec.to_proto` names each assigned top by its attribute; a top never assigned is
  named ``<Type><k>`` with one counter per type, counted in the order the tops are first named (a layer's
  bottoms are serialised before the layer, depth first).  A layer is named after its first top; a
  top-less layer (``ntop=0``) by its NetSpec attribute, else ``<Type><k>``.  ``in_place=True`` makes the
  tops the bottoms (the layer keeps the name of its own first top).  ``name=`` sets the layer name only.
* Keyword routing: a keyword ending in ``param`` (``transform_param``, ``param``, ``python_param``) is a
  LayerParameter field; any other goes into the type's parameter message when that message has the field,
  else into the LayerParameter (``loss_weight``, ``include``, ``propagate_down``, ``name``, ``phase``).  The
  type's message is the port's ``param_message`` fact (:mod:`caffe_compat.layers.registry`; e.g.
  Deconvolution's ``convolution_param``), falling back to Caffe's convention (the ``<Type>Parameter``
  field) for a type without a port.  Caffe's own table has no entry for types whose message is named
  otherwise (Deconvolution, SoftmaxWithLoss), where its keywords fail; here they reach the port's message.
* Values (``assign_proto``): a list fills a repeated field (a list of dicts adds one message per dict, a
  list of messages, e.g. ``param=[caffe_pb2.ParamSpec(lr_mult=1)]``, copies them as Caffe's ``extend`` does),
  a dict fills a nested message, a single value given to a repeated field is a one-element list, anything
  else is assigned.  ``P.<Type>.<ENUM>`` reads the enum value from ``<Type>Parameter``.

Errors: a keyword that is a field of neither message raises :class:`UnknownFieldError` (a FormatError and
an ``AttributeError``, what Caffe raises), naming the layer, its type and the keyword.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from google.protobuf.message import Message

from caffe_compat.errors import CaffeCompatError, FormatError
from caffe_compat.proto import caffe_pb2

__all__ = ["NetSpec", "Top", "Function", "Layers", "Parameters", "layers", "params", "to_proto", "assign_proto",
           "param_message_of", "UnknownFieldError", "NotATopError"]


class UnknownFieldError(FormatError, AttributeError):
    """A NetSpec keyword that is a field of neither the layer's parameter message nor LayerParameter."""


class NotATopError(CaffeCompatError, TypeError):
    """A NetSpec layer input that is not a :class:`Top` (pycaffe raises a TypeError)."""


def param_message_of(type_name: str) -> str | None:
    """The LayerParameter field of ``type_name``'s parameters: the registered port's ``param_message``,
    else Caffe's convention (the field whose message is ``<type_name>Parameter``), else None."""
    from caffe_compat.layers.registry import conventional_param_message, registered_ports

    port = registered_ports().get(type_name)
    if port is not None and port.param_message:
        return port.param_message
    return conventional_param_message(type_name)


def _has_field(message, name: str) -> bool:
    return name in message.DESCRIPTOR.fields_by_name


def assign_proto(proto, name: str, value, where: str = "") -> None:
    """Caffe's ``assign_proto``: set field ``name`` of ``proto`` from a Python value (lists fill repeated
    fields, dicts nested messages, recursively; a single value for a repeated field becomes a list; the items
    of a repeated message field may be messages of its type, copied in)."""
    if not _has_field(proto, name):
        raise UnknownFieldError(f"{where or proto.DESCRIPTOR.name}: {proto.DESCRIPTOR.name} has no field '{name}'")
    field = proto.DESCRIPTOR.fields_by_name[name]
    repeated = hasattr(getattr(proto, name), "extend")  # a repeated field (any protobuf runtime)
    if repeated and not isinstance(value, list):
        value = [value]
    try:
        if isinstance(value, list):
            target = getattr(proto, name)
            if field.message_type is not None:
                for item in value:
                    if isinstance(item, Message):  # Caffe extends the field with the messages themselves
                        target.add().CopyFrom(item)  # another message type: protobuf's TypeError
                        continue
                    if not isinstance(item, dict):
                        raise FormatError(f"{where}: '{name}' holds {field.message_type.name} messages: give "
                                          f"dicts or {field.message_type.name}s, got {item!r}")
                    message = target.add()
                    for key, sub in item.items():
                        assign_proto(message, key, sub, where)
            else:
                target.extend(value)
        elif isinstance(value, dict):
            if field.message_type is None:
                raise FormatError(f"{where}: '{name}' is not a message field; a dict was given")
            message = getattr(proto, name)
            for key, sub in value.items():
                assign_proto(message, key, sub, where)
        else:
            setattr(proto, name, value)
    except (TypeError, ValueError) as exc:
        raise FormatError(f"{where}: bad value for '{name}': {exc}") from None


class Top:
    """One output blob of a :class:`Function` (its ``n``-th top)."""

    def __init__(self, fn: "Function", n: int):
        self.fn, self.n = fn, n

    def to_proto(self) -> caffe_pb2.NetParameter:
        """The NetParameter of every layer this top needs (auto-named)."""
        return to_proto(self)

    def _to_proto(self, layers, names, autonames) -> None:
        self.fn._to_proto(layers, names, autonames)

    def __repr__(self) -> str:
        return f"Top({self.fn.type_name}, {self.n})"


class Function:
    """One layer: its type, bottoms (:class:`Top` s) and keyword parameters (``ntop``, ``in_place`` are
    taken out of them)."""

    def __init__(self, type_name: str, inputs, params: dict):
        self.type_name, self.inputs, self.params = type_name, tuple(inputs), dict(params)
        for index, bottom in enumerate(self.inputs):
            if not isinstance(bottom, Top):
                raise NotATopError(f"{type_name} input {index} is not a Top (type is {type(bottom)})")
        self.ntop = int(self.params.pop("ntop", 1))
        self.in_place = bool(self.params.pop("in_place", False))
        self.tops = tuple(Top(self, n) for n in range(self.ntop))

    def _auto_name(self, autonames: Counter) -> str:
        autonames[self.type_name] += 1
        return f"{self.type_name}{autonames[self.type_name]}"

    def _top_name(self, top: Top, names: dict, autonames: Counter) -> str:
        if top not in names:
            names[top] = top.fn._auto_name(autonames)
        return names[top]

    def _layer_name(self, names: dict, autonames: Counter) -> str:
        if self not in names:
            names[self] = (self._top_name(self.tops[0], names, autonames) if self.ntop > 0
                           else self._auto_name(autonames))
        return names[self]

    def _to_proto(self, layers: OrderedDict, names: dict, autonames: Counter) -> None:
        if self in layers:
            return
        bottoms = []
        for bottom in self.inputs:
            bottom._to_proto(layers, names, autonames)
            bottoms.append(layers[bottom.fn].top[bottom.n])
        layer = caffe_pb2.LayerParameter()
        layer.type = self.type_name
        layer.bottom.extend(bottoms)
        if self.in_place:
            layer.top.extend(layer.bottom)
        else:
            layer.top.extend(self._top_name(top, names, autonames) for top in self.tops)
        layer.name = self._layer_name(names, autonames)
        where = f"layer '{layer.name}' ({self.type_name})"
        message = param_message_of(self.type_name)
        for key, value in self.params.items():
            if key.endswith("param"):
                assign_proto(layer, key, value, where)
            elif message is not None and _has_field(getattr(layer, message), key):
                assign_proto(getattr(layer, message), key, value, where)
            elif _has_field(layer, key):
                assign_proto(layer, key, value, where)
            else:
                fields = f"{message} nor LayerParameter" if message else "LayerParameter"
                raise UnknownFieldError(f"{where}: keyword '{key}' is a field of neither {fields}")
        layers[self] = layer


def to_proto(*tops) -> caffe_pb2.NetParameter:
    """The NetParameter of every layer the given tops need, auto-named (Caffe's ``caffe.to_proto``)."""
    layers: OrderedDict = OrderedDict()
    autonames: Counter = Counter()
    for top in tops:
        top._to_proto(layers, {}, autonames)
    net = caffe_pb2.NetParameter()
    net.layer.extend(layers.values())
    return net


class NetSpec:
    """Tops assigned as attributes (or items); :meth:`to_proto` names them by their attribute."""

    def __init__(self):
        super().__setattr__("tops", OrderedDict())

    def __setattr__(self, name, value):
        self.tops[name] = value

    def __getattr__(self, name):
        try:
            return self.tops[name]
        except KeyError:
            raise AttributeError(f"NetSpec has no top '{name}'") from None

    def __setitem__(self, name, value):
        self.tops[name] = value

    def __getitem__(self, name):
        return self.tops[name]

    def __delattr__(self, name):
        del self.tops[name]

    def keys(self) -> list:
        return list(self.tops)

    def vals(self) -> list:
        return list(self.tops.values())

    def to_proto(self) -> caffe_pb2.NetParameter:
        names = {value: name for name, value in self.tops.items()}
        layers: OrderedDict = OrderedDict()
        autonames: Counter = Counter()
        for value in self.tops.values():
            value._to_proto(layers, names, autonames)
        net = caffe_pb2.NetParameter()
        net.layer.extend(layers.values())
        return net


class Layers:
    """``caffe.layers``: ``L.<Type>(*bottoms, **params)`` makes a layer (see the module docstring)."""

    def __getattr__(self, type_name: str):
        if type_name.startswith("__"):
            raise AttributeError(type_name)

        def layer_fn(*args, **kwargs):
            fn = Function(type_name, args, kwargs)
            if fn.ntop == 0:
                return fn
            if fn.ntop == 1:
                return fn.tops[0]
            return fn.tops

        layer_fn.__name__ = type_name
        return layer_fn


class _EnumScope:
    def __init__(self, message: str):
        self._message = message

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        cls = getattr(caffe_pb2, f"{self._message}Parameter", None)
        if cls is None:
            raise AttributeError(f"caffe_pb2 has no message {self._message}Parameter")
        try:
            return getattr(cls, name)
        except AttributeError:
            raise AttributeError(f"{self._message}Parameter has no constant '{name}'") from None


class Parameters:
    """``caffe.params``: ``P.Pooling.MAX`` is ``caffe_pb2.PoolingParameter.MAX``."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _EnumScope(name)


layers = Layers()
params = Parameters()
