"""User Python layers (``type: "Python"``) as pycaffe scripts drive them through ``caffe.Net``: the
layer's ``self.blobs`` are the net's parameter blobs (what the layer writes into them stays), ``net.reshape()`` calls
the layer's ``reshape``, an in-place top is the bottom's blob, the user's exceptions reach the script,
``net.layers[i]`` is an instance of the user's class, param diffs are what backward leaves, a param_str set by the
script survives a reshape."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import caffe_compat as caffe
from caffe_compat.errors import PythonLayerError
from caffe_compat.layers import python_user


class _CountingLayer(caffe.Layer):
    """Passes its bottom through; ``self.blobs[0]`` counts the forwards, ``self.blobs[1]`` the backwards
    (state kept in the layer's blobs, as Caffe layers keep an iteration counter or a running statistic)."""

    def setup(self, bottom, top):
        self.blobs.add_blob(1)
        self.blobs.add_blob(1)

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        self.blobs[0].data[...] += 1
        top[0].data[...] = bottom[0].data * self.blobs[0].data[0]

    def backward(self, top, propagate_down, bottom):
        self.blobs[1].data[...] += 1
        bottom[0].diff[...] = top[0].diff


@pytest.fixture(params=["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def counting_net(request, tmp_path):
    if request.param == "cuda":  # net.params are host copies there
        caffe.set_mode_gpu()
    path = tmp_path / "count.prototxt"
    path.write_text("""name: 'count' force_backward: true
layer { name: 'data' type: 'Input' top: 'data' input_param { shape { dim: 2 dim: 3 } } }
layer { name: 'count' type: 'Python' bottom: 'data' top: 'y' python_param { module: 'pl_net' layer: 'Count' } }""")
    caffe.register_python_layer("pl_net", "Count", _CountingLayer)
    try:
        yield caffe.Net(str(path), caffe.TRAIN)
    finally:
        caffe.set_mode_cpu()
        python_user.unregister_python_layer("pl_net", "Count")


def test_what_a_python_layer_writes_into_its_blobs_stays(counting_net, tmp_path):
    """Caffe's ``self.blobs`` of a Python layer are the layer's parameter blobs: a write in ``forward`` or
    ``backward`` is the parameter's value from then on (``net.params``, the next forward, a snapshot)."""
    net = counting_net
    net.blobs["data"].data[...] = 1
    net.forward()
    np.testing.assert_array_equal(net.forward()["y"], np.full((2, 3), 2.0))  # the second forward read 1, wrote 2
    net.backward()
    assert net.params["count"][0].data.tolist() == [2.0] and net.params["count"][1].data.tolist() == [1.0]
    net.params["count"][0].data[...] = 10  # what the script writes is what the layer reads next
    np.testing.assert_array_equal(net.forward()["y"], np.full((2, 3), 11.0))
    net.save(str(tmp_path / "count.caffemodel"))
    net.params["count"][0].data[...] = 0
    net.copy_from(str(tmp_path / "count.caffemodel"))
    assert net.params["count"][0].data.tolist() == [11.0]


class _BatchLayer(caffe.Layer):
    """A data layer whose batch size the script sets (``net.layers[0].batch = n``); counts its setups."""

    setups = 0

    def setup(self, bottom, top):
        type(self).setups += 1
        self.batch = 2

    def reshape(self, bottom, top):
        top[0].reshape(self.batch, 3)

    def forward(self, bottom, top):
        top[0].data[...] = 1

    def backward(self, top, propagate_down, bottom):
        pass


def test_net_reshape_calls_the_python_layers_reshape(tmp_path):
    """Caffe's ``net.reshape()`` (Net::Reshape) calls every layer's Reshape, a Python layer's ``reshape``
    included, with no input blob changed: the tops it now shapes and every blob after them take their new
    shapes at once, before any forward; the layer is not set up again."""
    path = tmp_path / "batch.prototxt"
    path.write_text("""name: 'batch'
layer { name: 'feed' type: 'Python' top: 'x' python_param { module: 'pl_net' layer: 'Batch' } }
layer { name: 'ip' type: 'InnerProduct' bottom: 'x' top: 'y'
  inner_product_param { num_output: 4 weight_filler { type: 'constant' value: 1 } } }""")
    caffe.register_python_layer("pl_net", "Batch", _BatchLayer)
    _BatchLayer.setups = 0
    try:
        net = caffe.Net(str(path), caffe.TEST)
        assert (net.blobs["x"].shape, net.blobs["y"].shape) == ((2, 3), (2, 4))
        net.layers[0].batch = 5
        net.reshape()
        assert (net.blobs["x"].shape, net.blobs["y"].shape) == ((5, 3), (5, 4))
        assert _BatchLayer.setups == 1
        np.testing.assert_array_equal(net.forward()["y"], np.full((5, 4), 3.0))
    finally:
        python_user.unregister_python_layer("pl_net", "Batch")


class _InPlaceDouble(caffe.Layer):
    """Written for in-place use only, as Caffe allows: it scales its top's data and diff where they lie."""

    def setup(self, bottom, top):
        self.same = bottom[0] is top[0]

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        top[0].data[...] *= 2

    def backward(self, top, propagate_down, bottom):
        bottom[0].diff[...] *= 2


def test_an_in_place_python_layer_works_on_its_bottoms_blob(tmp_path):
    """In Caffe an in-place top (``bottom: 'ip' top: 'ip'``) is the bottom's very blob: forward scaling
    ``top[0].data`` scales the bottom's values, and backward finds the top's diff in ``bottom[0].diff``."""
    path = tmp_path / "inplace.prototxt"
    path.write_text("""name: 'inplace' force_backward: true
layer { name: 'data' type: 'Input' top: 'data' input_param { shape { dim: 2 dim: 3 } } }
layer { name: 'ip' type: 'InnerProduct' bottom: 'data' top: 'ip'
  inner_product_param { num_output: 2 weight_filler { type: 'constant' value: 1 } } }
layer { name: 'dbl' type: 'Python' bottom: 'ip' top: 'ip' python_param { module: 'pl_net' layer: 'Double' } }""")
    caffe.register_python_layer("pl_net", "Double", _InPlaceDouble)
    try:
        net = caffe.Net(str(path), caffe.TRAIN)
        assert net.layers[2].same
        net.blobs["data"].data[...] = 1
        np.testing.assert_array_equal(net.forward()["ip"], np.full((2, 2), 6.0))
        net.blobs["ip"].diff[...] = 1
        np.testing.assert_array_equal(net.backward()["data"], np.full((2, 3), 4.0))  # 2 outputs x 2 x weight 1
    finally:
        python_user.unregister_python_layer("pl_net", "Double")


class _ShortFeed(caffe.Layer):
    """A data layer with two batches: then StopIteration; a bad ``param_str`` key is a KeyError."""

    def setup(self, bottom, top):
        self.batches = [np.full((2, 3), 1.0), np.full((2, 3), 2.0)]

    def reshape(self, bottom, top):
        top[0].reshape(2, 3)

    def forward(self, bottom, top):
        if self.param_str:
            raise KeyError(self.param_str)
        if not self.batches:
            raise StopIteration
        top[0].data[...] = self.batches.pop(0)

    def backward(self, top, propagate_down, bottom):
        pass


def test_the_user_layers_own_exception_reaches_the_script(tmp_path):
    """Caffe's PythonLayer calls the user's methods without catching, so the user's exception reaches the
    script: ``except StopIteration`` around ``net.forward()`` ends a loop over a Python data layer.  Ours
    is also a PythonLayerError (a RuntimeError) naming the layer."""
    path = tmp_path / "short.prototxt"
    path.write_text("""name: 'short'
layer { name: 'feed' type: 'Python' top: 'x' python_param { module: 'pl_net' layer: 'Short' } }""")
    caffe.register_python_layer("pl_net", "Short", _ShortFeed)
    try:
        net = caffe.Net(str(path), caffe.TEST)
        seen = []
        while True:
            try:
                seen.append(float(net.forward()["x"][0, 0]))
            except StopIteration as exc:
                assert isinstance(exc, PythonLayerError) and "layer 'feed'" in str(exc)
                break
        assert seen == [1.0, 2.0]
        net.layers[0].param_str = "label"
        with pytest.raises(KeyError, match="_ShortFeed.forward raised KeyError"):
            net.forward()
    finally:
        python_user.unregister_python_layer("pl_net", "Short")


def test_a_python_layer_in_net_layers_is_an_instance_of_the_users_class(counting_net):
    """pycaffe's ``net.layers[i]`` of a Python layer is the user's object: ``isinstance`` with the user's
    class holds (scripts pick their data layer so) and its ``__class__`` is that class."""
    layers = counting_net.layers
    assert isinstance(layers[1], _CountingLayer) and isinstance(layers[1], caffe.Layer)
    assert layers[1].__class__ is _CountingLayer and layers[1].__class__.__name__ == "_CountingLayer"
    assert not isinstance(layers[0], _CountingLayer)


class _ScaleByBlob(caffe.Layer):
    """y = w * x with a learnable scalar w; ``param_str`` 'assign' writes dw with ``=``, else with ``+=``;
    records the diff it finds when backward starts."""

    def setup(self, bottom, top):
        self.blobs.add_blob(1)
        self.blobs[0].data[...] = 1
        self.found = []

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        top[0].data[...] = self.blobs[0].data[0] * bottom[0].data

    def backward(self, top, propagate_down, bottom):
        self.found.append(float(self.blobs[0].diff[0]))
        grad = (top[0].diff * bottom[0].data).sum()
        if self.param_str == "assign":
            self.blobs[0].diff[...] = grad
        else:
            self.blobs[0].diff[...] += grad
        bottom[0].diff[...] = self.blobs[0].data[0] * top[0].diff


def test_a_python_layers_param_diff_is_what_its_backward_leaves(tmp_path):
    """Caffe's Python layer blobs are the parameter blobs: backward finds the diff accumulated so far (net
    diffs are not cleared by backward) and what it leaves is the diff: ``+=`` accumulates over two
    ``net.backward()`` calls, ``=`` overwrites (the second backward leaves one pass's gradient)."""
    path = tmp_path / "scale.prototxt"
    path.write_text("""name: 'scale' force_backward: true
layer { name: 'data' type: 'Input' top: 'data' input_param { shape { dim: 2 dim: 3 } } }
layer { name: 'add' type: 'Python' bottom: 'data' top: 'a'
  python_param { module: 'pl_net' layer: 'Scale' param_str: 'add' } }
layer { name: 'assign' type: 'Python' bottom: 'a' top: 'b'
  python_param { module: 'pl_net' layer: 'Scale' param_str: 'assign' } }""")
    caffe.register_python_layer("pl_net", "Scale", _ScaleByBlob)
    try:
        net = caffe.Net(str(path), caffe.TRAIN)
        net.blobs["data"].data[...] = 2
        net.forward()
        net.blobs["b"].diff[...] = 1
        net.backward()
        net.backward()
        # each pass: d/dw of sum(w * x) with x = 2 over 6 values is 12
        assert net.params["add"][0].diff.tolist() == [24.0] and net.params["assign"][0].diff.tolist() == [12.0]
        assert net.layers[1].found == [0.0, 12.0] and net.layers[2].found == [0.0, 12.0]
        net.clear_param_diffs()
        net.backward()
        assert net.params["add"][0].diff.tolist() == [12.0] and net.layers[2].found[-1] == 0.0
    finally:
        python_user.unregister_python_layer("pl_net", "Scale")


class _ParamStrScale(caffe.Layer):
    """Multiplies by ``float(self.param_str)``, read at each forward."""

    def setup(self, bottom, top):
        pass

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        top[0].data[...] = float(self.param_str) * bottom[0].data

    def backward(self, top, propagate_down, bottom):
        pass


def test_a_param_str_the_script_set_survives_a_reshape(tmp_path):
    """Caffe sets ``param_str`` once, in LayerSetUp; reshaping the net (an input blob's new shape) calls only
    ``reshape``, so what the script set on ``net.layers[i].param_str`` stays."""
    path = tmp_path / "pstr.prototxt"
    path.write_text("""name: 'pstr'
layer { name: 'data' type: 'Input' top: 'data' input_param { shape { dim: 2 dim: 3 } } }
layer { name: 'scale' type: 'Python' bottom: 'data' top: 'y'
  python_param { module: 'pl_net' layer: 'PStr' param_str: '2' } }""")
    caffe.register_python_layer("pl_net", "PStr", _ParamStrScale)
    try:
        net = caffe.Net(str(path), caffe.TEST)
        net.layers[1].param_str = "5"
        net.blobs["data"].reshape(4, 3)
        net.blobs["data"].data[...] = 1
        np.testing.assert_array_equal(net.forward()["y"], np.full((4, 3), 5.0))
        assert net.layers[1].param_str == "5"
    finally:
        python_user.unregister_python_layer("pl_net", "PStr")


def test_a_python_layers_type_is_python(counting_net):
    """pycaffe's ``caffe.Layer`` has Caffe's ``type`` property: ``PythonLayer::type()`` is "Python", read
    by the layer itself (``self.type``) as on ``net.layers[i]``."""
    user = counting_net.torch_net.layers["count"].user
    assert (user.type, counting_net.layers[1].type, caffe.Layer.type) == ("Python", "Python", "Python")


class _PassThrough(caffe.Layer):
    """Top 0 is bottom 0 (no gradient): the layers below test what their ``setup`` does."""

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        top[0].data[...] = bottom[0].data

    def backward(self, top, propagate_down, bottom):
        pass


def _pass_through_net(tmp_path, layer: str, cls) -> "caffe.Net":
    """``caffe.Net`` of an Input (2, 3) and one Python layer ``layer`` of class ``cls`` (registered as
    ``pl_net.<layer>``; the caller unregisters it)."""
    path = tmp_path / f"{layer.lower()}.prototxt"
    path.write_text(f"""name: '{layer.lower()}'
layer {{ name: 'data' type: 'Input' top: 'data' input_param {{ shape {{ dim: 2 dim: 3 }} }} }}
layer {{ name: '{layer.lower()}' type: 'Python' bottom: 'data' top: 'y'
        python_param {{ module: 'pl_net' layer: '{layer}' }} }}""")
    caffe.register_python_layer("pl_net", layer, cls)
    return caffe.Net(str(path), caffe.TEST)


class _BlobMemory(_PassThrough):
    """Reshapes its own blobs in ``setup`` as Caffe's ``Blob::Reshape`` would see them; records what it saw."""

    seen: dict = {}

    def setup(self, bottom, top):
        self.blobs.add_blob(2, 3)
        self.blobs[0].data[...] = np.arange(6).reshape(2, 3)
        self.blobs[0].diff[...] = 7
        self.blobs[0].reshape(3, 2)  # same count: the same memory, seen in the new shape
        self.seen["same_count"] = (self.blobs[0].data.copy(), self.blobs[0].diff.copy())
        self.blobs[0].reshape(1, 2)  # smaller: the first values
        self.seen["smaller"] = self.blobs[0].data.copy()
        self.blobs[0].reshape(6)  # back within the capacity: all of them, those past the small count too
        self.seen["back"] = self.blobs[0].data.copy()
        self.blobs[0].reshape(7)  # past the capacity: new memory, zeros
        self.seen["grown"] = (self.blobs[0].data.copy(), self.blobs[0].diff.copy())
        self.blobs[0].data[...] = np.arange(7)
        self.blobs[0].reshape(1, 7)


def test_a_python_layers_own_blob_reshapes_as_caffes_blob(tmp_path):
    """A Python layer's ``self.blobs[i]`` is a Caffe Blob: ``reshape`` keeps its memory and values (data and
    diff) while the new count fits in its capacity (the largest count it had), and only a larger count gives
    new memory, which Caffe's SyncedMemory zeroes on first CPU use; the net's parameter is what setup left."""
    _BlobMemory.seen = {}
    try:
        net = _pass_through_net(tmp_path, "Mem", _BlobMemory)
        seen = _BlobMemory.seen
        np.testing.assert_array_equal(seen["same_count"][0], np.arange(6).reshape(3, 2))
        np.testing.assert_array_equal(seen["same_count"][1], np.full((3, 2), 7.0))
        np.testing.assert_array_equal(seen["smaller"], [[0.0, 1.0]])
        np.testing.assert_array_equal(seen["back"], np.arange(6))
        np.testing.assert_array_equal(seen["grown"][0], np.zeros(7))
        np.testing.assert_array_equal(seen["grown"][1], np.zeros(7))
        np.testing.assert_array_equal(net.params["mem"][0].data, np.arange(7).reshape(1, 7))
    finally:
        python_user.unregister_python_layer("pl_net", "Mem")


class _Kwargs(_PassThrough):
    """Calls ``add_blob`` and ``reshape`` with a keyword argument in ``setup``; records what each raised."""

    raised: dict = {}

    def setup(self, bottom, top):
        for what, call in (("add_blob", lambda: self.blobs.add_blob(2, shape=3)),
                           ("reshape", lambda: top[0].reshape(2, n=3))):
            try:
                call()
            except Exception as exc:  # noqa: BLE001 - what pycaffe raises is the point
                self.raised[what] = exc
        self.blobs.add_blob(2)


def test_keyword_arguments_to_reshape_and_add_blob_are_pycaffes_runtime_error(tmp_path):
    """pycaffe's ``Blob.reshape`` and ``BlobVec.add_blob`` are boost raw_functions that throw
    ``std::runtime_error("Blob.reshape takes no kwargs")`` / ``("BlobVec.add_blob takes no kwargs")``: a
    RuntimeError (not the TypeError of a Python signature), on net, parameter and Python layer blobs alike."""
    _Kwargs.raised = {}
    try:
        net = _pass_through_net(tmp_path, "Kw", _Kwargs)
        raised = dict(_Kwargs.raised)
        for blob in (net.blobs["data"], net.params["kw"][0]):
            try:
                blob.reshape(4, 3, shape=1)
            except Exception as exc:  # noqa: BLE001
                raised[repr(blob)] = exc
        assert len(raised) == 4
        for exc in raised.values():
            assert type(exc) is RuntimeError
        assert str(raised["add_blob"]) == "BlobVec.add_blob takes no kwargs"
        assert str(raised["reshape"]) == "Blob.reshape takes no kwargs"
        assert net.blobs["data"].shape == (2, 3) and net.params["kw"][0].shape == (2,)  # nothing changed
    finally:
        python_user.unregister_python_layer("pl_net", "Kw")


class _ReshapeLog(caffe.Layer):
    """Records each ``setup``/``reshape``/``forward`` call with the bottom's shape."""

    calls: list = []

    def setup(self, bottom, top):
        self.calls.append("setup")

    def reshape(self, bottom, top):
        self.calls.append(("reshape", tuple(bottom[0].data.shape)))
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        self.calls.append("forward")
        top[0].data[...] = bottom[0].data

    def backward(self, top, propagate_down, bottom):
        pass


def test_an_input_reshape_reaches_a_python_layer_as_in_caffe(tmp_path):
    """Caffe's ``Blob::Reshape`` changes that blob alone; ``net.reshape()`` (``Net::Reshape``) calls every layer's
    Reshape once, and each forward calls it again (``Layer::Forward``).  Ours rebuilt the net at the blob's
    reshape already, so the pycaffe idiom ``blob.reshape(...); net.reshape(); net.forward()`` called the Python
    layer's ``reshape`` three times, and the other blobs took their new shapes before ``net.reshape()``."""
    path = tmp_path / "log.prototxt"
    path.write_text("""name: 'log'
layer { name: 'data' type: 'Input' top: 'data' input_param { shape { dim: 2 dim: 3 } } }
layer { name: 'log' type: 'Python' bottom: 'data' top: 'y' python_param { module: 'pl_net' layer: 'Log' } }""")
    caffe.register_python_layer("pl_net", "Log", _ReshapeLog)
    calls = _ReshapeLog.calls
    try:
        calls.clear()
        net = caffe.Net(str(path), caffe.TEST)
        assert calls == ["setup", ("reshape", (2, 3))]  # Layer::SetUp
        calls.clear()
        net.blobs["data"].reshape(4, 3)
        assert calls == [] and net.blobs["y"].shape == (2, 3)  # the other blobs keep their shapes for now
        net.reshape()
        assert calls == [("reshape", (4, 3))] and net.blobs["y"].shape == (4, 3)
        calls.clear()
        net.forward()
        assert calls == [("reshape", (4, 3)), "forward"]
    finally:
        python_user.unregister_python_layer("pl_net", "Log")
