"""Data sets in their native layouts, Caffe's image decoding and DataTransformer, samplers, toy data.

Nothing here reads protobuf: LMDB/Datum input and ``.binaryproto`` means live in ``caffe_compat.io``.
"""

from caffe_compat.data.cub200 import Cub200, read_cub200
from caffe_compat.data.dataset import ImageRecordDataset
from caffe_compat.data.image import load_image_bgr
from caffe_compat.data.records import NO_CATEGORY, ImageRecord, categories_of, labels_of
from caffe_compat.data.samplers import CategoryHardSampler, LabelShufflingSampler, MPerClassSampler
from caffe_compat.data.sop import StanfordOnlineProducts, read_sop
from caffe_compat.data.toy import KINDS as TOY_KINDS
from caffe_compat.data.toy import make_toy_data
from caffe_compat.data.transformer import DataTransformer
from caffe_compat.data.vehicleid import VehicleID, read_vehicle_models, read_vehicleid

__all__ = [
    "NO_CATEGORY",
    "TOY_KINDS",
    "CategoryHardSampler",
    "Cub200",
    "DataTransformer",
    "ImageRecord",
    "ImageRecordDataset",
    "LabelShufflingSampler",
    "MPerClassSampler",
    "StanfordOnlineProducts",
    "VehicleID",
    "categories_of",
    "labels_of",
    "load_image_bgr",
    "make_toy_data",
    "read_cub200",
    "read_sop",
    "read_vehicle_models",
    "read_vehicleid",
]
