"""Yahoo's open_nsfw (ResNet-50 1by2, BatchNorm + Scale, published caffemodel) against OpenCV's Caffe importer.

OpenCV 4.x ``cv2.dnn.readNetFromCaffe`` is an independent implementation of Caffe's layers.  Inputs: two
real photos (scikit-learn's bundled china.jpg and flower.jpg, resized to 224x224 with OpenCV, BGR minus
open_nsfw's mean (104, 117, 123)) and Gaussian noise at pixel scale.  ``prob`` is compared with OpenCV's
default (fused) net; every intermediate blob with fusion off, each against the output of the *last* layer
that wrote it (our blobs hold the post-in-place value, as pycaffe's).  Measured on this machine (CPU):
``prob`` max abs difference 1.3e-8; intermediate blobs max relative difference (max |diff| / max |blob|)
7.9e-6 over 73 blobs.
"""

from __future__ import annotations

import cv2
import numpy as np
import pytest
import torch

from caffe_compat.net import load_net

MEAN_BGR = np.array([104.0, 117.0, 123.0], dtype=np.float32)


def _photos() -> np.ndarray:
    from sklearn.datasets import load_sample_images

    batch = []
    for rgb in load_sample_images().images:  # china.jpg, flower.jpg (427x640 RGB)
        bgr = cv2.resize(np.ascontiguousarray(rgb[:, :, ::-1]), (224, 224), interpolation=cv2.INTER_LINEAR)
        batch.append((bgr.astype(np.float32) - MEAN_BGR).transpose(2, 0, 1))
    return np.ascontiguousarray(np.stack(batch))


def _noise() -> np.ndarray:
    return (np.random.RandomState(0).randn(2, 3, 224, 224) * 50).astype(np.float32)


INPUTS = {"photos": _photos, "noise": _noise}


@pytest.fixture(scope="module")
def nets(nsfw_dir):
    proto, weights = str(nsfw_dir / "deploy.prototxt"), str(nsfw_dir / "resnet_50_1by2_nsfw.caffemodel")
    return proto, weights, load_net(proto, weights)


@pytest.mark.parametrize("kind", sorted(INPUTS))
def test_prob_and_every_blob_match_opencv(nets, kind):
    proto, weights, net = nets
    x = INPUTS[kind]()
    with torch.no_grad():
        ours = net(data=torch.from_numpy(x))
    fused = cv2.dnn.readNetFromCaffe(proto, weights)
    fused.setInput(x)
    prob_cv = fused.forward()
    prob = ours["prob"].numpy()
    prob_abs = float(np.abs(prob - prob_cv).max())
    assert prob.shape == (2, 2) and np.allclose(prob.sum(1), 1, atol=1e-6)
    assert prob_abs < 1e-5, prob_abs
    if kind == "photos":  # both photos are harmless scenery: open_nsfw calls them SFW
        assert (prob[:, 0] > 0.9).all()

    last_writer = {}
    for step in net.steps:
        if step.module_key is not None and step.type != "Input":
            for top in step.tops:
                last_writer[top] = step.name
    layers = list(dict.fromkeys(last_writer.values()))
    plain = cv2.dnn.readNetFromCaffe(proto, weights)
    plain.enableFusion(False)
    plain.setInput(x)
    outputs = dict(zip(layers, plain.forward(layers)))
    rel = {}
    for blob, layer in last_writer.items():
        theirs, mine = outputs[layer], ours[blob].numpy()
        assert theirs.size == mine.size, blob
        rel[blob] = float(np.abs(mine - theirs.reshape(mine.shape)).max() / max(np.abs(theirs).max(), 1e-30))
    worst = max(rel, key=rel.get)
    print(f"\nopen_nsfw vs OpenCV {cv2.__version__} ({kind}): prob max abs {prob_abs:.2e}; "
          f"{len(rel)} blobs, worst max-rel {rel[worst]:.2e} at {worst}")
    assert len(rel) == 73  # every blob except the input and the Split copies
    assert rel[worst] < 1e-4, (worst, rel[worst])
