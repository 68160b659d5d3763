"""``export_onnx``: a Caffe embedder (TEST-phase net cut at one blob) as a self-describing ONNX file.

Graph: input ``<input blob>`` float32 ``(N, C, H, W)`` -> the kept layers -> output ``<output blob>``
float32 ``(N, D)``, optionally row-wise L2-normalised (:class:`~caffe_compat.export.embedder.Embedder`).
``batch="dynamic"`` names the batch axis ``"batch"``; an int fixes it.  The preprocessing and the
export settings go into ``metadata_props`` (:mod:`caffe_compat.export.metadata`).

Exporter: PyTorch's TorchScript-based ``torch.onnx.export(..., dynamo=False)``, tracing the layer ports
themselves, so the ONNX graph computes what the ports compute with no second implementation to keep in
step.  It needs no onnxscript, and the ports are written to trace into plain ONNX ops.  In particular
Caffe pooling traces to ``Pad`` (explicit, including the extra right/bottom overhang of Caffe's ceil
rounding; ``-inf`` for MAX) + ``MaxPool``/``AveragePool`` with ``pads = 0`` and ``ceil_mode = 0`` +
``Slice`` (+ a constant ``Mul`` by ``k_h·k_w / divisor`` for AVE windows that Caffe clips), so no
ONNX Runtime ``ceil_mode``/``count_include_pad`` path is ever used.  The exporter's constant
subgraphs (pad lists) are then folded into initializers (:mod:`caffe_compat.export.fold`) so every
``Pad`` has constant pads and ONNX shape inference gives Caffe's shapes.

``compile=True`` (the CLI's ``--compile``): the graph is captured instead by ``torch.export`` from the
compilable net (what ``torch.compile(net, fullgraph=True)`` compiles: one graph, no graph break, see
:func:`caffe_compat.net.traces_whole`) and translated by PyTorch's dynamo exporter,
``torch.onnx.export(..., dynamo=True)``.  It needs the ``onnxscript`` package (``pip install
'caffe-compat[compile]'``; without it a :class:`~caffe_compat.errors.CaffeCompatError` says so) and opset
18..20 (the exporter builds opset 18 and cannot convert Caffe's pooling pads down; the default opset is
then 18).  A dynamic batch is a ``torch.export.Dim("batch")`` of the input's first axis; everything else
(the cut, ``normalize``, ``fuse``, ``fp16``, fixed batch, the metadata, the constant folding, the checker,
the atomic write) is the same, the ports trace into the same export forms (the exporter sets
``torch.onnx.is_in_onnx_export()`` while it captures), and the metadata is identical to the traced
export's at the same opset.  A cut with a layer that cannot be one graph (a user Python layer: its NumPy
code runs outside torch) raises a FormatError naming it, never a silent fallback to the tracer.

A layer that cannot be exported raises :class:`~caffe_compat.errors.FormatError` naming the layer and its
type (each kept layer is exported alone to find it; with ``compile``, the first line of the capture
failure).  The file is written atomically (temp file + rename) and passes ``onnx.checker`` first: an
error leaves nothing behind.

Defaults: ``output_blob=None`` (``fc_embedding`` when the net has it, else its only output blob:
:meth:`~caffe_compat.export.source.TestPhaseNet.default_output`), ``normalize=False``, ``opset=None``
(17; 18 with ``compile``),
``fp16=False``, ``compile=False``, ``batch="dynamic"``, ``preprocessing=None``: read from the TEST-phase
data layer the cut reads (its ``transform_param``: crop_size, mean_value, mean_file, scale; mirror off),
else assumed ("resize to the input size, no crop, no mean") and recorded as such in the metadata
(``preprocessing_source``, ``preprocessing_assumed``) with a
:class:`~caffe_compat.export.notices.PreprocessingAssumedWarning`.

A training prototxt exports without its training data: data layers are never opened, the data layer the
cut reads is replaced by an Input layer (:mod:`caffe_compat.export.source`), whose size comes from the
layer's crop_size or from the preprocessing.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from caffe_compat.errors import CaffeCompatError, FormatError
from caffe_compat.export.embedder import Embedder
from caffe_compat.export.fold import fold_constants
from caffe_compat.export.metadata import (FORMAT, assumed_preprocessing, normalize_preprocessing,
                                          preprocessing_from_data_layer, write_metadata)
from caffe_compat.export.notices import PreprocessingAssumedWarning
from caffe_compat.export.source import TestPhaseNet

__all__ = ["export_onnx", "build_embedder", "example_input", "default_opset", "require_onnxscript",
           "whole_graph_blocker"]

MIN_OPSET, MAX_OPSET = 11, 20
DEFAULT_OPSET = 17
#: the dynamo exporter's lowest opset (it builds opset 18; ONNX's converter has no Pad adapter below it)
COMPILE_MIN_OPSET = 18


def default_opset(compile: bool = False) -> int:
    """The opset an export writes when none is given: 17, or 18 with ``compile``."""
    return COMPILE_MIN_OPSET if compile else DEFAULT_OPSET


def require_onnxscript() -> None:
    """CaffeCompatError (one line, what to install) when ``onnxscript``, which the dynamo exporter of
    ``compile=True`` needs, cannot be imported."""
    try:
        import onnxscript  # noqa: F401
    except ImportError as exc:
        raise CaffeCompatError(f"--compile (torch.export -> ONNX) needs the onnxscript package, which cannot be "
                               f"imported ({type(exc).__name__}); install it: pip install 'caffe-compat[compile]' "
                               f"(or pip install onnxscript)") from None


def whole_graph_blocker(embedder):
    """The first kept step of ``embedder`` that keeps its cut from being one graph (``traces_whole`` false
    for it: a user Python layer), or None when the cut traces whole.  Only the cut counts: a Python loss
    head outside it does not reach the graph."""
    from caffe_compat.net import graph_breaking_step

    return graph_breaking_step(embedder.steps, embedder.net.layers)


def example_input(shape, batch: int, seed: int = 0) -> torch.Tensor:
    """``RandomState(seed).randn(batch, C, H, W) * 50`` as float32 (pixel-scale values, as the fixtures)."""
    values = np.random.RandomState(seed).randn(batch, *shape[1:]) * 50
    return torch.from_numpy(values.astype(np.float32))


def _batch_size(batch) -> int | None:
    """None for a dynamic batch axis, else the fixed size."""
    if batch in ("dynamic", None):
        return None
    try:
        size = int(batch)
    except (TypeError, ValueError):
        raise CaffeCompatError(f"batch must be 'dynamic' or a positive int, got {batch!r}") from None
    if size < 1 or str(size) != str(batch).strip():
        raise CaffeCompatError(f"batch must be 'dynamic' or a positive int, got {batch!r}")
    return size


def build_embedder(prototxt=None, weights=None, checkpoint=None, output_blob: str | None = None,
                   normalize: bool = False, fp16: bool = False, image_size=None, test_net=None,
                   strict: bool = False, fuse: bool = False) -> Embedder:
    """The :class:`Embedder` an export traces (float32 reference when ``fp16`` is False).  ``image_size``
    (``(H, W)`` or ``(C, H, W)``) sizes the Input that stands for a data layer the prototxt reads.
    ``strict``: caffemodel layer names that do not match the net raise a FormatError (else a
    :class:`~caffe_compat.errors.WeightsMismatchWarning`).  ``test_net``: the
    :class:`~caffe_compat.export.source.TestPhaseNet` already read (it carries the prototxt, weights and
    checkpoint; the three arguments are then unused).  An unknown ``output_blob`` raises a FormatError
    listing the blobs (:func:`~caffe_compat.export.embedder.cut_steps`).  ``fuse``: the net folded for
    inference first (:mod:`caffe_compat.fuse`, contiguous layout; a blob folded away cannot be the output).
    ``output_blob`` None: ``fc_embedding``, else the net's only output (:meth:`TestPhaseNet.default_output`)."""
    test_net = test_net or TestPhaseNet(prototxt, checkpoint, weights)
    output_blob = test_net.default_output() if output_blob is None else output_blob
    net = test_net.build(output_blob, image_size, strict=strict)
    if fuse:
        net = net.fuse_for_inference(keep=(output_blob,) if output_blob in net.blob_shapes else (),
                                     memory_format=torch.contiguous_format)
    if fp16:
        net = net.half()
    return Embedder(net, output_blob, normalize=normalize, half=fp16).eval()


