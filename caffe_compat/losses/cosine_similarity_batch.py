"""CosineSimilarityBatch: the FAPPY authors' pairwise cosine layer.

Outputs, for a batch x of B rows and M = B(B-1)/2 pairs i<j in row-major order
(pair k = B·i − i(i+1)/2 + (j − i − 1)):

* ``cosine[k] = xy_ij / sqrt(xy_ii · xy_jj)`` with ``xy = x·xᵀ``: the square root of the *product* of
  the squared norms (a zero row gives NaN, as in Caffe);
* ``pair_label[k]``: ``pos_label`` (default 1) when the labels of i and j are equal, else ``neg_label``
  (default -1).

Both have Caffe's top shape (M, 1, 1, 1).  The gradient (autograd through the formula above) is the
C++ Backward, ``dx_i = Σ_{j≠i} g_ij (x_j − xy_ij/xy_ii · x_i) / sqrt(xy_ii xy_jj)``; ``pair_label``
has none (Caffe ignores the diff of its second top).

Caffe quirks reproduced with ``faithful=True`` (the default):

* **pair_label off by one**: the C++ increments k *before* writing the label, so element 0 is never
  written (it keeps Caffe's zero fill), element k+1 holds pair k's label, and the last pair's label is
  written one float past the end of the buffer (a heap overflow that aborts the process for B ≡ 4, 5
  mod 8 in Caffe; here the write is simply dropped);
* ``pos_label``/``neg_label`` are proto doubles read into C++ ``int``s: truncated toward zero
  (0.5 → 0, -1.7 → -1).

``faithful=False`` gives the intended output instead: ``pair_label[k]`` is pair k's label, with the
two label values used as given.

:class:`CosineSimilarityBatch` is the same computation as an ``nn.Module`` returning flat ``(M,)`` tensors.
"""

from __future__ import annotations

import math

import torch

from caffe_compat.losses.loss_errors import LossInputError
from caffe_compat.losses.pairwise import cosine_matrix, lifting_subnormal_grads, upper_pairs


def _as_rows(features: torch.Tensor) -> torch.Tensor:
    """(B, D) or Caffe's (B, D, 1, 1) as (B, D); anything else is what the layer's CHECKs reject."""
    if features.dim() == 2:
        return features
    if features.dim() == 4 and tuple(features.shape[2:]) == (1, 1):
        return features.reshape(features.shape[0], features.shape[1])
    raise LossInputError(
        f"CosineSimilarityBatch: features must have shape (B, D) or (B, D, 1, 1), got {tuple(features.shape)}")


def cosine_similarity_batch(features: torch.Tensor, labels: torch.Tensor, pos_label: float = 1.0,
                            neg_label: float = -1.0, faithful: bool = True
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(cosine, pair_label)``, both (M, 1, 1, 1) in the features' dtype and device.

    ``labels``: (B,) or (B, 1, 1, 1).  ``faithful`` selects Caffe's pair_label (off by one, integer label
    values) or the corrected one; the cosines are the same either way."""
    x = _as_rows(features)
    labels = torch.as_tensor(labels, device=x.device)
    if labels.dim() not in (1, 4) or (labels.dim() == 4 and tuple(labels.shape[1:]) != (1, 1, 1)):
        raise LossInputError(
            f"CosineSimilarityBatch: labels must have shape (B,) or (B,1,1,1), got {tuple(labels.shape)}")
    labels = labels.reshape(-1)
    b = x.shape[0]
    if labels.numel() != b:
        raise LossInputError(f"CosineSimilarityBatch: {b} feature rows but {labels.numel()} labels")
    iu, ju = upper_pairs(b, device=x.device)
    m = iu.numel()
    cosine = lifting_subnormal_grads(lambda rows: cosine_matrix(rows)[iu, ju], x).reshape(m, 1, 1, 1)

    with torch.no_grad():
        same = labels[iu] == labels[ju]
        if faithful:
            pos, neg = float(math.trunc(pos_label)), float(math.trunc(neg_label))
        else:
            pos, neg = float(pos_label), float(neg_label)
        values = torch.where(same, pos, neg).to(x.dtype)
        if faithful:
            pair_label = torch.zeros(m, dtype=x.dtype, device=x.device)
            pair_label[1:] = values[:-1]
        else:
            pair_label = values
    return cosine, pair_label.reshape(m, 1, 1, 1)


class CosineSimilarityBatch(torch.nn.Module):
    """The authors' ``CosineSimilarityBatch`` layer as a PyTorch module (no parameters).

    ``forward(features, labels)`` returns ``(cosine, pair_label)``, both ``(M,)`` with M = B(B−1)/2, for
    the pairs i<j in Caffe's row-major order: exactly :func:`cosine_similarity_batch` with its
    ``(M, 1, 1, 1)`` outputs flattened.  ``cosine`` is differentiable (the C++ Backward), ``pair_label``
    is not.

    Args:
        pos_label: label of a same-class pair (default 1, the authors' proto default).
        neg_label: label of a different-class pair (default −1).
        faithful: True (default, as the function and the Caffe layer) reproduces Caffe's off-by-one
            ``pair_label`` (element 0 is 0, element k+1 holds pair k's label) and its integer truncation
            of the two values; False gives ``pair_label[k]`` = pair k's label with the values as given.
    """

    def __init__(self, pos_label: float = 1.0, neg_label: float = -1.0, faithful: bool = True):
        super().__init__()
        self.pos_label = float(pos_label)
        self.neg_label = float(neg_label)
        self.faithful = bool(faithful)

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cosine, pair_label = cosine_similarity_batch(features, labels, self.pos_label, self.neg_label,
                                                     faithful=self.faithful)
        return cosine.reshape(-1), pair_label.reshape(-1)

    def extra_repr(self) -> str:
        return f"pos_label={self.pos_label}, neg_label={self.neg_label}, faithful={self.faithful}"
