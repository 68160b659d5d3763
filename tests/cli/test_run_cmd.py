"""``caffe-compat run SCRIPT.py ARGS`` / ``run -m MODULE ARGS``: an unchanged pycaffe script sees ``import
caffe`` as caffe_compat and ``sys.argv`` as Python sets it; its errors are its own (traceback, exit 1,
``sys.exit`` codes kept); a missing script is a one-line error with exit 2; ``--python-path`` is handed to
``caffe_compat.allow_python_imports`` before the script runs."""

from __future__ import annotations

import sys


import caffe_compat
from caffe_compat.cli import main
from tests.cli.test_cli_errors import assert_usage_error, run_cli

SCRIPT = """import sys
import caffe
import caffe.io
from caffe.proto import caffe_pb2
net_file = sys.argv[1]
net = caffe.Net(net_file, caffe.TEST)
net.params['ip'][0].data[...] = 1.0
net.params['ip'][1].data[...] = 0.5
out = net.forward(data=caffe.io.blobproto_to_array(caffe.io.array_to_blobproto([[1.0, 2.0, 3.0]])))
print("argv", sys.argv[2:], caffe.__name__, type(caffe_pb2.Datum()).__name__, float(out['ip'][0, 0]))
"""

NET = ("layer { name: 'data' type: 'Input' top: 'data' input_param { shape { dim: 1 dim: 3 } } }\n"
       "layer { name: 'ip' type: 'InnerProduct' bottom: 'data' top: 'ip' inner_product_param { num_output: 2 } }\n")


def test_a_pycaffe_script_runs_unchanged_and_sees_its_argv(tmp_path):
    (tmp_path / "script.py").write_text(SCRIPT)
    (tmp_path / "net.prototxt").write_text(NET)
    done = run_cli("run", "script.py", "net.prototxt", "a", "--b", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "argv ['a', '--b'] caffe_compat.pycaffe Datum 6.5"  # 1+2+3 + 0.5


def test_netspec_names_through_the_alias(tmp_path):
    (tmp_path / "spec.py").write_text("import sys\nimport caffe\nfrom caffe import layers as L, params as P\n"
                                      "n = caffe.NetSpec()\nn.data = L.Input(shape=dict(dim=[1, 3]))\n"
                                      "print(sys.argv[1:], str(n.to_proto()).count('Input'))\n")
    done = run_cli("run", "spec.py", "x", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['x'] 1"


def test_script_errors_are_the_scripts_own(tmp_path):
    (tmp_path / "boom.py").write_text("import caffe\n\ndef f():\n    raise ValueError('bad batch')\n\nf()\n")
    done = run_cli("run", "boom.py", cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.startswith("Traceback (most recent call last):\n  File \"boom.py\", line 6, in <module>")
    assert done.stderr.rstrip().endswith("ValueError: bad batch") and "run_cmd.py" not in done.stderr
    (tmp_path / "code.py").write_text("import sys\nsys.exit(7)\n")
    assert run_cli("run", "code.py", cwd=tmp_path).returncode == 7


def test_a_missing_script_is_a_usage_error(tmp_path):
    assert_usage_error(run_cli("run", "nope.py", cwd=tmp_path), "run", "nope.py: no such script file")


def test_module_mode_runs_like_python_dash_m(tmp_path):
    (tmp_path / "tool.py").write_text("import sys, caffe\nprint(sys.argv[1:], caffe.layer_type_list()[0])\n")
    done = run_cli("run", "-m", "tool", "-q", "x", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['-q', 'x'] AbsVal"


def test_python_path_is_allowed_before_the_script_runs(tmp_path, monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(caffe_compat, "allow_python_imports", lambda paths: seen.append(list(paths)), raising=False)
    (tmp_path / "s.py").write_text("import sys\nprint('ran', sys.argv[1:])\n")
    saved_argv = sys.argv[:]
    try:
        assert main(["run", "--python-path", str(tmp_path / "layers"), "--python-path", "more",
                     str(tmp_path / "s.py"), "1"]) == 0
    finally:
        caffe_compat.uninstall_alias()
    assert seen == [[str(tmp_path / "layers"), "more"]]
    assert capsys.readouterr().out == "ran ['1']\n" and sys.argv == saved_argv
