"""Data (LMDB), ImageData and HDF5Data layers against real Caffe's Data-layer outputs and hand-built inputs."""

from __future__ import annotations

import json
import sys

import cv2
import numpy as np
import pytest
import torch
from google.protobuf import text_format

import caffe_compat as caffe
from caffe_compat.data.imageset import convert_imageset
from caffe_compat.data.lmdb_source import DatumDataset, DatumSource
from caffe_compat.data.transformer import DataTransformer
from caffe_compat.errors import DataError, FormatError
from caffe_compat.io import make_datum, read_net, write_lmdb
from caffe_compat.layers import layer_class
from caffe_compat.net import CaffeNet
from caffe_compat.proto import caffe_pb2
from tests.conftest import fixture_path

DATA_DIR = fixture_path("data/cases.json").parent
CASES = json.loads((DATA_DIR / "cases.json").read_text())["cases"]


def _layer(text: str, phase: str = "test"):
    param = text_format.Parse(text, caffe_pb2.LayerParameter())
    return layer_class(param)(param, [], phase)


def _data_layer(source, batch: int, transform: str = "", phase: str = "test", extra: str = ""):
    return _layer(f'name: "data" type: "Data" top: "data" top: "label" transform_param {{ {transform} }} '
                  f'data_param {{ source: "{source}" batch_size: {batch} backend: LMDB {extra} }}', phase)


@pytest.fixture
def in_data_dir(monkeypatch):
    monkeypatch.chdir(DATA_DIR)  # the prototxts name lmdb_* and mean.binaryproto relative to data/, like Caffe
    return DATA_DIR


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_data_layer_equals_caffe_bit_for_bit(case, in_data_dir):
    net = CaffeNet(read_net(f"{case['name']}.prototxt"), phase="test")
    expected = np.load(f"{case['name']}.npz")
    assert net.blob_shapes["data"] == tuple(case["data_shape"]) and net.blob_shapes["label"] == (case["batch_size"],)
    for it in range(case["n_forward"]):  # the second batch wraps around: records 4, 5, 0, 1
        blobs = net.forward()
        data, label = blobs["data"].numpy(), blobs["label"].numpy()
        assert data.dtype == np.float32 and np.array_equal(data, expected[f"data_iter{it}"])
        assert np.array_equal(label, expected[f"label_iter{it}"]) and label.tolist() == case["labels"][it]


def test_facade_forward_advances_and_wraps(in_data_dir):
    expected = np.load("raw_meanfile_crop12_scale0.5.npz")
    labels = np.load("source_images.npz")["labels"].astype(np.float32)
    net = caffe.Net("raw_meanfile_crop12_scale0.5.prototxt", caffe.TEST)
    out = net.forward()
    assert np.array_equal(net.blobs["data"].data, expected["data_iter0"])
    assert np.array_equal(out["label"], expected["label_iter0"])
    net.forward()
    assert np.array_equal(net.blobs["data"].data, expected["data_iter1"])
    net.forward()  # cursor at record 2 now: 2, 3, 4, 5
    assert np.array_equal(net.blobs["label"].data, labels[[2, 3, 4, 5]])
    net.forward()
    assert np.array_equal(net.blobs["label"].data, labels[[0, 1, 2, 3]])


def test_data_layer_without_label_top_and_batch_larger_than_db(in_data_dir):
    layer = _layer('name: "d" type: "Data" top: "data" data_param { source: "lmdb_raw" batch_size: 8 backend: LMDB }')
    images = np.load("source_images.npz")["images_chw_bgr_uint8"]
    (data,) = layer()
    assert np.array_equal(data.numpy(), images[[0, 1, 2, 3, 4, 5, 0, 1]].astype(np.float32))
    (data,) = layer()
    assert np.array_equal(data.numpy(), images[[2, 3, 4, 5, 0, 1, 2, 3]].astype(np.float32))


def _windows(image_chw: np.ndarray, crop: int) -> list[np.ndarray]:
    c, h, w = image_chw.shape
    found = []
    for y in range(h - crop + 1):
        for x in range(w - crop + 1):
            window = image_chw[:, y:y + crop, x:x + crop]
            found += [window, window[:, :, ::-1]]
    return found


