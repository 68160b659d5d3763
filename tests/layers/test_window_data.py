"""WindowData on generated images and a generated window file: the file format, foreground/background
split and fractions, warp, context padding with clipping, square crops, mirror, mean_value/mean_file and
scale, against hand-computed boxes (Caffe's arithmetic) and cv2.resize of the expected region."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
import torch

from caffe_compat.errors import DataError, FormatError
from caffe_compat.io import read_net, write_blob
from caffe_compat.layers.window_data import Window, c_round, parse_window_file
from caffe_compat.net_shapes import infer_shapes
from tests.layers.zoo_single_layer import make_layer


@pytest.fixture
def images(tmp_path):
    rng = np.random.default_rng(0)
    pictures = [rng.integers(0, 256, (20, 24, 3), dtype=np.uint8), rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)]
    for k, picture in enumerate(pictures):
        assert cv2.imwrite(str(tmp_path / f"img{k}.png"), picture)
    window_file = tmp_path / "windows.txt"
    window_file.write_text(
        "# 0\nimg0.png\n3 20 24\n3\n"
        "1 0.9 2 3 9 12\n"      # foreground, class 1
        "0 0.1 0 0 5 5\n"       # background
        "2 0.4 1 1 3 3\n"       # between the thresholds below: dropped
        "# 1\nimg1.png\n3 16 16\n2\n"
        "3 0.75 4 4 11 11\n"
        "5 0.2 0 0 15 15\n")    # background (label forced to 0)
    return tmp_path, pictures


def _layer(folder, extra="", transform="crop_size: 8", batch=4):
    return make_layer(f'type: "WindowData" top: "data" top: "label" window_data_param {{ source: "{folder}/windows.txt" '
                      f'root_folder: "{folder}/" batch_size: {batch} fg_threshold: 0.5 bg_threshold: 0.3 {extra} }} '
                      f'transform_param {{ {transform} }}', [])


def test_window_file_parsing_and_thresholds(images):
    folder, _ = images
    found, fg, bg = parse_window_file((folder / "windows.txt").read_text(), "r/", 0.5, 0.3, "w")
    assert found == [("r/img0.png", (3, 20, 24)), ("r/img1.png", (3, 16, 16))]
    assert [(w.image_index, w.label) for w in fg] == [(0, 1), (1, 3)]
    assert [(w.image_index, w.label, w.overlap) for w in bg] == [(0, 0, 0.0), (1, 0, 0.0)]
    with pytest.raises(DataError, match="needs a label > 0"):
        parse_window_file("# 0 a.png 3 4 4 1 0 0.9 0 0 1 1", "", 0.5, 0.5, "w")
    with pytest.raises(DataError, match="expected '#'"):
        parse_window_file("0 a.png 3 4 4 0", "", 0.5, 0.5, "w")
    with pytest.raises(DataError, match="window file is empty"):
        parse_window_file("", "", 0.5, 0.5, "w")


def test_batch_is_background_then_foreground_warped(images):
    folder, pictures = images
    port = _layer(folder, "fg_fraction: 0.5 scale: 0.5", "crop_size: 8 mean_value: 10 mean_value: 20 mean_value: 30")
    data, label = port()
    assert tuple(data.shape) == (4, 3, 8, 8) and port.output_shapes() == [(4, 3, 8, 8), (4,)]
    assert label[:2].tolist() == [0.0, 0.0] and set(label[2:].tolist()) <= {1.0, 3.0}
    mean = np.array([10, 20, 30], dtype=np.float32)[:, None, None]
    windows = {1.0: (0, (2, 3, 9, 12)), 3.0: (1, (4, 4, 11, 11))}
    for item in (2, 3):
        image, (x1, y1, x2, y2) = windows[float(label[item])]
        expected = cv2.resize(pictures[image][y1:y2 + 1, x1:x2 + 1], (8, 8), interpolation=cv2.INTER_LINEAR)
        np.testing.assert_array_equal(data[item].numpy(), (expected.transpose(2, 0, 1) - mean) * 0.5)


def test_context_pad_clips_at_the_border_and_mirror_moves_the_padding(images):
    """crop 12, context_pad 3: the 6x6 box (0..5) grows by 12/6 about its centre 3 to -3..9 (13 wide);
    3 pixels fall outside on the left/top: clipped 0..9 (10 wide) resized to round(10·12/13) = 9,
    padding round(3·12/13) = 3; mirrored, the padding is the right side's, 0."""
    folder, pictures = images
    port = _layer(folder, "context_pad: 3", "crop_size: 12")
    window = Window(0, 1, 0.9, 0, 0, 5, 5)
    assert port.box(window, 20, 24, mirror=False) == ((0, 0, 9, 9), (9, 9), (3, 3))
    assert port.box(window, 20, 24, mirror=True) == ((0, 0, 9, 9), (9, 9), (0, 3))
    patch = cv2.resize(pictures[0][0:10, 0:10], (9, 9), interpolation=cv2.INTER_LINEAR).transpose(2, 0, 1)
    item = port.warp(window, mirror=False)
    assert np.all(item[:, :3, :] == 0) and np.all(item[:, :, :3] == 0)
    np.testing.assert_array_equal(item[:, 3:, 3:], patch)
    mirrored = port.warp(window, mirror=True)
    np.testing.assert_array_equal(mirrored[:, 3:, :9], patch[:, :, ::-1])
    assert np.all(mirrored[:, :, 9:] == 0)


