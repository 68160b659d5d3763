"""``torch.compile(net, fullgraph=True)``: every fixture net and the paper nets trace as one graph (no
graph break), give eager's blobs, objective and gradients, and do not recompile from one step to the next
at the same shapes.

Most tests use the ``aot_eager`` backend: AOTAutograd traces the forward *and* the backward as it does
for inductor, without inductor's code generation (minutes on a busy CPU); one test runs inductor itself.

Tolerance: a compiled graph may sum in another order (decompositions, fused reductions).  Each value of
these nets is a float32 sum of at most K products (K = 4,608 for the widest convolution of the fixture
nets), and a reordered sum of K terms moves by about ``sqrt(K) · eps · Σ|terms|`` (random rounding);
``Σ|terms|`` is bounded by the blob's largest magnitude times the depth of the chain (≤ 4 here), so a
blob is compared with ``atol = 4 · sqrt(K) · eps32 · max|blob|`` ≈ 6.4e-5 · max|blob|, gradients alike.
"""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from caffe_compat.net import CaffeNet, load_net
from tests.conftest import REPO, fixture_path, needs_cxx

EPS32 = float(np.finfo(np.float32).eps)
RTOL = 4 * math.sqrt(4608) * EPS32

FIXTURES = {
    "googlenet_small": ("nets/googlenet_small/deploy.prototxt", "nets/googlenet_small/weights.caffemodel"),
    "googlenet_small_v1": ("nets/googlenet_small_v1/deploy_v1.prototxt", "nets/googlenet_small_v1/weights_v1.caffemodel"),
    "vgg_cnn_m_1024_small": ("nets/vgg_cnn_m_1024_small/deploy.prototxt",
                             "nets/vgg_cnn_m_1024_small/weights.caffemodel"),
    "layer_zoo": ("layer_zoo/deploy.prototxt", "layer_zoo/weights.caffemodel"),
    "layer_zoo_nondiff": ("layer_zoo_nondiff/deploy.prototxt", "layer_zoo_nondiff/weights.caffemodel"),
}


def _fixture_net(name: str) -> CaffeNet:
    prototxt, weights = FIXTURES[name]
    return load_net(str(fixture_path(prototxt)), str(fixture_path(weights)))


def _inputs(net: CaffeNet, seed: int = 0) -> dict:
    """Inputs for every feedable blob: the reference inputs of the fixture where they exist (Embed needs
    valid indices), else Gaussian data and labels with positive pairs (two samples per label)."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name in net.feedable_names:
        shape = net.blob_shapes[name]
        if name == "label":
            out[name] = torch.arange(shape[0], dtype=torch.float32).floor_divide(2).reshape(shape)
        elif name == "idx":
            out[name] = torch.randint(0, 10, shape, generator=generator).float()
        else:
            out[name] = torch.randn(shape, generator=generator)
    return out


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, what
    if expected.numel():
        scale = float(expected.detach().abs().max())
        err = float((actual.detach() - expected.detach()).abs().max())
        assert err <= RTOL * scale + 1e-30, f"{what}: |compiled - eager| = {err:.3g}, max |eager| = {scale:.3g}"


def _probe(blobs) -> torch.Tensor:
    """A scalar reading every floating output blob with fixed weights (its gradient reaches every layer)."""
    total = torch.zeros(())
    for k, (name, value) in enumerate(blobs.items()):
        if value.is_floating_point() and value.requires_grad:
            weights = torch.linspace(-1.0, 1.0, value.numel()).reshape(value.shape) * (1 + k % 3)
            total = total + (value * weights).sum()
    return total


def _forward_backward(fn, net: CaffeNet, inputs: dict):
    """Blobs, objective (or probe) and the gradients of parameters and floating inputs."""
    net.zero_grad(set_to_none=True)
    fed = {n: (v.clone().requires_grad_() if v.is_floating_point() and n != "label" else v.clone())
           for n, v in inputs.items()}
    blobs = fn(**fed)
    target = net.objective(blobs) if blobs.loss_terms else _probe(blobs)
    target.backward()
    grads = {f"param {n}": p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    grads.update({f"input {n}": v.grad.clone() for n, v in fed.items() if torch.is_tensor(v) and v.grad is not None})
    return {n: v.detach().clone() for n, v in blobs.items()}, target.detach(), grads


def _compare(net: CaffeNet, compiled, inputs: dict, grads_of=None) -> None:
    eager_blobs, eager_target, eager_grads = _forward_backward(net, net, inputs)
    blobs, target, grads = _forward_backward(compiled, net, inputs)
    assert list(blobs) == list(eager_blobs)
    for name, value in eager_blobs.items():
        _close(blobs[name], value, f"blob {name}")
    _close(target, eager_target, "objective")
    assert set(grads) == set(eager_grads) and eager_grads
    for name, value in eager_grads.items():
        if grads_of is None or grads_of(name):
            _close(grads[name], value, name)


HEAVY = pytest.mark.slow  # minutes of tracing on a shared 2-CPU machine


@pytest.mark.parametrize("name", [pytest.param(n, marks=HEAVY) if n.startswith("googlenet") else n
                                  for n in sorted(FIXTURES)])
def test_fixture_net_compiles_as_one_graph_with_eager_outputs_and_gradients(name):
    net = _fixture_net(name)
    compiles_as_one_graph(net, _inputs(net))


def compiles_as_one_graph(net: CaffeNet, *input_sets: dict) -> None:
    """``torch.compile(net, fullgraph=True)`` (``aot_eager``) gives eager's blobs, objective and gradients for
    each input set, from one graph (no recompilation)."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(net, fullgraph=True, backend=counter)
    for inputs in input_sets:
        _compare(net, compiled, inputs)
    assert counter.frame_count == 1


