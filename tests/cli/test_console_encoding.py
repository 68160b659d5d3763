"""A console whose encoding lacks a character the command prints (Windows' cp1252 pipes, ``PYTHONIOENCODING=
ascii``): the character comes out as a backslash escape, the command succeeds (before: ``UnicodeEncodeError``
and exit 1 after the work was done)."""

from __future__ import annotations

import io
import os
import subprocess
import sys

from caffe_compat.cli.output import tolerate_narrow_encodings

NET = """name: "net"
layer { name: "\u6570\u636e" type: "Input" top: "x" input_param { shape { dim: 1 dim: 3 } } }
layer { name: "relu\u00b1" type: "ReLU" bottom: "x" top: "y" }
"""


def test_a_strict_narrow_stream_escapes_what_it_cannot_encode():
    raw = io.BytesIO()
    stream = io.TextIOWrapper(raw, encoding="cp1252")
    tolerate_narrow_encodings(stream)
    print("Recall \u00b1 0.5, \u0394 \u2264 1e-4", file=stream)
    stream.flush()
    assert raw.getvalue() == b"Recall \xb1 0.5, \\u0394 \\u2264 1e-4\n"


def test_a_stream_with_its_own_error_handler_is_left_alone():
    stream = io.TextIOWrapper(io.BytesIO(), encoding="ascii", errors="replace")
    tolerate_narrow_encodings(stream)
    assert stream.errors == "replace"
    tolerate_narrow_encodings(io.StringIO())  # not a byte-backed wrapper: nothing to do


def test_the_command_line_prints_non_ascii_names_on_an_ascii_console(tmp_path):
    net = tmp_path / "net.prototxt"
    net.write_text(NET, encoding="utf-8")
    env = dict(os.environ, PYTHONIOENCODING="ascii")
    done = subprocess.run([sys.executable, "-m", "caffe_compat.cli", "inspect", str(net)], env=env,
                          capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    assert b"\\u6570\\u636e" in done.stdout and b"relu\\xb1" in done.stdout
    assert b"Traceback" not in done.stderr
