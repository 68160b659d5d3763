"""A small conv net for the toy digits data (:mod:`caffe_compat.data.toy`), trainable on CPU in minutes.

Three conv blocks and an embedding, Caffe layers only::

    conv1 16x3x3 pad 1 (stride 2 for 64x64 input, 1 for 32x32) → ReLU → max 2/2
    conv2 32x3x3 pad 1 → ReLU → max 2/2
    conv3 64x3x3 pad 1 → ReLU → max 2/2               (4x4 at both input sizes)
    fc_embedding = InnerProduct(1024 → embedding_size)

Weights ``xavier``, biases constant 0, ParamSpecs lr 1/2 and decay 1/0 (GoogLeNet's convention).
The training net starts with two ``Input`` layers, ``data (B,3,S,S)`` and ``label (B,)``: the
reproduce pipeline feeds them batches from a sampler (e.g. the label-shuffling one), so the batch
size ``B`` of the file must match the sampler's.
"""

from __future__ import annotations

from caffe_compat.errors import FormatError
from caffe_compat.zoo.builder import WEIGHT_BIAS_MULTS, NetBuilder, filler
from caffe_compat.zoo.data_layers import InputData
from caffe_compat.zoo.loss_heads import AUTHORS_DELTA, add_loss_head

CHANNELS = (16, 32, 64)


def digits_embedding(batch_size: int = 64, image_size: int = 64, embedding_size: int = 64,
                     loss: str | None = "fappy", delta: float = AUTHORS_DELTA, name: str = "digits_embedding",
                     **loss_settings):
    """The toy net as a NetParameter; ``loss=None`` gives the deploy net (``data`` input only)."""
    if image_size not in (32, 64):
        raise FormatError(f"digits_embedding: image_size must be 32 or 64, got {image_size}")
    b = NetBuilder(name)
    data, label = InputData((batch_size, 3, image_size, image_size), label=loss is not None).add_to(b)
    x = data
    for i, channels in enumerate(CHANNELS, start=1):
        stride = 2 if (i == 1 and image_size == 64) else None
        x = b.conv(f"conv{i}", x, channels, 3, stride=stride, pad=1, weight_filler=filler("xavier"),
                   bias_filler=filler("constant", value=0.0), mults=WEIGHT_BIAS_MULTS)
        x = b.relu(f"relu{i}", x)
        x = b.pool(f"pool{i}", x, "MAX", kernel=2, stride=2)
    x = b.fc("fc_embedding", x, embedding_size, weight_filler=filler("xavier"),
             bias_filler=filler("constant", value=0.0), mults=WEIGHT_BIAS_MULTS)
    if loss is not None:
        add_loss_head(b, loss, x, label, delta=delta, **loss_settings)
    return b.net
