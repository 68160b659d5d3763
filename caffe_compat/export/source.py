"""The TEST-phase net an export (or a verification) starts from.

``load_test_net(prototxt, weights=None, checkpoint=None, output_blob=None, image_size=None)``:

* ``weights``: a caffemodel copied in by layer name (Caffe's ``CopyTrainedLayersFrom``);
* ``checkpoint``: a caffe-compat checkpoint (``caffe_compat.checkpoint``).  Its weights are copied into the
  TEST-phase net of ``prototxt`` **by layer name**, exactly like a caffemodel (a checkpoint saved from the
  TRAIN net therefore fits the deploy net, whose data and loss layers it simply lacks).  Without
  ``prototxt`` the checkpoint's own net is rebuilt in the TEST phase;
* neither: the layers keep their Caffe filler values (seed 0), useful only for tests and shape checks.

Both weights and a checkpoint are refused (:class:`TestPhaseNet` checks it, for every export entry point).

**Data layers are never opened** (a training prototxt exports without its training data): when the
TEST-phase net has layers that read a data source (Data, ImageData, HDF5Data, the authors' Python
LabelShufflingLayer, ...: the ports that say ``reads_source``, and any bottomless layer without a port), the net
is first cut at ``output_blob`` on the NetParameter (the layers that blob depends on,
:func:`~caffe_compat.export.cut.cut_indices`, as :func:`~caffe_compat.export.embedder.cut_steps` cuts the
built net), and the data layer the cut reads is replaced by an ``Input`` layer of its top.  Its shape
``(1, C, H, W)`` comes from what the port says of its input (``input_facts``,
:class:`~caffe_compat.layers.facts.InputFacts`; a type without a port: its ``transform_param``): C is 3,
or 1 for gray; H×W is the crop, else the layer's resize (ImageData's ``new_height``×``new_width``), else
``image_size`` (what the preprocessing yields), else the mean file's
size; when none of them tells it a :class:`~caffe_compat.errors.FormatError` names the layer and asks for
the input size.  Loss heads and label inputs are outside the cut, so they are not built either.

The blob to cut at, when none is named (:meth:`TestPhaseNet.default_output`): ``fc_embedding`` (the
embedding layer of the paper nets and ours) when the net has it, else the net's output blob when it has
exactly one (Caffe's net outputs: the blobs no later layer reads, an in-place layer rewriting its bottom
as its own top) and reads no data source: the VehicleID net's ``fc7``, open_nsfw's ``prob``.  Otherwise
a :class:`~caffe_compat.errors.FormatError` asks for the blob and lists the outputs.
"""

from __future__ import annotations

import os
from pathlib import Path

from caffe_compat.errors import CaffeCompatError, FormatError, naming_file
from caffe_compat.export.cut import cut_indices
from caffe_compat.io.path_or_text import is_path
from caffe_compat.io.safe_open import require_regular_file

__all__ = ["EMBEDDING_BLOB", "TestPhaseNet", "check_weight_source", "data_layer_facts", "load_test_net",
           "proto_cut", "reads_source"]

#: The blob an export cuts at by default when the net has it (the paper nets' embedding layer).
EMBEDDING_BLOB = "fc_embedding"


def reads_source(layer) -> bool:
    """A bottomless layer that reads a data set: its port says so (``reads_source``), or it has no port."""
    from caffe_compat.layers.registry import port_for

    if layer.bottom:
        return False
    port = port_for(layer)
    return port is None or port.reads_source


def data_layer_facts(layer):
    """What data layer ``layer`` tells about its image input (its port's ``input_facts``; a type without a
    port: what its ``transform_param`` says)."""
    from caffe_compat.layers.facts import transform_input_facts
    from caffe_compat.layers.registry import port_for

    port = port_for(layer)
    facts = port.input_facts(layer) if port is not None else None
    return facts if facts is not None else transform_input_facts(layer)


def _existing(path, what: str) -> str:
    require_regular_file(path, missing=f"{path}: no such {what} file")  # a FIFO, a device, a folder: named
    return str(path)


def proto_cut(layers, output_blob: str) -> list:
    """The layers (prototxt order) that ``output_blob``'s final value depends on (in-place writers kept)."""
    layers = list(layers)
    return [layers[i] for i in cut_indices([(layer.bottom, layer.top) for layer in layers], output_blob)]


def data_input_shape(layer, image_size=None, where: str = "net") -> tuple[int, int, int, int]:
    """``(1, C, H, W)`` of the Input that stands for data layer ``layer`` (see the module docstring)."""
    facts = data_layer_facts(layer)
    channels = facts.channels
    if image_size is not None and len(image_size) == 3:
        channels, image_size = int(image_size[0]), tuple(image_size[1:])
    if facts.crop:
        return 1, channels, int(facts.crop), int(facts.crop)
    if facts.resize:
        return 1, channels, int(facts.resize[0]), int(facts.resize[1])
    if image_size is not None:
        return 1, channels, int(image_size[0]), int(image_size[1])
    mean_file = facts.mean_file
    if mean_file and Path(mean_file).is_file():
        from caffe_compat.export.metadata import read_mean_file

        mean = read_mean_file(mean_file, f"{where}: data layer '{layer.name}'")
        return 1, int(mean.shape[0]), int(mean.shape[1]), int(mean.shape[2])
    raise FormatError(f"{where}: data layer '{layer.name}' ({layer.type}) takes its image size from "
                      f"{facts.source}, which export does not open; give the input size through the "
                      f"preprocessing (crop_size or resize, e.g. --preprocessing '{{\"resize\": 256, "
                      f"\"crop_size\": 224}}'), or export the deploy prototxt")


