"""The ``caffe`` binary's flags are gflags defined once for every command (tools/caffe.cpp: gpu, solver,
model, phase, level, stage, snapshot, weights, iterations, sigint_effect, sighup_effect): a command parses
and ignores the ones it does not read (``caffe time -solver s.prototxt ...``, ``caffe test ... -phase TRAIN``,
``caffe device_query -model m``), where an unknown flag would abort.  Our train, test, time and
device_query accept them all; an int32 flag still needs an integer."""

from __future__ import annotations

import pytest

from caffe_compat.cli import build_parser, main
from caffe_compat.cli.caffe_flags import CAFFE_FLAGS
from tests.conftest import fixture_path

ZOO = str(fixture_path("layer_zoo/deploy.prototxt"))
VALUES = {"phase": "TEST", "level": "0", "iterations": "1", "gpu": "", "sigint_effect": "stop", "sighup_effect": "snapshot"}


def _every_flag() -> list[str]:
    return [f"-{name}={VALUES.get(name, 'x')}" for name in CAFFE_FLAGS]


@pytest.mark.parametrize("command", ["train", "test", "time", "device_query"])
def test_every_caffe_flag_parses_for_every_caffe_command(command):
    args = build_parser().parse_args([command, *_every_flag()])
    assert args.command == command


def test_unread_flags_change_nothing(capsys):
    assert main(["device_query", "-model", ZOO, "-iterations", "3", "-solver", "s.prototxt", "-phase", "TEST"]) == 0
    assert capsys.readouterr().out == "Querying GPUs \n"
    assert main(["time", "-model", ZOO, "-iterations", "1", "-solver", "s.prototxt", "-snapshot", "x",
                 "-sigint_effect", "none", "-sighup_effect", "stop"]) == 0
    assert "Average Forward pass" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # gflags: "illegal value 'abc' specified for int32 flag 'iterations'"
        build_parser().parse_args(["device_query", "-iterations", "abc"])


@pytest.mark.parametrize("command, flag, value", [
    ("time", "-iterations", str(2 ** 63)),  # looped for ever: an iteration count no int32 holds
    ("test", "-iterations", str(2 ** 31)),
    ("device_query", "-iterations", str(2 ** 31)),  # accepted and unread, still an int32 as gflags checks
    ("device_query", "-level", str(-2 ** 31 - 1)),  # (a -level read is the library's to refuse, naming NetState)
])
def test_int32_flags_refuse_values_beyond_int32(capsys, command, flag, value):
    """gflags refuses an int32 flag's value outside -2**31 .. 2**31 - 1; so does our parser for -iterations and
    the flags a command accepts unread (exit 2 with one error line, before any file is read)."""
    with pytest.raises(SystemExit) as raised:
        build_parser().parse_args([command, "-model", ZOO, flag, value] if command != "train"
                                  else [command, "s.prototxt", flag, value])
    assert raised.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (f"caffe-compat {command if command != 'device_query' else 'device-query'}: error: "
                                    f"argument --{flag[1:]}/{flag}: '{value}' is out of range for an int32 flag "
                                    f"(-2147483648 to 2147483647)")
    assert "Traceback" not in err


def test_an_int32_flag_at_its_bounds_parses():
    args = build_parser().parse_args(["test", "-model", ZOO, "-iterations", str(2 ** 31 - 1), "-level", str(-2 ** 31)])
    assert (args.iterations, args.level) == (2 ** 31 - 1, -2 ** 31)
