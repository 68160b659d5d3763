"""pycaffe's ``net.backward(start=..., end=...)`` / ``net._backward(start, end)``: Caffe's
``Net::BackwardFromTo`` over a range of layers of a :class:`~caffe_compat.pycaffe.net.Net`.

Caffe runs the ``Backward`` of layers ``start`` down to ``end`` on the blobs in memory: each layer reads
its tops' diffs (written by the later layers of the range, or left in the blobs: set by the user, by an
earlier backward, or a loss top's ``loss_weight``) and writes its bottoms' diffs; parameter diffs
accumulate.  Reproduced here with autograd on the last forward's graph:

* the **sources** are the range's top tensors that no later layer of the range reads; their gradient is
  the blob's current ``diff``;
* the **targets** are the tensors the range's layers read; a blob's new ``diff`` is the gradient of the
  version read by the *earliest* layer of the range that reads it (what Caffe's memory holds when the
  range is done, in-place chains included); blobs the range does not compute keep their diff, and a
  bottom with ``propagate_down: false`` (or one Caffe needs no diff for) keeps it too;
* the parameters of the range's layers get the gradient added to their diffs (the ``.grad`` tensors keep
  their identity, so numpy views of ``params[...][i].diff`` stay valid).

The last forward's graph is used when it computed every layer of the range with autograd on.  Otherwise
(no forward yet, a forward of another range, a shared parameter also used outside the range) the range is
recomputed from the blobs' stored data (a data layer's tops included: nothing is read or drawn anew),
which is what those layers read in Caffe: exact for layers that keep no state, but a Dropout in the range
draws a new mask.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from caffe_compat.pycaffe.blob import grad_of

if TYPE_CHECKING:
    from caffe_compat.pycaffe.net import Net

__all__ = ["backward_layers", "backward_range"]


def _consumers(steps, blobs):
    """For the steps the forward ran: (id of a produced tensor -> index of the step that read it) and
    (step index -> the tensors it read, one per bottom)."""
    produced = {top for index in blobs.step_outputs for top in steps[index].tops}
    current = {name: value for name, value in blobs.diff_targets.items() if name not in produced}
    consumer: dict[int, int] = {}
    read: dict[int, list] = {}
    for index in sorted(blobs.step_outputs):
        step = steps[index]
        read[index] = [current.get(b) for b in step.bottoms]
        for tensor in read[index]:
            if tensor is not None:
                consumer.setdefault(id(tensor), index)
        for top, out in zip(step.tops, blobs.step_outputs[index]):
            current[top] = out
    return consumer, read


def _range_params(cnet, steps, first: int, last: int) -> list[torch.Tensor]:
    seen, out = set(), []
    for step in steps[first:last + 1]:
        if step.module_key is None:
            continue
        for blob in cnet.layers[step.module_key].caffe_blobs():
            if isinstance(blob, torch.nn.Parameter) and blob.requires_grad and id(blob) not in seen:
                seen.add(id(blob))
                out.append(blob)
    return out


def _shared_outside(cnet, steps, first: int, last: int, params) -> bool:
    """Whether a parameter of the range is also a blob of a layer outside it (weight sharing)."""
    inside = {id(p) for p in params}
    for index, step in enumerate(steps):
        if first <= index <= last or step.module_key is None:
            continue
        if any(id(b) in inside for b in cnet.layers[step.module_key].caffe_blobs()):
            return True
    return False


def _covers(blobs, first: int, last: int) -> bool:
    return blobs is not None and all(i in blobs.step_outputs for i in range(first, last + 1))


def _recompute(net: "Net", first: int, last: int):
    """Run the range again from the blobs' stored data (inputs made leaves that require grad)."""
    cnet, steps = net._cnet, net._cnet.steps
    produced, feed = set(), {}
    for step in steps[first:last + 1]:
        for name in [b for b in step.bottoms if b not in produced]:
            if name not in feed:
                feed[name] = net._blob_map[name]._data.device().detach().clone().requires_grad_()
        for name in ([] if step.bottoms else step.tops):  # a data layer's tops: Caffe reads its memory, draws
            feed[name] = net._blob_map[name]._data.device().detach().clone()  # nothing new; their diff only
            feed[name].requires_grad_(cnet.force_backward)  # with force_backward
        produced.update(step.tops)
    quiet, cnet.debug_info = cnet.debug_info, False  # a recomputation is no forward of Caffe's: no debug lines
    try:
        with torch.enable_grad():
            return cnet.run(feed, start=steps[first].name, end=steps[last].name, input_grad=False)
    finally:
        cnet.debug_info = quiet