@pytest.mark.parametrize("name", [pytest.param("googlenet_small", marks=HEAVY), "layer_zoo"])
def test_no_recompilation_across_steps_of_the_same_shape(name):
    torch._dynamo.reset()
    net = _fixture_net(name)
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(net, fullgraph=True, backend=counter)
    for step in range(3):
        compiled(**_inputs(net, seed=step))
    assert counter.frame_count == 1
    with torch.no_grad():  # another grad mode is another graph (once), then reused too
        for step in range(3):
            compiled(**_inputs(net, seed=step))
    assert counter.frame_count == 2
    torch._dynamo.utils.counters.clear()


@HEAVY
def test_compiled_inference_keeps_caffe_in_place_values_and_leaves_inputs_alone():
    """Without autograd, eager overwrites in-place bottoms as Caffe does; compiled, the bookkeeping is off
    and each layer returns a new tensor: the blobs hold the same (post in-place) values."""
    torch._dynamo.reset()
    net = _fixture_net("googlenet_small")
    inputs = _inputs(net)
    kept = {n: v.clone() for n, v in inputs.items()}
    with torch.no_grad():
        eager = {n: v.clone() for n, v in net(**inputs).items()}
        compiled = torch.compile(net, fullgraph=True, backend="eager")(**inputs)
    for name, value in eager.items():
        _close(compiled[name], value, f"blob {name}")
    for name, value in inputs.items():
        assert torch.equal(value, kept[name]), name


def test_compiled_inference_with_a_dynamic_batch_is_one_graph_for_every_batch_size():
    """Without autograd, eager CPU pooling and LRN run sample by sample (cache blocking); under compile they
    run on the whole batch (the compiler plans its own loops), so a dynamic batch is one graph: eager's
    values at batch 2 and 5 (pooling and LRN compute each sample alone either way), no recompilation."""
    torch._dynamo.reset()
    net = _fixture_net("vgg_cnn_m_1024_small").eval()
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(net, fullgraph=True, dynamic=True, backend=counter)
    (name, shape), = ((n, net.blob_shapes[n]) for n in net.feedable_names)
    with torch.no_grad():
        for batch in (2, 5):
            x = torch.randn((batch, *shape[1:]), generator=torch.Generator().manual_seed(batch))
            eager = {n: v.clone() for n, v in net(**{name: x.clone()}).items()}
            for blob, value in compiled(**{name: x.clone()}).items():
                _close(value, eager[blob], f"batch {batch} blob {blob}")
    assert counter.frame_count == 1


@HEAVY
@needs_cxx
def test_inductor_compiles_a_fixture_net_with_eager_outputs_and_gradients():
    """Inductor itself: every blob and the objective as eager; gradients of the layers after the last
    max pooling.  Upstream, a max-pooling window of ties (ReLU zeros, then LRN, which passes gradient at 0)
    may route its gradient to another position than eager's first maximum (Caffe's choice): measured 5e-3
    of the largest conv1 weight gradient on this net, a different tie-break rather than round-off."""
    torch._dynamo.reset()
    net = _fixture_net("vgg_cnn_m_1024_small")
    _compare(net, torch.compile(net, fullgraph=True), _inputs(net), grads_of=lambda name: ".fc" in name)


