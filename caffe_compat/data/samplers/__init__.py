"""Batch samplers for metric learning (use with ``DataLoader(..., batch_sampler=...)``)."""

from caffe_compat.data.samplers.base import GlobalBatchSampler
from caffe_compat.data.samplers.category_hard import CategoryHardSampler
from caffe_compat.data.samplers.label_shuffling import LabelShufflingSampler, LabelShufflingStream
from caffe_compat.data.samplers.m_per_class import MPerClassSampler

__all__ = [
    "CategoryHardSampler",
    "GlobalBatchSampler",
    "LabelShufflingSampler",
    "LabelShufflingStream",
    "MPerClassSampler",
]
