"""Prefetching data layers (caffe_compat.data.prefetch): the batches, the stream states and a training
trajectory are bit-identical with and without prefetching (0, 1 and 3 decode workers) for Data (LMDB),
ImageData, HDF5Data, WindowData and the LabelShufflingLayer port; a resume from a state saved mid-stream
while the read-ahead runs continues exactly; a failing record raises the same typed error at the same batch
and leaves the same state; mode switches, reseeding and state loads drop the read-ahead; the threads stop
when the layer is collected and at interpreter exit; pinned memory and non-blocking copies on CUDA."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import time

import cv2
import numpy as np
import pytest
import torch
from google.protobuf import text_format

from caffe_compat.data import prefetch
from caffe_compat.errors import DataError
from caffe_compat.io import make_datum
from caffe_compat.io.datum_lmdb import LmdbWriter
from caffe_compat.layers import layer_class
from caffe_compat.proto import caffe_pb2

SEQUENTIAL, PREFETCHED = {"depth": 0}, [{"depth": 3, "workers": 0}, {"depth": 1, "workers": 1},
                                       {"depth": 3, "workers": 3}]


def _images(folder, n=13, size=(9, 11)):
    g = np.random.RandomState(0)
    folder.mkdir(exist_ok=True)
    lines = []
    for i in range(n):
        cv2.imwrite(str(folder / f"{i}.png"), g.randint(0, 256, (*size, 3)).astype(np.uint8))
        lines.append(f"{i}.png {i % 4}")
    (folder / "list.txt").write_text("\n".join(lines) + "\n")
    return folder


def _lmdb(path, n=11, size=10):
    g = np.random.RandomState(1)
    with LmdbWriter(path) as writer:
        for i in range(n):
            ok, jpeg = cv2.imencode(".jpg", g.randint(0, 256, (size, size, 3)).astype(np.uint8))
            writer.put(f"{i:08d}", make_datum(jpeg.tobytes(), i % 3, encoded=True))
    return path


def _hdf5(folder):
    h5py = pytest.importorskip("h5py")
    g = np.random.RandomState(2)
    names = []
    for k, rows in enumerate((5, 3, 4)):
        with h5py.File(folder / f"{k}.h5", "w") as f:
            f["data"] = g.rand(rows, 2, 3).astype(np.float32)
            f["label"] = np.arange(rows, dtype=np.float32) + 10 * k
        names.append(str(folder / f"{k}.h5"))
    (folder / "h5.txt").write_text("\n".join(names))


def _windows(folder):
    g = np.random.RandomState(3)
    for k in range(2):
        cv2.imwrite(str(folder / f"w{k}.png"), g.randint(0, 256, (20, 24, 3)).astype(np.uint8))
    (folder / "windows.txt").write_text("# 0\nw0.png\n3 20 24\n3\n1 0.9 2 3 9 12\n0 0.1 0 0 5 5\n4 0.8 1 1 20 15\n"
                                        "# 1\nw1.png\n3 20 24\n2\n3 0.75 4 4 11 11\n5 0.2 0 0 15 15\n")


def _param(kind, folder, batch=5):
    if kind == "data":
        text = (f'name: "d" type: "Data" top: "data" top: "label" transform_param {{ crop_size: 7 mirror: true '
                f'mean_value: 100 scale: 0.5 }} data_param {{ source: "{folder}/db" batch_size: {batch} backend: LMDB }}')
    elif kind == "image_data":
        text = (f'name: "d" type: "ImageData" top: "data" top: "label" transform_param {{ crop_size: 6 mirror: true }} '
                f'image_data_param {{ source: "{folder}/list.txt" root_folder: "{folder}/" batch_size: {batch} '
                f'shuffle: true rand_skip: 5 }}')
    elif kind == "hdf5":
        text = (f'name: "d" type: "HDF5Data" top: "data" top: "label" hdf5_data_param {{ source: "{folder}/h5.txt" '
                f'batch_size: {batch} shuffle: true }}')
    elif kind == "window":
        text = (f'name: "d" type: "WindowData" top: "data" top: "label" transform_param {{ crop_size: 8 mirror: true '
                f'mean_value: 50 }} window_data_param {{ source: "{folder}/windows.txt" root_folder: "{folder}/" '
                f'batch_size: {batch} fg_fraction: 0.4 context_pad: 1 }}')
    else:
        text = (f'name: "d" type: "Python" top: "data" top: "label" python_param {{ module: "label_shuffling_layer" '
                f'layer: "LabelShufflingLayer" param_str: "source: {folder}/db\\nbatch_size: {batch}\\n'
                f'scales: [0.5, 1.]\\nmax_number_object_per_label: 2" }}')
    return text_format.Parse(text, caffe_pb2.LayerParameter())


KINDS = ["data", "image_data", "hdf5", "window", "label_shuffling"]


@pytest.fixture
def sources(tmp_path):
    _images(tmp_path)
    _lmdb(tmp_path / "db")
    _windows(tmp_path)
    return tmp_path


def _layer(kind, folder, settings, phase="train", seed=7):
    if kind == "hdf5":
        _hdf5(folder)
    param = _param(kind, folder)
    layer = layer_class(param)(param, [], phase)
    layer.fill(torch.Generator().manual_seed(seed))
    layer.set_prefetch(**settings)
    return layer


def _run(layer, n):
    out = []
    for _ in range(n):
        tops = layer()
        out.append(([t.numpy().copy() for t in tops], _flat(layer.stream_state())))
    return out


def _flat(state):
    """A state as comparable plain values (RandomState dicts, arrays)."""
    if isinstance(state, dict):
        return {k: _flat(v) for k, v in state.items()}
    if isinstance(state, np.ndarray):
        return state.tolist()
    return state


def _assert_same(a, b):
    assert len(a) == len(b)
    for (tops_a, state_a), (tops_b, state_b) in zip(a, b):
        for x, y in zip(tops_a, tops_b):
            assert x.dtype == y.dtype and np.array_equal(x, y)
        assert state_a == state_b


_EARLIER: set = set()


@pytest.fixture(autouse=True)
def _threads_of_earlier_tests():
    """The prefetch threads alive when a test starts are not its own: a layer stops its threads when it is
    collected, and another module's test may still hold one (run after tests/layers, these tests saw them)."""
    _EARLIER.clear()
    _EARLIER.update(t for t in threading.enumerate() if t.name.startswith("caffe_compat-"))
    yield