class _OneLayer(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, *bottoms):
        return self.layer(*bottoms)


def _trace(module, args, opset, input_names, output_names, dynamic_axes) -> bytes:
    buffer = io.BytesIO()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # TracerWarnings about Python ints: H/W are static by design
        torch.onnx.export(module, args, buffer, dynamo=False, opset_version=opset, input_names=input_names,
                          output_names=output_names, dynamic_axes=dynamic_axes, do_constant_folding=True)
    return buffer.getvalue()


def _innermost(exc: BaseException) -> BaseException:
    """The first exception of ``exc``'s cause chain that says something (the exporter wraps the real one)."""
    seen = {id(exc)}
    while exc.__cause__ is not None and id(exc.__cause__) not in seen and str(exc.__cause__).strip():
        exc = exc.__cause__
        seen.add(id(exc))
    return exc


def _capture(module, example, opset, input_name, output_name, fixed) -> bytes:
    """The embedder captured by ``torch.export`` (one graph) and translated by the dynamo exporter."""
    import logging

    dynamic_shapes = None if fixed else ({0: torch.export.Dim("batch", min=1)},)
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)  # "torchvision is not installed" and the like: not this export's business
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(module, (example,), None, dynamo=True, opset_version=opset,
                                        input_names=[input_name], output_names=[output_name],
                                        dynamic_shapes=dynamic_shapes, optimize=True, verbose=False)
    finally:
        logger.setLevel(level)
    model = program.model_proto
    got = next((entry.version for entry in model.opset_import if entry.domain in ("", "ai.onnx")), None)
    if got != opset:
        raise FormatError(f"--compile: the dynamo exporter wrote opset {got}, not the requested {opset}")
    return model.SerializeToString()


