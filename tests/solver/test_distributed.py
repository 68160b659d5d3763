"""DDP over gloo, 2 CPU processes: a pair loss on the gathered batch gives the same loss and the same
parameter gradients as one process holding the whole batch (ranks with unequal batch sizes); and the
Solver on the authors' FAPPY net, each rank holding half of the batch, makes the same update as one
process with the whole batch."""

from __future__ import annotations

import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from caffe_compat.losses.fappy import FAPPYLoss
from caffe_compat.losses.pairwise import cosine_matrix, label_masks
from caffe_compat.solver.distributed import (all_gather_with_grad, average_gradients, average_gradients_hook,
                                             gather_batch, gather_loss_bottoms)
from tests.solver.caffe_cases import load_case, make_solver, param_arrays

FAPPY_CASE = "sgd_fappy_authors_setup"

ROWS = (5, 7)  # rank 0 holds rows 0..4, rank 1 rows 5..11
D_IN, D_OUT = 6, 4


def pair_loss(emb: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A small contrastive loss on cosines: mean over positives of (1 - s) + mean over negatives of
    relu(s - 0.2)²."""
    s = cosine_matrix(emb)
    pos, neg = label_masks(labels)
    return (1 - s[pos]).mean() + torch.relu(s[neg] - 0.2).pow(2).mean()


def problem():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(sum(ROWS), D_IN, generator=g, dtype=torch.float64)
    labels = torch.tensor([0, 0, 1, 1, 1, 2, 2, 0, 3, 3, 1, 2], dtype=torch.float64)
    weight = torch.randn(D_OUT, D_IN, generator=g, dtype=torch.float64)
    bias = torch.randn(D_OUT, generator=g, dtype=torch.float64)
    return x, labels, weight, bias


def model_from(weight, bias) -> nn.Linear:
    model = nn.Linear(D_IN, D_OUT, dtype=torch.float64)
    with torch.no_grad():
        model.weight.copy_(weight)
        model.bias.copy_(bias)
    return model


def losses():
    return {"pair": pair_loss, "fappy": lambda e, l: FAPPYLoss(delta=0.05)(e.float(), l.float()).double()}


def single_process():
    x, labels, weight, bias = problem()
    out = {}
    for name, fn in losses().items():
        model = model_from(weight, bias)
        loss = fn(model(x), labels)
        loss.backward()
        out[name] = (loss.item(), model.weight.grad.clone(), model.bias.grad.clone())
    return out


def _worker(rank: int, world: int, port: int, queue) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        x, labels, weight, bias = problem()
        start = sum(ROWS[:rank])
        rows = slice(start, start + ROWS[rank])
        out = {}
        for name, fn in losses().items():
            ddp = nn.parallel.DistributedDataParallel(model_from(weight, bias))
            emb, lab = gather_batch(ddp(x[rows]), labels[rows])
            assert emb.shape[0] == sum(ROWS) and torch.equal(lab, labels)
            loss = fn(emb, lab)
            loss.backward()  # DDP averages the parameter gradients across ranks
            out[name] = (loss.item(), ddp.module.weight.grad.numpy().copy(), ddp.module.bias.grad.numpy().copy())
        # the same through average_gradients (what the Solver's gradient_hook does) without DDP
        model = model_from(weight, bias)
        loss = pair_loss(all_gather_with_grad(model(x[rows])), labels)
        loss.backward()
        average_gradients(model.parameters())
        out["manual"] = (loss.item(), model.weight.grad.numpy().copy(), model.bias.grad.numpy().copy())
        out["solver"] = solver_step(rows=slice(4 * rank, 4 * rank + 4), distributed=True)
        queue.put((rank, out))  # numpy: pickled by value (tensors would travel as shared fds)
    finally:
        dist.destroy_process_group()


def solver_step(rows=slice(None), distributed=False):
    """One Solver iteration of the FAPPY fixture net on batch 0 (rows of it); loss and weights after."""
    solver = make_solver(FAPPY_CASE)
    if distributed:
        assert gather_loss_bottoms(solver.net) == ["cosine", "loss"]
        solver.gradient_hook = average_gradients_hook
    inputs, _ = load_case(FAPPY_CASE)
    solver.feed(data=inputs["data"][0][rows], label=inputs["label"][0][rows])
    solver.step(1)
    return float(solver.outputs["loss"]), param_arrays(solver)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_gathered_batch_equals_single_process():
    reference = single_process()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get() for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    ref_loss, ref_params = solver_step()
    for rank in (0, 1):
        loss, params = results[rank].pop("solver")
        assert loss == pytest.approx(ref_loss, rel=1e-6)
        for key, value in ref_params.items():
            np.testing.assert_allclose(params[key], value, rtol=1e-5, atol=1e-6 * np.abs(value).max(), err_msg=key)
    for rank in (0, 1):
        for name, (loss, gw, gb) in results[rank].items():
            ref_loss, ref_gw, ref_gb = reference["pair" if name == "manual" else name]
            assert abs(ref_gw).max() > 1e-3  # a real gradient
            tol = 1e-12 if name != "fappy" else 1e-5
            assert loss == np.float64(ref_loss) or abs(loss - ref_loss) <= tol * abs(ref_loss), (name, rank)
            gw, gb = torch.from_numpy(gw), torch.from_numpy(gb)
            torch.testing.assert_close(gw, ref_gw, rtol=tol, atol=tol * float(ref_gw.abs().max()))
            torch.testing.assert_close(gb, ref_gb, rtol=tol, atol=tol * float(ref_gb.abs().max()))


def test_gather_is_identity_without_process_group():
    x = torch.randn(3, 2, requires_grad=True)
    labels = torch.arange(3.0)
    emb, lab = gather_batch(x, labels)
    assert emb is x and lab is labels
