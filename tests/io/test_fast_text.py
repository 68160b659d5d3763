"""The fast prototxt path builds exactly the message protobuf's text parser builds."""

from __future__ import annotations

import glob
import re

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


# protobuf's C++ TextFormat (src/google/protobuf/text_format.cc) over io::Tokenizer (io/tokenizer.cc), what
# Caffe's ReadProtoFromTextFile uses, refuses each of these; protobuf's Python parser (and so the fast path's
# fallback) took every one of them.
@pytest.mark.parametrize("text, message", [
    ("layer { loss_weight: inff }", "Expected double, got: inff"),              # ConsumeDouble: inf, infinity, nan
    ("layer { loss_weight: NaNf }", "Expected double, got: nanf"),
    ("layer { loss_weight: -infinityf }", "Expected double, got: infinityf"),
    ("layer { loss_weight: 1_0 }", "Need space between number and identifier"),  # ConsumeNumber
    ("layer { loss_weight: 1.5ff }", "Need space between number and identifier"),
    ("layer { convolution_param { num_output: 1_000 } }", "Need space between number and identifier"),
    ("layer { convolution_param { num_output: 0b1 } }", "Need space between number and identifier"),
    ("layer { convolution_param { num_output: 0o7 } }", "Need space between number and identifier"),
    ('name: "a\\qb"', "Invalid escape sequence in string literal"),              # ConsumeString
    ('name: "\\N{DIGIT ONE}"', "Invalid escape sequence in string literal"),
    ('name: "a\x00b"', "Unexpected end of string"),                               # a NUL ends the string
    ("name:\xa0'a'", "Interpreting non ascii codepoint 194"),                     # U+00A0 is no blank there
    ("name:\x1c'a'", "Invalid control characters encountered in text"),          # nor is \x1c
    ("\ufeffname: 'a'", "Interpreting non ascii codepoint 239"),                  # a BOM
])
def test_what_the_cpp_tokenizer_refuses_is_refused(text, message):
    from caffe_compat.errors import ParseError
    from caffe_compat.io import read_net

    with pytest.raises(ParseError, match=r"<text>:1:\d+: " + re.escape(message)):
        read_net(text + "\n")


def test_a_cpp_token_error_names_file_line_and_column(tmp_path):
    from caffe_compat.errors import ParseError
    from caffe_compat.io import read_net

    path = tmp_path / "net.prototxt"
    path.write_text('name: "n"\nlayer {\n  loss_weight: 1_0\n}\n')
    with pytest.raises(ParseError, match=re.escape(f"{path}:3:16: Need space between number and identifier")):
        read_net(str(path))


@pytest.mark.parametrize("escape", [False, True])  # True: an escaped string sends the file to the full parser
@pytest.mark.parametrize("value, expected", [
    ("- 1", -1.0), ("-\t2.5", -2.5), ("-\n  # a comment\n  3", -3.0), ("- inf", float("-inf")), ("- .5", -0.5),
])
def test_a_minus_apart_from_its_number_is_a_sign_like_caffe(value, expected, escape):
    """The C++ tokenizer makes '-' a symbol of its own; ConsumeDouble and ConsumeSignedInteger TryConsume it and
    then read the number, so blanks and comments between them are fine.  Both our paths refused '- 1'."""
    from caffe_compat.io import read_net

    name = 'name: "a\\tb" ' if escape else ""
    net = read_net(f"layer {{ {name}loss_weight: {value} }}\nlayer {{ convolution_param {{ axis: - 1 }} }}\n")
    assert net.layer[0].loss_weight[0] == expected
    assert net.layer[1].convolution_param.axis == -1


def test_minus_nan_keeps_its_sign_like_caffe():
    """ConsumeDouble negates the quiet NaN for '-nan', so the stored float has its sign bit set (glog prints
    -nan); the fast path stored a positive NaN (protobuf's Python parser already kept the sign)."""
    import math

    from caffe_compat.io import read_net

    for text in ("layer { loss_weight: -nan loss_weight: - NaN }\n", 'layer { name: "\\t" loss_weight: -nan }\n'):
        assert all(math.copysign(1, v) == -1 for v in read_net(text).layer[0].loss_weight)


