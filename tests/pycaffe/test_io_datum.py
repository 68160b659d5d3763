"""pycaffe's ``caffe.io`` Datum and BlobProto converters: uint8 arrays as bytes, others as float_data, an
unset label not serialised, shape-less and legacy 4-D blobs, and ValueError-compatible typed errors."""

from __future__ import annotations

import numpy as np
import pytest

from caffe_compat.errors import ArrayShapeError, FormatError
from caffe_compat.pycaffe import io
from caffe_compat.proto import caffe_pb2


def test_uint8_array_round_trips_through_the_bytes():
    image = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    datum = io.array_to_datum(image, label=7)
    assert (datum.channels, datum.height, datum.width, datum.label) == (2, 3, 4, 7)
    assert datum.data == image.tobytes() and len(datum.float_data) == 0
    back = io.datum_to_array(caffe_pb2.Datum.FromString(datum.SerializeToString()))
    assert back.dtype == np.uint8 and np.array_equal(back, image)


def test_float_array_goes_to_float_data_and_comes_back_float64():
    values = np.linspace(-1.5, 2.25, 12, dtype=np.float32).reshape(3, 2, 2)
    datum = io.array_to_datum(values)
    assert datum.data == b"" and list(datum.float_data) == values.ravel().tolist()
    back = io.datum_to_array(datum)
    assert back.dtype == np.float64 and np.array_equal(back, values.astype(np.float64))


def test_an_unset_label_is_not_serialised():
    with_label = io.array_to_datum(np.ones((10, 10, 3)), label=1)
    without = io.array_to_datum(np.ones((10, 10, 3)))
    assert not without.HasField("label") and with_label.HasField("label")
    assert len(with_label.SerializeToString()) - len(without.SerializeToString()) == 2  # tag + varint 1


def test_bad_shapes_are_typed_errors_that_are_also_value_errors():
    with pytest.raises(ArrayShapeError, match=r"3-D .* got shape \(4, 4\)") as info:
        io.array_to_datum(np.zeros((4, 4)))
    assert isinstance(info.value, ValueError) and isinstance(info.value, FormatError)
    short = caffe_pb2.Datum(channels=1, height=2, width=2, data=b"\x00\x01\x02")
    with pytest.raises(ArrayShapeError, match=r"\(1, 2, 2\) holds 3 values"):
        io.datum_to_array(short)
    with pytest.raises(FormatError, match="encoded"):
        io.datum_to_array(caffe_pb2.Datum(channels=3, height=1, width=1, data=b"\xff\xd8", encoded=True))


def test_blobproto_shapes_new_legacy_and_none():
    blob = caffe_pb2.BlobProto()
    blob.data.extend([123.0])
    scalar = io.blobproto_to_array(blob)  # no shape, one value: a 0-d array
    assert scalar.shape == () and float(scalar) == 123.0
    blob.data.extend(range(99))
    with pytest.raises(ValueError, match=r"shape \(\) \(1 values\) holds 100 data values"):
        io.blobproto_to_array(blob)  # no shape, 100 values
    blob.num, blob.channels, blob.height, blob.width = 1, 1, 10, 10
    assert io.blobproto_to_array(blob).shape == (1, 1, 10, 10)
    new = io.array_to_blobproto(np.arange(6.0).reshape(2, 3))
    assert list(new.shape.dim) == [2, 3] and np.array_equal(io.blobproto_to_array(new), np.arange(6.0).reshape(2, 3))


def test_pycaffes_misspelled_arraylist_to_blobprotovecor_str_is_there():
    # pycaffe's io.py defines the list writer only as ``arraylist_to_blobprotovecor_str`` (sic); scripts call it so
    arrays = [np.arange(6.0).reshape(2, 3), np.full((1, 2, 2), -0.5)]
    data = io.arraylist_to_blobprotovecor_str(arrays)
    vec = caffe_pb2.BlobProtoVector.FromString(data)
    assert [list(b.shape.dim) for b in vec.blobs] == [[2, 3], [1, 2, 2]]
    assert list(vec.blobs[1].data) == [-0.5] * 4
    assert data == io.arraylist_to_blobprotovector_str(arrays)
    assert [a.tolist() for a in io.blobprotovector_str_to_arraylist(data)] == [a.tolist() for a in arrays]


def test_an_encoded_datum_is_a_value_error_as_pycaffes_failed_reshape():
    # convert_imageset --encoded leaves channels/height/width unset: pycaffe reshapes the JPEG bytes to
    # (0, 0, 0) and numpy raises ValueError, which scripts catch to decode the bytes themselves
    datum = caffe_pb2.Datum(data=b"\xff\xd8\xff\xe0" + b"\0" * 16, encoded=True, label=3)
    with pytest.raises(ValueError, match="encoded") as info:
        io.datum_to_array(datum)
    assert isinstance(info.value, FormatError)
