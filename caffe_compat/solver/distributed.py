"""Data-parallel training (torchrun / DDP): pair-based losses over the *global* batch.

Pair losses (FAPPY, contrastive, lifted structure, ...) couple every sample with every other one, so a
batch of 128 split over 4 GPUs is not 4 batches of 32: each rank must see all 128 embeddings.
:func:`all_gather_with_grad` concatenates the ranks' embeddings in rank order (rank 0's rows first), and
its backward all-reduces (sums) the incoming gradient and keeps the local rows.  Every rank computes the
same global loss L; the gradient reaching rank r's embeddings is ``world_size · ∂L/∂x_r``, and DDP's
averaging of the parameter gradients (or :func:`average_gradients`) divides by ``world_size`` again:
the parameter gradient equals the single-process gradient of L over the whole batch.  Ranks may hold
different batch sizes (rows are padded for the collective and stripped).

With the Solver: ``gather_loss_bottoms(solver.net)`` makes the pair layers (``CosineSimilarityBatch``,
the metric-learning loss layers) read gathered bottoms, and an observer calling
:func:`average_gradients_hook` (``solver.observers.append(SolverObserver(on_gradients_ready=average_gradients_hook))``)
averages the parameter diffs across ranks before Caffe's update (the update then runs identically on
every rank, so the weights stay in sync).  Losses reported by each rank are the global-batch loss.

:func:`caffe_compat.solver.train.train` does all of this when it runs under torchrun (see its module
docstring); the pieces it adds live here too: :func:`shard_batch` (rank ``r``'s contiguous share of a
global batch, the split :class:`~caffe_compat.data.samplers.GlobalBatchSampler` makes),
:func:`shard_data_layers` (the net's own data layers keep producing the global batch on every rank,
identically seeded, and each rank keeps its share), :func:`broadcast_parameters` (rank 0's weights,
as DDP does at construction) and :func:`any_rank` (a flag agreed by all ranks).

Normalisation.  Averaging the parameter gradients is exact for the pair layers (above).  A loss layer
that is *not* gathered (e.g. SoftmaxWithLoss beside the pair loss) sees only the rank's share; the
average of the ranks' gradients is then the gradient of the mean of the per-rank losses, which equals
the global-batch loss when the layer normalises by its batch size (Caffe's default BATCH_SIZE / VALID
without ignore_label) and the shares are equal (what :func:`shard_batch` makes).  Such a layer's loss,
as reported by a rank, is that rank's share's loss.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from caffe_compat.errors import CaffeCompatError
from caffe_compat.layers.registry import couples_batch_types

__all__ = ["GatherBottoms", "ShardTops", "all_gather", "all_gather_with_grad", "any_rank", "average_gradients",
           "average_gradients_hook", "broadcast_parameters", "env_world_size", "gather_batch", "gather_loss_bottoms",
           "init_distributed", "is_distributed", "is_main_process", "rank", "shard_batch", "shard_data_layers",
           "world_size", "PAIR_LAYER_TYPES"]

#: Registry keys of the built-in layers whose output couples the batch: derived from the ports'
#: ``couples_batch`` (a port registered later is found by :func:`gather_loss_bottoms` all the same).
PAIR_LAYER_TYPES = couples_batch_types()


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def is_main_process() -> bool:
    return rank() == 0


def env_world_size() -> int:
    """The ``WORLD_SIZE`` torchrun exports (1 when absent)."""
    try:
        return int(os.environ.get("WORLD_SIZE", 1))
    except ValueError:
        raise CaffeCompatError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not an integer") from None


def init_distributed(backend: str | None = None, device=None) -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_*``).

    Returns ``(rank, world_size, device)``.  ``device`` (default: CUDA when available): a CUDA device
    means ``cuda:<LOCAL_RANK>`` (a plain ``"cuda"``) with NCCL, CPU means gloo; ``backend`` overrides.
    Without torchrun's variables it is a single process: ``(0, 1, device)``.  A process group that is
    already initialised is joined as it is.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device(f"cuda:{local_rank}")
    if is_distributed():
        return rank(), world_size(), device
    if env_world_size() <= 1:
        return 0, 1, device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend or ("nccl" if device.type == "cuda" else "gloo"))
    return rank(), world_size(), device


def _sizes(n: int, device) -> list[int]:
    local = torch.tensor([n], dtype=torch.long, device=device)
    sizes = [torch.zeros_like(local) for _ in range(world_size())]
    dist.all_gather(sizes, local)
    return [int(s) for s in sizes]


def _gather_padded(tensor: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    longest = max(sizes)
    padded = tensor
    if tensor.shape[0] < longest:
        pad = tensor.new_zeros((longest - tensor.shape[0],) + tuple(tensor.shape[1:]))
        padded = torch.cat([tensor, pad])
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded.contiguous())
    return torch.cat([part[:n] for part, n in zip(parts, sizes)])


class _AllGatherWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor):
        sizes = _sizes(tensor.shape[0], tensor.device)
        ctx.offset = sum(sizes[:rank()])
        ctx.count = tensor.shape[0]
        return _gather_padded(tensor, sizes)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        return grad[ctx.offset:ctx.offset + ctx.count]


def all_gather_with_grad(tensor: torch.Tensor) -> torch.Tensor:
    """Rows of every rank concatenated in rank order, differentiable (see the module docstring).
    The identity when no process group is initialised."""
    if not is_distributed() or world_size() == 1:
        return tensor
    return _AllGatherWithGrad.apply(tensor)


@torch.no_grad()
def all_gather(tensor: torch.Tensor) -> torch.Tensor:
    """Rows of every rank concatenated in rank order, without gradient (labels)."""
    if not is_distributed() or world_size() == 1:
        return tensor
    return _gather_padded(tensor, _sizes(tensor.shape[0], tensor.device))


def gather_batch(embeddings: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch: gathered embeddings (differentiable) and labels, rows in rank order."""
    if embeddings.shape[0] != labels.shape[0]:
        raise CaffeCompatError(f"gather_batch: {embeddings.shape[0]} embeddings but {labels.shape[0]} labels")
    return all_gather_with_grad(embeddings), all_gather(labels)


