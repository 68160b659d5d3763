"""``torch.compile(net, fullgraph=True)`` and the static form (the meta device) for the layer types that
the fixture and paper nets of ``tests/test_net_compile.py`` do not hold: Caffe's classification losses and
Accuracy (their label checks), BatchReindex and Embed (index checks), Im2col and SPP (their geometry at
run time), the recurrent layers, the batch metric losses, and HDF5Output (a file write).

Before, a label check read the host (``bool(bad.any())``), so ``caffe-compat train --compile`` failed at
once on any net with a SoftmaxWithLoss (Dynamo: "Could not guard on data-dependent expression"), as on
Accuracy's per-class top (boolean indexing), BatchReindex, Im2col (which re-read its protobuf parameter in
forward) and SPP (which built its pyramid's Pooling layers at the first forward).  Now each check is an
assertion inside the graph where the computation takes its static form
(:func:`caffe_compat.losses.static_form.asserted_in_graph`), and eagerly it still names the bad value.

The tolerance is that of ``tests/test_net_compile.py`` (a reordered float32 sum; these nets are far
smaller than its bound's widest convolution).
"""

from __future__ import annotations

import csv
import re

import h5py
import numpy as np
import pytest
import torch
from google.protobuf import text_format
from torch._dynamo.testing import CompileCounterWithBackend

from caffe_compat import hardware
from caffe_compat.cli import main
from caffe_compat.errors import DataError
from caffe_compat.net import CaffeNet, GraphSegments, compile_net
from caffe_compat.proto import caffe_pb2
from caffe_compat.solver import train as train_module
from tests.solver.test_train_cli_options import _dummy_solver
from tests.test_net_compile import _close, _forward_backward, _meta_step, compiles_as_one_graph

# Every layer here is checked for no host read (meta) and one graph (compile); the tops of the layers that
# are not losses carry a loss weight (Caffe: that top's sum enters the objective), so every parameter and
# input gets a gradient to compare.
LABEL_NET = """
name: "label_and_index_layers"
layer { name: "input" type: "Input" top: "data" top: "label" top: "target" top: "index" top: "H" top: "pair" top: "idx"
        top: "image" top: "seq" top: "cont" top: "c_prev" top: "gates" top: "cont1"
  input_param { shape { dim: 8 dim: 6 } shape { dim: 8 } shape { dim: 8 dim: 5 } shape { dim: 4 }
                shape { dim: 1 dim: 1 dim: 5 dim: 5 } shape { dim: 8 } shape { dim: 8 }
                shape { dim: 2 dim: 3 dim: 6 dim: 6 } shape { dim: 3 dim: 2 dim: 4 } shape { dim: 3 dim: 2 }
                shape { dim: 1 dim: 2 dim: 4 } shape { dim: 1 dim: 2 dim: 16 } shape { dim: 1 dim: 2 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "scores"
  inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "softmax_loss" type: "SoftmaxWithLoss" bottom: "scores" bottom: "label" top: "softmax_loss"
  loss_param { ignore_label: 4 normalization: VALID } }
layer { name: "accuracy" type: "Accuracy" bottom: "scores" bottom: "label" top: "accuracy" top: "per_class"
  accuracy_param { top_k: 2 ignore_label: 4 } }
layer { name: "hinge" type: "HingeLoss" bottom: "scores" bottom: "label" top: "hinge" }
layer { name: "prob" type: "Softmax" bottom: "scores" top: "prob" }
layer { name: "logistic" type: "MultinomialLogisticLoss" bottom: "prob" bottom: "label" top: "logistic" }
layer { name: "infogain" type: "InfogainLoss" bottom: "prob" bottom: "label" bottom: "H" top: "infogain" }
layer { name: "sigmoid_ce" type: "SigmoidCrossEntropyLoss" bottom: "scores" bottom: "target" top: "sigmoid_ce" }
layer { name: "euclidean" type: "EuclideanLoss" bottom: "scores" bottom: "target" top: "euclidean" }
layer { name: "contrastive" type: "ContrastiveLoss" bottom: "scores" bottom: "target" bottom: "pair" top: "contrastive" }
layer { name: "reindex" type: "BatchReindex" bottom: "scores" bottom: "index" top: "picked" loss_weight: 0.5 }
layer { name: "argmax" type: "ArgMax" bottom: "scores" top: "argmax" argmax_param { top_k: 2 out_max_val: true } }
layer { name: "embed" type: "Embed" bottom: "idx" top: "embedded" loss_weight: 0.5
  embed_param { input_dim: 10 num_output: 3 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "clip" type: "Clip" bottom: "scores" top: "clipped" loss_weight: 0.5 clip_param { min: -0.5 max: 0.5 } }
layer { name: "swish" type: "Swish" bottom: "scores" top: "swished" loss_weight: 0.5 }
layer { name: "square" type: "Power" bottom: "scores" top: "square" power_param { power: 2 shift: 1 } }
layer { name: "log" type: "Log" bottom: "square" top: "logged" loss_weight: 0.5 }
layer { name: "im2col" type: "Im2col" bottom: "image" top: "columns" loss_weight: 0.5 convolution_param { kernel_size: 3 pad: 1 } }
layer { name: "spp" type: "SPP" bottom: "image" top: "pyramid" loss_weight: 0.5 spp_param { pyramid_height: 2 } }
layer { name: "lstm" type: "LSTM" bottom: "seq" bottom: "cont" top: "lstm" loss_weight: 0.5
  recurrent_param { num_output: 5 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "rnn" type: "RNN" bottom: "seq" bottom: "cont" top: "rnn" loss_weight: 0.5
  recurrent_param { num_output: 5 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "lstm_unit" type: "LSTMUnit" bottom: "c_prev" bottom: "gates" bottom: "cont1" top: "c" top: "h" loss_weight: 0.5 loss_weight: 0.5 }
layer { name: "binomial" type: "BinomialDevianceLoss" bottom: "scores" bottom: "label" top: "binomial" }
layer { name: "multi_similarity" type: "MultiSimilarityLoss" bottom: "scores" bottom: "label" top: "multi_similarity" }
layer { name: "margin" type: "MarginLoss" bottom: "scores" bottom: "label" top: "margin" metric_loss_param { mining: "none" } }
"""

