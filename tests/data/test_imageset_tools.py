"""make-lmdb / compute-mean (Caffe's convert_imageset / compute_image_mean) on generated images."""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from caffe_compat.cli import main
from caffe_compat.data.imageset import compute_image_mean, convert_imageset, read_list_file
from caffe_compat.io import iter_lmdb, read_blob
from caffe_compat.proto import caffe_pb2


@pytest.fixture
def images(tmp_path):
    rng = np.random.RandomState(3)
    root = tmp_path / "img"
    root.mkdir()
    lines, pixels = [], []
    for i in range(5):
        image = rng.randint(0, 256, size=(6, 7, 3)).astype(np.uint8)
        cv2.imwrite(str(root / f"a{i}.png"), image)
        lines.append(f"a{i}.png {i % 2}")
        pixels.append(image)
    (tmp_path / "list.txt").write_text("\n".join(lines) + "\n")
    return tmp_path, pixels


def test_raw_lmdb_keys_labels_and_pixels(images):
    tmp, pixels = images
    n = convert_imageset(tmp / "list.txt", tmp / "img", tmp / "db", progress=False)
    assert n == 5
    records = list(iter_lmdb(tmp / "db"))
    assert [k for k, _, _ in records] == [f"{i:08d}_a{i}.png" for i in range(5)]
    for (key, img, label), src, i in zip(records, pixels, range(5)):
        np.testing.assert_array_equal(img, src.transpose(2, 0, 1))
        assert label == i % 2


def test_encoded_stores_file_bytes_unchanged(images):
    tmp, _ = images
    convert_imageset(tmp / "list.txt", tmp / "img", tmp / "db", encoded=True, progress=False)
    _, datum, _ = next(iter_lmdb(tmp / "db", decode=False))
    assert isinstance(datum, caffe_pb2.Datum) and datum.encoded
    assert datum.data == (tmp / "img" / "a0.png").read_bytes()


def test_resize_uses_opencv_bilinear(images):
    tmp, pixels = images
    convert_imageset(tmp / "list.txt", tmp / "img", tmp / "db", resize=(4, 5), progress=False)
    _, img, _ = next(iter_lmdb(tmp / "db"))
    np.testing.assert_array_equal(img, cv2.resize(pixels[0], (5, 4)).transpose(2, 0, 1))


def test_compute_mean_is_float32_average(images, tmp_path):
    tmp, pixels = images
    convert_imageset(tmp / "list.txt", tmp / "img", tmp / "db", progress=False)
    assert main(["compute-mean", str(tmp / "db"), str(tmp / "mean.binaryproto")]) == 0
    mean = read_blob(tmp / "mean.binaryproto")
    expected = np.zeros((3, 6, 7), np.float32)
    for p in pixels:
        expected += p.transpose(2, 0, 1).astype(np.float32)
    np.testing.assert_array_equal(mean, (expected / np.float32(5))[None])
    np.testing.assert_array_equal(compute_image_mean(tmp / "db"), mean)
    blob = caffe_pb2.BlobProto.FromString((tmp / "mean.binaryproto").read_bytes())
    assert (blob.num, blob.channels, blob.height, blob.width) == (1, 3, 6, 7)


def test_list_file_lines_parse_as_caffes_find_last_of_and_atoi(tmp_path):
    """Caffe (ImageDataLayer, convert_imageset) splits each ``std::getline`` line at its last space and reads
    the label with ``atoi``; before, ours refused ``x``, ``1.5`` and label-less lines (DataError) and dropped a
    trailing space and blank lines."""
    listed = tmp_path / "list.txt"
    listed.write_text("a.png 0\nb.png x\nc d.png 1.5\ne.png\n\nf.png 4 \ng.png  +12\r\nh.png -7z\n")
    assert read_list_file(listed) == [("a.png", 0), ("b.png", 0), ("c d.png", 1), ("e.png", 0), ("", 0),
                                      ("f.png 4", 0), ("g.png ", 12), ("h.png", -7)]