def backward_range(net: "Net", first: int, last: int) -> list[str]:
    """Caffe's ``BackwardFromTo(last, first)`` on ``net`` (step indices, ``first <= last``); returns the
    names of the blobs whose diff was written."""
    cnet, steps = net._cnet, net._cnet.steps
    params = _range_params(cnet, steps, first, last)
    blobs = net._last
    if not _covers(blobs, first, last) or _shared_outside(cnet, steps, first, last, params):
        blobs = _recompute(net, first, last)
    consumer, read = _consumers(steps, blobs)
    sources, grads = [], []
    for index in range(first, last + 1):
        for top, out in zip(steps[index].tops, blobs.step_outputs[index]):
            if not (torch.is_tensor(out) and out.requires_grad):
                continue
            user = consumer.get(id(out))
            if user is not None and first < user <= last:
                continue  # read by a later layer of the range: its gradient comes from that layer
            sources.append(out)
            grads.append(net._blob_map[top]._diff.device().to(out.dtype).reshape(out.shape))
    targets: dict[str, torch.Tensor] = {}
    for index in range(last, first - 1, -1):  # the earliest reader's version wins, as in Caffe's memory
        step = steps[index]
        for name, tensor, keep in zip(step.bottoms, read[index], step.propagate_down):
            if keep and torch.is_tensor(tensor) and tensor.requires_grad:
                targets[name] = tensor
    if not sources:
        return []
    names = list(targets)
    wanted = [targets[n] for n in names] + params
    results = torch.autograd.grad(sources, wanted, grads, allow_unused=True, retain_graph=True)
    written = []
    with torch.no_grad():
        for name, grad in zip(names, results[:len(names)]):
            if grad is not None:
                net._blob_map[name]._diff.assign(grad)
                written.append(name)
        for param, grad in zip(params, results[len(names):]):
            if grad is not None:
                grad_of(param).add_(grad)
    net._forget_param_mirrors()
    return written


def _one_layer(net: "Net", blobs, read, index: int) -> None:
    """Caffe's ``layers_[index]->Backward``: the step's bottoms' diffs from its tops' current diffs, its
    parameters' gradients added to their diffs."""
    cnet, step = net._cnet, net._cnet.steps[index]
    params = _range_params(cnet, cnet.steps, index, index)
    outs, bottoms = blobs.step_outputs[index], read[index]
    # a parameter another layer uses too: autograd from this step's tops would also reach it through an
    # earlier user, so this layer alone, on its bottoms
    if params and _shared_outside(cnet, cnet.steps, index, index, params):
        local = {}  # under autograd _run_step only reads the bottoms from it
        for name, tensor in zip(step.bottoms, bottoms):
            if torch.is_tensor(tensor):
                local[name] = tensor.detach().requires_grad_(tensor.requires_grad)
        bottoms = [local.get(name) for name in step.bottoms]
        with torch.enable_grad():
            outs = cnet._run_step(step, local, {}, False)
    sources, grads = [], []
    for top, out in zip(step.tops, outs):
        if torch.is_tensor(out) and out.requires_grad:
            sources.append(out)
            grads.append(net._blob_map[top]._diff.device().to(out.dtype).reshape(out.shape))
    targets = [(name, tensor) for name, tensor, keep in zip(step.bottoms, bottoms, step.propagate_down)
               if keep and torch.is_tensor(tensor) and tensor.requires_grad]
    if not sources or not (targets or params):
        return  # Caffe: a layer that needs no backward
    results = torch.autograd.grad(sources, [t for _, t in targets] + params, grads, allow_unused=True,
                                  retain_graph=True)
    with torch.no_grad():
        for (name, _), grad in zip(targets, results[:len(targets)]):
            if grad is not None:
                net._blob_map[name]._diff.assign(grad)
        for param, grad in zip(params, results[len(targets):]):
            if grad is not None:
                grad_of(param).add_(grad)


def backward_layers(net: "Net", first: int, last: int, before: list, after: list) -> None:
    """Caffe's ``BackwardFromTo(last, first)`` one layer at a time, for the layer callbacks: for ``i`` from
    ``last`` down to ``first``, ``before_backward`` callbacks, layer ``i``'s backward (bottom diffs written,
    parameter diffs accumulated), ``after_backward`` callbacks, each called with ``i``.  The same diffs as
    :func:`backward_range` (autograd on the last forward's graph, or the range recomputed from the blobs),
    one layer's vector-Jacobian product at a time; a layer sharing a parameter with another layer is
    recomputed alone from its bottoms (a Dropout there draws a new mask).  Diffs the callbacks write into
    the blobs (or into parameter diffs) are what the next layers read, as in Caffe's memory."""
    steps = net._cnet.steps
    blobs = net._last
    if not _covers(blobs, first, last):
        blobs = _recompute(net, first, last)
    _, read = _consumers(steps, blobs)
    for index in range(last, first - 1, -1):
        for fn in before:
            fn(index)
        net._upload_params()
        _one_layer(net, blobs, read, index)
        net._forget_param_mirrors()
        for fn in after:
            fn(index)