def test_train_phase_random_crop_and_mirror_are_seeded_windows(in_data_dir):
    images = np.load("source_images.npz")["images_chw_bgr_uint8"].astype(np.float32)
    transform = 'crop_size: 9 mirror: true mean_value: 100 scale: 0.5'
    runs = []
    for seed in (7, 7, 8):
        layer = _data_layer("lmdb_raw", 6, transform, phase="train")
        layer.fill(torch.Generator().manual_seed(seed))
        runs.append(torch.cat([layer()[0] for _ in range(3)]).numpy())
    assert np.array_equal(runs[0], runs[1]) and not np.array_equal(runs[0], runs[2])
    out = runs[0]
    offsets = set()
    for k in range(out.shape[0]):
        windows = [(win - 100) * np.float32(0.5) for win in _windows(images[k % 6], 9)]
        matches = [i for i, win in enumerate(windows) if np.array_equal(win, out[k])]
        assert matches, f"sample {k} is no (mirrored) crop of record {k % 6}"
        offsets.add(matches[0])
    assert len(offsets) > 3  # crops and mirrors vary (18 draws)


def test_test_phase_mirror_flips_some_images_like_caffe(in_data_dir):
    images = np.load("source_images.npz")["images_chw_bgr_uint8"].astype(np.float32)
    layer = _data_layer("lmdb_raw", 6, "mirror: true", phase="test")
    data = layer()[0].numpy()
    flipped = [np.array_equal(data[i], images[i][:, :, ::-1]) for i in range(6)]
    kept = [np.array_equal(data[i], images[i]) for i in range(6)]
    assert all(f or k for f, k in zip(flipped, kept)) and any(flipped)


def test_data_layer_transform_follows_eval_and_train(in_data_dir):
    """The crop follows the layer's mode like Dropout/BatchNorm: a TRAIN-phase net after eval() gives Caffe's
    TEST centre crop bit for bit (the fixture), a TEST-phase net after train() random crops."""
    expected = np.load("raw_meanfile_crop12_scale0.5.npz")
    param = read_net("raw_meanfile_crop12_scale0.5.prototxt")
    del param.layer[0].include[:]  # the fixture layer is TEST-only; keep it in a TRAIN net
    net = CaffeNet(param, phase="train")
    assert net.training and net.layer("data").transformer.phase == "TRAIN"
    net.eval()
    for it in range(2):
        assert np.array_equal(net.forward()["data"].numpy(), expected[f"data_iter{it}"])
    net.train()
    random_crops = net.forward()["data"].numpy()
    images = np.load("source_images.npz")["images_chw_bgr_uint8"].astype(np.float32)
    mean = np.load("source_images.npz")["mean"].astype(np.float32)
    offsets = []
    for k, record in enumerate([2, 3, 4, 5]):  # the cursor after batches 0-3 and 4, 5, 0, 1
        centred = images[record] - mean
        found = [(y, x) for y in range(5) for x in range(9)
                 if np.array_equal(centred[:, y:y + 12, x:x + 12] * np.float32(0.5), random_crops[k])]
        assert found, f"sample {k} is no crop of record {record}"
        offsets += found
    assert any(offset != (2, 4) for offset in offsets)  # not all centre crops ((16-12)//2, (20-12)//2)
    test_net = CaffeNet(read_net("raw_meanfile_crop12_scale0.5.prototxt"), phase="test").train().eval()
    assert np.array_equal(test_net.forward()["data"].numpy(), expected["data_iter0"])


