"""LSTM (and Caffe's Recurrent machinery) against a hand-unrolled numpy reference of Caffe's unrolled net
over several time steps with ``cont`` resets; blob order and shapes as Caffe's caffemodels store them;
statefulness across forwards; expose_hidden; float64 gradcheck; setup CHECKs; ONNX at a fixed T."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from caffe_compat.errors import FormatError, ShapeMismatchError
from caffe_compat.io.blobs import array_to_blob
from caffe_compat.io.weights import read_weights
from caffe_compat.net import load_net
from caffe_compat.net_shapes import infer_shapes
from caffe_compat.io import read_net
from caffe_compat.proto import caffe_pb2
from tests.layers.zoo_single_layer import make_layer

T, N, D, DS, H = 4, 3, 5, 2, 3
LSTM = 'type: "LSTM" recurrent_param {{ num_output: {h} {extra} }}'


def sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


def numpy_lstm(x, cont, w_xc, b_c, w_hc, w_static=None, static=None, h0=None, c0=None):
    """Caffe's LSTM unrolled net, written out: h_conted = cont_t·h, gate = W_hc h_conted + W_xc x_t + b_c
    (+ W_xc_static x_static), gates [i, f, o, g], f = 0 where cont_t = 0 else cont_t·σ(f')."""
    steps, streams = cont.shape
    hidden = w_hc.shape[1]
    h = np.zeros((streams, hidden)) if h0 is None else h0
    c = np.zeros((streams, hidden)) if c0 is None else c0
    out = []
    for t in range(steps):
        gate = (cont[t][:, None] * h) @ w_hc.T + x[t].reshape(streams, -1) @ w_xc.T + b_c
        if static is not None:
            gate = gate + static.reshape(streams, -1) @ w_static.T
        i, f = sigmoid(gate[:, :hidden]), sigmoid(gate[:, hidden:2 * hidden])
        f = np.where(cont[t][:, None] == 0, 0.0, cont[t][:, None] * f)
        o, g = sigmoid(gate[:, 2 * hidden:3 * hidden]), np.tanh(gate[:, 3 * hidden:])
        c = f * c + i * g
        h = o * np.tanh(c)
        out.append(h)
    return np.stack(out), h, c


def _random_blobs(port, seed=0):
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for blob in port.caffe_blobs():
            blob.copy_(torch.from_numpy(rng.standard_normal(tuple(blob.shape)) * 0.5))
    return [b.detach().numpy() for b in port.caffe_blobs()]


CONT = np.array([[0, 0, 0], [1, 1, 0], [1, 0, 1], [1, 1, 1]], dtype=np.float64)  # resets at t = 2 and t = 3


def test_lstm_matches_the_hand_unrolled_net_with_cont_resets():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((T, N, D))
    port = make_layer(LSTM.format(h=H, extra=""), [(T, N, D), (T, N)]).double()
    w_xc, b_c, w_hc = _random_blobs(port)
    (top,) = port(torch.from_numpy(x), torch.from_numpy(CONT))
    expected, _, _ = numpy_lstm(x, CONT, w_xc, b_c, w_hc)
    assert top.shape == (T, N, H) and port.output_shapes() == [(T, N, H)]
    np.testing.assert_allclose(top.detach().numpy(), expected, rtol=1e-12, atol=1e-12)


def test_blob_order_and_shapes_are_caffes():
    port = make_layer(LSTM.format(h=H, extra=""), [(T, N, 2, 3), (T, N), (N, DS)])
    assert [tuple(b.shape) for b in port.caffe_blobs()] == [(4 * H, 6), (4 * H,), (4 * H, DS), (4 * H, H)]
    assert port._blob_names == ["W_xc", "b_c", "W_xc_static", "W_hc"]
    plain = make_layer(LSTM.format(h=H, extra=""), [(T, N, D), (T, N)])
    assert [tuple(b.shape) for b in plain.caffe_blobs()] == [(4 * H, D), (4 * H,), (4 * H, H)]


def test_static_input_and_a_4d_x():
    rng = np.random.default_rng(2)
    x, static = rng.standard_normal((T, N, 1, D)), rng.standard_normal((N, DS))
    port = make_layer(LSTM.format(h=H, extra=""), [x.shape, (T, N), static.shape]).double()
    w_xc, b_c, w_static, w_hc = _random_blobs(port, 3)
    (top,) = port(torch.from_numpy(x), torch.from_numpy(CONT), torch.from_numpy(static))
    expected, _, _ = numpy_lstm(x, CONT, w_xc, b_c, w_hc, w_static, static)
    np.testing.assert_allclose(top.detach().numpy(), expected, rtol=1e-12, atol=1e-12)


def test_state_carries_over_to_the_next_forward_unless_cont_resets_it():
    """Caffe copies h_T, c_T into h_0, c_0 before each forward (expose_hidden off)."""
    rng = np.random.default_rng(4)
    x1, x2 = rng.standard_normal((T, N, D)), rng.standard_normal((T, N, D))
    port = make_layer(LSTM.format(h=H, extra=""), [(T, N, D), (T, N)]).double()
    w_xc, b_c, w_hc = _random_blobs(port, 5)
    cont2 = np.ones((T, N))
    cont2[0, 1] = 0  # stream 1 restarts, streams 0 and 2 continue
    with torch.no_grad():
        port(torch.from_numpy(x1), torch.from_numpy(CONT))
        (top,) = port(torch.from_numpy(x2), torch.from_numpy(cont2))
    _, h_t, c_t = numpy_lstm(x1, CONT, w_xc, b_c, w_hc)
    expected, _, _ = numpy_lstm(x2, cont2, w_xc, b_c, w_hc, h0=h_t, c0=c_t)
    np.testing.assert_allclose(top.numpy(), expected, rtol=1e-12, atol=1e-12)
    port.reset_state()
    with torch.no_grad():
        (fresh,) = port(torch.from_numpy(x2), torch.from_numpy(cont2))
    np.testing.assert_allclose(fresh.numpy(), numpy_lstm(x2, cont2, w_xc, b_c, w_hc)[0], rtol=1e-12, atol=1e-12)


def test_expose_hidden_takes_and_gives_the_states_without_gradient():
    rng = np.random.default_rng(6)
    x, h0, c0 = rng.standard_normal((T, N, D)), rng.standard_normal((1, N, H)), rng.standard_normal((1, N, H))
    cont = np.ones((T, N))
    port = make_layer(LSTM.format(h=H, extra="expose_hidden: true"), [(T, N, D), (T, N), h0.shape, c0.shape]).double()
    w_xc, b_c, w_hc = _random_blobs(port, 7)
    h0_t = torch.from_numpy(h0).requires_grad_()
    top, h_t, c_t = port(torch.from_numpy(x), torch.from_numpy(cont), h0_t, torch.from_numpy(c0))
    expected, h_ref, c_ref = numpy_lstm(x, cont, w_xc, b_c, w_hc, h0=h0[0], c0=c0[0])
    np.testing.assert_allclose(top.detach().numpy(), expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(h_t.numpy()[0], h_ref, rtol=1e-12)
    np.testing.assert_allclose(c_t.numpy()[0], c_ref, rtol=1e-12)
    assert not h_t.requires_grad and not c_t.requires_grad
    top.sum().backward()
    assert h0_t.grad is None  # Caffe shares the given state's data, not its diff
    assert port.output_shapes() == [(T, N, H), (1, N, H), (1, N, H)]


def test_gradcheck_float64_through_x_static_and_the_weights():
    port = make_layer(LSTM.format(h=2, extra=""), [(3, 2, 3), (3, 2), (2, 2)]).double()
    _random_blobs(port, 8)
    cont = torch.tensor([[0.0, 0.0], [1.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
    x = torch.randn(3, 2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    s = torch.randn(2, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, s: (port.reset_state(), port(x, cont, s)[0])[1], (x, s))
    params = tuple(b.detach().clone().requires_grad_() for b in port.caffe_blobs())

    def functional(*weights):
        port.reset_state()
        return torch.func.functional_call(port, dict(zip(port._blob_names, weights)), (x.detach(), cont, s.detach()))[0]

    assert torch.autograd.gradcheck(functional, tuple(params))


def test_caffemodel_blobs_load_and_save_in_caffes_order(tmp_path):
    text = (f'layer {{ name: "x" type: "Input" top: "x" top: "cont" input_param {{ shape {{ dim: {T} dim: {N} dim: {D} }} '
            f'shape {{ dim: {T} dim: {N} }} }} }}\n'
            f'layer {{ name: "lstm1" type: "LSTM" bottom: "x" bottom: "cont" top: "h" '
            f'recurrent_param {{ num_output: {H} }} }}\n')
    prototxt = tmp_path / "lstm.prototxt"
    prototxt.write_text(text)
    rng = np.random.default_rng(9)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in [(4 * H, D), (4 * H,), (4 * H, H)]]
    model = caffe_pb2.NetParameter(name="published")
    layer = model.layer.add(name="lstm1", type="LSTM")
    layer.blobs.extend(array_to_blob(a) for a in arrays)
    (tmp_path / "in.caffemodel").write_bytes(model.SerializeToString())
    net = load_net(str(prototxt), weights=str(tmp_path / "in.caffemodel"), strict=True)
    port = net.layers[next(s.module_key for s in net.steps if s.type == "LSTM")]
    for blob, array in zip(port.caffe_blobs(), arrays):
        np.testing.assert_array_equal(blob.detach().numpy(), array)
    net.save_caffemodel(tmp_path / "out.caffemodel")
    (name, stored), = [(n, b) for n, b in read_weights(str(tmp_path / "out.caffemodel")) if b]
    assert name == "lstm1" and [s.shape for s in stored] == [a.shape for a in arrays]
    for blob, array in zip(stored, arrays):
        np.testing.assert_array_equal(np.asarray(blob.values).reshape(array.shape), array)
    blobs, _ = infer_shapes(read_net(text))
    assert blobs["h"] == (T, N, H)


def test_setup_checks_are_format_errors():
    with pytest.raises(FormatError, match="num_output must be positive"):
        make_layer('type: "LSTM"', [(T, N, D), (T, N)])
    with pytest.raises(FormatError, match=r"bottom 1 \(cont\) must have exactly 2 axes"):
        make_layer(LSTM.format(h=H, extra=""), [(T, N, D), (T, N, 1)])
    with pytest.raises(FormatError, match="at least 2 axes"):
        make_layer(LSTM.format(h=H, extra=""), [(T,), (T, N)])
    with pytest.raises(FormatError, match=r"x_static\) must lead with the 3 streams"):
        make_layer(LSTM.format(h=H, extra=""), [(T, N, D), (T, N), (N + 1, 2)])
    with pytest.raises(FormatError, match=r"needs 4 to 5 bottom blob\(s\), got 3"):
        make_layer(LSTM.format(h=H, extra="expose_hidden: true"), [(T, N, D), (T, N), (1, N, H)])
    with pytest.raises(FormatError, match=r"c_0\) must have the hidden state shape"):
        make_layer(LSTM.format(h=H, extra="expose_hidden: true"), [(T, N, D), (T, N), (1, N, H), (1, N, H + 1)])
    port = make_layer(LSTM.format(h=H, extra=""), [(T, N, D), (T, N)])
    with pytest.raises(ShapeMismatchError, match="number of timesteps changed"):
        port(torch.zeros(T + 1, N, D), torch.zeros(T + 1, N))


def test_onnx_export_unrolls_a_fixed_t_and_onnx_runtime_agrees(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    from caffe_compat.export.onnx_export import _OneLayer, _trace

    port = make_layer(LSTM.format(h=H, extra=""), [(T, N, D), (T, N), (N, DS)])
    _random_blobs(port, 10)
    port.float()
    rng = np.random.default_rng(11)
    x, static = rng.standard_normal((T, N, D)).astype(np.float32), rng.standard_normal((N, DS)).astype(np.float32)
    cont = CONT.astype(np.float32)
    data = _trace(_OneLayer(port).eval(), (torch.from_numpy(x), torch.from_numpy(cont), torch.from_numpy(static)), 17,
                  ["x", "cont", "x_static"], ["h"], None)
    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {"x": x, "cont": cont, "x_static": static})
    port.reset_state()
    with torch.no_grad():
        (expected,) = port(torch.from_numpy(x), torch.from_numpy(cont), torch.from_numpy(static))
    np.testing.assert_allclose(got, expected.numpy(), rtol=1e-5, atol=1e-6)