# A batch of 8 embeddings of 5 values, and their labels: what the metric losses below read.
EMBEDDINGS = """
layer { name: "input" type: "Input" top: "data" top: "label" input_param { shape { dim: 8 dim: 6 } shape { dim: 8 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "emb"
  inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.5 } } }
"""

# The list-wise losses, RAW (its VTHM miner: the loss reads the mined pair counts, never the index tuple,
# whose length only the host knows) and the port of madkn's histogram-loss Python layer.
METRIC_NET = 'name: "metric_losses"' + EMBEDDINGS + """
layer { name: "raw" type: "RAWLoss" bottom: "emb" bottom: "label" top: "raw" }
layer { name: "fastap" type: "FastAPLoss" bottom: "emb" bottom: "label" top: "fastap" }
layer { name: "smoothap" type: "SmoothAPLoss" bottom: "emb" bottom: "label" top: "smoothap" }
layer { name: "cosine" type: "CosineSimilarityBatch" bottom: "emb" bottom: "label" top: "cosine" top: "pair_label" }
layer { name: "distribution" type: "Python" bottom: "cosine" bottom: "pair_label" top: "distribution" loss_weight: 1
  python_param { module: "distribution_loss_layer" layer: "DistributionLossLayer" param_str: "grid_delta: 0.1" } }
"""

# Every miner in front of a pair loss, Wu et al.'s distance weighted sampling (MarginLoss's default) among
# them: it draws from torch's global generator, R draws per anchor in its static form.
MINED_NET = 'name: "mined_losses"' + EMBEDDINGS + """
layer { name: "margin" type: "MarginLoss" bottom: "emb" bottom: "label" top: "margin" }
layer { name: "contrastive_dw" type: "BatchContrastiveLoss" bottom: "emb" bottom: "label" top: "contrastive_dw"
  metric_loss_param { mining: "distance_weighted" } }
layer { name: "binomial_vthm" type: "BinomialDevianceLoss" bottom: "emb" bottom: "label" top: "binomial_vthm"
  metric_loss_param { mining: "vthm" } }
layer { name: "triplet_eps" type: "TripletLoss" bottom: "emb" bottom: "label" top: "triplet_eps"
  metric_loss_param { mining: "easy_positive+semihard" } }
layer { name: "ms_vthm" type: "MultiSimilarityLoss" bottom: "emb" bottom: "label" top: "ms_vthm"
  metric_loss_param { mining: "vthm" } }
"""