@pytest.mark.parametrize("text, field, expected", [
    ("layer { loss_weight: .5 }", "loss_weight", 0.5),
    ("layer { loss_weight: 1. }", "loss_weight", 1.0),
    ("layer { loss_weight: 5f }", "loss_weight", 5.0),
    ("layer { loss_weight: 1.5F }", "loss_weight", 1.5),
    ("layer { loss_weight: 1E+5 }", "loss_weight", 1e5),
    ("layer { loss_weight: -Infinity }", "loss_weight", float("-inf")),
    ("layer { loss_weight: 1e39 }", "loss_weight", float("inf")),                 # SafeDoubleToFloat
    ("layer { convolution_param { axis: -0x1F } }", "axis", -31),
    ('name: "\\x41\\101\\u0041\\U00000041" \'b\'', "name", "AAAAb"),
    ('name: "é" # ünïcode comment', "name", "é"),
    ("name:\x0b'a'", "name", "a"),                                                 # \v is a C++ blank
    ("layer { bottom: [] }", "bottom", []),
])
def test_what_the_cpp_parser_takes_is_taken(text, field, expected):
    from caffe_compat.io import read_net

    net = read_net(text + "\n")
    holder = net if field == "name" else net.layer[0]
    if field == "axis":
        holder = holder.convolution_param
    value = getattr(holder, field)
    if field in ("loss_weight",):
        value = value[0]
    assert (list(value) if field == "bottom" else value) == expected


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(['layer', '{', '}', ':', 'name', '"x"', 'loss_weight', '1', '-', '- ', '2.5',
                                 'inf', 'nanf', 'inff', '1.5ff', '5f', '.5', '1e', '1_0', '0b1', '\xa0', '\x1c',
                                 '"a\x00"', 'convolution_param', 'axis', 'num_output', '0x1F', '#c\n', '1.5.3',
                                 '00.5', 'top', "'y'", '-nan']), max_size=20))
def test_the_fast_path_takes_nothing_the_cpp_tokenizer_refuses(tokens):
    from caffe_compat.io.fast_text import CppTokenError, cpp_text

    text = " ".join(tokens)
    if merge_fast(text, caffe_pb2.NetParameter()):
        try:
            cpp_text(text)
        except CppTokenError as exc:
            raise AssertionError(f"fast path took {text!r}, which C++ refuses: {exc}") from None


@pytest.mark.parametrize("text", [
    "layer { convolution_param { num_output: -0 } }",                       # fast path
    "layer { convolution_param { kernel_size: [1, -0] } }",                 # list: full parser
    "layer [{ name: 'a\\t' }, { convolution_param { pad: - 0 } }]",         # message list, '-' apart
    "layer { convolution_param { weight_filler { std: -0 } stride: -0 } }",  # after a nested message
])
def test_a_sign_on_an_unsigned_field_is_refused_like_caffe(text):
    """ConsumeUnsignedInteger wants an integer token and finds the '-' symbol ("Expected integer, got: -"),
    even for -0, which protobuf's Python parser (and the fast path) read as 0."""
    from caffe_compat.errors import ParseError
    from caffe_compat.io import read_net

    with pytest.raises(ParseError, match=r"<text>:1:\d+: field '(num_output|kernel_size|pad|stride)': Expected "
                                         r"integer, got: -"):
        read_net(text + "\n")
    assert list(read_net("input_dim: [1, -0]\n").input_dim) == [1, 0]  # a signed field takes it
    with pytest.raises(ParseError, match="Value out of range: -4"):  # Python's own refusal, kept
        read_net(text.replace("-0", "-4").replace("- 0", "-4") + "\n")


@pytest.mark.parametrize("value, expected", [("0x1", True), ("01", True), ("00", False), ("0X0", False)])
def test_a_bool_written_as_hex_or_octal_is_taken_like_caffe(value, expected):
    """A bool field takes any integer token up to 1 (ConsumeUnsignedInteger(&value, 1) parses hex and octal);
    protobuf's Python parser takes only the words and 0/1."""
    from caffe_compat.io import read_net

    assert read_net(f"force_backward: {value}\n").force_backward is expected
    assert list(read_net(f"layer {{ propagate_down: [{value}, 1] }}\n").layer[0].propagate_down) == [expected, True]


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.rsplit("/", 2)[-2] + "/" + p.rsplit("/", 1)[-1])
def test_every_reference_file_passes_the_cpp_token_rules_unchanged(path):
    """Files Caffe reads pass cpp_text untouched (it runs on every file the fast path hands over: one escape
    anywhere is enough).  Its exponent check refused the adam solver's ``delta: 1e-08``."""
    from caffe_compat.io.fast_text import cpp_text

    text = open(path).read()
    assert cpp_text(text, _message(path).DESCRIPTOR) == text
