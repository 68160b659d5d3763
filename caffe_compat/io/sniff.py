"""What a file handed to the wrong reader looks like, for errors that diagnose the mix-up.

A caffemodel given where a prototxt is expected, a net given to ``train`` instead of a solver, or a solver
given where a net is expected: the readers of :mod:`caffe_compat.io.netfiles` call these only on their
error paths, so the files they accept cost nothing more.
"""

from __future__ import annotations

from google.protobuf import message as _pb_message

from caffe_compat.proto import caffe_pb2

#: Leading bytes of binary files that are not Caffe's protobufs, and what they are.
_MAGIC = (
    (b"PK\x03\x04", "a zip archive (a PyTorch .pt checkpoint is one)"),
    (b"\x89PNG", "a PNG image"),
    (b"\xff\xd8\xff", "a JPEG image"),
    (b"\x89HDF", "an HDF5 file"),
    (b"\x93NUMPY", "a NumPy .npy array"),
    (b"\x1f\x8b", "a gzip archive"),
)


def _parsed(data: bytes, message):
    try:
        message.ParseFromString(data)
    except (_pb_message.DecodeError, RuntimeError, ValueError):
        return None
    return message


def describe_binary(data: bytes) -> str:
    """A short phrase naming what binary ``data`` looks like: ``"a caffemodel (binary NetParameter with
    245 layers)"``, ``"a .solverstate ..."``, ``"a .binaryproto blob ..."``, a known file type by its magic
    bytes, else ``"a binary protobuf or other binary data"``."""
    for magic, kind in _MAGIC:
        if data.startswith(magic):
            return kind
    net = _parsed(data, caffe_pb2.NetParameter())
    if net is not None:
        layers = [layer for layer in (*net.layer, *net.layers) if layer.name]
        if layers:
            return f"a caffemodel (binary NetParameter with {len(layers)} layers)"
    state = _parsed(data, caffe_pb2.SolverState())
    if state is not None and state.learned_net:
        return f"a .solverstate (binary SolverState at iteration {state.iter})"
    blob = _parsed(data, caffe_pb2.BlobProto())
    if blob is not None and (blob.data or blob.double_data) and (blob.shape.dim or blob.num):
        dims = list(blob.shape.dim) or [blob.num, blob.channels, blob.height, blob.width]
        return f"a .binaryproto (binary BlobProto of shape {'x'.join(map(str, dims))}, e.g. a mean file)"
    return "a binary protobuf or other binary data"


def not_text_message(source: str, data: bytes, hint: str) -> str:
    """``"<source>: neither a text prototxt nor UTF-8 text: it looks like <what>; <hint>"``."""
    return f"{source}: neither a text prototxt nor UTF-8 text: it looks like {describe_binary(data)}; {hint}"


def _parses_as(text: str, message) -> bool:
    from caffe_compat.errors import ParseError
    from caffe_compat.io.protofiles import parse_text

    try:
        parse_text(text, message)
    except ParseError:
        return False
    return True


def is_net_text(text: str) -> bool:
    """True when prototxt ``text`` is a net: it parses as a NetParameter with layers or inputs."""
    net = caffe_pb2.NetParameter()
    return _parses_as(text, net) and bool(net.layer or net.layers or net.input)


def solver_net_of(text: str) -> str | None:
    """How a solver prototxt ``text`` gives its net (``'train.prototxt'``, or ``inline (net_param)``), or None
    when ``text`` is not a solver naming a net."""
    solver = caffe_pb2.SolverParameter()
    if not _parses_as(text, solver):
        return None
    if solver.net or solver.train_net:
        return f"'{solver.net or solver.train_net}'"
    return "inline (net_param)" if solver.HasField("net_param") or solver.HasField("train_net_param") else None


def minimal_solver(net_path: str) -> str:
    """One line of prototxt: the smallest solver file ``caffe-compat train`` runs, naming ``net_path``."""
    return f'net: "{net_path}" base_lr: 0.01 lr_policy: "fixed" max_iter: 100'