LABELS = [0.0, 1, 2, 3, 4, 0, 1, 4]  # 4 is the ignore_label of SoftmaxWithLoss and Accuracy; positive pairs


def _net(text: str, seed: int = 0) -> CaffeNet:
    return CaffeNet(text_format.Parse(text, caffe_pb2.NetParameter()), phase="train", seed=seed)


def _inputs(net: CaffeNet, seed: int = 0, **given) -> dict:
    generator = torch.Generator().manual_seed(seed)
    values = {"label": torch.tensor(LABELS), "index": torch.tensor([7.0, 0, 3, 3]),
              "idx": torch.randint(0, 10, (8,), generator=generator).float()}
    out = {}
    for name in net.feedable_names:
        shape = net.blob_shapes[name]
        if name in given:
            out[name] = given[name]
        elif name in values:
            out[name] = values[name]
        elif name.startswith("cont"):  # every stream starts a sequence at t = 0 (no state carried over)
            out[name] = torch.ones(shape)
            out[name][0] = 0.0
        elif name == "pair":  # dissimilar, then similar pairs
            out[name] = torch.ones(shape)
            out[name][0] = 0.0
        elif name in ("target", "H"):
            out[name] = torch.rand(shape, generator=generator)
        else:
            out[name] = torch.randn(shape, generator=generator)
    return out


@pytest.mark.parametrize("text", [LABEL_NET, METRIC_NET], ids=["label_and_index_layers", "metric_losses"])
def test_the_layers_trace_as_one_graph_with_eager_numbers_and_do_not_recompile(text):
    net = _net(text)
    compiles_as_one_graph(net, _inputs(net), _inputs(net, seed=1))


def test_the_recurrent_layers_carry_their_state_across_compiled_steps_as_eagerly():
    """LSTM and RNN without ``expose_hidden`` start each forward from the previous one's final states
    (Caffe's ``h_T`` copied into ``h_0``): a second batch that continues its sequences (``cont`` 1 at t = 0)
    gives the same outputs from two nets of the same seed, one eager and one compiled."""
    torch._dynamo.reset()
    eager, net = _net(LABEL_NET), _net(LABEL_NET)
    compiled = torch.compile(net, fullgraph=True, backend="aot_eager")
    first, second = _inputs(eager), _inputs(eager, seed=1)
    second["cont"] = torch.ones_like(second["cont"])
    with torch.no_grad():
        for inputs in (first, second):
            expected, got = eager(**inputs), compiled(**inputs)
            for name in ("lstm", "rnn"):
                _close(got[name], expected[name], name)
    assert float(expected["lstm"].abs().max()) > 0


@pytest.mark.parametrize("text", [LABEL_NET, METRIC_NET, MINED_NET],
                         ids=["label_and_index_layers", "metric_losses", "mined_losses"])
def test_the_layers_read_nothing_on_the_host(text):
    """The static form (what CUDA-graph capture records): forward, backward and Caffe's update on meta.  The
    metric losses used to read the host there: a miner's index tuple (``torch.nonzero``) that the losses never
    read, the distance weighted sampler's number of draws, FastAP's, Smooth-AP's and the histogram-loss
    port's boolean indexing, and Smooth-AP's largest number of positives."""
    net = _net(text)
    _meta_step(net, _inputs(net))