def _prefetch_threads():
    return [t for t in threading.enumerate() if t.name.startswith("caffe_compat-") and t not in _EARLIER]


def _wait_no_threads(timeout=10.0):
    deadline = time.monotonic() + timeout
    while _prefetch_threads() and time.monotonic() < deadline:
        time.sleep(0.02)
    return _prefetch_threads()


@pytest.mark.parametrize("settings", PREFETCHED, ids=lambda s: f"depth{s['depth']}-workers{s['workers']}")
@pytest.mark.parametrize("kind", KINDS)
def test_batches_and_states_equal_without_prefetching(sources, kind, settings):
    expected = _run(_layer(kind, sources, SEQUENTIAL), 9)  # wraps the sources (shuffles, file changes)
    layer = _layer(kind, sources, settings)
    assert layer.prefetch_depth == settings["depth"]
    _assert_same(_run(layer, 9), expected)
    assert _prefetch_threads()
    layer.reset_prefetch()
    assert not _wait_no_threads()


def test_prefetching_is_the_default_and_data_param_prefetch_sets_the_depth(sources, monkeypatch):
    param = _param("data", sources)
    assert layer_class(param)(param, [], "train").prefetch_depth == prefetch.DEFAULT_DEPTH == 3
    param.data_param.prefetch = 5
    assert layer_class(param)(param, [], "train").prefetch_depth == 5
    param.data_param.prefetch = 0
    assert layer_class(param)(param, [], "train").prefetch_depth == 0
    monkeypatch.setenv("CAFFE_COMPAT_PREFETCH", "0")
    assert layer_class(_param("image_data", sources))(_param("image_data", sources), [], "train").prefetch_depth == 0
    monkeypatch.setenv("CAFFE_COMPAT_PREFETCH_WORKERS", "2")
    assert prefetch.default_workers() == 2


@pytest.mark.parametrize("kind", KINDS)
def test_resume_from_a_state_saved_mid_stream_continues_exactly(sources, kind):
    expected = _run(_layer(kind, sources, SEQUENTIAL), 8)
    first = _layer(kind, sources, {"depth": 3, "workers": 2})
    _run(first, 3)
    time.sleep(0.05)  # the read-ahead is batches beyond the consumed ones by now
    state = first.stream_state()
    assert _flat(state) == expected[2][1]  # the consumed stream, not the read-ahead position
    second = _layer(kind, sources, {"depth": 2, "workers": 1}, seed=99)
    _run(second, 2)  # its own read-ahead runs: load_stream_state must drop it
    second.load_stream_state(state)
    _assert_same(_run(second, 5), expected[3:])
    _assert_same(_run(first, 5), expected[3:])


def test_mode_switch_and_reseed_drop_the_read_ahead(sources):
    def steps(layer):
        out = _run(layer, 2)
        layer.eval()  # TEST transform: centre crop
        out += _run(layer, 2)
        layer.train()
        out += _run(layer, 1)
        layer.fill(torch.Generator().manual_seed(3))
        return out + _run(layer, 2)

    _assert_same(steps(_layer("image_data", sources, {"depth": 3, "workers": 2})),
                 steps(_layer("image_data", sources, SEQUENTIAL)))