def _uncapturable(embedder: Embedder, opset: int, cause: Exception) -> FormatError:
    inner = _innermost(cause)
    text = str(inner).strip()
    first = text.splitlines()[0] if text else type(inner).__name__
    return FormatError(f"--compile: net '{embedder.net.name}' cut at '{embedder.output_blob}' cannot be captured by "
                       f"torch.export and exported to ONNX opset {opset}: {type(inner).__name__}: {first} (export "
                       f"without --compile uses the TorchScript tracer)")


def _unexportable_layer(embedder: Embedder, example: torch.Tensor, opset: int, cause: Exception) -> FormatError:
    """Export each kept layer alone, on its real bottoms, and name the first one that fails."""
    net = embedder.net
    blobs = {embedder.input_blob: example.half() if embedder.half_precision else example}
    with torch.no_grad():
        for step in embedder.steps:
            bottoms = [blobs[b] for b in step.bottoms]
            if step.module_key is None:
                blobs.update((t, bottoms[0]) for t in step.tops)
                continue
            layer = net.layers[step.module_key]
            try:
                _trace(_OneLayer(layer).eval(), tuple(bottoms), opset, None, None, None)
            except Exception as exc:  # torch raises several unrelated types for an unsupported op
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                return FormatError(f"layer '{step.name}' (type {step.type}) cannot be exported to ONNX opset {opset}: "
                                   f"{first}")
            outs = layer(*bottoms)
            blobs.update(zip(step.tops, (outs,) if torch.is_tensor(outs) else outs))
    first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    return FormatError(f"net '{net.name}' cut at '{embedder.output_blob}' cannot be exported to ONNX opset {opset}: "
                       f"{type(cause).__name__}: {first}")


