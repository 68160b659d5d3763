"""The library never imports the top-level ``converters`` package (which imports the library): the
conversions live in ``caffe_compat.convert`` and ``converters`` is a thin entry point over them."""

from __future__ import annotations

import ast

from tests.conftest import REPO
from tests.test_layering import imported_modules


def test_caffe_compat_never_imports_converters():
    offenders = []
    for path in sorted((REPO / "caffe_compat").rglob("*.py")):
        for name in imported_modules(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if name == "converters" or name.startswith("converters."):
                offenders.append(f"{path.relative_to(REPO)}: imports {name}")
    assert not offenders, offenders


def test_converters_are_the_library_functions():
    import converters
    from caffe_compat import convert

    assert converters.convert_caffe_to_torch is convert.convert_caffe_to_torch
    assert converters.convert_torch_to_caffe is convert.convert_torch_to_caffe
