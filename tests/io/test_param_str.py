"""parse_param_str: the one param_str parser, torch-free, importable from the layer ports and the zoo too."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from caffe_compat.errors import FormatError
from caffe_compat.io.param_str import parse_param_str
from tests.conftest import REPO


def test_values_are_read_as_yaml_reads_them():
    parsed = parse_param_str("# a comment\n\n a : 1. \n b: [0.00390625, 1.]\n c: hist \n d: True\n"
                             " e: 'quoted: text'\n f: ~\n g: .inf\n h: {[1]: 2}\n")
    assert parsed == {"a": 1.0, "b": [0.00390625, 1.0], "c": "hist", "d": True, "e": "quoted: text", "f": None,
                      "g": math.inf, "h": "{[1]: 2}"}


def test_a_line_without_colon_names_the_layer_when_given():
    with pytest.raises(FormatError, match=r"^layer 'data': param_str line 'batch_size 3' is not 'key: value'$"):
        parse_param_str("source: a\nbatch_size 3\n", "data")
    with pytest.raises(FormatError, match=r"^param_str line ': 3' is not 'key: value'$"):
        parse_param_str(": 3")


def test_one_parser_everywhere_and_no_torch():
    from caffe_compat.layers import python_ports
    from caffe_compat.zoo import data_layers

    assert python_ports.parse_param_str is parse_param_str and data_layers.parse_param_str is parse_param_str
    code = "import sys, caffe_compat.io.param_str; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
