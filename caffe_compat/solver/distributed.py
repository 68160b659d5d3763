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
the metric-learning loss layers) read gathered bottoms, and ``solver.gradient_hook = average_gradients_hook``
averages the parameter diffs across ranks before Caffe's update (the update then runs identically on
every rank, so the weights stay in sync).  Losses reported by each rank are the global-batch loss.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from caffe_compat.errors import CaffeCompatError

__all__ = ["GatherBottoms", "all_gather", "all_gather_with_grad", "average_gradients", "average_gradients_hook",
           "gather_batch", "gather_loss_bottoms", "init_distributed", "is_distributed", "is_main_process",
           "rank", "world_size", "PAIR_LAYER_TYPES"]

PAIR_LAYER_TYPES = ("CosineSimilarityBatch", "FAPPYLoss", "ContrastiveBatchLoss", "LiftedStructSimilaritySoftmaxLoss",
                    "HistogramLoss", "TripletLoss", "BinomialDevianceLoss", "MultiSimilarityLoss", "MarginLoss",
                    "FastAPLoss", "SmoothAPLoss")


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def is_main_process() -> bool:
    return rank() == 0


def init_distributed(backend: str | None = None) -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_*``).

    Returns ``(rank, world_size, device)``: ``cuda:<LOCAL_RANK>`` with NCCL when CUDA is available, else
    CPU with gloo.  Without torchrun's variables it is a single process: ``(0, 1, device)``.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{local_rank}") if cuda else torch.device("cpu")
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) <= 1:
        return 0, 1, device
    if cuda:
        torch.cuda.set_device(device)
    if not is_distributed():
        dist.init_process_group(backend or ("nccl" if cuda else "gloo"))
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
    Every rank must hold a gradient for the same parameters."""
    if not is_distributed() or world_size() == 1:
        return
    n = world_size()
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad.div_(n)


def average_gradients_hook(solver) -> None:
    """``solver.gradient_hook``: average the train net's parameter diffs across ranks before the update."""
    average_gradients(solver.optimizer.params)


class GatherBottoms(nn.Module):
    """Wraps a layer port so that its batch bottoms are gathered across ranks first (``gather[k]`` says
    which): floating bottoms that require grad with :func:`all_gather_with_grad`, others (labels, float in
    Caffe) with :func:`all_gather`."""

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


def gather_loss_bottoms(net, layer_types=PAIR_LAYER_TYPES) -> list[str]:
    """Make the pair layers of ``net`` (a CaffeNet; types in ``layer_types``) read the global batch: each
    bottom not produced by another pair layer (features, labels) is gathered across ranks; a bottom
    coming from a pair layer (e.g. FAPPYLoss's cosines) is already global.  Returns the wrapped names."""
    from_pair_layer: set[str] = set()
    wrapped = []
    for step in net.steps:
        if step.type in layer_types and step.module_key is not None:
            gather = tuple(b not in from_pair_layer for b in step.bottoms)
            module = net.layers[step.module_key]
            if any(gather) and not isinstance(module, GatherBottoms):
                net.layers[step.module_key] = GatherBottoms(module, gather)
                wrapped.append(step.name)
            from_pair_layer.update(step.tops)
    return wrapped
