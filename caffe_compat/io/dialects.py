"""LayerParameter fields 147/148: the FAPPY authors' fork versus BVLC master.

The authors' fork numbers ``cosine_similarity_batch_param`` 147 and ``fappy_loss_param`` 148; BVLC
master later gave these numbers to ``swish_param`` and ``clip_param``.  Text files name the field, so
they are unambiguous (our proto declares swish/clip under private numbers 9147/9148).  A *binary*
file only carries the number, so after parsing a caffemodel we decide by the layer's **type**:

* type ``Swish`` with field 147 present: the bytes are re-read as ``SwishParameter``;
* type ``Clip`` with field 148 present: re-read as ``ClipParameter``;
* any other type keeps the authors' reading.

Nothing is lost in either direction because protobuf keeps fields of a mismatched wire type as unknown
fields and re-serialises them.  When writing binary, Swish/Clip parameters go back under 147/148 so
BVLC master reads our files.  A Swish/Clip layer from BVLC master never carries the authors' params,
and the authors' layers are never called Swish/Clip, so the type decides without a silent misread.
"""

from __future__ import annotations

from caffe_compat.proto import caffe_pb2

_BY_TYPE = {"Swish": ("cosine_similarity_batch_param", "swish_param"),
            "Clip": ("fappy_loss_param", "clip_param")}


def _layers(net: caffe_pb2.NetParameter):
    return list(net.layer)


def normalize_binary_dialect(net: caffe_pb2.NetParameter) -> None:
    """After reading binary: move 147/148 of Swish/Clip layers to their BVLC-master meaning."""
    for layer in _layers(net):
        fields = _BY_TYPE.get(layer.type)
        if fields and layer.HasField(fields[0]):
            src, dst = fields
            getattr(layer, dst).ParseFromString(getattr(layer, src).SerializeToString())
            layer.ClearField(src)


def to_binary_dialect(net: caffe_pb2.NetParameter) -> caffe_pb2.NetParameter:
    """A copy of ``net`` whose Swish/Clip parameters sit under BVLC master's numbers 147/148."""
    if not any(layer.type in _BY_TYPE and layer.HasField(_BY_TYPE[layer.type][1]) for layer in net.layer):
        return net
    out = caffe_pb2.NetParameter()
    out.CopyFrom(net)
    for layer in out.layer:
        fields = _BY_TYPE.get(layer.type)
        if fields and layer.HasField(fields[1]):
            src, dst = fields
            getattr(layer, src).ParseFromString(getattr(layer, dst).SerializeToString())
            layer.ClearField(dst)
    return out