def _paper_net(path: str, phase: str, batch: int) -> CaffeNet:
    """A paper prototxt at a small batch (its Input shapes' batch axis replaced)."""
    from caffe_compat.io import read_net

    param = read_net(str(REPO / path))
    for layer in param.layer:
        if layer.type == "Input":
            for shape in layer.input_param.shape:
                shape.dim[0] = batch
    return CaffeNet(param, phase=phase, seed=3)


DIGITS = ["deploy", "train_contrastive", "train_fappy", "train_histogram", "train_lifted", "train_triplet"]


@pytest.mark.parametrize("which", DIGITS)
def test_paper_digits_nets_compile_with_eager_objective_and_gradients(which):
    torch._dynamo.reset()
    net = _paper_net(f"prototxt/digits/{which}.prototxt", "test" if which == "deploy" else "train", batch=8)
    net.eval()  # deterministic layers (no Dropout draw), so eager and compiled see the same computation
    counter = CompileCounterWithBackend("aot_eager")
    _compare(net, torch.compile(net, fullgraph=True, backend=counter), _inputs(net))
    assert counter.frame_count == 1


@pytest.mark.slow
@pytest.mark.parametrize("path", ["prototxt/cub200/deploy.prototxt", "prototxt/cub200/train_fappy.prototxt",
                                  "prototxt/vehicleid/train_histogram.prototxt"])
def test_paper_googlenet_and_vgg_nets_trace_without_graph_break(path):
    """The full-size nets (GoogLeNet, VGG-M; their data layers stood in by Inputs) in their phase,
    traced whole (``backend="eager"`` runs the captured graph as is)."""
    torch._dynamo.reset()
    train = "train_" in path
    net = _paper_net_with_inputs(path, batch=4)
    counter = CompileCounterWithBackend("eager")
    blobs = torch.compile(net, fullgraph=True, backend=counter)(**_inputs(net))
    assert counter.frame_count == 1
    if train:
        assert torch.isfinite(net.objective(blobs))


def _paper_net_with_inputs(path: str, batch: int) -> CaffeNet:
    """A paper prototxt in its phase, its data layer stood in by Inputs of ``batch`` 224² images and labels."""
    from caffe_compat.io import read_net

    param = read_net(str(REPO / path))
    for layer in param.layer:
        if not layer.bottom and layer.type != "Input":
            tops = list(layer.top)
            layer.Clear()
            layer.name, layer.type = tops[0], "Input"
            layer.top.extend(tops)
            layer.input_param.shape.add().dim.extend([batch, 3, 224, 224])
            if len(tops) > 1:
                layer.input_param.shape.add().dim.extend([batch])
    return CaffeNet(param, phase="train" if "/train_" in path else "test", seed=1)


PAPER_NETS = sorted(str(p.relative_to(REPO)) for p in (REPO / "prototxt").glob("*/*.prototxt")
                    if p.name.startswith(("train_", "deploy")))


def _meta_step(net: CaffeNet, inputs: dict) -> None:
    """Forward, objective (a probe for a deploy net), backward and Caffe's SGD update on the meta device."""
    from caffe_compat.solver.updates import SGD

    net.to("meta")
    fed = {n: (v.to("meta").requires_grad_() if v.is_floating_point() and n not in ("label", "idx") else v.to("meta"))
           for n, v in inputs.items()}
    blobs = net(**fed)
    target = net.objective(blobs) if blobs.loss_terms else sum(
        (b.float().sum() for b in blobs.values() if b.is_floating_point() and b.requires_grad),
        torch.zeros((), device="meta"))
    target.backward()
    SGD(list(net.parameters()), lr=0.01, momentum=0.9, weight_decay=2e-4).step()
    assert all(p.grad is not None and p.grad.device.type == "meta" for p in net.parameters() if p.requires_grad)


