"""Every concrete example of issue #19 is a test that gets a typed error (a ``CaffeCompatError`` subclass naming
the file), or for a valid-but-huge request a MemoryBudgetError, quickly.  This table maps each example to its
test; the ones that had none are in this module.

=====================================================  ===============================================================
example in the issue                                   test
=====================================================  ===============================================================
truncated ``data.mdb`` (SIGBUS)                        io/test_lmdb_hostile.py::test_corrupt_data_files_are_typed_errors_
                                                       in_a_child_that_no_signal_kills (``truncated_to_12288``);
                                                       ::test_compute_mean_cli_on_a_truncated_database_exits_2_without_
                                                       writing
flipped page (``IS_LEAF`` abort)                       same test (``leaf_3_flagged_branch``); premise:
                                                       ::test_premise_plain_liblmdb_dies_on_the_same_files
FIFO as learned_net                                    io/test_regular_files.py::test_fifo_as_solverstate_learned_net
FIFO as InfogainLoss source                            io/test_regular_files.py::test_fifo_as_infogain_source
FIFO as a solver's net                                 io/test_regular_files.py::test_fifo_as_solver_net
FIFO as ImageData source and entry                     io/test_regular_files.py::test_fifo_as_image_data_source_and_entry
FIFO as HDF5Data list entry                            io/test_regular_files.py::test_fifo_as_hdf5_list_and_entry
long string hanging ``upgrade``                        here: test_upgrade_of_a_long_string_is_quick
``num_output: 2000000000``                             test_net_budget.py::test_a_giant_num_output_is_refused_naming_
                                                       the_layer; here: test_huge_requests_are_budget_errors[num_output]
Input of 3e12 values                                   test_net_budget.py::test_a_giant_input_is_refused_before_
                                                       allocation; here: test_huge_requests_are_budget_errors[input]
Tile / DummyData / Embed of huge sizes                 here: test_huge_requests_are_budget_errors[tile, dummy_data,
                                                       embed]
``/dev/zero`` as a net / a list / an image             io/test_regular_files.py::test_dev_zero_and_directory_as_net,
                                                       ::test_dev_zero_as_list; here: test_dev_zero_as_an_image
few-KB gzip HDF5 bomb                                  data/test_hostile_files.py::test_hdf5_data_layer_reports_a_bomb_
                                                       and_a_corrupt_file
ONNX metadata resize 1e5 x 1e5                         fuzz/test_fuzz_found.py::test_onnx_metadata_evaluate_would_use_is_
                                                       checked_naming_the_model (resize [100000, 100000])
corrupt HDF5 (h5py RuntimeError/KeyError)              data/test_hostile_files.py::test_damaged_hdf5_files_are_data_
                                                       errors_naming_the_file
lmdb CorruptedError / PageNotFoundError                io/test_lmdb_hostile.py (the corruptions above are caught before
                                                       liblmdb; ::test_record_that_is_not_a_datum_names_the_file_the_
                                                       record_and_its_key)
``cv2.error`` decoding a Datum                         io/test_lmdb_hostile.py::test_bad_datums_are_data_errors_naming_
                                                       the_record; data/test_hostile_files.py::test_opencv_errors_while_
                                                       decoding_are_data_errors; here: test_encoded_datum_opencv_
                                                       cannot_decode
make-lmdb on odd list lines (ValueError)               here: test_make_lmdb_odd_list_lines
mutated ``.trainstate`` (TypeError/KeyError/...)       solver/test_trainstate_integrity.py::test_a_hostile_file_is_a_
                                                       typed_error_naming_the_json_path
LabelShufflingLayer ``param_str`` ValueError           here: test_label_shuffling_param_str_is_a_typed_error
blob whose dims overflow ("cannot reshape")            here: test_blob_dims_that_overflow
conv with a missing kernel (IndexError)                here: test_nets_caffe_refuses_exit_2_naming_the_file[no_kernel]
negative or zero dims, huge dilations reaching torch   here: [negative_dim, zero_dim, dilation_huge];
                                                       test_net_shapes.py::test_caffes_setup_checks_are_format_errors
corrupted ``.pt`` checkpoint                           converters/test_checkpoint_integrity.py::test_a_flipped_byte_in_a_
                                                       tensor_is_a_digest_mismatch, ::test_a_truncated_file_is_a_typed_
                                                       error
fast caffemodel reader vs protobuf                     io/test_weights_differential.py (the differential test)
inspect on nets Caffe refuses: kernel > padded input,  here: test_nets_caffe_refuses_exit_2_naming_the_file (one case
huge dilation, negative dims, slice points / crop      each: kernel_too_big, dilation_huge, negative_dim,
offsets out of range, Concat / Eltwise mismatch,       slice_out_of_range, slice_not_increasing, crop_offset, concat,
ArgMax top_k over the axis, duplicate layer names      eltwise, argmax_top_k, duplicate_top)
weights blob count vs shape                            here: test_weights_blob_count_disagreeing_with_its_shape
weights naming no layer / layer without weights,       test_weights_report.py::test_strict_raises_format_error_naming_
``--strict``                                           the_file_and_layers, ::test_inspect_strict_exits_2
NaN scale / bad channel order in ONNX metadata         fuzz/test_fuzz_found.py::test_onnx_metadata_evaluate_would_use_is_
                                                       checked_naming_the_model (scale nan, channel_order XYZ)
stale ``.tmp`` after SIGKILL                           io/test_atomic.py::test_a_solver_snapshot_removes_stale_
                                                       temporaries_of_its_prefix; solver/test_snapshot_kill.py
=====================================================  ===============================================================
"""

