"""NCHW <-> NHWC copies through OpenCV (``caffe_compat.layers.layout``) equal PyTorch's, bit for bit."""

from __future__ import annotations

import pytest
import torch

from caffe_compat.layers.layout import to_channels_last, to_contiguous


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``'s values in NCHW order (NaN compared by its bits)."""
    return t.contiguous().flatten().view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.uint8, torch.int32,
                                   torch.int64, torch.bfloat16, torch.bool])
@pytest.mark.parametrize("shape", [(3, 5, 7, 9), (1, 64, 12, 12), (2, 1, 4, 3), (2, 3, 1, 1)])
def test_both_directions_equal_torch_copies(dtype, shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 50
    x[0, 0, 0, 0] = float("nan") if dtype.is_floating_point else 7
    x = x.to(dtype)
    nhwc = to_channels_last(x)
    reference = x.contiguous(memory_format=torch.channels_last)
    assert nhwc.shape == x.shape and nhwc.stride() == reference.stride()
    assert torch.equal(_bits(nhwc), _bits(x))
    back = to_contiguous(nhwc)
    assert back.is_contiguous() and torch.equal(_bits(back), _bits(x))


def test_inputs_already_in_the_layout_are_returned_and_others_fall_back():
    x = torch.randn(2, 3, 4, 5)
    assert to_contiguous(x) is x
    cl = x.contiguous(memory_format=torch.channels_last)
    assert to_channels_last(cl) is cl
    strided = torch.randn(2, 3, 8, 5)[:, :, ::2]  # neither layout: PyTorch's copy
    assert torch.equal(to_channels_last(strided), strided)
    tracked = x.clone().requires_grad_()  # autograd records it: PyTorch's differentiable copy
    out = to_channels_last(tracked)
    assert out.requires_grad and out.is_contiguous(memory_format=torch.channels_last)
    out.sum().backward()
    assert torch.equal(tracked.grad, torch.ones_like(x))


def test_dtypes_this_opencv_refuses_take_torchs_copy(monkeypatch):
    """OpenCV 4.5.4 has no float16 transpose (``cv2.error``: "src data type = 23 is not supported"): the
    probe leaves such a dtype out and the copy is PyTorch's, so fp16 training runs there too."""
    import cv2
    import numpy as np

    from caffe_compat.layers import layout

    real = cv2.transpose
    calls = []

    def transpose_without_float16(src, dst=None):
        calls.append(src.dtype)
        if src.dtype == np.float16:
            raise cv2.error("src data type = 23 is not supported")
        return real(src, dst=dst)

    monkeypatch.setattr(layout.cv2, "transpose", transpose_without_float16)
    layout.opencv_dtypes.cache_clear()
    try:
        assert torch.float16 not in layout.opencv_dtypes()
        assert {torch.float32, torch.float64, torch.uint8} <= layout.opencv_dtypes()
        x = torch.randn(2, 3, 4, 5, generator=torch.Generator().manual_seed(2)).half()
        calls.clear()
        nhwc = to_channels_last(x)
        assert calls == [] and torch.equal(_bits(nhwc), _bits(x))
        assert torch.equal(_bits(to_contiguous(nhwc)), _bits(x)) and calls == []
        y = torch.randn(2, 3, 4, 5)
        assert torch.equal(_bits(to_channels_last(y)), _bits(y)) and calls == [np.float32, np.float32]
    finally:
        layout.opencv_dtypes.cache_clear()