@pytest.mark.parametrize("name", PAPER_NETS + sorted(FIXTURES))
def test_a_training_step_reads_nothing_on_the_host_on_the_device_path(name):
    """CUDA graph capture of a whole step needs a step that never reads a value on the host: every paper
    net and fixture net runs its forward, backward and Caffe's SGD update on the meta device, whose tensors
    have no values (a ``.item()``, ``bool()`` or data-dependent shape there raises).  The device path is the
    one CUDA takes (the CPU's NumPy kernels are not used on meta); the layers that branch on values take
    their static forms there (``caffe_compat.losses.static_form``), as under capture."""
    net = _fixture_net(name) if name in FIXTURES else _paper_net_with_inputs(name, batch=8)
    _meta_step(net, _inputs(net))


def test_the_eager_fappy_layout_would_read_the_host(monkeypatch):
    """The meta step catches a host read: FAPPY's eager row layout (the number of positive partners read
    on the host) fails there, which is why it takes its static form under capture."""
    from caffe_compat.losses import fappy

    monkeypatch.setattr(fappy, "static_form", lambda t: False)
    net = _paper_net_with_inputs("prototxt/digits/train_fappy.prototxt", batch=8)
    with pytest.raises(RuntimeError, match="meta"):
        _meta_step(net, _inputs(net))


def _label_shuffling_net(tmp_path, seed: int = 0) -> CaffeNet:
    """The FAPPY fixture net fed by the authors' label-shuffling layer over 32 PNGs (a data layer reading its
    files in Python ahead of everything, as in their train prototxt)."""
    from tests.solver.test_distributed import _label_shuffling_solver

    _label_shuffling_solver(tmp_path, "compiled")
    net = CaffeNet(str(tmp_path / "compiled_net.prototxt"), phase="train", seed=seed)
    net.layer("data").set_prefetch(0)  # the batches drawn here, in this thread: two nets draw the same ones
    return net