def check_weight_source(weights, checkpoint) -> None:
    """CaffeCompatError when both ``weights`` (a caffemodel) and a ``checkpoint`` are given."""
    if weights is not None and checkpoint is not None:
        raise CaffeCompatError("give either weights (a caffemodel) or a checkpoint, not both")


class TestPhaseNet:
    """A prototxt (or checkpoint) read and filtered for the TEST phase, and the caffemodel ``weights`` to
    copy in (not both, see :func:`check_weight_source`); not yet built.  ``path``: the prototxt's file
    name, None when the net was given as text, a message or by the checkpoint."""

    def __init__(self, prototxt=None, checkpoint=None, weights=None):
        from caffe_compat.io import read_net
        from caffe_compat.net_graph import filter_net, make_state

        check_weight_source(weights, checkpoint)
        self.weights = weights
        if prototxt is None and checkpoint is None:
            raise CaffeCompatError("a net prototxt is required (or a checkpoint that carries its net)")
        self.stored = None
        if checkpoint is not None:
            from caffe_compat.checkpoint import checkpoint_prototxt, load_checkpoint

            self.stored = load_checkpoint(_existing(checkpoint, "checkpoint"))
            if prototxt is None:
                prototxt = checkpoint_prototxt(self.stored)
        elif is_path(prototxt) and Path(prototxt).suffix == ".prototxt":
            _existing(prototxt, "prototxt")
        self.path = str(prototxt) if is_path(prototxt) else None
        self.prototxt = str(prototxt) if isinstance(prototxt, os.PathLike) else prototxt
        source = read_net(self.prototxt)
        self.where = self.path or f"net '{source.name}'"
        self.param = filter_net(source, make_state(source, "test"))
        self.sources = [layer for layer in self.param.layer if reads_source(layer)]

    def outputs(self) -> list[str]:
        """The TEST-phase net's output blobs (:func:`~caffe_compat.net_graph.net_outputs`)."""
        from caffe_compat.net_graph import net_outputs

        return net_outputs((layer.bottom, layer.top) for layer in self.param.layer)

    def default_output(self) -> str:
        """The blob an export cuts at when none is named (module docstring)."""
        if any(EMBEDDING_BLOB in layer.top for layer in self.param.layer):
            return EMBEDDING_BLOB
        outputs = self.outputs()
        if len(outputs) == 1 and not self.sources:
            return outputs[0]
        reason = (f"its TEST-phase net reads data layers ({', '.join(repr(l.name) for l in self.sources)})"
                  if self.sources else f"its outputs are {', '.join(repr(o) for o in outputs) or 'none'}")
        raise FormatError(f"{self.where}: no blob named '{EMBEDDING_BLOB}' and {reason}; name the blob to cut at "
                          "(export --output BLOB)")

    def cut(self, output_blob: str) -> list:
        known = list(dict.fromkeys(t for layer in self.param.layer for t in layer.top))
        if output_blob not in known:
            raise FormatError(f"net '{self.param.name}': no blob named '{output_blob}'; available blobs: "
                              f"{', '.join(known)}")
        return proto_cut(self.param.layer, output_blob)

    def data_layer(self, output_blob: str):
        """The data-source layer the cut at ``output_blob`` reads (None when it reads an Input)."""
        sources = {id(layer) for layer in self.sources}
        found = [layer for layer in self.cut(output_blob) if id(layer) in sources]
        return found[0] if found else None

    def _net(self, param, weights, strict: bool):
        """The CaffeNet of ``param``; a setup error (which names the layer) names the file too, as load_net."""
        from caffe_compat.net import CaffeNet

        try:
            return CaffeNet(param, phase="test", weights=weights, strict=strict)
        except CaffeCompatError as exc:
            raise naming_file(exc, self.path, weights) from exc

    def build(self, output_blob: str | None = None, image_size=None, strict: bool = False):
        """The TEST-phase :class:`~caffe_compat.net.CaffeNet` with the weights or the checkpoint copied in
        (deploy cut when it has data layers).  Caffemodel layer names that do not match the (cut) net
        warn, or raise a FormatError with ``strict``."""
        from caffe_compat.proto import caffe_pb2

        weights = None if self.weights is None else _existing(self.weights, "caffemodel")
        if not self.sources:
            net = self._net(self.prototxt, weights, strict)
        else:
            if output_blob is None:
                raise FormatError(f"{self.where}: its TEST-phase net reads data layers "
                                  f"({', '.join(repr(l.name) for l in self.sources)}); name the output blob")
            kept = self.cut(output_blob)
            sources = {id(layer) for layer in self.sources}
            read = {b for layer in kept if id(layer) not in sources for b in layer.bottom}
            param = caffe_pb2.NetParameter()
            param.CopyFrom(self.param)
            del param.layer[:]
            for layer in kept:
                if id(layer) not in sources:
                    param.layer.add().CopyFrom(layer)
                    continue
                tops = [t for t in layer.top if t in read]
                if len(tops) != 1:
                    raise FormatError(f"{self.where}: the cut at '{output_blob}' reads tops {tops} of data layer "
                                      f"'{layer.name}' ({layer.type}); an embedder takes one image input")
                shape = data_input_shape(layer, image_size, self.where)
                stand_in = param.layer.add(name=layer.name, type="Input", top=tops)
                stand_in.input_param.shape.add().dim.extend(shape)
            net = self._net(param, weights, strict)
        if self.stored is not None:
            net.load_caffemodel(self.stored.to_netparameter())
        return net.eval()


def load_test_net(prototxt=None, weights=None, checkpoint=None, output_blob: str | None = None, image_size=None,
                  strict: bool = False):
    """A TEST-phase :class:`~caffe_compat.net.CaffeNet` (see the module docstring)."""
    return TestPhaseNet(prototxt, checkpoint, weights).build(output_blob, image_size, strict=strict)
