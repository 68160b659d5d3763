"""The dependency direction of the README's architecture section, checked on the source (every
``import`` / ``from ... import`` / ``importlib.import_module("...")`` of every module, lazy ones included).

Each package (or top-level module) of ``caffe_compat`` may import only the parts listed for it: the
layering runs proto → io → losses → layers → net → solver/export/tools → pycaffe → cli, and a part that
is not listed for a package is a violation naming the file and the import."""

from __future__ import annotations

import ast

from tests.conftest import REPO

CORE = {"errors", "proto"}
#: package -> what it may import besides itself (``torch``: whether it may import torch at all).
ALLOWED = {
    "proto": set(),
    "errors": set(),
    "io": {"errors", "proto"},
    "losses": {"errors", "vector_math", "torch"},
    "data": CORE | {"io", "allocator", "torch"},
    "layers": CORE | {"io", "losses", "data", "torch"},
    "net_graph": CORE,
    "net_weights": CORE | {"io", "allocator", "torch"},
    "net_run": CORE | {"net_debug", "torch"},
    "net_debug": CORE | {"io", "torch"},
    "net_log": CORE | {"io", "net_debug", "net_graph"},
    "net": CORE | {"io", "layers", "net_graph", "net_run", "net_debug", "net_log", "net_shapes", "net_weights", "fuse",
            "collector", "torch"},
    "fuse": CORE | {"layers", "fuse_ops", "torch"},
    "fuse_ops": CORE | {"torch"},
    "net_shapes": CORE | {"io", "layers"},
    "net_report": CORE | {"io", "layers", "net_shapes"},
    "evaluate": CORE | {"io", "losses", "torch"},
    "hardware": CORE | {"torch"},
    "allocator": set(),  # the standard library only (the command line applies it before importing anything)
    "collector": set(),
    "vector_math": {"torch"},
    "checkpoint": CORE | {"io", "net", "torch"},
    "convert": CORE | {"io", "net", "checkpoint", "torch"},
    "solver": CORE | {"io", "layers", "net", "net_graph", "net_debug", "hardware", "data", "checkpoint", "torch"},
    "export": CORE | {"io", "layers", "net", "net_graph", "checkpoint", "data", "evaluate", "torch"},
    "tools": CORE | {"io", "net", "net_graph", "evaluate", "data", "solver", "torch"},
    "draw": CORE | {"io"},
    "models": CORE | {"io"},
    "zoo": CORE | {"io"},
    "pycaffe": CORE | {"io", "layers", "net", "net_graph", "net_log", "net_weights", "solver", "draw", "data", "torch"},
    "reproduce": CORE | {"io", "data", "evaluate", "export", "solver", "net", "layers", "zoo", "checkpoint",
                         "hardware", "caffe_compat", "torch"},
}


def imported_modules(tree: ast.AST) -> list[str]:
    """Absolute module names a source file imports (statements and string-literal import_module calls)."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "caffe_compat":
            names.extend(f"caffe_compat.{alias.name}" for alias in node.names)  # from caffe_compat import proto
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
              in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)):
            names.append(str(node.args[0].value))
    return names


def _part(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] in ("torch",):
        return "torch"
    if parts[0] != "caffe_compat" or (len(parts) > 1 and parts[1].startswith("__")):  # the package's __version__
        return None
    return parts[1] if len(parts) > 1 else "caffe_compat"


def test_every_package_imports_only_what_the_architecture_allows():
    offenders = []
    for path in sorted((REPO / "caffe_compat").rglob("*.py")):
        rel = path.relative_to(REPO / "caffe_compat")
        owner = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        if owner not in ALLOWED:  # cli, __init__, __main__: the top, may import anything but converters
            continue
        for name in imported_modules(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            part = _part(name)
            if part is None or part == owner:
                continue
            if part not in ALLOWED[owner]:
                offenders.append(f"caffe_compat/{rel}: imports {name} ({owner} may import {sorted(ALLOWED[owner])})")
    assert not offenders, "\n".join(offenders)


def test_only_the_command_line_imports_the_command_line():
    offenders = [str(path.relative_to(REPO)) for path in sorted((REPO / "caffe_compat").rglob("*.py"))
                 if "cli" not in path.relative_to(REPO / "caffe_compat").parts[:1]
                 and any(n == "caffe_compat.cli" or n.startswith("caffe_compat.cli.")
                         for n in imported_modules(ast.parse(path.read_text(encoding="utf-8"))))]
    assert not offenders, offenders
