"""Retrieval metrics and evaluation protocols on feature arrays (numpy or torch, from any source).

Nothing here imports the nets or layers: features from PyTorch, pycaffe or ONNX Runtime are all just
``(N, D)`` arrays. Conventions shared by every metric: cosine similarity of L2-normalised features,
each query searched against all *other* items (masked by index), ties ranked by lower index first,
chunked computation under a memory budget on the CPU or CUDA (``device=``).
"""

from caffe_compat.evaluate.inputs import EvaluationInputError
from caffe_compat.evaluate.kmeans import kmeans
from caffe_compat.evaluate.knn import topk_neighbours
from caffe_compat.evaluate.map_at_r import map_at_r, precision_at_1
from caffe_compat.evaluate.nmi import nmi, normalized_mutual_information
from caffe_compat.evaluate.protocols import PROTOCOLS, evaluate_cub200, evaluate_sop, evaluate_vehicleid, paper_tables
from caffe_compat.evaluate.recall import recall_at_k
from caffe_compat.evaluate.retrieval import retrieval_metrics
from caffe_compat.evaluate.vehicleid import vehicleid_cmc, vehicleid_cmc_curve

__all__ = [
    "EvaluationInputError",
    "PROTOCOLS",
    "evaluate_cub200",
    "evaluate_sop",
    "evaluate_vehicleid",
    "kmeans",
    "map_at_r",
    "nmi",
    "normalized_mutual_information",
    "paper_tables",
    "precision_at_1",
    "recall_at_k",
    "retrieval_metrics",
    "topk_neighbours",
    "vehicleid_cmc",
    "vehicleid_cmc_curve",
]
