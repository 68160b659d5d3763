"""Regenerate ``caffe_pb2.py`` from ``caffe.proto`` (development tool; needs ``grpcio-tools``).

``python -m caffe_compat.proto.regenerate`` rewrites the committed module; ``--check`` only compares.

protoc stamps its own version into the module and, since protobuf 5, makes the module refuse any
runtime older than that stamp.  The committed module must load on protobuf 4, 5 and 6+ runtimes, so
the stamp and the runtime check are removed here (the rest of the generated code only uses the
``descriptor_pool``/``builder`` API that exists since protobuf 3.20).
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO = HERE / "caffe.proto"
MODULE = HERE / "caffe_pb2.py"


def make_portable(source: str) -> str:
    """Strip protoc's version stamp and the runtime-version check from generated code."""
    source = re.sub(r"^# Protobuf Python Version: .*\n", "", source, flags=re.M)
    source = re.sub(r"^from google\.protobuf import runtime_version as _runtime_version\n", "", source, flags=re.M)
    source = re.sub(r"^_runtime_version\.ValidateProtobufRuntimeVersion\(\n(?:.*\n)*?\)\n", "", source, flags=re.M)
    return source


def generate() -> str:
    """Run protoc (from grpcio-tools) on caffe.proto and return the portable module text."""
    try:
        from grpc_tools import protoc
    except ImportError as exc:  # pragma: no cover - dev dependency
        raise SystemExit("regenerating caffe_pb2.py needs grpcio-tools (pip install -e .[dev])") from exc
    with tempfile.TemporaryDirectory() as tmp:
        status = protoc.main(["protoc", f"-I{HERE}", f"--python_out={tmp}", str(PROTO)])
        if status != 0:
            raise SystemExit(f"protoc failed on {PROTO} (exit {status})")
        return make_portable((Path(tmp) / "caffe_pb2.py").read_text())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = generate()
    if "--check" in argv:
        same = MODULE.read_text() == text
        print("caffe_pb2.py is up to date" if same else "caffe_pb2.py differs from caffe.proto: regenerate it")
        return 0 if same else 1
    MODULE.write_text(text)
    print(f"wrote {MODULE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
