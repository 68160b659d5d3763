"""Caffe layer ports: one registry (``registry.py``), one module per family of layers."""

from caffe_compat.layers.registry import CaffeLayer, layer_class, register_layer, registered_types

# Family modules register their ports on import.
import importlib as _importlib

for _family in ("vision", "activations", "normalization", "shape", "common", "data", "loss", "metric_learning",
                "python_ports"):
    try:
        _importlib.import_module(f"caffe_compat.layers.{_family}")
    except ModuleNotFoundError as _exc:  # a family not written yet
        if _exc.name != f"caffe_compat.layers.{_family}":
            raise

__all__ = ["CaffeLayer", "layer_class", "register_layer", "registered_types"]
