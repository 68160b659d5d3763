"""VGG_CNN_M_1024 (Chatfield et al., "Return of the Devil in the Details", BMVC 2014) up to ``fc7``.

The FAPPY authors' VehicleID net (after Liu et al.'s CCL setup): conv1 96x7x7/2 → ReLU → LRN (5,
alpha 5e-4, beta 0.75, k 2) → max 3/2 → conv2 256x5x5/2 pad 1 → ReLU → LRN → max 3/2 → conv3-5
512x3x3 pad 1 + ReLU → max 3/2 → fc6 4096 + ReLU + dropout 0.5 → fc7 1024 + ReLU + dropout 0.5.
The embedding is ``fc7`` itself (``embedding_size`` = 1024 keeps the ImageNet fc7 weights), read
*after* its in-place ReLU and dropout: the authors' FAPPY head sees non-negative features.

Quirk kept: the authors' layers carry no ParamSpec and no fillers (everything comes from the ImageNet
caffemodel; an unset filler is Caffe's constant 0).  At 224x224 the spatial sizes are conv1 109,
pool1 54, conv2 26, pool2 13, pool5 6, so fc6 reads 512·6·6 = 18432 values, as the caffemodel expects.
"""

from __future__ import annotations

from caffe_compat.zoo.builder import NetBuilder
from caffe_compat.zoo.loss_heads import AUTHORS_DELTA, add_loss_head


def vgg_cnn_m_1024_trunk(b: NetBuilder, data: str, embedding_size: int = 1024) -> str:
    """``conv1`` ... ``fc7`` (+ relu7, drop7); returns ``fc7``."""
    x = b.relu("relu1", b.conv("conv1", data, 96, 7, stride=2))
    x = b.lrn("norm1", x, local_size=5, alpha=5e-4, beta=0.75, k=2)
    x = b.pool("pool1", x, "MAX", kernel=3, stride=2)
    x = b.relu("relu2", b.conv("conv2", x, 256, 5, stride=2, pad=1))
    x = b.lrn("norm2", x, local_size=5, alpha=5e-4, beta=0.75, k=2)
    x = b.pool("pool2", x, "MAX", kernel=3, stride=2)
    for i in (3, 4, 5):
        x = b.relu(f"relu{i}", b.conv(f"conv{i}", x, 512, 3, pad=1))
    x = b.pool("pool5", x, "MAX", kernel=3, stride=2)
    x = b.dropout("drop6", b.relu("relu6", b.fc("fc6", x, 4096)), 0.5)
    return b.dropout("drop7", b.relu("relu7", b.fc("fc7", x, embedding_size)), 0.5)


def vgg_cnn_m_1024_embedding(data, name: str = "VGG_CNN_M_1024_embedding", embedding_size: int = 1024,
                             loss: str | None = "fappy", delta: float = AUTHORS_DELTA, **loss_settings):
    """The net as a NetParameter (``data``/``loss`` as in :func:`~caffe_compat.zoo.googlenet.googlenet_embedding`;
    the deploy net, ``loss=None``, ends at ``fc7``)."""
    b = NetBuilder(name)
    data_blob, label = data.add_to(b)
    x = vgg_cnn_m_1024_trunk(b, data_blob, embedding_size)
    if loss is not None:
        add_loss_head(b, loss, x, label, delta=delta, **loss_settings)
    return b.net