def test_square_mode_takes_the_longer_side(images):
    """Box 2..7 x 4..5 (6 x 2), square, no context: half-sides 3 and 1 -> 3; centre (5, 5): 2..8 both ways."""
    folder, _ = images
    port = _layer(folder, 'crop_mode: "square"', "crop_size: 10")
    assert port.box(Window(0, 1, 0.9, 2, 4, 7, 5), 20, 24, mirror=False) == ((2, 2, 8, 8), (10, 10), (0, 0))


def test_mean_file_is_read_at_the_centred_padded_offset(images):
    folder, pictures = images
    mean = np.arange(3 * 10 * 10, dtype=np.float32).reshape(1, 3, 10, 10)
    write_blob(mean, folder / "mean.binaryproto")
    port = _layer(folder, "", f'crop_size: 8 mean_file: "{folder}/mean.binaryproto"')
    item = port.warp(Window(1, 3, 0.75, 4, 4, 11, 11), mirror=False)
    expected = cv2.resize(pictures[1][4:12, 4:12], (8, 8), interpolation=cv2.INTER_LINEAR).transpose(2, 0, 1)
    np.testing.assert_array_equal(item, expected - mean[0, :, 1:9, 1:9])  # (10 - 8) / 2 = 1


def test_mirror_draws_and_seeding_is_reproducible(images):
    folder, _ = images
    first, second = _layer(folder, "", "crop_size: 8 mirror: true"), _layer(folder, "", "crop_size: 8 mirror: true")
    for port in (first, second):
        port.fill(torch.Generator().manual_seed(3))
    for _ in range(2):
        a, b = first(), second()
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_c_round_and_checks(images):
    assert [c_round(v) for v in (0.5, 1.5, 2.5, -0.5, -2.5)] == [1, 2, 3, -1, -3]
    folder, _ = images
    with pytest.raises(FormatError, match="crop_size must be > 0"):
        _layer(folder, "", "mirror: false")
    with pytest.raises(FormatError, match="1 mean_value or as many as channels"):
        _layer(folder, "", "crop_size: 8 mean_value: 1 mean_value: 2")
    with pytest.raises(DataError, match="failed to open window file"):
        make_layer(f'type: "WindowData" top: "d" top: "l" window_data_param {{ source: "{folder}/missing.txt" '
                   f'batch_size: 1 }} transform_param {{ crop_size: 4 }}', [])
    (folder / "fg_only.txt").write_text("# 0\nimg0.png\n3 20 24\n1\n1 0.9 0 0 3 3\n")
    port = make_layer(f'type: "WindowData" top: "d" top: "l" window_data_param {{ source: "{folder}/fg_only.txt" '
                      f'root_folder: "{folder}/" batch_size: 2 }} transform_param {{ crop_size: 4 }}', [])
    with pytest.raises(DataError, match="needs 2 background windows and the window file has none"):
        port()


def test_inspect_and_export_facts():
    text = ('layer { name: "w" type: "WindowData" top: "data" top: "label" window_data_param { source: "w.txt" '
            'batch_size: 16 scale: 0.25 } transform_param { crop_size: 227 mean_value: 104 } }\n')
    blobs, _ = infer_shapes(read_net(text))
    assert blobs["data"] == (16, 3, 227, 227) and blobs["label"] == (16,)
    from caffe_compat.layers.window_data import WindowData

    facts = WindowData.input_facts(read_net(text).layer[0])
    assert facts.crop == 227 and facts.scale == 0.25 and facts.source == "w.txt"


def test_mean_file_of_several_means_uses_the_first_like_caffe(images):
    """Caffe's WindowDataLayer indexes the mean blob with its legacy height()/width() from its first value, so a
    blob of two means uses the first; before, ours reshaped it to its last three axes (a ValueError)."""
    folder, pictures = images
    mean = np.arange(3 * 10 * 10, dtype=np.float32).reshape(1, 3, 10, 10)
    write_blob(np.concatenate([mean, mean + 50]), folder / "means.binaryproto")
    port = _layer(folder, "", f'crop_size: 8 mean_file: "{folder}/means.binaryproto"')
    item = port.warp(Window(1, 3, 0.75, 4, 4, 11, 11), mirror=False)
    expected = cv2.resize(pictures[1][4:12, 4:12], (8, 8), interpolation=cv2.INTER_LINEAR).transpose(2, 0, 1)
    np.testing.assert_array_equal(item, expected - mean[0, :, 1:9, 1:9])


def test_an_unknown_crop_mode_warps_like_caffe(images):
    """Caffe's WindowDataLayer sets ``use_square = (crop_mode == "square")``: every other value (a typo, "Warp")
    warps.  Before, ours refused such a prototxt (a FormatError).  Now it warns and draws the warp's batch."""
    folder, _ = images
    with pytest.warns(UserWarning, match="crop_mode 'fit' is neither 'warp' nor 'square'"):
        odd = _layer(folder, 'crop_mode: "fit" context_pad: 1', "crop_size: 8 mirror: true")
    warp = _layer(folder, "context_pad: 1", "crop_size: 8 mirror: true")
    for port in (odd, warp):
        port.fill(torch.Generator().manual_seed(5))
    (a, la), (b, lb) = odd(), warp()
    assert torch.equal(a, b) and torch.equal(la, lb) and torch.count_nonzero(a) > 0
