"""GoogLeNet (Szegedy et al. 2015, BVLC's Caffe replication) up to ``pool5``, plus an embedding layer.

The FAPPY authors' CUB-200-2011 and Stanford Online Products net: BVLC GoogLeNet's layers, names and
fillers from ``conv1/7x7_s2`` to ``pool5/7x7_s1`` (AVE 7x7) and ``pool5/drop_7x7_s1`` (ratio 0.4), then

    fc_embedding = InnerProduct(pool5, embedding_size)   lr_mult 10/20, xavier, bias constant 0

instead of the ImageNet classifier; the auxiliary classifiers (loss1/*, loss2/*) are absent.  Every
convolution has ParamSpecs lr 1/2, decay 1/0 and bias constant 0.2; the weights are ``xavier`` with a
``std`` that xavier ignores but the BVLC file carries (1x1: 0.03, 3x3_reduce: 0.09, 3x3: 0.03,
5x5_reduce: 0.2, 5x5: 0.03, pool_proj: 0.1).  Caffe's ceil-rounded pooling makes 224 and 227 inputs
both reach 7x7 at ``inception_5b`` (so ``pool5`` is 1x1 and ``fc_embedding`` reads 1024 values).
"""

from __future__ import annotations

from caffe_compat.zoo.builder import WEIGHT_BIAS_MULTS, NetBuilder, filler
from caffe_compat.zoo.loss_heads import AUTHORS_DELTA, add_loss_head

# (name, #1x1, #3x3_reduce, #3x3, #5x5_reduce, #5x5, #pool_proj); "pool" marks a 3x3/2 max pooling.
INCEPTIONS = (
    ("inception_3a", 64, 96, 128, 16, 32, 32),
    ("inception_3b", 128, 128, 192, 32, 96, 64),
    "pool3/3x3_s2",
    ("inception_4a", 192, 96, 208, 16, 48, 64),
    ("inception_4b", 160, 112, 224, 24, 64, 64),
    ("inception_4c", 128, 128, 256, 24, 64, 64),
    ("inception_4d", 112, 144, 288, 32, 64, 64),
    ("inception_4e", 256, 160, 320, 32, 128, 128),
    "pool4/3x3_s2",
    ("inception_5a", 256, 160, 320, 32, 128, 128),
    ("inception_5b", 384, 192, 384, 48, 128, 128),
)

_BIAS = filler("constant", value=0.2)


def _conv_relu(b: NetBuilder, name: str, relu: str, bottom: str, num_output: int, kernel: int, std: float,
               stride: int | None = None, pad: int | None = None) -> str:
    top = b.conv(name, bottom, num_output, kernel, stride=stride, pad=pad, weight_filler=filler("xavier", std=std),
                 bias_filler=_BIAS, mults=WEIGHT_BIAS_MULTS)
    return b.relu(relu, top)


def inception(b: NetBuilder, name: str, bottom: str, n1x1: int, n3x3_reduce: int, n3x3: int, n5x5_reduce: int,
              n5x5: int, n_pool_proj: int) -> str:
    """One inception module (four branches concatenated into ``<name>/output``)."""
    branch1 = _conv_relu(b, f"{name}/1x1", f"{name}/relu_1x1", bottom, n1x1, 1, 0.03)
    reduce3 = _conv_relu(b, f"{name}/3x3_reduce", f"{name}/relu_3x3_reduce", bottom, n3x3_reduce, 1, 0.09)
    branch3 = _conv_relu(b, f"{name}/3x3", f"{name}/relu_3x3", reduce3, n3x3, 3, 0.03, pad=1)
    reduce5 = _conv_relu(b, f"{name}/5x5_reduce", f"{name}/relu_5x5_reduce", bottom, n5x5_reduce, 1, 0.2)
    branch5 = _conv_relu(b, f"{name}/5x5", f"{name}/relu_5x5", reduce5, n5x5, 5, 0.03, pad=2)
    pooled = b.pool(f"{name}/pool", bottom, "MAX", kernel=3, stride=1, pad=1)
    branch_pool = _conv_relu(b, f"{name}/pool_proj", f"{name}/relu_pool_proj", pooled, n_pool_proj, 1, 0.1)
    return b.concat(f"{name}/output", [branch1, branch3, branch5, branch_pool])


def googlenet_trunk(b: NetBuilder, data: str) -> str:
    """``conv1/7x7_s2`` ... ``pool5/7x7_s1`` + its dropout; returns ``pool5/7x7_s1``."""
    x = _conv_relu(b, "conv1/7x7_s2", "conv1/relu_7x7", data, 64, 7, 0.1, stride=2, pad=3)
    x = b.pool("pool1/3x3_s2", x, "MAX", kernel=3, stride=2)
    x = b.lrn("pool1/norm1", x, local_size=5, alpha=1e-4, beta=0.75)
    x = _conv_relu(b, "conv2/3x3_reduce", "conv2/relu_3x3_reduce", x, 64, 1, 0.1)
    x = _conv_relu(b, "conv2/3x3", "conv2/relu_3x3", x, 192, 3, 0.03, pad=1)
    x = b.lrn("conv2/norm2", x, local_size=5, alpha=1e-4, beta=0.75)
    x = b.pool("pool2/3x3_s2", x, "MAX", kernel=3, stride=2)
    for module in INCEPTIONS:
        if isinstance(module, str):
            x = b.pool(module, x, "MAX", kernel=3, stride=2)
        else:
            x = inception(b, module[0], x, *module[1:])
    x = b.pool("pool5/7x7_s1", x, "AVE", kernel=7, stride=1)
    return b.dropout("pool5/drop_7x7_s1", x, 0.4)


def googlenet_embedding(data, name: str = "GoogleNet_embedding", embedding_size: int = 512,
                        loss: str | None = "fappy", delta: float = AUTHORS_DELTA, **loss_settings):
    """The net as a NetParameter.  ``data``: a data-layer spec from :mod:`caffe_compat.zoo.data_layers`
    (it must provide ``label`` when ``loss`` is set); ``loss``: a head of
    :data:`caffe_compat.zoo.loss_heads.LOSSES`, or None for a deploy net ending at ``fc_embedding``."""
    b = NetBuilder(name)
    data_blob, label = data.add_to(b)
    x = googlenet_trunk(b, data_blob)
    x = b.fc("fc_embedding", x, embedding_size, weight_filler=filler("xavier"),
             bias_filler=filler("constant", value=0.0), mults=((10, 1), (20, 0)))
    if loss is not None:
        add_loss_head(b, loss, x, label, delta=delta, **loss_settings)
    return b.net