def test_force_color_and_force_gray_together_fail_only_on_an_encoded_record(in_data_dir, tmp_path, monkeypatch):
    """Caffe CHECKs "cannot set both force_color and force_gray" only where DataTransformer decodes an encoded
    Datum (Transform / InferBlobShape): a Data layer over raw records (Caffe logs 'only for encoded datum') and
    an ImageData layer (which never reads the two flags) accept both and give the flag-free values.  Before,
    ours refused both layers at construction."""
    both = "force_color: true force_gray: true"
    with pytest.raises(FormatError, match="force_color and force_gray"):
        _data_layer("lmdb_png", 2, both)
    with pytest.warns(UserWarning, match="only apply to encoded Datums"):
        data, label = _data_layer("lmdb_raw", 2, both)()
    plain, plain_label = _data_layer("lmdb_raw", 2)()
    assert np.array_equal(data.numpy(), plain.numpy()) and label.tolist() == plain_label.tolist()
    entries = _toy_images(tmp_path, count=2)
    monkeypatch.chdir(tmp_path)
    data, label = _layer(f'name: "img" type: "ImageData" top: "data" top: "label" transform_param {{ {both} }} '
                         'image_data_param { source: "list.txt" batch_size: 2 }')()
    assert label.tolist() == [10.0, 11.0]
    assert np.array_equal(data.numpy(), np.stack([image.transpose(2, 0, 1) for _, _, image in entries]))


def test_data_layer_errors(in_data_dir, tmp_path):
    with pytest.raises(FormatError, match="LEVELDB"):
        _layer('name: "d" type: "Data" top: "data" data_param { source: "lmdb_raw" batch_size: 2 }')
    with pytest.raises(DataError, match="no_such_lmdb.*working directory"):
        _data_layer("no_such_lmdb", 2)
    with pytest.raises(FormatError, match="force_color and force_gray"):
        _data_layer("lmdb_png", 2, "force_color: true force_gray: true")
    with pytest.raises(DataError, match="smaller than crop_size"):
        _data_layer("lmdb_raw", 2, "crop_size: 17")()
    with pytest.raises(DataError, match="mean_file 'nope.binaryproto' not found"):
        _data_layer("lmdb_raw", 2, 'mean_file: "nope.binaryproto"')
    mixed = tmp_path / "mixed_lmdb"
    write_lmdb(mixed, [("a", make_datum(np.zeros((3, 4, 4), np.uint8), 0)),
                       ("b", make_datum(np.zeros((3, 5, 4), np.uint8), 1))])
    with pytest.raises(DataError, match="Caffe needs equal sizes"):
        _data_layer(mixed, 2)()


def test_encoded_gray_png_native_and_force_color(tmp_path):
    gray = (np.arange(48, dtype=np.uint8) * 5).reshape(6, 8)
    ok, png = cv2.imencode(".png", gray)
    assert ok
    db = tmp_path / "gray_lmdb"
    write_lmdb(db, [("00000000", make_datum(png.tobytes(), 3, encoded=True))])
    native, label = _data_layer(db, 1)()
    assert native.shape == (1, 1, 6, 8) and np.array_equal(native[0, 0].numpy(), gray.astype(np.float32))
    assert label.tolist() == [3.0]
    for extra in ('', 'force_encoded_color: true'):
        transform = "force_color: true" if not extra else ""
        color, _ = _data_layer(db, 1, transform, extra=extra)()
        assert color.shape == (1, 3, 6, 8)
        assert all(np.array_equal(color[0, c].numpy(), gray.astype(np.float32)) for c in range(3))


def _toy_images(root, count: int = 5, size=(10, 14)) -> list[tuple[str, int, np.ndarray]]:
    rng = np.random.RandomState(4)
    entries = []
    (root / "img").mkdir(parents=True)
    for i in range(count):
        image = rng.randint(0, 256, size=(*size, 3)).astype(np.uint8)
        name = f"img/toy_{i}.png"
        cv2.imwrite(str(root / name), image)
        entries.append((name, 10 + i % 3, image))
    (root / "list.txt").write_text("".join(f"{name} {label}\n" for name, label, _ in entries))
    return entries


