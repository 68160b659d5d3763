"""The peer of ``bench_train.py``'s training rows: the authors' CUB-200 net written by hand as a plain
PyTorch ``nn.Module`` — what a PyTorch user would write for BVLC GoogLeNet + ``fc_embedding`` (512) +
CosineSimilarityBatch + FAPPYLoss — trained by ``torch.optim.SGD``.

Standard PyTorch operators only: ``F.conv2d`` through ``nn.Conv2d``, ``F.max_pool2d(ceil_mode=True)``
(PyTorch's own tie and NaN choices, not Caffe's), ``F.local_response_norm`` (Caffe's ACROSS_CHANNELS
formula ``x / (k + α/n Σ x²)^β``), ``F.avg_pool2d``, ``F.dropout``, ``F.linear``; the loss is
caffe-compat's ``FAPPYLoss`` (delta 1e-4, as the authors' prototxt), so a comparison times the net and
the update, not two losses.  ``torch.optim.SGD`` (momentum 0.9, weight decay 2e-4) with the prototxt's
``lr_mult``/``decay_mult`` as parameter groups: weights 1/1, biases 2/0, ``fc_embedding`` 10/1 and 20/0.
(PyTorch's SGD applies the learning rate after the momentum, Caffe's before it: the same work per step.)

:func:`copy_caffe_weights` takes the weights of a :class:`~caffe_compat.net.CaffeNet` of the same
prototxt by layer name, so both start from the same fillers; :func:`max_embedding_difference` checks
that the two are the same function (dropout off).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from caffe_compat.losses import FAPPYLoss

#: BVLC GoogLeNet's inception modules: input channels, then 1x1, 3x3 reduce, 3x3, 5x5 reduce, 5x5, pool proj.
INCEPTIONS = {
    "3a": (192, 64, 96, 128, 16, 32, 32), "3b": (256, 128, 128, 192, 32, 96, 64),
    "4a": (480, 192, 96, 208, 16, 48, 64), "4b": (512, 160, 112, 224, 24, 64, 64),
    "4c": (512, 128, 128, 256, 24, 64, 64), "4d": (512, 112, 144, 288, 32, 64, 64),
    "4e": (528, 256, 160, 320, 32, 128, 128), "5a": (832, 256, 160, 320, 32, 128, 128),
    "5b": (832, 384, 192, 384, 48, 128, 128),
}
#: The LRN of ``pool1/norm1`` and ``conv2/norm2``: local_size 5, alpha 1e-4, beta 0.75 (k = 1); alpha as the
#: proto ``float`` holds it (what the CaffeNet computes with), so that the two nets are the same function.
LRN = dict(size=5, alpha=float(np.float32(1e-4)), beta=0.75, k=1.0)


def _conv(convs: nn.ModuleDict, name: str, cin: int, cout: int, kernel: int, stride: int = 1, pad: int = 0) -> None:
    convs[name.replace("/", ":")] = nn.Conv2d(cin, cout, kernel, stride, pad)


class HandWrittenGoogLeNet(nn.Module):
    """GoogLeNet (no auxiliary heads) → dropout 0.4 → ``fc_embedding`` (1024 → 512); ``forward(x, labels)``
    returns the FAPPY loss, ``embed(x)`` the embeddings."""

    def __init__(self, embedding: int = 512, delta: float = 1e-4):
        super().__init__()
        self.convs = nn.ModuleDict()
        _conv(self.convs, "conv1/7x7_s2", 3, 64, 7, 2, 3)
        _conv(self.convs, "conv2/3x3_reduce", 64, 64, 1)
        _conv(self.convs, "conv2/3x3", 64, 192, 3, 1, 1)
        for name, (cin, c1, r3, c3, r5, c5, cp) in INCEPTIONS.items():
            _conv(self.convs, f"inception_{name}/1x1", cin, c1, 1)
            _conv(self.convs, f"inception_{name}/3x3_reduce", cin, r3, 1)
            _conv(self.convs, f"inception_{name}/3x3", r3, c3, 3, 1, 1)
            _conv(self.convs, f"inception_{name}/5x5_reduce", cin, r5, 1)
            _conv(self.convs, f"inception_{name}/5x5", r5, c5, 5, 1, 2)
            _conv(self.convs, f"inception_{name}/pool_proj", cin, cp, 1)
        self.fc_embedding = nn.Linear(1024, embedding)
        self.loss = FAPPYLoss(delta=delta)

    def _relu_conv(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.convs[name.replace("/", ":")](x), inplace=True)

    def _inception(self, name: str, x: torch.Tensor) -> torch.Tensor:
        c = self._relu_conv
        p = f"inception_{name}/"
        return torch.cat([c(p + "1x1", x),
                          c(p + "3x3", c(p + "3x3_reduce", x)),
                          c(p + "5x5", c(p + "5x5_reduce", x)),
                          c(p + "pool_proj", F.max_pool2d(x, 3, 1, 1, ceil_mode=True))], 1)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(self._relu_conv("conv1/7x7_s2", x), 3, 2, ceil_mode=True)
        x = F.local_response_norm(x, **LRN)
        x = self._relu_conv("conv2/3x3", self._relu_conv("conv2/3x3_reduce", x))
        x = F.max_pool2d(F.local_response_norm(x, **LRN), 3, 2, ceil_mode=True)
        for name in INCEPTIONS:
            x = self._inception(name, x)
            if name in ("3b", "4e"):
                x = F.max_pool2d(x, 3, 2, ceil_mode=True)
        x = F.dropout(F.avg_pool2d(x, 7, 1), 0.4, self.training)
        return self.fc_embedding(x.flatten(1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss(self.embed(x), labels)


def copy_caffe_weights(module: HandWrittenGoogLeNet, net) -> None:
    """The CaffeNet ``net``'s blobs (same prototxt) into ``module``, by layer name."""
    with torch.no_grad():
        for key, conv in module.convs.items():
            weight, bias = net.params[key.replace(":", "/")]
            conv.weight.copy_(weight)
            conv.bias.copy_(bias)
        weight, bias = net.params["fc_embedding"]
        module.fc_embedding.weight.copy_(weight)
        module.fc_embedding.bias.copy_(bias)


def sgd(module: HandWrittenGoogLeNet, base_lr: float, momentum: float, weight_decay: float) -> torch.optim.SGD:
    """``torch.optim.SGD`` with the prototxt's lr_mult / decay_mult as parameter groups."""
    fc = module.fc_embedding
    convs = list(module.convs.values())
    groups = [
        {"params": [c.weight for c in convs], "lr": base_lr, "weight_decay": weight_decay},
        {"params": [c.bias for c in convs], "lr": 2 * base_lr, "weight_decay": 0.0},
        {"params": [fc.weight], "lr": 10 * base_lr, "weight_decay": weight_decay},
        {"params": [fc.bias], "lr": 20 * base_lr, "weight_decay": 0.0},
    ]
    return torch.optim.SGD(groups, lr=base_lr, momentum=momentum)


@torch.no_grad()
def max_embedding_difference(module: HandWrittenGoogLeNet, net, data: torch.Tensor, labels: torch.Tensor) -> float:
    """Largest |difference| between the two nets' embeddings of ``data`` (dropout off), relative to the
    largest |embedding|: float32 round-off (~1e-6) when they are the same net."""
    was_module, was_net = module.training, net.training
    module.eval()
    net.eval()
    try:
        ours = net.forward(data=data, label=labels)["fc_embedding"].float()
        peer = module.embed(data).float()
    finally:
        module.train(was_module)
        net.train(was_net)
    return float((ours - peer).abs().max() / ours.abs().max())
