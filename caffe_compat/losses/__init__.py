"""Metric-learning losses as plain ``nn.Module``s, each called ``loss(embeddings, labels)``, or with
pytorch-metric-learning's convention ``loss(embeddings, labels, indices_tuple=None, ref_emb=None,
ref_labels=None)`` (see :mod:`.batch_input`); miners return PML's index tuples (:mod:`.miners`).

The Caffe loss *layers* (``caffe_compat/layers/metric_learning.py``) are thin adapters over these.
Batch geometry (cosines, distances, label masks, Caffe's pair order) lives in :mod:`.pairwise`.
"""

from caffe_compat.losses.binomial_deviance import BinomialDevianceLoss
from caffe_compat.losses.contrastive import ContrastiveLoss
from caffe_compat.losses.cosine_similarity_batch import CosineSimilarityBatch, cosine_similarity_batch
from caffe_compat.losses.fappy import FAPPYLoss, fappy_caffe, fappy_paper
from caffe_compat.losses.fastap import FastAPLoss
from caffe_compat.losses.histogram import HistogramLoss
from caffe_compat.losses.lifted_struct import LiftedStructLoss
from caffe_compat.losses.margin import MarginLoss
from caffe_compat.losses.miners import DistanceWeightedMiner, EasyPositiveMiner, TripletMiner, VTHMMiner
from caffe_compat.losses.multi_similarity import MultiSimilarityLoss
from caffe_compat.losses.raw import RAWLoss
from caffe_compat.losses.smooth_ap import SmoothAPLoss
from caffe_compat.losses.triplet import TripletLoss
from caffe_compat import vector_math

vector_math.initialise()  # before any multi-threaded element-wise call (see vector_math)

__all__ = [
    "BinomialDevianceLoss", "ContrastiveLoss", "CosineSimilarityBatch", "DistanceWeightedMiner",
    "EasyPositiveMiner", "FAPPYLoss", "FastAPLoss", "HistogramLoss", "LiftedStructLoss", "MarginLoss",
    "MultiSimilarityLoss", "RAWLoss", "SmoothAPLoss", "TripletLoss", "TripletMiner", "VTHMMiner",
    "cosine_similarity_batch", "fappy_caffe", "fappy_paper",
]