@pytest.mark.parametrize("encoded", [False, True])
def test_convert_imageset_lmdb_read_back_through_data_layer(tmp_path, encoded):
    entries = _toy_images(tmp_path)
    db = tmp_path / "toy_lmdb"
    assert convert_imageset(tmp_path / "list.txt", tmp_path, db, encoded=encoded, progress=False) == 5
    layer = _data_layer(db, 3, "mean_value: 10 mean_value: 20 mean_value: 30 scale: 0.25")
    mean = np.array([10, 20, 30], np.float32)[:, None, None]
    expected = [((image.transpose(2, 0, 1).astype(np.float32) - mean) * np.float32(0.25), label)
                for _, label, image in entries]
    got = [layer() for _ in range(2)]
    order = [0, 1, 2, 3, 4, 0]
    for k, i in enumerate(order):
        data, labels = got[k // 3]
        assert np.array_equal(data[k % 3].numpy(), expected[i][0])
        assert labels[k % 3].item() == expected[i][1]
    # the same records as a torch Dataset
    dataset = DatumDataset(DatumSource(db), DataTransformer(mean_value=[10, 20, 30], scale=0.25, phase="TEST"))
    image, label = dataset[4]
    assert np.array_equal(image.numpy(), expected[4][0]) and label == expected[4][1] and len(dataset) == 5


def test_datum_dataset_batches_from_dataloader_workers_equal_the_records(tmp_path):
    """DatumDataset (an LMDB of PNG-encoded Datums) through a DataLoader with 2 workers: each
    worker opens the LMDB itself and builds its batch in one shared-memory buffer; the batches equal
    the records transformed one by one."""
    from torch.utils.data import DataLoader

    entries = _toy_images(tmp_path)
    db = tmp_path / "toy_lmdb"
    assert convert_imageset(tmp_path / "list.txt", tmp_path, db, encoded=True, progress=False) == 5
    transformer = DataTransformer(mean_value=[10, 20, 30], scale=0.25, phase="TEST")
    dataset = DatumDataset(DatumSource(db), transformer)
    mean = np.array([10, 20, 30], np.float32)[:, None, None]
    expected = [(image.transpose(2, 0, 1).astype(np.float32) - mean) * np.float32(0.25) for _, _, image in entries]
    batches = [[0, 1], [2, 3], [4, 0]]
    got = list(DataLoader(dataset, batch_sampler=batches, num_workers=2))
    for (images, labels), indices in zip(got, batches):
        assert images.shape == (2, 3, 10, 14) and images.is_shared()
        assert np.array_equal(images.numpy(), np.stack([expected[i] for i in indices]))
        assert labels.tolist() == [entries[i][1] for i in indices]


def test_image_data_layer_reads_resizes_and_wraps(tmp_path, monkeypatch):
    entries = _toy_images(tmp_path)
    monkeypatch.chdir(tmp_path)
    layer = _layer('name: "img" type: "ImageData" top: "data" top: "label" transform_param { crop_size: 6 } '
                   'image_data_param { source: "list.txt" root_folder: "./" new_height: 8 new_width: 12 '
                   'batch_size: 4 }')
    assert layer.output_shapes() == [(4, 3, 6, 6), (4,)]
    expected = []
    for _, label, image in entries:
        resized = cv2.resize(image, (12, 8)).transpose(2, 0, 1).astype(np.float32)
        expected.append((resized[:, 1:7, 3:9], label))  # TEST centre crop: offsets (8-6)//2, (12-6)//2
    (d0, l0), (d1, l1) = layer(), layer()
    order = [0, 1, 2, 3, 4, 0, 1, 2]
    for k, i in enumerate(order):
        data, labels = (d0, l0) if k < 4 else (d1, l1)
        assert np.array_equal(data[k % 4].numpy(), expected[i][0]) and labels[k % 4].item() == expected[i][1]


def test_image_data_shuffle_is_seeded_and_reshuffles_each_pass(tmp_path, monkeypatch):
    entries = _toy_images(tmp_path, count=6)
    monkeypatch.chdir(tmp_path)
    text = ('name: "img" type: "ImageData" top: "data" top: "label" image_data_param { source: "list.txt" '
            'root_folder: "./" batch_size: 3 shuffle: true is_color: false }')
    sequences = []
    for seed in (1, 1, 2):
        layer = _layer(text)
        layer.fill(torch.Generator().manual_seed(seed))
        batches = [layer() for _ in range(4)]
        sequences.append(torch.cat([b[0] for b in batches]))
        assert batches[0][0].shape == (3, 1, 10, 14)
    assert torch.equal(sequences[0], sequences[1]) and not torch.equal(sequences[0], sequences[2])
    grays = [cv2.imread(name, cv2.IMREAD_GRAYSCALE).astype(np.float32) for name, _, _ in entries]
    seen = [next(i for i, g in enumerate(grays) if np.array_equal(g, img[0].numpy())) for img in sequences[0]]
    first, second = seen[:6], seen[6:]
    assert sorted(first) == sorted(second) == list(range(6))  # each pass visits every line once
    assert first != list(range(6)) or second != list(range(6))


def test_image_data_missing_list_or_image(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match="no such list file"):
        _layer('name: "img" type: "ImageData" top: "data" top: "label" image_data_param { source: "missing.txt" }')
    (tmp_path / "list.txt").write_text("ghost.png 1\n")
    with pytest.raises(DataError, match="ghost.png"):
        _layer('name: "img" type: "ImageData" top: "data" top: "label" image_data_param { source: "list.txt" }')


def test_image_data_list_lines_parse_as_caffes_find_last_of_and_atoi(tmp_path, monkeypatch):
    """Caffe's ImageDataLayer splits each line at its last space and reads the label with ``atoi``:
    ``1.5`` is 1, ``-3`` is -3, ``7abc`` is 7, and a line without a space (no label) is label 0.  Before,
    ours refused the first, third and fourth lines (DataError: not an integer / expected 'path label')."""
    entries = _toy_images(tmp_path, count=4)
    monkeypatch.chdir(tmp_path)
    names = [name for name, _, _ in entries]
    (tmp_path / "list.txt").write_text(f"{names[0]} 1.5\n{names[1]} -3\n{names[2]} 7abc\n{names[3]}\n")
    layer = _layer('name: "img" type: "ImageData" top: "data" top: "label" '
                   'image_data_param { source: "list.txt" batch_size: 4 }')
    data, labels = layer()
    assert labels.tolist() == [1.0, -3.0, 7.0, 0.0]
    for k, (_, _, image) in enumerate(entries):
        assert np.array_equal(data[k].numpy(), image.transpose(2, 0, 1).astype(np.float32))


def test_image_data_trailing_space_or_blank_line_is_caffes_unloadable_path(tmp_path, monkeypatch):
    """With a trailing space Caffe's path is ``img/toy_1.png 11`` (the text before the last space) and the
    label ``atoi("")`` = 0; a blank line is an entry with the empty path.  Caffe aborts when it reaches
    either ("Could not load"); ours raises a DataError naming the line, and the lines before it are read.
    Before, ours read ``img/toy_1.png`` with label 11 and skipped the blank line."""
    entries = _toy_images(tmp_path, count=2)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "list.txt").write_text(f"{entries[0][0]} 10\n{entries[1][0]} 11 \n")
    layer = _layer('name: "img" type: "ImageData" top: "data" top: "label" '
                   'image_data_param { source: "list.txt" batch_size: 1 }')
    assert layer.lines == [(entries[0][0], 10), (f"{entries[1][0]} 11", 0)]
    assert layer()[1].tolist() == [10.0]
    with pytest.raises(DataError, match=r"line 2.*toy_1.png 11"):
        layer()
    (tmp_path / "list.txt").write_text(f"{entries[0][0]} 10\n\n{entries[1][0]} 11\n")
    layer = _layer('name: "img" type: "ImageData" top: "data" top: "label" '
                   'image_data_param { source: "list.txt" batch_size: 1 }')
    assert layer.lines == [(entries[0][0], 10), ("", 0), (entries[1][0], 11)]
    assert layer()[1].tolist() == [10.0]
    with pytest.raises(DataError, match=r"line 2"):
        layer()