def test_a_net_with_data_layers_compiles_the_rest_as_one_graph_with_eager_numbers(tmp_path):
    """``compile_net`` runs the data layers eagerly and the rest as one graph fed their tops: one graph for
    every step (no recompilation, no graph break), the eager net's objective and gradients step by step."""
    from caffe_compat.net import DataAheadOfGraph, compile_net

    torch._dynamo.reset()
    eager, net = _label_shuffling_net(tmp_path), _label_shuffling_net(tmp_path)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = compile_net(net, backend=counter)
    assert isinstance(compiled, DataAheadOfGraph) and [s.name for s in compiled.sources] == ["data"]
    for step in range(3):
        results = []
        for model, fn in ((eager, eager), (net, compiled)):
            model.zero_grad(set_to_none=True)
            blobs = fn()
            objective = model.objective(blobs)
            objective.backward()
            results.append((blobs["label"].clone(), objective.detach(),
                            {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
        (labels, target, grads), (labels_c, target_c, grads_c) = results
        assert torch.equal(labels_c, labels)  # the same batch: the data layer ran once per step, in order
        _close(target_c, target, f"objective, step {step}")
        assert grads.keys() == grads_c.keys() and grads
        for name, value in grads.items():
            _close(grads_c[name], value, f"{name}, step {step}")
    assert counter.frame_count == 1


def test_fed_data_tops_skip_the_data_layer_and_an_input_net_is_the_plain_compiled_module(tmp_path):
    from caffe_compat.net import compile_net

    torch._dynamo.reset()
    net = _label_shuffling_net(tmp_path)
    compiled = compile_net(net, backend=CompileCounterWithBackend("eager"))

    def refuse():
        raise AssertionError("the data layer ran although its tops were fed")

    net.layer("data").forward = refuse
    fed = {"data": torch.zeros(16, 3, 10, 10), "label": torch.arange(16.0).floor_divide(4)}
    assert torch.equal(compiled(**fed)["label"], fed["label"])
    net = _paper_net("prototxt/digits/train_fappy.prototxt", "train", batch=8)
    assert not isinstance(compile_net(net), type(compiled))  # Inputs only: the plain compiled module


def test_a_distributed_runs_gathered_pair_layers_split_the_net_into_fullgraph_segments(tmp_path, monkeypatch):
    """Under torchrun the pair layers' bottoms are gathered across ranks (``GatherBottoms``), padding to the
    ranks' shares read at run time: Dynamo cannot make one graph of that (``fullgraph=True`` failed on the
    first step), so ``compile_net`` runs the gathering layers (here the last two: the cosines and the loss,
    which gathers the labels) eagerly after one ``fullgraph`` graph of the layers before them, the data
    layer still ahead of it all."""
    from caffe_compat.net import DataAheadOfGraph, GraphSegments, compile_net, graph_breaking_step, traces_whole
    from caffe_compat.solver.distributed import gather_loss_bottoms

    net = _label_shuffling_net(tmp_path)
    seen = []
    monkeypatch.setattr(torch, "compile", lambda model, **options: seen.append(options) or model)
    compile_net(net)
    assert seen == [{"fullgraph": True}]  # the data layer runs ahead: the rest is one graph
    assert gather_loss_bottoms(net) == ["cosine", "loss"]  # (the loss gathers the labels)
    assert not traces_whole(net) and graph_breaking_step(net.steps, net.layers).name == "data"
    assert graph_breaking_step(net.steps[1:], net.layers).name == "cosine"
    seen.clear()
    compiled = compile_net(net)
    assert isinstance(compiled, DataAheadOfGraph) and isinstance(compiled.graph, GraphSegments)
    names = [s.name for s in net.steps]
    parts = [(names[first], names[last], graph is not None) for first, last, graph in compiled.graph.parts]
    assert parts == [("data", names[names.index("cosine") - 1], True), ("cosine", "cosine", False),
                     ("loss", "loss", False)] and names[-1] == "loss"
    assert seen == [{"fullgraph": True}]


def _user_layer_net(module) -> CaffeNet:
    """Convolution, ReLU, the user's ``ChannelScale`` Python layer (its NumPy code), 1x1 convolution, ReLU and
    a Euclidean loss: a user layer between two runs of native layers."""
    from caffe_compat.layers.python_user import register_python_layer

    register_python_layer("user_layers", "ChannelScale", module.ChannelScale)
    conv = 'convolution_param {{ num_output: 4 kernel_size: {} pad: {} weight_filler {{ type: "gaussian" std: 0.3 }} }}'
    return CaffeNet(
        'layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 dim: 5 dim: 5 } } }\n'
        'layer { name: "t" type: "Input" top: "t" input_param { shape { dim: 2 dim: 4 dim: 5 dim: 5 } } }\n'
        f'layer {{ name: "conv" type: "Convolution" bottom: "x" top: "c" {conv.format(3, 1)} }}\n'
        'layer { name: "relu" type: "ReLU" bottom: "c" top: "c" }\n'
        'layer { name: "scale" type: "Python" bottom: "c" top: "y" python_param { module: "user_layers" '
        'layer: "ChannelScale" param_str: "init: 1.5" } }\n'
        f'layer {{ name: "conv2" type: "Convolution" bottom: "y" top: "z" {conv.format(1, 0)} }}\n'
        'layer { name: "relu2" type: "ReLU" bottom: "z" top: "z" }\n'
        'layer { name: "loss" type: "EuclideanLoss" bottom: "z" bottom: "t" top: "loss" }\n', phase="train", seed=1)


def test_a_user_python_layer_splits_the_net_into_graphs_that_do_not_recompile(monkeypatch):
    """A user Python layer runs eagerly between two ``fullgraph`` graphs (Dynamo cannot trace the user's NumPy
    code): the eager net's blobs, diff targets, objective and gradients at every step, two graphs compiled
    once for three steps (the whole net compiled with graph breaks recompiled the blob table's
    ``__setitem__`` once per blob name)."""
    from caffe_compat.layers import python_user
    from caffe_compat.net import GraphSegments, compile_net

    monkeypatch.syspath_prepend(str(fixture_path("python_layers/user_layers.py").parent))
    import user_layers

    torch._dynamo.reset()
    try:
        net = _user_layer_net(user_layers)
        counter = CompileCounterWithBackend("aot_eager")
        compiled = compile_net(net, backend=counter)
        assert isinstance(compiled, GraphSegments)
        assert [(first, last, graph is not None) for first, last, graph in compiled.parts] == [
            (0, 3, True), (4, 4, False), (5, 7, True)]
        for step in range(3):
            inputs = _inputs(net, seed=step)
            _compare(net, compiled, inputs)
            fed = {n: v.clone().requires_grad_() for n, v in inputs.items()}  # as _compare feeds them
            blobs = compiled(**fed)
            assert list(blobs.diff_targets) == list(net(**fed).diff_targets)
            assert [(name, weight) for name, weight, _ in blobs.loss_terms] == [("loss", 1.0)]
        assert counter.frame_count == 2
    finally:
        python_user._REGISTERED.clear()
        sys.modules.pop("user_layers", None)
