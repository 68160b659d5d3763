"""Caffe layer ports: one registry (``registry.py``), one module per family of layers.

Importing this package imports every family module (explicitly: a family that fails to import fails
here, not later as an unknown layer type), and each registers its ports."""

from caffe_compat.layers.registry import CaffeLayer, layer_class, register_layer, registered_types

from caffe_compat.layers import (  # noqa: E402,F401  (imported for their registrations)
    activations, common, data, datasets, hdf5_output, loss, metric_learning, normalization, pooling, python_ports, recurrent,
    shape, vision, window_data)

__all__ = ["CaffeLayer", "layer_class", "register_layer", "registered_types"]