HDF5_TEXT = ('name: "h5" type: "HDF5Data" top: "data" top: "label" '
             'hdf5_data_param { source: "files.txt" batch_size: 3 }')


def test_hdf5_data_without_h5py_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "h5py", None)  # an import of h5py now fails, as when it is not installed
    with pytest.raises(DataError, match="HDF5Data.*needs the h5py package"):
        _layer(HDF5_TEXT)


def test_hdf5_data_batches_across_files(tmp_path, monkeypatch):
    """Real HDF5 files written with h5py (a dev dependency): rows in order, a batch that spans two
    files, wrap-around to the first file, float32 tops from float64/int datasets, as Caffe's
    HDF5DataLayer copies row by row and loads the next file when one is exhausted."""
    import h5py

    monkeypatch.chdir(tmp_path)
    with h5py.File(tmp_path / "a.h5", "w") as f:
        f["data"] = np.arange(8, dtype=np.float64).reshape(4, 2)
        f["label"] = np.arange(4)
    with h5py.File(tmp_path / "b.h5", "w") as f:
        f["data"] = 100 + np.arange(4, dtype=np.float64).reshape(2, 2)
        f["label"] = np.arange(4, 6)
    (tmp_path / "files.txt").write_text("a.h5\nb.h5\n")
    layer = _layer(HDF5_TEXT)
    assert layer.output_shapes() == [(3, 2), (3,)]
    labels = [layer()[1].tolist() for _ in range(3)]
    assert labels == [[0, 1, 2], [3, 4, 5], [0, 1, 2]]
    data, label = layer()
    assert data.dtype == torch.float32 and label.tolist() == [3, 4, 5]
    assert data.tolist() == [[6, 7], [100, 101], [102, 103]]


