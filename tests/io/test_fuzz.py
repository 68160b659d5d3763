"""Fuzzing the readers: mutated prototxt text, solver text, caffemodel and binaryproto bytes raise only
the project's typed errors (or parse), never a crash, a hang or a foreign exception."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from caffe_compat.errors import CaffeCompatError
from caffe_compat.io import read_blob, read_net, read_solver
from caffe_compat.net_shapes import infer_shapes
from tests.conftest import fixture_path

PROTOTXT = fixture_path("layer_zoo/deploy.prototxt").read_text()
# Whole real caffemodels (a cut one would stop every mutation at the first parse): Caffe's V2 layer_zoo
# (38 KB) and the legacy V1 GoogLeNet twin (read through protobuf and the V1 upgrade).
CAFFEMODEL = fixture_path("layer_zoo/weights.caffemodel").read_bytes()
CAFFEMODEL_V1 = fixture_path("nets/googlenet_small_v1/weights_v1.caffemodel").read_bytes()
ZOO_NET = fixture_path("layer_zoo/deploy.prototxt")
# A real Caffe solver with the legacy enum added, so that upgrade_solver runs too.
SOLVER = fixture_path("solvers/nesterov/solver.prototxt").read_text().replace('type: "Nesterov"',
                                                                            "solver_type: NESTEROV")
# compute_image_mean's legacy 4-D blob, and a shape-form blob
BINARYPROTOS = [fixture_path("data/mean.binaryproto").read_bytes(),
                fixture_path("losses/infogain_H.binaryproto").read_bytes()]
# Over the 64 KiB that content sniffing reads: invalid UTF-8 after it reaches the text decoder.
BIG_PREFIX = ("# " + "x" * 200 + "\n") * 330

CHUNKS = ["{", "}", ":", '"', "layer", "dim: -3", "dim: 0", "0", "axis: 9", "axis: -9", "num_axes: 7", "group: 0",
          "group: 3", "pad_w: 1", "\x00", "é", " "]


def _read(data):
    try:
        net = read_net(data)
        infer_shapes(net)
    except CaffeCompatError:
        pass


def _mutate_text(data, text: str) -> str:
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, max(len(text) - 1, 0)))
        op = data.draw(st.sampled_from(["delete", "insert", "replace", "truncate"]))
        chunk = data.draw(st.sampled_from(CHUNKS))
        if op == "delete":
            text = text[:i] + text[i + 1:]
        elif op == "insert":
            text = text[:i] + chunk + text[i:]
        elif op == "replace":
            text = text[:i] + chunk + text[i + len(chunk):]
        else:
            text = text[:i]
    return text


def _mutate_bytes(data, raw: bytes, start: int = 0) -> bytes:
    if len(raw) <= start:
        return raw
    raw = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(start, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    return bytes(raw[:data.draw(st.integers(max(start, 1), len(raw)))])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_prototxt_only_typed_errors(data):
    _read(_mutate_text(data, PROTOTXT).encode("utf-8"))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_big_prototxt_with_mutated_bytes_only_typed_errors(data):
    raw = (BIG_PREFIX + PROTOTXT).encode("utf-8")
    assert len(BIG_PREFIX) > 65536
    _read(_mutate_bytes(data, raw, start=len(BIG_PREFIX)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_caffemodel_bytes_only_typed_errors(data):
    _read(_mutate_bytes(data, data.draw(st.sampled_from([CAFFEMODEL, CAFFEMODEL_V1]))))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.data())
def test_mutated_caffemodel_file_through_read_weights_and_load_net_only_typed_errors(tmp_path, data):
    """The hand-written framing reader (mmap) behind load_net, and load_net itself, on mutated files."""
    import warnings

    from caffe_compat import load_net, read_weights

    path = tmp_path / "w.caffemodel"
    path.write_bytes(_mutate_bytes(data, CAFFEMODEL))
    try:
        read_weights(path)
    except CaffeCompatError:
        pass
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load_net(ZOO_NET, path)
    except CaffeCompatError:
        pass


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_solver_only_typed_errors(data):
    text = _mutate_text(data, SOLVER)
    raw = text.encode("utf-8")
    if data.draw(st.booleans()):
        raw = _mutate_bytes(data, raw)
    try:
        read_solver(raw)
    except CaffeCompatError:
        pass


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_binaryproto_only_typed_errors(data):
    raw = _mutate_bytes(data, data.draw(st.sampled_from(BINARYPROTOS)))
    try:
        read_blob(raw)
    except CaffeCompatError:
        pass


def test_fuzz_seeds_are_valid():
    """The seeds themselves parse: the fuzzers start from real files, not from garbage."""
    assert len(read_net(PROTOTXT.encode()).layer) == 54
    assert read_solver(SOLVER.encode()).type == "Nesterov"
    assert read_blob(BINARYPROTOS[0]).ndim == 4
    assert len(read_net((BIG_PREFIX + PROTOTXT).encode()).layer) == 54
    assert sum(len(layer.blobs) for layer in read_net(CAFFEMODEL).layer) == 21
    assert len(read_net(CAFFEMODEL_V1).layer) > 50


_INT_TYPES = {"int32", "int64", "uint32", "uint64", "sint32", "sint64"}


def _int_fields(message):
    """(message, field descriptor) for every integer field of ``message``'s set ``*_param`` sub-messages."""
    from google.protobuf.descriptor import FieldDescriptor

    names = {getattr(FieldDescriptor, f"TYPE_{t.upper()}"): t for t in _INT_TYPES}
    found = []
    for descriptor, value in message.ListFields():
        if descriptor.name.endswith("_param") and descriptor.type == FieldDescriptor.TYPE_MESSAGE:
            for field in value.DESCRIPTOR.fields:
                if field.type in names:
                    found.append((value, field, names[field.type]))
    return found


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_layer_parameters_only_typed_errors(data):
    """Shape inference with integer parameters set to arbitrary small values (group 0, axis 9, kernel
    larger than the input, a 3-axis input, ...) raises FormatError or infers: nothing else."""
    net = read_net(PROTOTXT.encode())
    for _ in range(data.draw(st.integers(1, 3))):
        layer = net.layer[data.draw(st.integers(0, len(net.layer) - 1))]
        fields = _int_fields(layer)
        if not fields:
            continue
        message, field, kind = data.draw(st.sampled_from(fields))
        low = 0 if kind.startswith("uint") else -12
        if not isinstance(getattr(message, field.name), int):  # a repeated field
            values = data.draw(st.lists(st.integers(low, 12), max_size=3))
            getattr(message, field.name)[:] = values
        else:
            setattr(message, field.name, data.draw(st.integers(low, 12)))
    if data.draw(st.booleans()):  # the input with one axis fewer or more
        dims = net.layer[0].input_param.shape[0].dim
        if data.draw(st.booleans()):
            del dims[-1]
        else:
            dims.append(3)
    try:
        infer_shapes(net)
    except CaffeCompatError:
        pass
