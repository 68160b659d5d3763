"""The fast prototxt path builds exactly the message protobuf's text parser builds."""

from __future__ import annotations

import glob

import pytest
from google.protobuf import text_format
from hypothesis import given, settings
from hypothesis import strategies as st

from caffe_compat.io.fast_text import merge_fast
from caffe_compat.proto import caffe_pb2
from tests.conftest import FIXTURES

FILES = sorted(glob.glob(str(FIXTURES / "**" / "*.prototxt"), recursive=True))  # the authors' files included


def _message(path):
    return caffe_pb2.SolverParameter() if path.endswith("solver.prototxt") or "solver" in path.rsplit("/", 1)[-1] \
        else caffe_pb2.NetParameter()


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.rsplit("/", 2)[-2] + "/" + p.rsplit("/", 1)[-1])
def test_fast_equals_protobuf(path):
    text = open(path).read()
    fast, slow = _message(path), _message(path)
    text_format.Merge(text, slow)
    if merge_fast(text, fast):
        assert fast == slow
    else:  # only escapes in strings (the authors' param_str) send a file to the full parser
        assert "\\" in text


def test_plain_subset_takes_the_fast_path():
    net = caffe_pb2.NetParameter()
    assert merge_fast('name: "n" layer { name: "c" type: "Convolution" convolution_param { num_output: 3 '
                      'kernel_size: 3 weight_filler { type: "xavier" std: 1e-2 } } loss_weight: 0.5 }\n', net)
    assert net.layer[0].convolution_param.weight_filler.std == pytest.approx(0.01)


@settings(max_examples=500, deadline=None)
@given(st.lists(st.sampled_from(['layer', '{', '}', ':', 'name', '"x"', 'type', 'top', 'bottom', '1', '-2.5',
                                 'inf', 'true', 'loss_weight', 'convolution_param', 'pad', 'engine', 'CAFFE',
                                 'force_backward', '#c\n', "'y'", 'input_dim', '0x10', '1e3f', '1_0', '"', "'",
                                 '"a#b"', '+3', '-0', '\u0663', '1.5F', 'nan', '-inf', '[1,', 'phase', 'TEST',
                                 'input_shape', 'dim', '"a"#c\n', 'debug_info', 't', '07', '010', '05.5']), max_size=25))
def test_random_token_streams_agree(tokens):
    text = " ".join(tokens)
    slow = caffe_pb2.NetParameter()
    try:
        text_format.Merge(text, slow)
        slow_ok = True
    except text_format.ParseError:
        slow_ok = False
    fast = caffe_pb2.NetParameter()
    if merge_fast(text, fast):
        assert slow_ok and fast == slow


@pytest.mark.parametrize("text, field, message", [
    ('name: "a"\nname: "b"\n', "name", "NetParameter"),
    ('layer {\n  name: "c" type: "Convolution"\n  convolution_param { num_output: 1 }\n'
     '  convolution_param { num_output: 2 }\n}\n', "convolution_param", "LayerParameter"),
    ('layer { name: "p" type: "Pooling" pooling_param { pool: MAX pool: AVE } }', "pool", "PoolingParameter"),
])
def test_singular_field_given_twice_is_an_error_like_caffe(text, field, message):
    """Caffe reads prototxt with TextFormat::Parse, which refuses a non-repeated field given twice
    (Merge would keep the last value silently); the fast path hands such files to protobuf for the
    position."""
    from caffe_compat.errors import ParseError
    from caffe_compat.io import read_net

    assert not merge_fast(text, caffe_pb2.NetParameter())
    with pytest.raises(ParseError, match=rf"<text>:\d+:\d+: '{field}' is given more than once in {message}"):
        read_net(text)
    # repeated fields may repeat, in any order
    net = read_net('layer { name: "a" type: "Concat" bottom: "x" top: "y" bottom: "z" }')
    assert list(net.layer[0].bottom) == ["x", "z"]


@pytest.mark.parametrize("text, expected", [
    ("layer { convolution_param { num_output: 010 } }", 8),
    ("layer { convolution_param { num_output: 0x10 } }", 16),
    ("layer { convolution_param { num_output: 007 } }", 7),
    ("layer { convolution_param { num_output: 08 } }", None),
    ("layer { loss_weight: 05 }", None),
    ("layer { loss_weight: 01.5 }", None),
    ("layer { loss_weight: -010 }", None),
    ("layer { loss_weight: 0.5 }", 0.5),
    ("layer { loss_weight: 0 }", 0.0),
])
def test_leading_zero_numbers_are_octal_like_caffe(text, expected):
    """Caffe's ReadProtoFromTextFile uses protobuf's C++ TextFormat, whose tokenizer reads an integer with a
    leading zero as octal (``num_output: 010`` is 8) and whose ConsumeDouble refuses one for a float ("Expect a
    decimal number, got: 05"); protobuf's Python parser agrees.  The fast path read 010 as 10 and 05 as 5.0."""
    from caffe_compat.errors import ParseError
    from caffe_compat.io import read_net

    if expected is None:
        with pytest.raises(ParseError, match=r"<text>:1:\d+: "):
            read_net(text)
        return
    layer = read_net(text).layer[0]
    value = layer.convolution_param.num_output if "num_output" in text else layer.loss_weight[0]
    assert value == expected


@pytest.mark.parametrize("text, value", [
    ("layer { loss_weight: +1 }", None),
    ("layer { convolution_param { num_output: +3 } }", None),
    ("layer { loss_weight: [1, +2] }", None),
    ("layer { loss_weight: +inf }", None),
    ("layer { loss_weight: 1e+2 }", 100.0),
    ("layer { loss_weight: -1.5E+1 name: 'a+b' } # +1", -15.0),
    ('layer { loss_weight: 2 python_param { param_str: "{\\"k\\": \\"+1\\"}" } name: \'it\\\'s+\' }', 2.0),
])
def test_a_plus_sign_is_refused_like_caffe(text, value):
    """protobuf's C++ tokenizer (Caffe's ReadProtoFromTextFile) makes '+' a symbol that no value may start with:
    ConsumeSignedInteger and ConsumeDouble take only '-' ("Expected integer, got: +"); only an exponent's sign
    is part of a number.  protobuf's Python parser reads +3 as 3, so we accepted what Caffe refuses."""
    from caffe_compat.errors import ParseError
    from caffe_compat.io import read_net

    if value is None:
        with pytest.raises(ParseError, match=r"<text>:1:\d+: '\+' before a value"):
            read_net(text)
    else:
        assert read_net(text).layer[0].loss_weight[0] == value