def test_a_failing_record_raises_the_same_error_at_the_same_batch(sources):
    (sources / "5.png").write_bytes(b"not an image")

    def until_error(layer):
        out = []
        for _ in range(6):
            try:
                out.append([t.numpy().copy() for t in layer()])
            except DataError as exc:
                with pytest.raises(DataError) as again:  # it stays at the failing record, as Caffe's cursor
                    layer()
                return out, str(exc), _flat(layer.stream_state()), str(again.value)
        raise AssertionError("no error")

    param = _param("image_data", sources)
    param.image_data_param.shuffle = False
    param.image_data_param.rand_skip = 0
    results = []
    for settings in (SEQUENTIAL, {"depth": 3, "workers": 2}):
        layer = layer_class(param)(param, [], "train")
        layer.set_prefetch(**settings)
        results.append(until_error(layer))
    (good_a, message_a, state_a, after_a), (good_b, message_b, state_b, after_b) = results
    assert len(good_a) == len(good_b) == 1 and np.array_equal(good_a[0][0], good_b[0][0])
    assert message_a == message_b and "line 6" in message_a
    assert state_a == state_b  # where the sequential code stopped, mid-batch
    assert after_a == after_b == message_a


def test_threads_stop_when_the_layer_or_the_net_is_collected(sources):
    from caffe_compat.net import CaffeNet

    assert not _wait_no_threads()
    layer = _layer("label_shuffling", sources, {"depth": 3, "workers": 2})
    layer()
    assert len(_prefetch_threads()) == 3  # the sequencer and two decode workers
    del layer
    gc.collect()
    assert not _wait_no_threads()
    net_param = caffe_pb2.NetParameter(name="n")
    net_param.layer.add().CopyFrom(_param("data", sources))
    net = CaffeNet(net_param, phase="train")
    net.forward()
    assert _prefetch_threads()
    del net
    gc.collect()
    assert not _wait_no_threads()


def test_interpreter_exit_with_running_prefetchers_is_clean(sources):
    script = (f"import torch\nfrom google.protobuf import text_format\nfrom caffe_compat.layers import layer_class\n"
              f"from caffe_compat.proto import caffe_pb2\n"
              f"p = text_format.Parse({str(_param('data', sources))!r}, caffe_pb2.LayerParameter())\n"
              f"layers = [layer_class(p)(p, [], 'train') for _ in range(2)]\n"
              f"[l.set_prefetch(depth=2, workers=2) for l in layers]\n[l() for l in layers]\nprint('ok')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr


def test_pinned_memory_and_non_blocking_copies_for_cuda(sources, monkeypatch):
    """On CUDA the sequencer pins the batch and the copy is non_blocking (the logic, checked on CPU)."""
    pinned, copies = set(), []
    real_to = torch.Tensor.to

    def fake_pin(self):
        out = self.clone()
        pinned.add(out.data_ptr())
        return out

    def recording_to(self, *args, **kwargs):
        copies.append(kwargs.get("non_blocking", False))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(prefetch, "wants_pinned", lambda device: True)
    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: self.data_ptr() in pinned)
    monkeypatch.setattr(torch.Tensor, "to", recording_to)
    layer = _layer("data", sources, {"depth": 2, "workers": 1})
    tops = layer()
    assert len(pinned) >= 2 and copies[-2:] == [True, True]
    layer.reset_prefetch()
    monkeypatch.setattr(prefetch, "wants_pinned", lambda device: False)
    # the fake pinned clones are freed by now: a new batch may get one's address, which is not pinning it
    pinned.clear()
    copies.clear()
    layer()
    assert copies[-2:] == [False, False] and tops[0].shape == (5, 3, 7, 7)
    layer.reset_prefetch()


def test_training_trajectory_equal_with_and_without_prefetching(sources):
    from caffe_compat.solver import Solver

    net = text_format.Parse(str(_param("data", sources)), caffe_pb2.LayerParameter())
    hidden = ('layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param { num_output: 3 '
              'weight_filler { type: "gaussian" std: 0.1 } } }\n'
              'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }\n')

    def trajectory(settings):
        prefetch.configure(enabled=settings["depth"] > 0, workers=settings.get("workers"))
        try:
            param = caffe_pb2.SolverParameter(base_lr=0.05, lr_policy="fixed", momentum=0.9, max_iter=10,
                                              random_seed=5, display=0)
            text_format.Parse(f"layer {{ {net} }}\n{hidden}", param.net_param)
            solver = Solver(param, device="cpu")
            assert solver.net.layer("d").prefetch_depth == settings["depth"]
            losses = [solver.step(1) for _ in range(8)]
            weights = [b.detach().numpy().copy() for blobs in solver.net.params.values() for b in blobs]
            return losses, weights
        finally:
            prefetch.configure()

    losses_a, weights_a = trajectory(SEQUENTIAL)
    losses_b, weights_b = trajectory({"depth": 3, "workers": 2})
    assert losses_a == losses_b and len(set(losses_a)) > 1
    assert all(np.array_equal(a, b) for a, b in zip(weights_a, weights_b))