def test_hdf5_data_missing_dataset_and_unreadable_file_name_the_file(tmp_path, monkeypatch):
    import h5py

    monkeypatch.chdir(tmp_path)
    with h5py.File(tmp_path / "a.h5", "w") as f:
        f["data"] = np.zeros((2, 2))
    (tmp_path / "files.txt").write_text("a.h5\n")
    with pytest.raises(DataError, match="a.h5 has no dataset 'label'"):
        _layer(HDF5_TEXT)
    (tmp_path / "broken.h5").write_bytes(b"not an hdf5 file")
    (tmp_path / "files.txt").write_text("broken.h5\n")
    with pytest.raises(DataError, match="cannot read broken.h5"):
        _layer(HDF5_TEXT)


@pytest.mark.parametrize("top", ["g/data", "/data"])
def test_hdf5_data_top_name_with_a_slash_is_not_a_path_into_a_group(tmp_path, monkeypatch, top):
    """Caffe's hdf5_load_nd_dataset CHECKs ``H5LTfind_dataset(file, name)``, which compares the name with the
    links of the file's root group: ``g/data`` (or ``/data``) is never found ("Failed to find HDF5 dataset").
    Before, ours followed h5py's path and read the group's dataset (or the root's ``data``)."""
    import h5py

    monkeypatch.chdir(tmp_path)
    with h5py.File(tmp_path / "a.h5", "w") as f:
        f["g/data"] = np.ones((4, 2), np.float32)
        f["data"] = np.ones((4, 2), np.float32)
    (tmp_path / "files.txt").write_text("a.h5\n")
    with pytest.raises(DataError, match=f"a.h5 has no dataset '{top}'.*root"):
        _layer(f'name: "h5" type: "HDF5Data" top: "{top}" hdf5_data_param {{ source: "files.txt" batch_size: 2 }}')
    data, = _layer('name: "h5" type: "HDF5Data" top: "data" hdf5_data_param { source: "files.txt" batch_size: 2 }')()
    assert data.tolist() == [[1, 1], [1, 1]]


