"""RNN against a hand-unrolled numpy reference of Caffe's unrolled net (several steps, cont resets, static
input), its blob order and shapes, state carry-over, expose_hidden, float64 gradcheck, ONNX at fixed T."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from caffe_compat.errors import FormatError
from tests.layers.zoo_single_layer import make_layer

T, N, D, DS, H = 5, 2, 3, 4, 3
RNN = 'type: "RNN" recurrent_param {{ num_output: {h} {extra} }}'
CONT = np.array([[0, 0], [1, 1], [0, 1], [1, 0], [1, 1]], dtype=np.float64)


def numpy_rnn(x, cont, w_xh, b_h, w_hh, w_ho, b_o, w_static=None, static=None, h0=None):
    """h_t = tanh(W_hh (cont_t h_{t-1}) + W_xh x_t + b_h [+ W_xh_static x_static]); o_t = tanh(W_ho h_t + b_o)."""
    h = np.zeros((cont.shape[1], w_hh.shape[0])) if h0 is None else h0
    out = []
    for t in range(cont.shape[0]):
        pre = (cont[t][:, None] * h) @ w_hh.T + x[t].reshape(cont.shape[1], -1) @ w_xh.T + b_h
        if static is not None:
            pre = pre + static @ w_static.T
        h = np.tanh(pre)
        out.append(np.tanh(h @ w_ho.T + b_o))
    return np.stack(out), h


def _random_blobs(port, seed):
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for blob in port.caffe_blobs():
            blob.copy_(torch.from_numpy(rng.standard_normal(tuple(blob.shape)) * 0.6))
    return [b.detach().numpy() for b in port.caffe_blobs()]


def test_blob_order_and_shapes_are_caffes():
    port = make_layer(RNN.format(h=H, extra=""), [(T, N, D), (T, N), (N, DS)])
    assert port._blob_names == ["W_xh", "b_h", "W_xh_static", "W_hh", "W_ho", "b_o"]
    assert [tuple(b.shape) for b in port.caffe_blobs()] == [(H, D), (H,), (H, DS), (H, H), (H, H), (H,)]


def test_rnn_matches_the_hand_unrolled_net():
    rng = np.random.default_rng(0)
    x, static = rng.standard_normal((T, N, D)), rng.standard_normal((N, DS))
    port = make_layer(RNN.format(h=H, extra=""), [x.shape, (T, N), static.shape]).double()
    w_xh, b_h, w_static, w_hh, w_ho, b_o = _random_blobs(port, 1)
    with torch.no_grad():
        (top,) = port(torch.from_numpy(x), torch.from_numpy(CONT), torch.from_numpy(static))
        (second,) = port(torch.from_numpy(x), torch.from_numpy(np.ones((T, N))), torch.from_numpy(static))
    expected, h_t = numpy_rnn(x, CONT, w_xh, b_h, w_hh, w_ho, b_o, w_static, static)
    np.testing.assert_allclose(top.numpy(), expected, rtol=1e-12, atol=1e-12)
    carried, _ = numpy_rnn(x, np.ones((T, N)), w_xh, b_h, w_hh, w_ho, b_o, w_static, static, h0=h_t)
    np.testing.assert_allclose(second.numpy(), carried, rtol=1e-12, atol=1e-12)  # h_T became h_0


def test_expose_hidden():
    rng = np.random.default_rng(2)
    x, h0 = rng.standard_normal((T, N, D)), rng.standard_normal((1, N, H))
    port = make_layer(RNN.format(h=H, extra="expose_hidden: true"), [x.shape, (T, N), h0.shape]).double()
    blobs = _random_blobs(port, 3)
    top, h_t = port(torch.from_numpy(x), torch.from_numpy(CONT), torch.from_numpy(h0))
    expected, h_ref = numpy_rnn(x, CONT, *blobs, h0=h0[0])
    np.testing.assert_allclose(top.detach().numpy(), expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(h_t.numpy()[0], h_ref, rtol=1e-12)
    assert port.output_shapes() == [(T, N, H), (1, N, H)]


def test_gradcheck_float64():
    port = make_layer(RNN.format(h=2, extra=""), [(3, 2, 2), (3, 2)]).double()
    _random_blobs(port, 4)
    cont = torch.tensor([[0.0, 0.0], [1.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
    x = torch.randn(3, 2, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: (port.reset_state(), port(x, cont)[0])[1], (x,))
    params = tuple(b.detach().clone().requires_grad_() for b in port.caffe_blobs())

    def functional(*weights):
        port.reset_state()
        return torch.func.functional_call(port, dict(zip(port._blob_names, weights)), (x.detach(), cont))[0]

    assert torch.autograd.gradcheck(functional, params)


def test_cont_gets_no_gradient_and_fillers_fill():
    port = make_layer(RNN.format(h=H, extra='weight_filler { type: "constant" value: 0.5 } '
                                           'bias_filler { type: "constant" value: -1 }'), [(T, N, D), (T, N)])
    port.fill(torch.Generator().manual_seed(0))
    assert all(float(v) == 0.5 for name in ("W_xh", "W_hh", "W_ho") for v in getattr(port, name).detach().flatten())
    assert all(float(v) == -1 for name in ("b_h", "b_o") for v in getattr(port, name).detach().flatten())
    cont = torch.ones(T, N, requires_grad=True)
    port(torch.randn(T, N, D), cont)[0].sum().backward()
    assert cont.grad is None


def test_setup_checks():
    with pytest.raises(FormatError, match="num_output must be positive"):
        make_layer('type: "RNN"', [(T, N, D), (T, N)])
    with pytest.raises(FormatError, match=r"needs 2 to 3 bottom blob\(s\), got 4"):
        make_layer(RNN.format(h=H, extra=""), [(T, N, D), (T, N), (N, 1), (N, 1)])
    with pytest.raises(FormatError, match=r"\(#timesteps, #streams\) = \(5, 2\)"):
        make_layer(RNN.format(h=H, extra=""), [(T, N, D), (T, N + 1)])


def test_onnx_export_at_fixed_t(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    from caffe_compat.export.onnx_export import _OneLayer, _trace

    port = make_layer(RNN.format(h=H, extra=""), [(T, N, D), (T, N)])
    _random_blobs(port, 5)
    port.float()
    x, cont = np.random.default_rng(6).standard_normal((T, N, D)).astype(np.float32), CONT.astype(np.float32)
    data = _trace(_OneLayer(port).eval(), (torch.from_numpy(x), torch.from_numpy(cont)), 17, ["x", "cont"], ["o"], None)
    (got,) = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, {"x": x, "cont": cont})
    port.reset_state()
    with torch.no_grad():
        np.testing.assert_allclose(got, port(torch.from_numpy(x), torch.from_numpy(cont))[0].numpy(), rtol=1e-5,
                                   atol=1e-6)


@pytest.mark.parametrize("kind", ["RNN", "LSTM"])
@pytest.mark.parametrize("static", [False, True])
def test_no_stream_gives_caffes_empty_top(kind, static):
    # RecurrentLayer with N = 0: the unrolled net's InnerProducts (M = 0), Slices, units and Concat all accept
    # an empty batch, so the top is (T, 0, H).  We raised torch's RuntimeError (reshape(T, 0, -1) is ambiguous).
    shapes = [(3, 0, 4, 2), (3, 0)] + ([(0, 5)] if static else [])
    port = make_layer(f'type: "{kind}" recurrent_param {{ num_output: 6 }}', shapes)
    x = torch.zeros(3, 0, 4, 2, requires_grad=True)
    extra = [torch.zeros(0, 5)] if static else []
    (h,) = port(x, torch.zeros(3, 0), *extra)
    assert tuple(h.shape) == (3, 0, 6) == tuple(port.output_shapes()[0])
    h.sum().backward()
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("kind", ["RNN", "LSTM"])
def test_no_timestep_is_a_format_error(kind):
    # T = 0: Caffe's FillUnrolledNet adds one Slice top and one Concat bottom per timestep, so the Slice has no
    # top and the Concat no bottom: their blob-count CHECKs abort.  We raised torch's RuntimeError in forward.
    with pytest.raises(FormatError, match="no timestep"):
        make_layer(f'type: "{kind}" recurrent_param {{ num_output: 6 }}', [(0, 2, 4), (0, 2)])


@pytest.mark.parametrize("kind", ["RNN", "LSTM"])
def test_fed_another_input_size_is_a_shape_mismatch_error(kind):
    # the unrolled net's InnerProduct Reshape CHECK_EQs its input size K (an empty one included); we raised torch's
    # RuntimeError from the matrix product
    from caffe_compat.errors import ShapeMismatchError

    port = make_layer(f'type: "{kind}" recurrent_param {{ num_output: 6 }}', [(3, 2, 4, 4), (3, 2)])
    with pytest.raises(ShapeMismatchError, match="set up for 16 input values"):
        port(torch.zeros(3, 2, 0, 4), torch.zeros(3, 2))