@torch.no_grad()
def average_gradients(params) -> None:
    """All-reduce the ``.grad`` of ``params`` and divide by the world size (what DDP does in backward).
    Every rank must hold a gradient for the same parameters.  The gradients travel in one flat buffer
    per (device, dtype) (one collective, like DDP's buckets); the values are those of one all-reduce
    per tensor (an element-wise sum)."""
    if not is_distributed() or world_size() == 1:
        return
    n = world_size()
    groups: dict = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
    for grads in groups.values():
        flat = torch.cat([g.reshape(-1) for g in grads]) if len(grads) > 1 else grads[0].reshape(-1).clone()
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat.div_(n)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def average_gradients_hook(solver) -> None:
    """A solver observer's ``on_gradients_ready``: average the train net's parameter diffs across ranks
    before the update."""
    average_gradients(solver.optimizer.params)


class GatherBottoms(nn.Module):
    """Wraps a layer port so that its batch bottoms are gathered across ranks first (``gather[k]`` says
    which): floating bottoms that require grad with :func:`all_gather_with_grad`, others (labels, float in
    Caffe) with :func:`all_gather`.  ``breaks_graph``: the gather pads to the ranks' shares, whose sizes it
    reads at run time, so ``torch.compile`` breaks the graph around it (one graph failed under torchrun)."""

    breaks_graph = True

    def __init__(self, layer: nn.Module, gather: tuple[bool, ...]):
        super().__init__()
        self.inner = layer
        self.gather = tuple(gather)

    def caffe_blobs(self):
        return self.inner.caffe_blobs()

    @property
    def is_loss(self):
        return getattr(self.inner, "is_loss", False)

    def forward(self, *bottoms):
        out = []
        for b, gather in zip(bottoms, self.gather):
            if gather:
                b = all_gather_with_grad(b) if b.is_floating_point() and b.requires_grad else all_gather(b)
            out.append(b)
        return self.inner(*out)


def gather_loss_bottoms(net, layer_types=None) -> list[str]:
    """Make the pair layers of ``net`` (a CaffeNet; ports with ``couples_batch``, or the registry keys in
    ``layer_types`` when given) read the global batch: each
    bottom not produced by another pair layer (features, labels) is gathered across ranks; a bottom
    coming from a pair layer (e.g. FAPPYLoss's cosines) is already global.  Returns the wrapped names."""
    from_pair_layer: set[str] = set()
    wrapped = []
    for step in net.steps:
        if step.module_key is None:
            continue
        module = net.layers[step.module_key]
        # a Python layer's registry key ("Python:module.Layer") names the port, its step type is "Python"
        port = module.inner if isinstance(module, GatherBottoms) else module
        if layer_types is None:
            coupled = bool(getattr(port, "couples_batch", False))
        else:
            coupled = step.type in layer_types or getattr(port, "caffe_type", step.type) in layer_types
        if coupled:
            gather = tuple(b not in from_pair_layer for b in step.bottoms)
            if any(gather) and not isinstance(module, GatherBottoms):
                net.layers[step.module_key] = GatherBottoms(module, gather)
                wrapped.append(step.name)
            from_pair_layer.update(step.tops)
    return wrapped