from __future__ import annotations

import pytest

from caffe_compat.errors import CaffeCompatError, DataError, FormatError, MemoryBudgetError
from caffe_compat.proto import caffe_pb2

INPUT = 'layer {{ name: "data" type: "Input" top: "data" input_param {{ shape {{ {dims} }} }} }}\n'


def _input(*dims) -> str:
    return INPUT.format(dims=" ".join(f"dim: {d}" for d in dims))


def _cli(argv, capsys) -> tuple[int, str]:
    from caffe_compat.cli import main

    status = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return status, err


REFUSED = {
    "kernel_too_big": (_input(1, 3, 5, 5) + 'layer { name: "c" type: "Convolution" bottom: "data" top: "c" '
                       'convolution_param { num_output: 2 kernel_size: 7 } }', "layer 'c'"),
    "no_kernel": (_input(1, 3, 5, 5) + 'layer { name: "c" type: "Convolution" bottom: "data" top: "c" '
                  'convolution_param { num_output: 2 } }', "layer 'c'"),
    "dilation_huge": (_input(1, 3, 5, 5) + 'layer { name: "c" type: "Convolution" bottom: "data" top: "c" '
                      'convolution_param { num_output: 2 kernel_size: 3 dilation: 1000000 } }', "layer 'c'"),
    "negative_dim": (_input(1, -3, 5, 5), "data"),
    "zero_dim": (_input(1, 3, 0, 5) + 'layer { name: "c" type: "Convolution" bottom: "data" top: "c" '
                 'convolution_param { num_output: 2 kernel_size: 3 } }', "layer 'c'"),
    "slice_out_of_range": (_input(1, 3, 5, 5) + 'layer { name: "s" type: "Slice" bottom: "data" top: "a" top: "b" '
                           'slice_param { axis: 1 slice_point: 7 } }', "layer 's'"),
    "slice_not_increasing": (_input(1, 6, 5, 5) + 'layer { name: "s" type: "Slice" bottom: "data" top: "a" top: "b" '
                             'top: "c" slice_param { axis: 1 slice_point: 4 slice_point: 2 } }', "layer 's'"),
    "crop_offset": (_input(1, 3, 8, 8) + _input(1, 3, 4, 4).replace('"data"', '"ref"') +
                    'layer { name: "k" type: "Crop" bottom: "data" bottom: "ref" top: "k" '
                    'crop_param { axis: 2 offset: 6 } }', "layer 'k'"),
    "concat": (_input(1, 3, 5, 5) + _input(1, 3, 4, 5).replace('"data"', '"other"') +
               'layer { name: "cat" type: "Concat" bottom: "data" bottom: "other" top: "cat" }', "layer 'cat'"),
    "eltwise": (_input(1, 3, 5, 5) + _input(1, 3, 4, 5).replace('"data"', '"other"') +
                'layer { name: "sum" type: "Eltwise" bottom: "data" bottom: "other" top: "sum" }', "layer 'sum'"),
    "argmax_top_k": (_input(1, 3, 5, 5) + 'layer { name: "am" type: "ArgMax" bottom: "data" top: "am" '
                     'argmax_param { top_k: 10 axis: 1 } }', "layer 'am'"),
    # Caffe's Net::Init accepts two layers of one name (its name index keeps the last) but refuses a top
    # produced twice: the duplicate Caffe refuses
    "duplicate_top": (_input(1, 3, 5, 5) + 'layer { name: "r" type: "ReLU" bottom: "data" top: "r1" }\n'
                      'layer { name: "s" type: "Sigmoid" bottom: "data" top: "r1" }', "'r1'"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_nets_caffe_refuses_exit_2_naming_the_file(tmp_path, capsys, case):
    from caffe_compat.net import load_net

    text, where = REFUSED[case]
    path = tmp_path / f"{case}.prototxt"
    path.write_text(text)
    status, err = _cli(["inspect", path], capsys)
    assert status == 2, err
    assert path.name in err and where in err, err
    with pytest.raises(CaffeCompatError):
        load_net(str(path))


def test_weights_blob_count_disagreeing_with_its_shape(tmp_path, capsys):
    net = tmp_path / "net.prototxt"
    net.write_text(_input(1, 4) + 'layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" '
                   'inner_product_param { num_output: 2 } }')
    weights = caffe_pb2.NetParameter()
    layer = weights.layer.add(name="ip", type="InnerProduct")
    blob = layer.blobs.add()
    blob.shape.dim.extend([2, 4])
    blob.data.extend([0.5] * 7)  # 8 values declared
    bias = layer.blobs.add()
    bias.shape.dim.append(2)
    bias.data.extend([0.0, 0.0])
    (tmp_path / "w.caffemodel").write_bytes(weights.SerializeToString())
    status, err = _cli(["inspect", net, "--weights", tmp_path / "w.caffemodel"], capsys)
    assert status == 2 and "w.caffemodel" in err and "ip" in err, err


@pytest.mark.parametrize("layer", [
    pytest.param(_input(1, 3, 8, 8) + 'layer { name: "t" type: "Tile" bottom: "data" top: "t" '
                 'tile_param { axis: 1 tiles: 2000000000 } }', id="tile"),
    pytest.param('layer { name: "d" type: "DummyData" top: "d" dummy_data_param { shape { dim: 100000 dim: 100000 '
                 'dim: 1000 } } }', id="dummy_data"),
    pytest.param(_input(4) + 'layer { name: "e" type: "Embed" bottom: "data" top: "e" '
                 'embed_param { num_output: 1000000 input_dim: 1000000 } }', id="embed"),
    pytest.param(_input(1, 3, 8, 8) + 'layer { name: "c" type: "Convolution" bottom: "data" top: "c" '
                 'convolution_param { num_output: 2000000000 kernel_size: 1 } }', id="num_output"),
    pytest.param(_input(3000000, 1000000), id="input"),
])
def test_huge_requests_are_budget_errors(tmp_path, monkeypatch, capsys, layer):
    from caffe_compat.net import load_net

    monkeypatch.setenv("CAFFE_COMPAT_MEMORY_BUDGET", "1G")
    path = tmp_path / "huge.prototxt"
    path.write_text(layer)
    with pytest.raises(MemoryBudgetError, match="more than the"):
        load_net(str(path))
    status, err = _cli(["inspect", path], capsys)
    assert status == 2 and "huge.prototxt" in err and "more than the" in err, err


def test_upgrade_of_a_long_string_is_quick(tmp_path, capsys):
    text = 'name: "' + "x" * 2_000_000 + '"\nlayers { name: "a" type: DATA top: "data" }\n'
    path = tmp_path / "long.prototxt"
    path.write_text(text)
    status, err = _cli(["upgrade", path, tmp_path / "new.prototxt"], capsys)
    assert status == 0, err
    (tmp_path / "cut.prototxt").write_text(text[:1_000_000])  # the string never closes
    status, err = _cli(["upgrade", tmp_path / "cut.prototxt", tmp_path / "new2.prototxt"], capsys)
    assert status == 2 and "cut.prototxt" in err
    assert not (tmp_path / "new2.prototxt").exists()


def test_dev_zero_as_an_image():
    from caffe_compat.data.image import load_image_bgr
    from caffe_compat.errors import NotRegularFileError
    from caffe_compat.io.transformer import load_image

    with pytest.raises(NotRegularFileError, match="/dev/zero"):
        load_image_bgr("/dev/zero")
    with pytest.raises(NotRegularFileError, match="/dev/zero"):
        load_image("/dev/zero")


def test_encoded_datum_opencv_cannot_decode(tmp_path):
    pytest.importorskip("lmdb")
    from caffe_compat.io import iter_lmdb, write_lmdb

    jpeg_head = b"\xff\xd8\xff\xe0\x00\x10JFIF\x00" + bytes(40)
    write_lmdb(tmp_path / "db", [("k7", caffe_pb2.Datum(encoded=True, data=jpeg_head, label=0))])
    with pytest.raises(DataError, match=r"db\[k7\]: .*could not decode"):
        list(iter_lmdb(tmp_path / "db"))


@pytest.mark.parametrize("line, message", [
    # Caffe's find_last_of(' ') + atoi: these are the paths 'onlyonefield' and 'a.png' with labels 0, 0 and 1,
    # which name no image here (skipped, as Caffe skips them): nothing is written
    ("onlyonefield", "none of its 1 images could be read"),
    ("a.png notanint", "none of its 1 images could be read"),
    ("a.png 1.5", "none of its 1 images could be read"),
    ("a.png 99999999999999999999999", None),
    ("\x00 1", None),
])
def test_make_lmdb_odd_list_lines(tmp_path, capsys, line, message):
    (tmp_path / "list.txt").write_text(f"{line}\n")
    status, err = _cli(["make-lmdb", "--quiet", tmp_path / "list.txt", tmp_path, tmp_path / "db"], capsys)
    assert status == 2 and "list.txt:1" in err, err
    if message:
        assert message in err
    assert not (tmp_path / "db").exists()


@pytest.mark.parametrize("param_str", ["batch_size: many", "batch_size: -3", "source", "batch_size: 1e400",
                                       "max_number_object_per_label: 0", "scales: [1, x]"])
def test_label_shuffling_param_str_is_a_typed_error(tmp_path, param_str):
    from caffe_compat.net import load_net

    path = tmp_path / "net.prototxt"
    path.write_text('layer { name: "data" type: "Python" top: "data" top: "label" python_param { '
                    'module: "data_layer" layer: "LabelShufflingLayer" param_str: "' + param_str + '" } }')
    with pytest.raises(CaffeCompatError, match="'data'"):
        load_net(str(path))


@pytest.mark.parametrize("dims", [[2 ** 40, 2 ** 40], [2 ** 62, 4], [-1, 3]])
def test_blob_dims_that_overflow(tmp_path, dims):
    from caffe_compat.io import read_blob

    blob = caffe_pb2.BlobProto()
    blob.shape.dim.extend(dims)
    blob.data.extend([1.0, 2.0, 3.0])
    path = tmp_path / "b.binaryproto"
    path.write_bytes(blob.SerializeToString())
    with pytest.raises((FormatError, DataError), match="b.binaryproto"):
        read_blob(path)