def export_onnx(prototxt=None, weights=None, checkpoint=None, output_blob: str | None = None,
                path="embedder.onnx", normalize: bool = False, opset: int | None = None, fp16: bool = False,
                batch="dynamic", preprocessing: dict | None = None, strict: bool = False, fuse: bool = False,
                compile: bool = False) -> Path:
    """Write the embedder ONNX file (see the module docstring) and return its path.  ``strict``: refuse
    (FormatError) a caffemodel whose layer names do not match the net (see :func:`build_embedder`).
    ``fuse``: BatchNorm/Scale/Bias (+ Eltwise shortcut) + ReLU folded into the convolutions before export
    (:mod:`caffe_compat.fuse`); the metadata records ``fuse`` and ``fuse_tolerance`` (the bound
    :func:`verify_onnx` then applies against the unfused net).  ``compile``: captured by ``torch.export``
    (one graph) and the dynamo exporter instead of the TorchScript tracer; needs onnxscript and opset
    >= 18, and refuses (FormatError) a cut that is not one graph (see the module docstring)."""
    import onnx

    from caffe_compat.io.atomic import write_bytes_atomic

    if compile:
        require_onnxscript()
    opset = default_opset(compile) if opset is None else opset
    if not MIN_OPSET <= int(opset) <= MAX_OPSET:
        raise CaffeCompatError(f"opset must be in {MIN_OPSET}..{MAX_OPSET} (the legacy exporter's range), got {opset}")
    if compile and int(opset) < COMPILE_MIN_OPSET:
        raise CaffeCompatError(f"--compile needs opset {COMPILE_MIN_OPSET}..{MAX_OPSET} (the dynamo exporter builds "
                               f"opset {COMPILE_MIN_OPSET} and cannot convert Caffe's pooling pads below it), got "
                               f"{opset}; pass --opset {COMPILE_MIN_OPSET} or export without --compile")
    fixed = _batch_size(batch)
    test_net = TestPhaseNet(prototxt, checkpoint, weights)
    output_blob = test_net.default_output() if output_blob is None else output_blob
    spec, origin, assumed = preprocessing, "given", []
    if spec is None:
        data_layer = test_net.data_layer(output_blob)
        if data_layer is not None:
            spec, assumed = preprocessing_from_data_layer(data_layer)
            origin = f"data layer '{data_layer.name}' ({data_layer.type})"
    embedder = build_embedder(prototxt, weights, checkpoint, output_blob, normalize, fp16,
                              image_size=_image_size(spec), test_net=test_net, strict=strict, fuse=fuse)
    net, input_blob = embedder.net, embedder.input_blob
    if input_blob == output_blob:
        raise FormatError(f"output blob '{output_blob}' is the net's input")
    prep = normalize_preprocessing(spec, input_blob, embedder.input_shape,
                                   where="export" if origin == "given" else f"export ({origin})")
    if spec is None:
        origin, assumed = "assumed", assumed_preprocessing(embedder.input_shape)
    try:
        example = example_input(embedder.input_shape, fixed or 2)
    except (MemoryError, ValueError) as exc:  # numpy: "Maximum allowed dimension exceeded", "Unable to allocate"
        raise CaffeCompatError(f"--batch {fixed}: cannot make an example batch of that size ({exc})") from None
    if compile:
        blocker = whole_graph_blocker(embedder)
        if blocker is not None:
            raise FormatError(f"--compile: layer '{blocker.name}' (type {blocker.type}) runs the user's Python "
                              f"(NumPy) code outside torch, so the cut at '{output_blob}' of net '{net.name}' is "
                              f"not one graph torch.export can capture; export without --compile")
        try:
            data = _capture(embedder, example, int(opset), input_blob, output_blob, fixed)
        except CaffeCompatError:
            raise
        except Exception as exc:  # noqa: BLE001 - torch.export / the dynamo exporter raise many types
            raise _uncapturable(embedder, int(opset), exc) from None
    else:
        dynamic_axes = None if fixed else {input_blob: {0: "batch"}, output_blob: {0: "batch"}}
        try:
            data = _trace(embedder, (example,), int(opset), [input_blob], [output_blob], dynamic_axes)
        except CaffeCompatError:
            raise
        except Exception as exc:  # noqa: BLE001 - any exporter failure becomes a FormatError naming the layer
            raise _unexportable_layer(embedder, example, int(opset), exc) from None
    model = fold_constants(onnx.load_model_from_string(data))
    model.producer_name = "caffe-compat"
    model.doc_string = (f"Caffe net '{net.name}' (TEST phase) cut at blob '{output_blob}'"
                        f"{', L2-normalised' if normalize else ''}{', float16' if fp16 else ''}"
                        f"{', fused for inference' if fuse else ''}"
                        f"{'; captured by torch.export (dynamo exporter)' if compile else ''}")
    source = {"net": net.name, "prototxt": test_net.path,
              "weights": None if weights is None else str(weights),
              "checkpoint": None if checkpoint is None else str(checkpoint)}
    prep.pop("preprocessing_derived")
    derived = origin != "given"  # read from the net's data layer, or assumed
    write_metadata(model, {
        "format": FORMAT, **prep, "input_shape": list(embedder.input_shape[1:]), "output_blob": output_blob,
        "embedding_dim": embedder.dim, "normalize": bool(normalize), "fp16": bool(fp16),
        "batch": "dynamic" if fixed is None else fixed, "opset": int(opset), "source": source,
        "preprocessing_derived": derived, "preprocessing_source": origin, "preprocessing_assumed": assumed,
        "fuse": bool(fuse), "fuse_tolerance": float(net.tolerance()) if fuse else 0.0,
    })
    onnx.checker.check_model(model)
    path = Path(path)
    write_bytes_atomic(path, model.SerializeToString())
    if assumed:
        what = ("no preprocessing given and the net has no TEST-phase data layer with a transform_param"
                if origin == "assumed" else f"the preprocessing comes from the net's {origin}, but")
        warnings.warn(f"{test_net.where}: {what}; the metadata assumes {'; '.join(assumed)}. Pass the preprocessing the "
                      f"model was trained with if it differs (export --preprocessing, e.g. '{{\"resize\": 256, "
                      f"\"crop_size\": 224, \"mean_value\": [104, 117, 123]}}')",
                      PreprocessingAssumedWarning, stacklevel=2)
    return path


def _image_size(spec):
    """``(H, W)`` the preprocessing ``spec`` yields (crop, else resize), or None when it does not say."""
    if not isinstance(spec, dict):
        return None
    try:
        crop = int(spec.get("crop_size") or 0)
        if crop > 0:
            return crop, crop
        resize = spec.get("resize")
        if isinstance(resize, (int, float)) and not isinstance(resize, bool) and resize > 0:
            return int(resize), int(resize)
        if isinstance(resize, (list, tuple)) and len(resize) == 2:
            return int(resize[0]), int(resize[1])
    except (TypeError, ValueError):
        return None  # normalize_preprocessing names the bad value
    return None