def test_sampled_pairs_compile_as_one_graph_with_the_numbers_of_the_static_draws(monkeypatch):
    """``torch.compile(net, fullgraph=True)`` of the mined losses: one graph across batches (it used to stop
    at Dynamo's data-dependent guard on the sampler's draws); from the same global seed its blobs, objective and
    gradients are those of the eager net whose sampler takes the static form (eager draws differ)."""
    from caffe_compat.losses import miners

    torch._dynamo.reset()
    net = _net(MINED_NET)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(net, fullgraph=True, backend=counter)
    results = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        results.append(_forward_backward(compiled, net, _inputs(net, seed=seed)))
    assert counter.frame_count == 1
    monkeypatch.setattr(miners, "static_form", lambda t: True)
    for seed, (blobs, target, grads) in zip((0, 1), results):
        torch.manual_seed(seed)
        eager_blobs, eager_target, eager_grads = _forward_backward(net, net, _inputs(net, seed=seed))
        for name, value in eager_blobs.items():
            _close(blobs[name], value, f"blob {name}")
        _close(target, eager_target, "objective")
        assert set(grads) == set(eager_grads) and eager_grads
        for name, value in eager_grads.items():
            _close(grads[name], value, name)
        assert float(eager_blobs["margin"]) > 0 and float(eager_blobs["contrastive_dw"]) > 0


@pytest.mark.parametrize("given, eager_message, graph_message", [
    ({"label": torch.tensor([0.0, 1, 2, 3, 4, 0, 1, 7])}, "layer 'softmax_loss': label 7 is outside [0, 5)",
     "layer 'softmax_loss': a label is outside [0, 5)"),
    ({"index": torch.tensor([7.0, 0, 8, 3])}, "layer 'reindex' (BatchReindex): index 8.0 is outside [0, 8)",
     "layer 'reindex' (BatchReindex): an index is outside [0, 8)"),
    ({"idx": torch.tensor([0.0, 1, 2, 3, 4, 5, 6, 10])}, "layer 'embed': Embed index 10.0 is outside [0, 10)",
     "layer 'embed': an Embed index is outside [0, 10)"),
])
def test_a_bad_label_or_index_fails_eagerly_naming_it_and_compiled_naming_the_layer(given, eager_message,
                                                                                    graph_message):
    torch._dynamo.reset()
    net = _net(LABEL_NET)
    inputs = _inputs(net, **given)
    with pytest.raises(DataError, match=re.escape(eager_message)):
        net(**inputs)
    compiled = torch.compile(net, fullgraph=True, backend="aot_eager")
    with pytest.raises(RuntimeError, match=re.escape(graph_message)):
        compiled(**inputs)


def test_accuracy_per_class_counts_every_position_without_boolean_indexing():
    """Accuracy's per-class top counts each class over its positions (ignored ones excluded): by hand."""
    net = _net(LABEL_NET)
    with torch.no_grad():
        blobs = net(**_inputs(net))
    scores, labels = blobs["scores"], torch.tensor(LABELS).long()
    top2 = scores.topk(2, dim=1).indices
    expected = torch.zeros(5)
    for c in range(4):  # class 4 is the ignore_label: never counted, 0
        rows = labels == c
        expected[c] = (top2[rows] == c).any(dim=1).float().mean()
    assert torch.equal(blobs["per_class"], expected)


def test_hdf5_output_writes_its_file_between_two_compiled_graphs(tmp_path):
    """HDF5Output writes a file in forward (h5py), which no graph holds: the net compiles as graphs around it
    (its port ``breaks_graph``), and the file holds the blobs of that forward."""
    torch._dynamo.reset()
    path = tmp_path / "out.h5"
    text = f"""
    name: "h5"
    layer {{ name: "input" type: "Input" top: "data" top: "label" input_param {{ shape {{ dim: 4 dim: 3 }} shape {{ dim: 4 }} }} }}
    layer {{ name: "ip" type: "InnerProduct" bottom: "data" top: "emb"
      inner_product_param {{ num_output: 2 weight_filler {{ type: "gaussian" std: 0.5 }} }} }}
    layer {{ name: "out" type: "HDF5Output" bottom: "emb" bottom: "label" hdf5_output_param {{ file_name: "{path}" }} }}
    layer {{ name: "after" type: "Power" bottom: "emb" top: "after" power_param {{ scale: 2 }} }}
    """
    net = _net(text)
    compiled = compile_net(net, backend="aot_eager")
    assert isinstance(compiled, GraphSegments)
    inputs = {"data": torch.randn(4, 3), "label": torch.tensor([0.0, 1, 2, 3])}
    blobs = compiled(**inputs)
    with h5py.File(path) as written:
        assert np.array_equal(written["data"][:].reshape(4, 2), blobs["emb"].detach().numpy())
        assert np.array_equal(written["label"][:].reshape(4), inputs["label"].numpy())
    assert torch.equal(blobs["after"], 2 * blobs["emb"])


