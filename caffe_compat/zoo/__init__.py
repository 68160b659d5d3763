"""Our nets and solvers for the FAPPY paper setup, built as ``caffe_pb2`` messages (no torch here).

* :mod:`~caffe_compat.zoo.builder`: ``NetBuilder``, a tiny NetSpec-like writer (conv, pool, lrn, fc,
  relu, dropout, concat, input);
* :mod:`~caffe_compat.zoo.googlenet`, :mod:`~caffe_compat.zoo.vgg_cnn_m_1024`,
  :mod:`~caffe_compat.zoo.digits`: the backbones with an embedding and a loss head;
* :mod:`~caffe_compat.zoo.data_layers`, :mod:`~caffe_compat.zoo.loss_heads`: the pieces they share;
* :mod:`~caffe_compat.zoo.solvers`: the authors' solver settings;
* :mod:`~caffe_compat.zoo.paper`: the table of setups behind ``prototxt/``, written by
  ``python -m caffe_compat.zoo.write_prototxt prototxt/``.
"""

from caffe_compat.zoo.builder import NetBuilder, filler
from caffe_compat.zoo.data_layers import InputData, LabelShufflingData, LmdbData
from caffe_compat.zoo.digits import digits_embedding
from caffe_compat.zoo.googlenet import googlenet_embedding, inception
from caffe_compat.zoo.loss_heads import BASELINES, LOSSES, add_loss_head
from caffe_compat.zoo.paper import PAPER_SETUPS, paper_files
from caffe_compat.zoo.solvers import digits_solver, paper_solver, solver_parameter
from caffe_compat.zoo.vgg_cnn_m_1024 import vgg_cnn_m_1024_embedding

__all__ = [
    "BASELINES", "InputData", "LOSSES", "LabelShufflingData", "LmdbData", "NetBuilder", "PAPER_SETUPS",
    "add_loss_head", "digits_embedding", "digits_solver", "filler", "googlenet_embedding", "inception",
    "paper_files", "paper_solver", "solver_parameter", "vgg_cnn_m_1024_embedding",
]
