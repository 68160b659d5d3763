"""The committed caffe_pb2.py is exactly what caffe.proto generates, and carries the authors' fields."""

from __future__ import annotations

import pytest

from caffe_compat.proto import caffe_pb2, regenerate


def test_committed_module_equals_regenerated():
    assert regenerate.generate() == regenerate.MODULE.read_text()


def test_no_runtime_version_pin():
    text = regenerate.MODULE.read_text()
    assert "runtime_version" not in text and "Protobuf Python Version" not in text


def test_authors_fields_numbers_and_defaults():
    fields = caffe_pb2.LayerParameter.DESCRIPTOR.fields_by_name
    assert fields["cosine_similarity_batch_param"].number == 147
    assert fields["fappy_loss_param"].number == 148
    cos = caffe_pb2.CosineSimilarityBatchParameter()
    assert (cos.pos_label, cos.neg_label) == (1.0, -1.0)
    assert cos.DESCRIPTOR.fields_by_name["pos_label"].type == cos.DESCRIPTOR.fields_by_name["pos_label"].TYPE_DOUBLE
    assert caffe_pb2.FAPPYLossParameter().delta == pytest.approx(0.001)


@pytest.mark.parametrize("message,field,number", [
    ("LayerParameter", "convolution_param", 106), ("LayerParameter", "batch_norm_param", 139),
    ("LayerParameter", "input_param", 143), ("NetParameter", "layers", 2), ("NetParameter", "layer", 100),
    ("SolverParameter", "solver_type", 30), ("SolverParameter", "type", 40), ("SolverParameter", "iter_size", 36),
    ("BlobProto", "shape", 7), ("BlobProto", "double_data", 8), ("Datum", "encoded", 7),
    ("V1LayerParameter", "blobs_lr", 7), ("V0LayerParameter", "kernelsize", 8), ("SolverState", "current_step", 4),
])
def test_field_numbers(message, field, number):
    assert getattr(caffe_pb2, message).DESCRIPTOR.fields_by_name[field].number == number