def test_cli_train_compile_on_a_margin_loss_net_trains_as_the_static_draws(tmp_path, monkeypatch):
    """``caffe-compat train --compile`` on an HDF5Data net trained with MarginLoss (Wu et al.'s sampling, the
    layer's default) stopped at its first iteration with a traceback (Dynamo's data-dependent guard on the
    number of draws, exit 1); now it trains, its losses those of an eager run whose sampler takes the static
    form (same solver seed; backend ``aot_eager``, as above)."""
    from caffe_compat.losses import miners

    monkeypatch.setattr(train_module, "compile_net", lambda net, **options: compile_net(net, backend="aot_eager"))
    monkeypatch.setattr(hardware, "cpu_compiler", lambda: "/usr/bin/c++")  # aot_eager builds no C++
    monkeypatch.chdir(tmp_path)
    with h5py.File(tmp_path / "data.h5", "w") as out:
        out["data"] = np.random.default_rng(0).standard_normal((32, 6)).astype(np.float32)
        out["label"] = (np.arange(32) % 4).astype(np.float32)
    (tmp_path / "list.txt").write_text(f"{tmp_path / 'data.h5'}\n")
    (tmp_path / "net.prototxt").write_text(f"""
    name: "margin"
    layer {{ name: "data" type: "HDF5Data" top: "data" top: "label"
      hdf5_data_param {{ source: "{tmp_path / 'list.txt'}" batch_size: 8 }} }}
    layer {{ name: "ip" type: "InnerProduct" bottom: "data" top: "emb"
      inner_product_param {{ num_output: 5 weight_filler {{ type: "gaussian" std: 0.5 }} }} }}
    layer {{ name: "loss" type: "MarginLoss" bottom: "emb" bottom: "label" top: "loss" }}
    """)
    (tmp_path / "solver.prototxt").write_text('net: "net.prototxt"\nbase_lr: 0.1\nlr_policy: "fixed"\nmax_iter: 3\n'
                                              'snapshot_after_train: false\nrandom_seed: 1\nsolver_mode: CPU\n')
    losses = {}
    for mode, extra in (("compiled", ["--compile"]), ("eager, static draws", [])):
        if not extra:
            monkeypatch.setattr(miners, "static_form", lambda t: True)
        log = tmp_path / f"{len(losses)}.csv"
        assert main(["train", "solver.prototxt", "--log", str(log), *extra]) == 0
        with open(log, newline="") as fh:
            losses[mode] = [float(row["loss"]) for row in csv.DictReader(fh)]
    assert len(losses["compiled"]) == 3 and all(v > 0 for v in losses["compiled"])
    np.testing.assert_allclose(losses["compiled"], losses["eager, static draws"], rtol=1e-5)


def test_cli_train_compile_on_a_softmax_with_loss_net_trains_as_eager(tmp_path, monkeypatch):
    """``caffe-compat train --compile`` on the BVLC-style toy net (DummyData, conv, pooling, SoftmaxWithLoss)
    used to stop at its first iteration with Dynamo's data-dependent guard error; now its losses are
    eager's (the backend is ``aot_eager`` here: Dynamo's tracing, where it failed, without inductor's C++)."""
    monkeypatch.setattr(train_module, "compile_net", lambda net, **options: compile_net(net, backend="aot_eager"))
    monkeypatch.setattr(hardware, "cpu_compiler", lambda: "/usr/bin/c++")  # aot_eager builds no C++
    monkeypatch.chdir(tmp_path)
    losses = {}
    for mode, extra in (("eager", []), ("compiled", ["--compile"])):
        (tmp_path / mode).mkdir()
        solver = _dummy_solver(tmp_path / mode, max_iter=3)
        assert main(["train", solver, "--log", str(tmp_path / mode / "log.csv"), *extra]) == 0
        with open(tmp_path / mode / "log.csv", newline="") as fh:
            losses[mode] = [float(row["loss"]) for row in csv.DictReader(fh)]
    assert len(losses["eager"]) == 3
    np.testing.assert_allclose(losses["compiled"], losses["eager"], rtol=1e-5)
