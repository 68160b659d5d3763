"""Eltwise, Softmax, Reduction, ArgMax, Embed, Accuracy, Parameter against real Caffe and closed forms."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from caffe_compat.errors import DataError, FormatError
from tests.layers.zoo_single_layer import Zoo, assert_matches, make_layer, run_and_compare


@pytest.fixture(scope="module")
def zoo():
    return Zoo("layer_zoo")


@pytest.fixture(scope="module")
def zoo_nondiff():
    return Zoo("layer_zoo_nondiff")


@pytest.mark.parametrize("layer", ["sum_coeff", "prod", "emax", "red_sumsq", "red_asum", "red_mean", "red_sum"])
def test_layer_matches_caffe_forward_and_backward(zoo, layer):
    errors = run_and_compare(zoo, layer)
    assert max(errors.values()) < 1e-6


def test_softmax_matches_caffe(zoo):
    # Forward at the element-wise tolerance.  The recorded top diff is constant along the softmax axis
    # (it comes from an ASUM over that axis), so the true bottom diff is 0 and Caffe's stored values
    # (|x| <= 1e-8) are rounding noise: compare it absolutely, then check the backward on a random diff.
    port = zoo.build("softmax_ax2")
    (x,) = zoo.bottoms("softmax_ax2")
    (y,) = port(x)
    assert_matches(y, zoo.blobs["softmax_ax2"], what="softmax forward")
    top_diff = torch.from_numpy(zoo.grads["diff:softmax_ax2"])
    (gx,) = torch.autograd.grad(y, x, top_diff, retain_graph=True)
    reference = zoo.grads["diff:reshape"]
    assert np.max(np.abs(gx.numpy() - reference)) < 1e-6 * np.max(np.abs(zoo.grads["diff:softmax_ax2"]))
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(0))
    (gx,) = torch.autograd.grad(y, x, dy)
    yd, dyd = y.detach().double().numpy(), dy.double().numpy()
    caffe = (dyd - (dyd * yd).sum(axis=2, keepdims=True)) * yd  # SoftmaxLayer::Backward_cpu
    np.testing.assert_allclose(gx.numpy(), caffe, rtol=1e-5, atol=1e-7)


def test_eltwise_max_routes_ties_like_caffe():
    # Bottoms 0/1: a tie goes to bottom 1 (a > b ? a : b); later bottoms must be strictly greater.
    a = torch.tensor([1.0, 2.0, 3.0, 0.0], requires_grad=True)
    b = torch.tensor([1.0, 1.0, 4.0, 0.0], requires_grad=True)
    c = torch.tensor([0.0, 2.0, 5.0, 0.0], requires_grad=True)
    port = make_layer('type: "Eltwise" bottom: "a" bottom: "b" bottom: "c" eltwise_param { operation: MAX }',
                      [(4,)] * 3)
    (y,) = port(a, b, c)
    assert y.tolist() == [1.0, 2.0, 5.0, 0.0]
    ga, gb, gc = torch.autograd.grad(y.sum(), (a, b, c))
    assert ga.tolist() == [0, 1, 0, 0] and gb.tolist() == [1, 0, 0, 1] and gc.tolist() == [0, 0, 1, 0]


def test_eltwise_parameter_errors():
    with pytest.raises(FormatError, match="only takes coefficients for SUM"):
        make_layer('type: "Eltwise" bottom: "a" bottom: "b" eltwise_param { operation: PROD coeff: 1 coeff: 2 }',
                   [(2,), (2,)])
    with pytest.raises(FormatError, match="1 coeff"):
        make_layer('type: "Eltwise" bottom: "a" bottom: "b" eltwise_param { coeff: 1 }', [(2,), (2,)])
    with pytest.raises(FormatError, match="equal shapes"):
        make_layer('type: "Eltwise" bottom: "a" bottom: "b"', [(2,), (3,)])


def test_eltwise_max_accepts_and_ignores_coefficients_as_caffe():
    # Caffe's LayerSetUp refuses coefficients only for PROD (and a count other than one per bottom, for
    # any operation); MAX takes them and its forward never reads them.
    a = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
    b = torch.tensor([2.0, -3.0, 3.0], requires_grad=True)
    port = make_layer('type: "Eltwise" bottom: "a" bottom: "b" eltwise_param { operation: MAX coeff: -1 coeff: 5 }',
                      [(3,), (3,)])
    (y,) = port(a, b)
    assert y.tolist() == [2.0, -2.0, 3.0]
    ga, gb = torch.autograd.grad(y.sum(), (a, b))
    assert ga.tolist() == [0.0, 1.0, 0.0] and gb.tolist() == [1.0, 0.0, 1.0]
    with pytest.raises(FormatError, match="1 coeff"):
        make_layer('type: "Eltwise" bottom: "a" bottom: "b" eltwise_param { operation: MAX coeff: 1 }',
                   [(2,), (2,)])


def test_eltwise_prod_unstable_gradient_is_caffes_quotient():
    # EltwiseLayer::Backward_cpu, PROD with stable_prod_grad false: bottom_diff = top / bottom_i * top_diff,
    # NaN (0/0) where bottom_i is 0; the default (stable) form is the product of the other bottoms.
    a = torch.tensor([2.0, 0.0, -3.0], dtype=torch.float64, requires_grad=True)
    b = torch.tensor([5.0, 4.0, 0.5], dtype=torch.float64, requires_grad=True)
    dy = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    text = 'type: "Eltwise" bottom: "a" bottom: "b" eltwise_param { operation: PROD %s }'
    unstable = make_layer(text % "stable_prod_grad: false", [(3,), (3,)])
    (y,) = unstable(a, b)
    assert y.tolist() == [10.0, 0.0, -1.5]
    ga, gb = torch.autograd.grad(y, (a, b), dy)
    assert ga[0].item() == 5.0 and math.isnan(ga[1].item()) and ga[2].item() == 1.5
    assert gb.tolist() == [2.0, 0.0, -9.0]
    stable = make_layer(text % "", [(3,), (3,)])
    ga, gb = torch.autograd.grad(stable(a, b)[0], (a, b), dy)
    assert ga.tolist() == [5.0, 8.0, 1.5] and gb.tolist() == [2.0, 0.0, -9.0]


def test_gradcheck_eltwise_prod_and_softmax_float64():
    gen = torch.Generator().manual_seed(11)
    xs = [torch.randn(2, 3, 4, dtype=torch.float64, generator=gen).requires_grad_() for _ in range(3)]
    prod = make_layer('type: "Eltwise" bottom: "a" bottom: "b" bottom: "c" eltwise_param { operation: PROD }',
                      [(2, 3, 4)] * 3)
    assert torch.autograd.gradcheck(lambda *t: prod(*t)[0], tuple(xs))
    softmax = make_layer('type: "Softmax" softmax_param { axis: -1 }', [(2, 3, 4)])
    assert torch.autograd.gradcheck(lambda t: softmax(t)[0], (xs[0],))
    reduction = make_layer('type: "Reduction" reduction_param { operation: SUMSQ axis: 1 coeff: -0.5 }', [(2, 3, 4)])
    assert torch.autograd.gradcheck(lambda t: reduction(t)[0], (xs[1],))


def test_reduction_shapes_and_mean_coefficient():
    x = torch.arange(24.0).reshape(2, 3, 4)
    mean = make_layer('type: "Reduction" reduction_param { operation: MEAN axis: -1 coeff: 2 }', [x.shape])
    assert mean.output_shapes() == [(2, 3)]
    assert torch.equal(mean(x)[0], 2 * x.mean(-1))
    total = make_layer('type: "Reduction"', [x.shape])
    assert total.output_shapes() == [()] and total(x)[0].item() == 276.0


@pytest.mark.parametrize("layer", ["argmax_axis1_top2", "argmax_axis2_val", "argmax_flat_top3_val", "argmax_flat"])
def test_argmax_matches_caffe_exactly(zoo_nondiff, layer):
    errors = run_and_compare(zoo_nondiff, layer, compare_backward=False)
    assert max(errors.values()) == 0.0
    port = zoo_nondiff.build(layer)
    (out,) = port(*zoo_nondiff.bottoms(layer))
    assert not out.requires_grad


def test_argmax_ties_prefer_the_larger_index():
    # std::partial_sort with std::greater on (value, index): equal values -> larger index first.
    x = torch.tensor([[3.0, 7.0, 7.0, 1.0, 7.0]])
    flat = make_layer('type: "ArgMax" argmax_param { top_k: 4 out_max_val: true }', [x.shape])
    (y,) = flat(x)
    assert flat.output_shapes() == [(1, 2, 4)]
    assert y.tolist() == [[[4.0, 2.0, 1.0, 0.0], [7.0, 7.0, 7.0, 3.0]]]
    axis = make_layer('type: "ArgMax" argmax_param { axis: 1 top_k: 2 }', [x.shape])
    assert axis(x)[0].tolist() == [[4.0, 2.0]]
    with pytest.raises(FormatError, match="top_k 6"):
        make_layer('type: "ArgMax" argmax_param { top_k: 6 }', [x.shape])


def test_embed_forward_and_weight_diffs_match_caffe(zoo_nondiff):
    embed, embed_nobias = zoo_nondiff.build("embed"), zoo_nondiff.build("embed_nobias")
    sumsq, total = zoo_nondiff.build("embed_sumsq"), zoo_nondiff.build("embed_nb_sum")
    (idx,) = zoo_nondiff.bottoms("embed", requires_grad=False)
    (e,) = embed(idx)
    (e_nb,) = embed_nobias(idx)
    assert_matches(e, zoo_nondiff.blobs["embed"], what="embed")
    assert_matches(e_nb, zoo_nondiff.blobs["embed_nobias"], what="embed_nobias")
    loss = 1.0 * sumsq(e)[0] + 0.5 * total(e_nb)[0]  # the prototxt's loss_weights
    grads = torch.autograd.grad(loss, [embed.weight, embed.bias, embed_nobias.weight])
    for grad, key in zip(grads, ["embed:0", "embed:1", "embed_nobias:0"]):
        assert_matches(grad, zoo_nondiff.grads[f"param_diff:{key}"], what=key)
    assert zoo_nondiff.blobs["idx"][0, 0] == zoo_nondiff.blobs["idx"][0, 1]  # a repeated index accumulates


def test_embed_truncates_float_indices_and_rejects_out_of_range():
    port = make_layer('type: "Embed" embed_param { input_dim: 3 num_output: 2 bias_term: false '
                      'weight_filler { type: "uniform" } }', [(4,)])
    port.fill(torch.Generator().manual_seed(0))
    (y,) = port(torch.tensor([0.0, 1.9, 2.2, 0.7]))
    assert torch.equal(y, port.weight[[0, 1, 2, 0]])
    assert port.output_shapes() == [(4, 2)]
    with pytest.raises(DataError, match=r"outside \[0, 3\)"):
        port(torch.tensor([3.0]))


def test_accuracy_top_k_ignore_label_and_per_class():
    scores = torch.tensor([[0.1, 0.7, 0.2],    # label 1: ignored (top-1 correct without ignore_label)
                           [0.5, 0.3, 0.2],    # label 2: rank 3 -> wrong for top-2
                           [0.4, 0.4, 0.2],    # label 0 tied with class 1: 2 scores >= it -> wrong at top-1
                           [0.3, 0.3, 0.4],    # label 1: ignored (wrong without ignore_label)
                           [0.2, 0.5, 0.3]])   # label 2: rank 2
    labels = torch.tensor([1.0, 2.0, 0.0, 1.0, 2.0])
    text = 'type: "Accuracy" bottom: "s" bottom: "l" top: "acc" top: "per_class" accuracy_param { top_k: %d ignore_label: 1 }'
    top1 = make_layer(text % 1, [scores.shape, labels.shape])
    acc, per_class = top1(scores, labels)
    assert top1.output_shapes() == [(), (3,)]
    assert acc.item() == pytest.approx(0.0) and per_class.tolist() == [0.0, 0.0, 0.0]
    top2 = make_layer(text % 2, [scores.shape, labels.shape])
    acc2, per_class2 = top2(scores, labels)
    assert acc2.item() == pytest.approx(2 / 3) and per_class2.tolist() == pytest.approx([1.0, 0.0, 0.5])
    plain = make_layer('type: "Accuracy" bottom: "s" bottom: "l"', [scores.shape, labels.shape])
    assert plain(scores, labels)[0].item() == pytest.approx(1 / 5)
    with pytest.raises(DataError, match="outside"):
        plain(scores, torch.tensor([1.0, 2.0, 0.0, 3.0, 2.0]))


def test_accuracy_spatial_axis():
    scores = torch.randn(2, 4, 3, generator=torch.Generator().manual_seed(5))
    labels = torch.randint(0, 4, (2, 3), generator=torch.Generator().manual_seed(6)).float()
    port = make_layer('type: "Accuracy" bottom: "s" bottom: "l"', [scores.shape, labels.shape])
    expected = (scores.argmax(1) == labels.long()).float().mean().item()
    assert port(scores, labels)[0].item() == pytest.approx(expected)


def test_accuracy_top_k_is_bounded_by_the_classes_with_spatial_scores():
    # AccuracyLayer::Reshape: CHECK_LE(top_k, count(scores) / count(labels)), i.e. <= C: with (N, C, H) scores
    # and N*H labels top_k = C + 1 aborts although it is below C * H.
    text = 'type: "Accuracy" bottom: "s" bottom: "l" accuracy_param { top_k: %d }'
    with pytest.raises(FormatError, match="top_k 5"):
        make_layer(text % 5, [(2, 4, 3), (2, 3)])
    port = make_layer(text % 4, [(2, 4, 3), (2, 3)])
    scores = torch.randn(2, 4, 3, generator=torch.Generator().manual_seed(5))
    assert port(scores, torch.zeros(2, 3))[0].item() == 1.0


def test_parameter_layer_exposes_its_blob():
    port = make_layer('type: "Parameter" top: "p" parameter_param { shape { dim: 2 dim: 3 } }', [])
    (p,) = port()
    assert p is port.caffe_blobs()[0] and p.requires_grad and port.output_shapes() == [(2, 3)]


@pytest.mark.parametrize("coeff", [1.0, 0.7, -2.0])
def test_reduction_mean_scales_the_sum_by_coeff_over_n_in_float(coeff):
    """reduction_layer.cpp: Reshape sets ``coeff_ = coeff; coeff_ /= dim_`` (Dtype), Forward scales the sum by
    coeff_ and Backward sets ``bottom_diff = top_diff · coeff_``.  Σ[1, 2, 4] = 7 exactly, so the top is
    ``float(7 · float(coeff / 3))``; ``7 / 3 · coeff`` (a mean, then the coefficient) is another float."""
    x = torch.tensor([[1.0, 2.0, 4.0], [3.0, 3.0, 3.0]], requires_grad=True)
    param = f"reduction_param {{ operation: MEAN axis: 1 coeff: {coeff} }}"
    port = make_layer(f'type: "Reduction" {param}', [tuple(x.shape)])
    (y,) = port(x)
    coeff_ = np.float32(coeff) / np.float32(3)
    assert y.tolist() == [float(np.float32(7) * coeff_), float(np.float32(9) * coeff_)]
    (gx,) = torch.autograd.grad(y, x, torch.tensor([1.5, -0.25]))
    assert gx.tolist() == [[float(np.float32(1.5) * coeff_)] * 3, [float(np.float32(-0.25) * coeff_)] * 3]
    if coeff == 1.0:  # 7 · float(1/3) rounds up, 7/3 rounds down: one ulp apart
        assert y[0].item() != np.float32(7) / np.float32(3)


def test_reduction_of_a_0_axis_blob_is_refused():
    # CanonicalAxisIndex(0) on a 0-axis blob fails CHECK_LT(axis_index, num_axes())
    with pytest.raises(FormatError, match="out of range for a 0-axis blob"):
        make_layer('type: "Reduction" reduction_param { operation: SUM }', [()])


def test_argmax_without_axis_on_a_0_axis_blob_is_a_format_error():
    # ArgMaxLayer::LayerSetUp reads bottom[0]->count(1): Blob::count(1, 0) CHECKs 1 <= num_axes() (was an
    # IndexError here); a 1-axis (3,) input is fine: count(1) = 1, top (3, 1, 1)
    with pytest.raises(FormatError, match="at least one axis"):
        make_layer('type: "ArgMax"', [()])
    assert make_layer('type: "ArgMax"', [(3,)]).output_shapes() == [(3, 1, 1)]


def test_argmax_of_an_empty_batch_is_an_empty_top():
    # ArgMaxLayer loops over num = 0 samples: an empty (0, 1, 1) top (we raised a reshape RuntimeError)
    port = make_layer('type: "ArgMax"', [(0, 3)])
    assert port.output_shapes() == [(0, 1, 1)] and tuple(port(torch.zeros(0, 3))[0].shape) == (0, 1, 1)


@pytest.mark.parametrize("axis, top", [(1, (0,)), (0, ())])
def test_reduction_of_an_empty_batch_gives_caffes_top(axis, top):
    # ReductionLayer: num_ = count(0, axis) outputs of dim_ = count(axis) values; (0, 3) at axis 1 is an empty
    # (0,) top, at axis 0 one sum over no value (0).  We raised torch's RuntimeError (reshape(0, -1)).
    port = make_layer(f'type: "Reduction" reduction_param {{ axis: {axis} operation: SUMSQ }}', [(0, 3)])
    (y,) = port(torch.zeros(0, 3))
    assert tuple(y.shape) == top == tuple(port.output_shapes()[0]) and not y.any()


def test_accuracy_fed_fewer_classes_than_top_k_is_a_shape_mismatch_error():
    # accuracy_layer.cpp Reshape CHECK_LE(top_k, count / label count) on every reshape; a net set up for 3 classes
    # and fed (2, 0) scores raised torch's RuntimeError (gather on an empty class axis)
    from caffe_compat.errors import ShapeMismatchError

    port = make_layer('type: "Accuracy" bottom: "x" bottom: "y"', [(2, 3), (2,)])
    with pytest.raises(ShapeMismatchError, match="top_k 1 must be less than or equal"):
        port(torch.zeros(2, 0), torch.zeros(2))
    assert port(torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0]]), torch.tensor([1.0, 2.0]))[0].item() == 0.5