@pytest.mark.parametrize("sizes", ["new_height: 8", "new_width: 12", "new_height: 8 new_width: 0"])
def test_image_data_new_height_and_width_must_come_together(tmp_path, monkeypatch, sizes):
    _toy_images(tmp_path)
    monkeypatch.chdir(tmp_path)
    text = ('name: "imgs" type: "ImageData" top: "data" top: "label" '
            f'image_data_param {{ source: "list.txt" root_folder: "./" {sizes} batch_size: 2 }}')
    with pytest.raises(FormatError, match=r"layer 'imgs' \(ImageData\): new_height \(\d+\) and new_width \(\d+\) "
                                          r"must be set together"):
        _layer(text)
    both = _layer(text.replace(sizes, "new_height: 8 new_width: 12"))
    assert both.output_shapes() == [(2, 3, 8, 12), (2,)]
    neither = _layer(text.replace(sizes, ""))
    assert neither.output_shapes() == [(2, 3, 10, 14), (2,)]


@pytest.mark.parametrize("transform", ["transform_param { scale: 0.5 }", "transform_param { }"])
def test_hdf5_data_refuses_a_transform_param_like_caffe(tmp_path, monkeypatch, transform):
    """Caffe's HDF5DataLayer::LayerSetUp CHECKs ``!has_transform_param()`` ("HDF5Data does not transform
    data."), so even an empty transform_param aborts; before, ours read the rows and ignored the scale."""
    import h5py

    monkeypatch.chdir(tmp_path)
    with h5py.File(tmp_path / "a.h5", "w") as f:
        f["data"] = np.arange(6, dtype=np.float32).reshape(3, 2)
        f["label"] = np.arange(3)
    (tmp_path / "files.txt").write_text("a.h5\n")
    with pytest.raises(FormatError, match=r"layer 'h5' \(HDF5Data\): HDF5Data does not transform data"):
        _layer(HDF5_TEXT.replace("hdf5_data_param", f"{transform} hdf5_data_param"))
    data, label = _layer(HDF5_TEXT)()  # without it, the rows as stored
    assert data.tolist() == [[0, 1], [2, 3], [4, 5]] and label.tolist() == [0, 1, 2]


def test_image_data_rand_skip_beyond_the_list_fails_like_caffe(tmp_path, monkeypatch):
    """Caffe's ImageDataLayer draws ``skip = Rand() % rand_skip`` and CHECKs ``lines_.size() > skip`` ("Not
    enough points to skip"); before, ours wrapped the skip around the list (skip % lines) and went on."""
    entries = _toy_images(tmp_path, count=3)
    monkeypatch.chdir(tmp_path)
    text = ('name: "img" type: "ImageData" top: "data" top: "label" image_data_param { source: "list.txt" '
            'root_folder: "./" batch_size: 1 rand_skip: SKIP }')
    with pytest.raises(DataError, match=r"'img' \(ImageData\): not enough points to skip: rand_skip 1000 drew "
                                        r"\d+, the list has 3 lines"):
        _layer(text.replace("SKIP", "1000"))  # the layer's RandomState(0) draws 684 of 1000
    for seed in range(6):  # rand_skip 3: every skip (0, 1 or 2) is inside the list
        layer = _layer(text.replace("SKIP", "3"))
        layer.fill(torch.Generator().manual_seed(seed))
        skip = layer.position
        assert skip in (0, 1, 2)
        assert layer()[1].tolist() == [entries[skip][1]]


def test_mean_file_is_read_through_caffes_legacy_accessors(in_data_dir, tmp_path):
    """Caffe's DataTransformer checks the mean blob with ``channels()``, ``height()``, ``width()`` (axes 1-3) and
    indexes its first C·H·W values.  A 3-D ``3 x 16 x 20`` blob (pycaffe's array_to_blobproto of a C x H x W
    array) therefore reads as 16 x 20 x 1 and aborts ("datum_channels == data_mean_.channels() (3 vs. 16)",
    BVLC/caffe#6087); before, ours used it as the 3 x 16 x 20 mean.  A blob of two means uses the first."""
    from caffe_compat.io import read_blob, write_blob

    mean = read_blob("mean.binaryproto")
    assert mean.shape == (1, 3, 16, 20)  # legacy dims, as compute_image_mean writes it
    write_blob(mean[0], tmp_path / "mean3d.binaryproto", legacy=False)
    write_blob(np.concatenate([mean, mean + 7]), tmp_path / "mean2.binaryproto", legacy=False)
    transform = "crop_size: 12 scale: 0.5 mean_file: '{}'"
    with pytest.raises(DataError, match=r"record 0: mean_file has shape \(16, 20, 1\), the image \(3, 16, 20\)"):
        _data_layer("lmdb_raw", 4, transform.format(tmp_path / "mean3d.binaryproto"))()
    data, _ = _data_layer("lmdb_raw", 4, transform.format(tmp_path / "mean2.binaryproto"))()
    assert np.array_equal(data.numpy(), np.load("raw_meanfile_crop12_scale0.5.npz")["data_iter0"])  # Caffe's


