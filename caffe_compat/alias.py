"""``import caffe`` for unchanged pycaffe scripts: a meta-path finder that resolves ``caffe`` and
``caffe.X`` to caffe_compat's modules, switched on by :func:`install_alias` (``caffe_compat.install_alias()``,
one line for notebooks and test runners; ``caffe-compat run SCRIPT.py`` calls it).  No torch is imported
here; the modules load when the script imports them.

The map (pycaffe's layout, BVLC ``python/caffe/``):

=========================  =================================================
``caffe``, ``caffe.pycaffe``  :mod:`caffe_compat.pycaffe` (``Net``, the solvers, ``io``, ``proto``, ...)
``caffe.proto``            :mod:`caffe_compat.proto` (``caffe.proto.caffe_pb2``)
``caffe.io``               :mod:`caffe_compat.pycaffe.io`
``caffe.draw``             :mod:`caffe_compat.draw`
``caffe.X`` (any other)    ``caffe_compat.pycaffe.X`` (``net_spec``, ``coord_map``, ``classifier``,
                           ``detector``, ``_caffe``), else ModuleNotFoundError naming both
=========================  =================================================

An alias name is the very module object of its target (``caffe.Net is caffe_compat.pycaffe.Net``), so
nothing is loaded twice.  Never installed by default: a real pycaffe on ``sys.path`` stays importable
until the alias is asked for, and :func:`install_alias` refuses (CaffeCompatError) when a real ``caffe``
is already imported.  :func:`uninstall_alias` removes the finder and the ``caffe`` entries it made.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

from caffe_compat.errors import CaffeCompatError

__all__ = ["ALIASES", "alias_target", "install_alias", "uninstall_alias", "alias_installed"]

#: alias name -> caffe_compat module; other ``caffe.X`` map to ``caffe_compat.pycaffe.X``
ALIASES = {
    "caffe": "caffe_compat.pycaffe",
    "caffe.pycaffe": "caffe_compat.pycaffe",
    "caffe.proto": "caffe_compat.proto",
    "caffe.proto.caffe_pb2": "caffe_compat.proto.caffe_pb2",
    "caffe.io": "caffe_compat.pycaffe.io",
    "caffe.draw": "caffe_compat.draw",
}


def alias_target(name: str) -> str | None:
    """The caffe_compat module an alias name stands for (None: not a ``caffe`` name)."""
    if name in ALIASES:
        return ALIASES[name]
    if name.startswith("caffe."):
        return "caffe_compat.pycaffe." + name[len("caffe."):]
    return None


class _ExistingModuleLoader(importlib.abc.Loader):
    """Hands the import system the already-imported target module (attributes are left as they are)."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return importlib.import_module(self.target)

    def exec_module(self, module) -> None:
        pass


class CaffeAliasFinder(importlib.abc.MetaPathFinder):
    """The meta-path finder of the alias (see the module docstring)."""

    def find_spec(self, fullname, path=None, target=None):
        destination = alias_target(fullname)
        if destination is None:
            return None
        if importlib.util.find_spec(destination) is None:
            raise ModuleNotFoundError(f"No module named {fullname!r} (caffe_compat's alias maps it to "
                                      f"{destination!r}, which does not exist)", name=fullname)
        return importlib.util.spec_from_loader(fullname, _ExistingModuleLoader(destination),
                                               is_package=hasattr(importlib.import_module(destination), "__path__"))


_FINDER = CaffeAliasFinder()


def alias_installed() -> bool:
    return _FINDER in sys.meta_path


def install_alias() -> None:
    """Make ``import caffe`` (and ``caffe.X``) resolve to caffe_compat (idempotent).  Refuses when a real
    ``caffe`` module is already imported: two pycaffes in one process would mix their objects."""
    current = sys.modules.get("caffe")
    if current is not None and getattr(current, "__name__", None) != "caffe_compat.pycaffe":
        where = getattr(current, "__file__", None) or repr(current)
        raise CaffeCompatError(f"install_alias: a real 'caffe' module is already imported (from {where}); "
                               f"caffe_compat will not shadow it. Call caffe_compat.install_alias() before "
                               f"anything imports caffe, or run the script with 'caffe-compat run'")
    if not alias_installed():
        sys.meta_path.insert(0, _FINDER)


def uninstall_alias() -> None:
    """Remove the finder and the ``caffe``/``caffe.*`` entries of ``sys.modules`` that are caffe_compat's."""
    while _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    for name in [n for n in sys.modules if n == "caffe" or n.startswith("caffe.")]:
        if getattr(sys.modules[name], "__name__", "").startswith("caffe_compat"):
            del sys.modules[name]