def shutdown_distributed(barrier: bool = True) -> None:
    """Leave the process group: with ``barrier`` every rank first waits for the others, then the group
    is destroyed.  A rank that tore its connections down while another still used them, or a group left
    to the interpreter's exit (gloo's worker threads destroyed while joinable), aborts the process with
    "terminate called without an active exception"; after an error (``barrier=False``) the group is
    destroyed at once, so that ranks waiting in a collective fail instead of waiting for its timeout."""
    if not is_distributed():
        return
    try:
        if barrier:
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _comm_device(device=None) -> torch.device:
    """Where a small collective's tensor must live: CUDA for NCCL, CPU otherwise."""
    if dist.get_backend() == "nccl":
        return torch.device(device) if device is not None and torch.device(device).type == "cuda" else \
            torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def any_rank(flag: bool, device=None) -> bool:
    """True on every rank when ``flag`` is true on at least one (a MAX all-reduce; every rank must call it
    at the same point).  ``flag`` itself without a process group."""
    if not is_distributed() or world_size() == 1:
        return bool(flag)
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=_comm_device(device))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


@torch.no_grad()
def broadcast_parameters(net) -> None:
    """Copy rank 0's parameters and buffers to every rank (DDP does it at construction)."""
    if not is_distributed() or world_size() == 1:
        return
    seen = set()
    tensors = [blob for blobs in net.params.values() for blob in blobs] + list(net.buffers())
    for tensor in tensors:
        if id(tensor) not in seen and tensor.numel():
            seen.add(id(tensor))
            dist.broadcast(tensor.data, src=0)


def shard_batch(batch: dict, where: str = "batch") -> dict:
    """This rank's share of a global batch ``{blob: tensor or array}``: rows ``[r·b, (r+1)·b)`` of every
    value along its first axis, ``b = B / world_size`` (the split of :class:`GlobalBatchSampler`), so
    the ranks' shares in rank order are the global batch, rows in order.  0-d values are left whole;
    ``B`` must be divisible by the world size (equal shares keep per-rank losses normalised alike)."""
    n = world_size()
    if n == 1:
        return batch
    r = rank()
    out = {}
    for name, value in batch.items():
        shape = getattr(value, "shape", None)
        if shape is None or len(shape) == 0:
            out[name] = value
            continue
        rows = int(shape[0])
        if rows % n:
            raise CaffeCompatError(f"{where}: blob '{name}' has {rows} rows, not divisible by the {n} ranks: "
                                   f"use a global batch size that is a multiple of the world size")
        b = rows // n
        out[name] = value[r * b:(r + 1) * b]
    return out


class ShardTops(nn.Module):
    """Wraps a data layer (a layer without bottoms) so that each rank keeps its share of the global batch
    the layer produces (:func:`shard_batch` on its tops).  Every rank runs the layer (seeded alike from
    the net's generator), so the shares are consistent.  The identity without a process group; other
    attributes (``set_input_arrays``, ``fill``, ...) are the wrapped layer's."""

    def __init__(self, layer: nn.Module, tops: tuple[str, ...], where: str):
        super().__init__()
        self.inner = layer
        self.tops = tuple(tops)
        self.where = where

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules", {})
            if "inner" not in modules:
                raise
            return getattr(modules["inner"], name)

    def caffe_blobs(self):
        return self.inner.caffe_blobs()

    def forward(self, *bottoms):
        outs = self.inner(*bottoms)
        single = torch.is_tensor(outs)
        outs = (outs,) if single else tuple(outs)
        shared = shard_batch(dict(zip(self.tops, outs)), self.where)
        outs = tuple(shared[t] for t in self.tops)
        return outs[0] if single else outs


def shard_data_layers(net, skip_types=("Input",)) -> list[str]:
    """Wrap the data layers of ``net`` (layers without bottoms, other than ``skip_types``) in
    :class:`ShardTops`.  Returns the wrapped names.  Idempotent."""
    wrapped = []
    for step in net.steps:
        if step.bottoms or step.type in skip_types or step.module_key is None or not step.tops:
            continue
        module = net.layers[step.module_key]
        if not isinstance(module, ShardTops):
            net.layers[step.module_key] = ShardTops(module, step.tops, f"layer '{step.name}' ({step.type})")
            wrapped.append(step.name)
    return wrapped
