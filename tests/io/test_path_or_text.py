"""is_path / is_existing_file: the one "file name or prototxt text?" decision, and its readers."""

from __future__ import annotations

from pathlib import Path

import pytest

from caffe_compat.errors import ParseError
from caffe_compat.io import read_net, read_weights
from caffe_compat.io.path_or_text import is_existing_file, is_path
from caffe_compat.proto import caffe_pb2

NET = 'name: "n"\nlayer { name: "x" type: "Input" top: "x" input_param { shape { dim: 1 dim: 2 } } }\n'


@pytest.mark.parametrize("value", ["deploy.prototxt", "w.caffemodel", "mean.binaryproto", "some/dir/file",
                                   Path("anything"), "name_only.txt"])
def test_names_are_paths(value):
    assert is_path(value)


@pytest.mark.parametrize("value", [NET, 'layer { name: "x" type: "Input" }', 'name: "n"', "input: 'data'",
                                   b"bytes", caffe_pb2.NetParameter(), None, 3, "x" * 5000])
def test_text_and_other_values_are_not_paths(value):
    assert not is_path(value)


def test_an_existing_file_is_a_path_even_with_a_brace(tmp_path):
    odd = tmp_path / "run{1}.prototxt"
    odd.write_text(NET)
    assert is_path(str(odd)) and is_existing_file(str(odd)) and is_existing_file(odd)
    assert read_net(str(odd)).name == "n"


def test_is_existing_file(tmp_path):
    (tmp_path / "net.prototxt").write_text(NET)
    assert is_existing_file(tmp_path / "net.prototxt")
    assert not is_existing_file(tmp_path / "missing.prototxt")
    assert not is_existing_file(tmp_path)  # a folder
    assert not is_existing_file(NET) and not is_existing_file("a\0b")


def test_readers_follow_the_decision(tmp_path):
    assert read_net(NET).name == "n"
    with pytest.raises(ParseError, match="missing.prototxt: no such file"):
        read_net(str(tmp_path / "missing.prototxt"))
    assert read_weights(NET) == [("x", [])]