def test_cli_make_lmdb_refuses_existing_output(images, capsys):
    tmp, _ = images
    assert main(["make-lmdb", str(tmp / "list.txt"), str(tmp / "img"), str(tmp / "db")]) == 0
    assert main(["make-lmdb", str(tmp / "list.txt"), str(tmp / "img"), str(tmp / "db")]) == 2
    assert "already exists" in capsys.readouterr().err


def test_cli_make_toy_data_cub(tmp_path):
    from caffe_compat.data import read_cub200

    assert main(["make-toy-data", "cub", str(tmp_path / "CUB_200_2011"), "--size", "32"]) == 0
    train = read_cub200(tmp_path / "CUB_200_2011", "train")
    test = read_cub200(tmp_path / "CUB_200_2011", "test")
    assert train and test and not ({r.label for r in train} & {r.label for r in test})


def _mixed_list(tmp_path):
    """Five list lines: a0.png, a missing file (line 2), a1.png, a corrupt PNG (line 4), a2.png."""
    rng = np.random.RandomState(8)
    root = tmp_path / "img"
    root.mkdir()
    pixels = {}
    for name in ("a0.png", "a1.png", "a2.png"):
        pixels[name] = rng.randint(0, 256, size=(5, 6, 3)).astype(np.uint8)
        cv2.imwrite(str(root / name), pixels[name])
    (root / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"x" * 40)
    (tmp_path / "list.txt").write_text("a0.png 0\nghost.png 1\na1.png 2\nbroken.png 3\na2.png 4\n")
    return tmp_path, pixels


@pytest.mark.parametrize("encoded", [True, False])
def test_make_lmdb_skips_unreadable_images_like_caffe(tmp_path, capfd, encoded):
    tmp, pixels = _mixed_list(tmp_path)
    argv = ["make-lmdb", str(tmp / "list.txt"), str(tmp / "img"), str(tmp / "db"), "--quiet"]
    assert main(argv + (["--encoded"] if encoded else [])) == 0
    out, err = capfd.readouterr()
    assert f"{tmp / 'list.txt'}:2: skipped {tmp / 'img' / 'ghost.png'}: file not found" in err
    assert f"{tmp / 'list.txt'}:4: skipped {tmp / 'img' / 'broken.png'}: OpenCV could not decode it" in err
    assert "[ WARN" not in err and "[ERROR" not in err and "imread_" not in err  # OpenCV's own log is silenced
    assert "Traceback" not in err
    assert "wrote 3 records" in out and "skipped 2 unreadable image(s)" in out
    assert f"{tmp / 'list.txt'}:2, {tmp / 'list.txt'}:4" in out
    records = list(iter_lmdb(tmp / "db", decode=False))
    # Caffe's key is the list line's index: the skipped lines leave gaps
    assert [k for k, _, _ in records] == ["00000000_a0.png", "00000002_a1.png", "00000004_a2.png"]
    assert [label for _, _, label in records] == [0, 2, 4]
    for (key, datum, _), name in zip(records, ("a0.png", "a1.png", "a2.png")):
        assert datum.encoded == encoded
        if encoded:
            assert datum.data == (tmp / "img" / name).read_bytes()
    for (_, image, _), name in zip(iter_lmdb(tmp / "db"), ("a0.png", "a1.png", "a2.png")):
        np.testing.assert_array_equal(image, pixels[name].transpose(2, 0, 1))


def test_make_lmdb_strict_stops_at_the_first_unreadable_line(tmp_path, capsys):
    tmp, _ = _mixed_list(tmp_path)
    assert main(["make-lmdb", str(tmp / "list.txt"), str(tmp / "img"), str(tmp / "db"), "--quiet", "--strict"]) == 2
    err = capsys.readouterr().err
    assert f"list.txt:2: could not read image {tmp / 'img' / 'ghost.png'} (file not found)" in err
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp.iterdir()) == ["img", "list.txt"]  # no half-written database, no temp folder