def test_image_data_needs_exactly_two_tops_like_caffe(tmp_path, monkeypatch):
    """Caffe's ImageDataLayer declares ``ExactNumTopBlobs() == 2`` (its setup reshapes ``top[1]``
    unconditionally), so a data-only ImageData fails Caffe's layer check; before, ours accepted it.  The
    Data layer keeps Caffe's BaseDataLayer rule, 1 or 2 tops."""
    _toy_images(tmp_path, count=2)
    monkeypatch.chdir(tmp_path)
    params = 'image_data_param { source: "list.txt" root_folder: "./" batch_size: 2 }'
    with pytest.raises(FormatError, match=r"'img'.*needs 2 top blob\(s\), got 1"):
        _layer(f'name: "img" type: "ImageData" top: "data" {params}')
    assert _layer(f'name: "img" type: "ImageData" top: "data" top: "label" {params}')()[1].tolist() == [10, 11]


def test_hdf5_data_file_with_other_row_shape_is_a_data_error(tmp_path, monkeypatch):
    """Caffe's HDF5DataLayer shapes its tops from the first file at setup and copies ``count / batch_size``
    values per row from every later file without a check (a wider row reads the wrong values).  Before, ours
    silently changed the top's shape for a batch of the second file ((2, 3) after (2, 2))."""
    import h5py

    monkeypatch.chdir(tmp_path)
    with h5py.File(tmp_path / "a.h5", "w") as f:
        f["data"] = np.zeros((4, 2), np.float32)
        f["label"] = np.arange(4)
    with h5py.File(tmp_path / "b.h5", "w") as f:
        f["data"] = np.ones((2, 3), np.float32)
        f["label"] = np.arange(2)
    (tmp_path / "files.txt").write_text("a.h5 b.h5\n")
    layer = _layer(HDF5_TEXT.replace("batch_size: 3", "batch_size: 2"))
    assert [tuple(t.shape) for t in layer()] == [(2, 2), (2,)]
    with pytest.raises(DataError, match=r"b.h5: rows of shape \[\(3,\), \(\)\] .* the first file's are "
                                        r"\[\(2,\), \(\)\]"):
        layer()  # the second batch ends a.h5, which loads b.h5


def test_hdf5_data_batch_size_0_gives_empty_tops_like_caffe(tmp_path, monkeypatch):
    """hdf5_data_layer.cpp: LayerSetUp reshapes the tops to (batch_size, ...) with no CHECK on batch_size, and
    Forward_cpu's row loop runs batch_size times: 0 (the proto default) gives empty tops and reads no row.
    We refused it (FormatError)."""
    import h5py

    monkeypatch.chdir(tmp_path)
    with h5py.File(tmp_path / "a.h5", "w") as f:
        f["data"] = np.arange(8, dtype=np.float64).reshape(4, 2)
        f["label"] = np.arange(4)
    (tmp_path / "files.txt").write_text("a.h5\n")
    layer = _layer(HDF5_TEXT.replace("batch_size: 3", "batch_size: 0"))
    assert layer.output_shapes() == [(0, 2), (0,)]
    for _ in range(2):
        data, label = layer()
        assert tuple(data.shape) == (0, 2) and tuple(label.shape) == (0,) and data.dtype == torch.float32
    assert layer.position == 0
