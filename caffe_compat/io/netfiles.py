"""read_net / write_net, read_solver, read_solverstate: Caffe's files as upgraded protobuf messages."""

from __future__ import annotations

import os
from pathlib import Path

from caffe_compat.errors import FormatError, ParseError
from caffe_compat.io.dialects import normalize_binary_dialect, to_binary_dialect
from caffe_compat.io.path_or_text import BINARY_SUFFIXES, is_existing_file, is_path
from caffe_compat.io.protofiles import (decode_prototxt, looks_binary, parse_binary, parse_text, read_bytes,
                                        write_message)
from caffe_compat.io.sniff import describe_binary, is_net_text, minimal_solver, not_text_message, solver_net_of
from caffe_compat.io.upgrade import upgrade_net, upgrade_solver
from caffe_compat.proto import caffe_pb2

def _source_and_data(path_or_text) -> tuple[str, bytes | str]:
    if isinstance(path_or_text, caffe_pb2.NetParameter):
        return "<NetParameter>", path_or_text.SerializeToString()
    if isinstance(path_or_text, bytes):
        return "<bytes>", path_or_text
    if is_path(path_or_text):
        return str(path_or_text), read_bytes(path_or_text)
    return "<text>", str(path_or_text)


def read_net(path_or_text, upgrade: bool = True) -> caffe_pb2.NetParameter:
    """A NetParameter from a prototxt (text) or caffemodel (binary) path, bytes, or prototxt text.

    Text or binary is detected from the content.  Legacy V0/V1 nets and net-level inputs are upgraded
    as Caffe upgrades them (see :mod:`caffe_compat.io.upgrade`) unless ``upgrade=False``.  A solver
    prototxt raises FormatError naming it as a solver and its net.
    """
    source, data = _source_and_data(path_or_text)
    net = caffe_pb2.NetParameter()
    if isinstance(data, bytes) and looks_binary(data):
        parse_binary(data, net, source)
        if upgrade:
            upgrade_net(net, source)
        normalize_binary_dialect(net)
        return net
    _parse_net_text(data if isinstance(data, str) else decode_prototxt(data, source), net, source)
    if upgrade:
        upgrade_net(net, source)
    return net


def _parse_net_text(text: str, net: caffe_pb2.NetParameter, source: str) -> None:
    """parse_text, except that a solver prototxt is named as such (FormatError) instead of its first
    unknown field."""
    try:
        parse_text(text, net, source)
    except ParseError:
        named = solver_net_of(text)
        if named is None:
            raise
        raise FormatError(f"{source}: this is a solver (SolverParameter), not a net; its net is {named}") \
            from None


def check_net_and_weights(prototxt, caffemodel) -> None:
    """Refuse a binary net definition before either file is parsed: a text ``caffemodel`` with it means
    the two were given the wrong way round (FormatError saying so), else ParseError saying what the
    binary file looks like.  Arguments that are not existing files (messages, text) pass unchecked."""
    if not is_existing_file(prototxt):
        return
    net_data = read_bytes(prototxt)
    if not looks_binary(net_data):
        return
    if is_existing_file(caffemodel) and not looks_binary(read_bytes(caffemodel)):
        raise FormatError(f"{prototxt} and {caffemodel} look swapped: {prototxt} is binary (weights) and "
                          f"{caffemodel} is text (a net prototxt); give the net prototxt first, then the "
                          f"caffemodel")
    raise ParseError(not_text_message(str(prototxt), net_data, "the net definition must be a text prototxt"))


def write_net(net: caffe_pb2.NetParameter, path: str | os.PathLike, binary: bool | None = None) -> None:
    """Write a NetParameter atomically: binary for ``.caffemodel`` (or ``binary=True``), else prototxt."""
    if binary is None:
        binary = Path(path).suffix in BINARY_SUFFIXES
    write_message(to_binary_dialect(net) if binary else net, path, binary=binary)


def read_solver(path_or_text, upgrade: bool = True) -> caffe_pb2.SolverParameter:
    """A SolverParameter from a solver prototxt; ``solver_type`` is upgraded to ``type``.  A net prototxt
    raises FormatError showing a minimal solver naming it; a binary file raises ParseError saying what it
    looks like (a caffemodel, a .solverstate, ...)."""
    source, data = _source_and_data(path_or_text)
    if isinstance(data, bytes) and looks_binary(data):
        raise ParseError(not_text_message(source, data, "a solver is a text prototxt naming its net (give a "
                                                        "caffemodel to train with --weights)"))
    text = data if isinstance(data, str) else decode_prototxt(data, source)
    solver = caffe_pb2.SolverParameter()
    try:
        parse_text(text, solver, source)
    except ParseError:
        if not is_net_text(text):
            raise
        net = "NET.prototxt" if source.startswith("<") else source
        raise FormatError(f"{source}: this is a net (NetParameter), not a solver; train takes a solver file "
                          f"naming the net, e.g. a solver.prototxt holding: {minimal_solver(net)}") from None
    if upgrade:
        upgrade_solver(solver, source)
    return solver


def read_solverstate(path: str | os.PathLike) -> caffe_pb2.SolverState:
    """A binary ``.solverstate`` (iteration, learned net path, history blobs, current_step).  A
    ``learned_net`` that is not UTF-8 (protobuf's Python reader then returns bytes, not a path) is a
    ParseError naming the file and the field; a caffemodel (which parses as an empty SolverState) is a
    FormatError saying so."""
    data = read_bytes(path)
    state = parse_binary(data, caffe_pb2.SolverState(), str(path))
    if not state.learned_net and not state.history:  # a caffemodel parses as an empty SolverState
        what = describe_binary(data)
        if what.startswith("a caffemodel"):
            raise FormatError(f"{path}: not a .solverstate: it looks like {what}; resume from the .solverstate "
                              f"written beside it (-snapshot), or start from these weights with -weights")
    if not isinstance(state.learned_net, str):
        raise ParseError(f"{path}: field 'learned_net' is not UTF-8 text ({state.learned_net[:40]!r}...)")
    return state


def write_solverstate(state: caffe_pb2.SolverState, path: str | os.PathLike) -> None:
    write_message(state, path, binary=True)
