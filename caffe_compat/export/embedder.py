"""The exportable embedder: a TEST-phase :class:`~caffe_compat.net.CaffeNet` cut at one output blob.

``Embedder(net, output_blob, normalize=False, half=False)`` maps the net's input blob ``x`` of shape
``(N, C, H, W)`` to

    e = flatten(blob)                       # (N, D), D = prod of the blob's non-batch axes
    e = e / max(||e||_2, 1e-12)             # only with normalize=True (row-wise L2)

where ``blob`` is what pycaffe's ``net.blobs[output_blob]`` would hold after a forward pass, i.e. the
value after the **last in-place layer** writing it (VGG's ``fc7`` is post ``relu7``/``drop7``).

The cut keeps only the layers the output depends on (:func:`~caffe_compat.export.cut.cut_indices`, a
reverse walk over the steps: a step is kept when it writes a blob still needed; an in-place step keeps its
blob needed, an ordinary producer retires it), so side branches, loss heads and label inputs never reach the ONNX graph.  Exactly one bottomless blob
(the ``Input`` top, usually ``data``) may be needed: it becomes the graph's input.  The output blob must
keep the input's batch axis first (a blob reduced over the batch, e.g. Reduction over all axes, is refused).

``half=True`` runs the layers in float16 (cast the net with ``.half()`` first) while input and output
stay float32: the exported graph casts on entry and exit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from caffe_compat.errors import FormatError
from caffe_compat.export.cut import cut_indices

__all__ = ["Embedder", "cut_steps", "needed_input"]


def cut_steps(net, output_blob: str) -> list:
    """The steps (``net.steps`` order) that ``output_blob``'s final value depends on."""
    if output_blob not in net.blob_shapes:
        raise FormatError(f"net '{net.name}': no blob named '{output_blob}'; available blobs: "
                          f"{', '.join(net.blob_shapes)}")
    steps = list(net.steps)
    return [steps[i] for i in cut_indices([(step.bottoms, step.tops) for step in steps], output_blob)]


def needed_input(net, steps) -> str:
    """The one bottomless blob the cut reads (the graph input); FormatError when there are several/none."""
    sources = [t for s in steps if not s.bottoms for t in s.tops]
    read = {b for s in steps for b in s.bottoms}
    inputs = [t for t in sources if t in read]
    if len(inputs) != 1:
        raise FormatError(f"net '{net.name}': the cut needs exactly one input blob, found {inputs or 'none'} "
                          f"(feedable blobs: {net.feedable_names})")
    return inputs[0]


class Embedder(nn.Module):
    """``x -> flatten(net.blobs[output_blob])`` (optionally L2-normalised); see the module docstring."""

    def __init__(self, net, output_blob: str, normalize: bool = False, half: bool = False):
        super().__init__()
        self.net = net
        self.output_blob = output_blob
        self.normalize = bool(normalize)
        self.half_precision = bool(half)
        kept = cut_steps(net, output_blob)  # FormatError listing the blobs when the name is unknown
        self.steps = [s for s in kept if s.bottoms]
        self.input_blob = needed_input(net, kept)
        self.input_shape = tuple(net.blob_shapes[self.input_blob])
        shape = tuple(net.blob_shapes[output_blob])
        if not shape or shape[0] != self.input_shape[0]:
            raise FormatError(f"net '{net.name}': blob '{output_blob}' has shape {shape}, which does not keep the "
                              f"batch axis of input '{self.input_blob}' {self.input_shape}; an embedder's output "
                              f"must be (N, ...)")
        self.dim = int(torch.Size(shape[1:]).numel())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blobs = {self.input_blob: x.half() if self.half_precision else x}
        for step in self.steps:
            bottoms = [blobs[b] for b in step.bottoms]
            if step.module_key is None:  # Caffe's automatic Split: every top is the bottom
                outs = bottoms * len(step.tops)
            else:
                outs = self.net.layers[step.module_key](*bottoms)
                outs = (outs,) if torch.is_tensor(outs) else outs
            blobs.update(zip(step.tops, outs))
        out = blobs[self.output_blob]
        if out.dim() != 2:  # (N, D); ONNX Flatten / Unsqueeze keep the shapes inferable
            out = torch.flatten(out, 1) if out.dim() > 2 else out.unsqueeze(1)
        if self.half_precision:
            out = out.float()
        return F.normalize(out, p=2.0, dim=1, eps=1e-12) if self.normalize else out
