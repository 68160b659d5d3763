"""``static_form``: the losses and ports take their fixed-shape, synchronisation-free forms under
``torch.compile``, while a CUDA graph is captured, and on the meta device, and only then."""

from __future__ import annotations

import pytest
import torch

from caffe_compat.losses import FAPPYLoss
from caffe_compat.losses.static_form import static_form

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


def test_eager_cpu_is_not_static_meta_and_compiled_code_are():
    assert not static_form(torch.zeros(2))
    assert static_form(torch.zeros(2, device="meta"))
    seen = []

    def probe(x):
        seen.append(static_form(x))
        return x + 1

    torch._dynamo.reset()
    torch.compile(probe, fullgraph=True, backend="eager")(torch.zeros(2))
    assert seen == [True]


def test_the_meta_device_refuses_every_host_read():
    """What makes the meta device a proof that a step reads nothing on the host: a value read raises."""
    t = torch.ones(4, device="meta")
    for read in (lambda: t.sum().item(), lambda: bool(t.any()), lambda: int(t.max()), lambda: t.nonzero()):
        with pytest.raises((RuntimeError, NotImplementedError)):  # nonzero on meta: NotImplementedError
            read()


@needs_cuda
def test_fappy_inside_a_captured_cuda_graph_replays_the_eager_loss_and_gradient():
    """A caller capturing its own CUDA graph (a whole training step) gets FAPPY's static form inside it:
    the eager row layout reads the number of positive partners on the host, which capture forbids."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    labels = (torch.arange(32, device="cuda") // 4).float()
    loss_fn = FAPPYLoss(1e-3)
    static_x = torch.randn(32, 16, device="cuda", generator=generator, requires_grad=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch.cuda.graph's documentation asks
        for _ in range(2):
            loss_fn(static_x, labels).backward()
    torch.cuda.current_stream().wait_stream(side)
    static_x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = loss_fn(static_x, labels)
        static_loss.backward()
    for _ in range(3):
        x = torch.randn(32, 16, device="cuda", generator=generator)
        with torch.no_grad():
            static_x.copy_(x)
        graph.replay()
        eager_x = x.clone().requires_grad_()
        eager = loss_fn(eager_x, labels)
        eager.backward()
        # the static form sums padded slots too (float64, then rounded to float32: at most an ulp of the loss);
        # the gradient is one float32 product of 16-term rows over that diff: a few ulps of its largest entry
        torch.testing.assert_close(static_loss, eager, rtol=2.0 ** -23, atol=0.0)
        scale = float(eager_x.grad.abs().max())
        torch.testing.assert_close(static_x.grad, eager_x.grad, rtol=0.0, atol=16 * 2.0 ** -24 * scale)