def test_make_lmdb_library_warns_by_default(tmp_path):
    tmp, _ = _mixed_list(tmp_path)
    skipped = []
    with pytest.warns(UserWarning) as record:
        n = convert_imageset(tmp / "list.txt", tmp / "img", tmp / "db", progress=False, skipped=skipped)
    assert [str(w.message).split(": skipped")[0] for w in record] == [f"{tmp / 'list.txt'}:2", f"{tmp / 'list.txt'}:4"]
    assert "ghost.png: file not found" in str(record[0].message)
    assert n == 3 and skipped == [f"{tmp / 'list.txt'}:2", f"{tmp / 'list.txt'}:4"]


def test_make_lmdb_bad_encode_type_exits_2_before_writing(images, capsys):
    tmp, _ = images
    assert main(["make-lmdb", str(tmp / "list.txt"), str(tmp / "img"), str(tmp / "db"), "--encoded",
                 "--encode-type", "xyz", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "encode type 'xyz': OpenCV has no encoder for '.xyz'" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp.iterdir()) == ["img", "list.txt"]


def test_make_lmdb_unencodable_file_extension_names_list_line(tmp_path, capsys):
    root = tmp_path / "img"
    root.mkdir()
    cv2.imwrite(str(root / "a.png"), np.zeros((4, 4, 3), np.uint8))
    (root / "a.png").rename(root / "a.weird")  # a PNG under an extension OpenCV has no encoder for
    (tmp_path / "list.txt").write_text("a.weird 0\n")
    # --encoded with a resize re-encodes in the file's own extension (Caffe's guess): no encoder for it
    assert main(["make-lmdb", str(tmp_path / "list.txt"), str(root), str(tmp_path / "db"), "--encoded",
                 "--resize", "2", "2", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "list.txt:1: OpenCV cannot encode" in err and "'.weird'" in err and "Traceback" not in err
    assert not (tmp_path / "db").exists()


def test_make_lmdb_nothing_readable_writes_nothing(tmp_path, capsys):
    (tmp_path / "img").mkdir()
    (tmp_path / "list.txt").write_text("x.png 0\ny.png 1\n")
    assert main(["make-lmdb", str(tmp_path / "list.txt"), str(tmp_path / "img"), str(tmp_path / "db"),
                 "--quiet"]) == 2
    assert "none of its 2 images could be read; nothing written" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["img", "list.txt"]


def test_encode_type_matches_like_caffes_matchext_and_implies_encoded(tmp_path):
    """Caffe's matchExt compares the file's extension with its dot (``.jpeg``) with the encoding: the usual
    ``--encode_type=jpg`` never matches, so every image is re-encoded (JPEGs too, at quality 95); ``.jpg``
    matches ``.jpg`` files only; no encode_type guesses the dotted extension, which matches (file bytes)."""
    root = tmp_path / "img"
    root.mkdir()
    image = np.random.RandomState(2).randint(0, 256, size=(8, 8, 3)).astype(np.uint8)
    for name in ("p.JPEG", "q.png", "r.jpg"):
        cv2.imwrite(str(root / name), image)
    (tmp_path / "list.txt").write_text("p.JPEG 0\nq.png 1\nr.jpg 2\n")

    def stored(db, **kwargs):
        convert_imageset(tmp_path / "list.txt", root, tmp_path / db, progress=False, **kwargs)
        return [datum for _, datum, _ in iter_lmdb(tmp_path / db, decode=False)]

    def reencoded(name):  # Caffe's ReadImageToCVMat then cv::imencode(".jpg")
        return cv2.imencode(".jpg", cv2.imread(str(root / name), cv2.IMREAD_COLOR))[1].tobytes()

    p, q, r = stored("plain", encode_type="jpg")
    assert p.encoded and q.encoded and r.encoded
    assert [p.data, q.data, r.data] == [reencoded("p.JPEG"), reencoded("q.png"), reencoded("r.jpg")]
    assert p.data != (root / "p.JPEG").read_bytes() and r.data != (root / "r.jpg").read_bytes()
    p, q, r = stored("dotted", encode_type=".jpg")
    assert [p.data, q.data, r.data] == [reencoded("p.JPEG"), reencoded("q.png"), (root / "r.jpg").read_bytes()]
    p, q, r = stored("guessed", encoded=True)
    assert [p.data, q.data, r.data] == [(root / n).read_bytes() for n in ("p.JPEG", "q.png", "r.jpg")]


def test_corrupt_jpeg_that_decodes_is_kept_and_libjpeg_message_names_list_line(tmp_path, capfd):
    root = tmp_path / "img"
    root.mkdir()
    image = np.random.RandomState(5).randint(0, 256, size=(32, 32, 3)).astype(np.uint8)
    ok, data = cv2.imencode(".jpg", image)
    damaged = bytearray(data.tobytes())
    damaged[len(damaged) // 2] ^= 0xFF  # libjpeg prints "Corrupt JPEG data: ..." itself and decodes anyway
    (root / "t.jpg").write_bytes(bytes(damaged))
    (tmp_path / "list.txt").write_text("t.jpg 7\n")
    capfd.readouterr()
    messages = []
    assert convert_imageset(tmp_path / "list.txt", root, tmp_path / "db", progress=False,
                            on_skip=messages.append) == 1
    out, err = capfd.readouterr()
    assert "Corrupt JPEG data" not in err  # libjpeg's own stderr line is captured ...
    assert len(messages) == 1
    assert messages[0].startswith(f"{tmp_path / 'list.txt'}:1: {root / 't.jpg'}: Corrupt JPEG data")
    assert messages[0].endswith("(decoded anyway; kept, as Caffe keeps it)")  # ... and reported with its line
    (key, decoded, label), = iter_lmdb(tmp_path / "db")
    expected = cv2.imdecode(np.frombuffer(bytes(damaged), np.uint8), cv2.IMREAD_COLOR)
    assert key == "00000000_t.jpg" and label == 7
    np.testing.assert_array_equal(decoded, expected.transpose(2, 0, 1))


def test_caffe_command_lines_of_convert_imageset_and_compute_image_mean(images, capsys):
    """create_imagenet.sh / make_imagenet_mean.sh with only the program renamed: root first, gflags spellings
    (``--resize_height=H``, ``--shuffle``, ``--gray=false``), the same records as the library call."""
    tmp, pixels = images
    root = f"{tmp / 'img'}/"
    assert main(["convert_imageset", "--resize_height=4", "--resize_width=5", "--shuffle", "--gray=false",
                 "--backend=lmdb", root, str(tmp / "list.txt"), str(tmp / "caffe_db")]) == 0
    convert_imageset(tmp / "list.txt", tmp / "img", tmp / "db", resize=(4, 5), shuffle=True, progress=False)
    ours = [(key, image.tolist(), label) for key, image, label in iter_lmdb(tmp / "caffe_db")]
    assert ours == [(key, image.tolist(), label) for key, image, label in iter_lmdb(tmp / "db")]
    assert sorted(key[9:] for key, _, _ in ours) == [f"a{i}.png" for i in range(5)]
    assert [key[9:] for key, _, _ in ours] != [f"a{i}.png" for i in range(5)]  # shuffled
    assert ours[0][1] == cv2.resize(pixels[int(ours[0][0][10])], (5, 4)).transpose(2, 0, 1).tolist()
    assert main(["convert_imageset", "-gray", "-shuffle=no", root, str(tmp / "list.txt"), str(tmp / "grey")]) == 0
    keys = [(key, image.shape) for key, image, _ in iter_lmdb(tmp / "grey")]
    assert keys == [(f"{i:08d}_a{i}.png", (1, 6, 7)) for i in range(5)]
    capsys.readouterr()
    assert main(["compute_image_mean", "-backend", "lmdb", str(tmp / "grey")]) == 0  # no output file: the means
    grey = np.mean([cv2.imread(str(tmp / "img" / f"a{i}.png"), cv2.IMREAD_GRAYSCALE).astype(np.float64)
                    for i in range(5)])  # Caffe's grey decode (ReadImageToCVMat)
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 1 and printed[0].startswith("mean_value channel [0]:")
    assert float(printed[0].split("]:")[1]) == pytest.approx(grey, rel=1e-5)
    assert main(["compute_image_mean", str(tmp / "grey"), str(tmp / "grey_mean.binaryproto")]) == 0
    assert read_blob(tmp / "grey_mean.binaryproto").shape == (1, 1, 6, 7)


def test_check_size_and_backend_as_caffe(tmp_path, capsys):
    root = tmp_path / "img"
    root.mkdir()
    for i, (h, w) in enumerate([(6, 7), (6, 7), (5, 7)]):
        cv2.imwrite(str(root / f"b{i}.png"), np.full((h, w, 3), i * 40, np.uint8))
    (tmp_path / "list.txt").write_text("b0.png 0\nb1.png 1\nb2.png 0\n")
    args = [f"{root}/", str(tmp_path / "list.txt")]
    assert main(["convert_imageset", *args, str(tmp_path / "unchecked")]) == 0  # sizes may differ without it
    assert len(list(iter_lmdb(tmp_path / "unchecked"))) == 3
    capsys.readouterr()
    assert main(["convert_imageset", "--check_size", *args, str(tmp_path / "checked")]) == 2
    err = capsys.readouterr().err
    assert "list.txt:3" in err and "3 x 5 x 7 = 105 bytes, the first image 126" in err
    assert not (tmp_path / "checked").exists()
    assert main(["convert_imageset", "--check_size=true", "--resize_height=4", "--resize_width=4", *args,
                 str(tmp_path / "resized")]) == 0  # all 4 x 4 after the resize
    assert main(["convert_imageset", "--check_size", "--encoded", *args, str(tmp_path / "enc")]) == 2
    assert "check_size applies to raw records" in capsys.readouterr().err
    assert main(["convert_imageset", "--backend=leveldb", *args, str(tmp_path / "ldb")]) == 2
    assert "only lmdb is supported" in capsys.readouterr().err
    assert not (tmp_path / "enc").exists() and not (tmp_path / "ldb").exists()


def test_compute_image_mean_prints_caffes_float_channel_means_with_or_without_output(tmp_path, capsys):
    """Caffe's compute_image_mean sums each channel of the mean image in a float, value after value, divides by
    H*W and logs ``mean_value channel [c]:v`` (no space) whether or not OUTPUT_FILE is given."""
    rng = np.random.RandomState(2)  # a seed where the float running sum and NumPy's pairwise mean print apart
    root = tmp_path / "img"
    root.mkdir()
    images = [rng.randint(0, 256, size=(64, 64, 3)).astype(np.uint8) for _ in range(3)]
    for i, image in enumerate(images):
        cv2.imwrite(str(root / f"m{i}.png"), image)
    (tmp_path / "list.txt").write_text("".join(f"m{i}.png 0\n" for i in range(3)))
    assert main(["convert_imageset", f"{root}/", str(tmp_path / "list.txt"), str(tmp_path / "db")]) == 0
    total = np.zeros((3, 64, 64), np.float32)
    for image in images:
        total += image.transpose(2, 0, 1).astype(np.float32)
    mean = total / np.float32(3)
    expected, numpy_means = [], []
    for c, plane in enumerate(mean.reshape(3, -1)):
        running = np.float32(0)
        for value in plane:  # Caffe's float mean_values[c] += sum_blob.data(dim * c + i)
            running = np.float32(running + value)
        expected.append(f"mean_value channel [{c}]:{float(running / np.float32(plane.size)):.6g}")
        numpy_means.append(f"mean_value channel [{c}]:{float(plane.mean()):.6g}")
    assert expected != numpy_means  # the test tells the two sums apart
    capsys.readouterr()
    assert main(["compute_image_mean", str(tmp_path / "db")]) == 0
    assert capsys.readouterr().out.splitlines() == expected
    assert main(["compute_image_mean", str(tmp_path / "db"), str(tmp_path / "mean.binaryproto")]) == 0
    assert capsys.readouterr().out.splitlines() == expected  # printed with the output file too
    np.testing.assert_array_equal(read_blob(tmp_path / "mean.binaryproto")[0], mean)


def test_convert_imageset_takes_gflags_noswitch_spellings_and_the_last_one_wins(images, capsys):
    """gflags reads ``-nogray`` / ``--noshuffle`` as the switch off and lets the last spelling of a switch win
    (``--gray --nogray``, ``-gray=true -gray=false``: colour; ``--nogray --gray``: grey)."""
    tmp, _ = images
    root, listed = f"{tmp / 'img'}/", str(tmp / "list.txt")
    for i, switches in enumerate([["-nogray", "--noshuffle"], ["--gray", "--nogray"], ["-gray=true", "-gray=false"],
                                  ["--nogray", "--gray"], ["--gray=no", "-gray"]]):
        assert main(["convert_imageset", *switches, root, listed, str(tmp / f"db{i}")]) == 0, switches
        records = list(iter_lmdb(tmp / f"db{i}"))
        assert [key for key, _, _ in records] == [f"{n:08d}_a{n}.png" for n in range(5)]  # not shuffled
        assert records[0][1].shape == ((1, 6, 7) if i >= 3 else (3, 6, 7)), switches
    assert main(["convert_imageset", "-nocheck_size", "--noencoded", root, listed, str(tmp / "plain")]) == 0
    assert not next(iter_lmdb(tmp / "plain", decode=False))[1].encoded


def test_convert_imageset_negative_resize_is_no_resize(images):
    """Caffe's convert_imageset takes ``std::max(0, FLAGS_resize_height)`` (and width): -1 means no resize."""
    tmp, pixels = images
    root, listed = f"{tmp / 'img'}/", str(tmp / "list.txt")
    assert main(["convert_imageset", "--resize_height=-1", "--resize_width=-1", root, listed, str(tmp / "a")]) == 0
    assert main(["convert_imageset", "-resize_height", "4", "-resize_width", "-3", root, listed, str(tmp / "b")]) == 0
    for db in ("a", "b"):
        _, image, _ = next(iter_lmdb(tmp / db))
        np.testing.assert_array_equal(image, pixels[0].transpose(2, 0, 1))


def test_raw_records_are_caffes_bytes(images):
    """Caffe's CVMatToDatum sets channels, height, width, data and encoded (false, set explicitly, so on the
    wire), then ReadImageToDatum the label: each raw record's value is those fields in field-number order."""
    import lmdb

    tmp, pixels = images
    assert main(["convert_imageset", f"{tmp / 'img'}/", str(tmp / "list.txt"), str(tmp / "db")]) == 0
    env = lmdb.open(str(tmp / "db"), readonly=True, lock=False)
    with env.begin() as txn:
        values = [value for _, value in txn.cursor()]
    env.close()
    for i, (value, image) in enumerate(zip(values, pixels)):
        planes = image.transpose(2, 0, 1).tobytes()  # 3 x 6 x 7 = 126 bytes: one-byte varints throughout
        expected = (bytes([0x08, 3, 0x10, 6, 0x18, 7, 0x22, len(planes)]) + planes
                    + bytes([0x28, i % 2, 0x38, 0]))
        assert value == expected, i


def test_make_lmdb_skips_blank_lines_and_directories_like_caffe(tmp_path, capfd):
    """convert_imageset reads a blank line as the empty path (the root) and a directory line as that directory;
    cv::imread fails on both and the line is skipped (a FIFO stays refused: io/test_regular_files.py)."""
    tmp, _ = _mixed_list(tmp_path)
    (tmp / "img" / "sub").mkdir()
    (tmp / "list.txt").write_text("a0.png 0\n\nsub 5\na1.png 2\n")
    assert main(["make-lmdb", str(tmp / "list.txt"), str(tmp / "img"), str(tmp / "db"), "--quiet"]) == 0
    out, err = capfd.readouterr()
    assert f"{tmp / 'list.txt'}:2: skipped {tmp / 'img'}: a directory, not an image file" in err
    assert f"{tmp / 'list.txt'}:3: skipped {tmp / 'img' / 'sub'}: a directory, not an image file" in err
    assert "Traceback" not in err and "wrote 2 records" in out
    assert [k for k, _, _ in iter_lmdb(tmp / "db", decode=False)] == ["00000000_a0.png", "00000003_a1.png"]
