"""BVLC's "Learning LeNet" notebook flow, unchanged pycaffe code, run by ``caffe-compat run``: NetSpec → write
the prototxts → ``caffe.SGDSolver`` → inspect blobs/params → ``forward`` → ``step`` → diffs → a training loop
reading ``blobs['loss']`` → test accuracy from ``test_nets[0]``.  The data are scikit-learn's bundled
digits (8×8, 16 grey levels) in Caffe's LMDB layout, written by the project's own LmdbWriter."""

from __future__ import annotations

import json

import numpy as np

from caffe_compat.io.datum_lmdb import LmdbWriter, make_datum
from tests.cli.test_cli_errors import run_cli

NOTEBOOK = r'''
import json
import numpy as np
import caffe
from caffe import layers as L, params as P


def lenet(lmdb, batch_size):
    n = caffe.NetSpec()
    n.data, n.label = L.Data(batch_size=batch_size, backend=P.Data.LMDB, source=lmdb,
                             transform_param=dict(scale=1. / 16), ntop=2)
    n.conv1 = L.Convolution(n.data, kernel_size=3, num_output=20, weight_filler=dict(type='xavier'))
    n.pool1 = L.Pooling(n.conv1, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    n.fc1 = L.InnerProduct(n.pool1, num_output=100, weight_filler=dict(type='xavier'))
    n.relu1 = L.ReLU(n.fc1, in_place=True)
    n.score = L.InnerProduct(n.relu1, num_output=10, weight_filler=dict(type='xavier'))
    n.loss = L.SoftmaxWithLoss(n.score, n.label)
    return n.to_proto()


with open('lenet_train.prototxt', 'w') as f:
    f.write(str(lenet('train_lmdb', 64)))
with open('lenet_test.prototxt', 'w') as f:
    f.write(str(lenet('test_lmdb', 99)))
with open('lenet_solver.prototxt', 'w') as f:
    f.write('train_net: "lenet_train.prototxt"\ntest_net: "lenet_test.prototxt"\ntest_iter: 3\n'
            'test_interval: 1000\nbase_lr: 0.01\nmomentum: 0.9\nweight_decay: 0.0005\nlr_policy: "inv"\n'
            'gamma: 0.0001\npower: 0.75\ndisplay: 0\nmax_iter: 1000\nsnapshot: 0\n'
            'snapshot_prefix: "lenet"\nsolver_mode: CPU\n')

caffe.set_mode_cpu()
solver = caffe.SGDSolver('lenet_solver.prototxt')
shapes = [(k, v.data.shape) for k, v in solver.net.blobs.items()]
param_shapes = [(k, v[0].data.shape) for k, v in solver.net.params.items()]
solver.net.forward()
solver.test_nets[0].forward()
first_labels = solver.net.blobs['label'].data[:8].tolist()
solver.step(1)
conv1_diff = float(np.abs(solver.net.params['conv1'][0].diff).sum())

niter, test_interval = 80, 40
train_loss = np.zeros(niter)
accuracy = []
for it in range(niter):
    solver.step(1)
    train_loss[it] = solver.net.blobs['loss'].data
    if it % test_interval == 0 or it == niter - 1:
        correct = 0
        for test_it in range(3):
            solver.test_nets[0].forward()
            correct += sum(solver.test_nets[0].blobs['score'].data.argmax(1)
                           == solver.test_nets[0].blobs['label'].data)
        accuracy.append(correct / 297.)
print(json.dumps({"shapes": [[k, list(s)] for k, s in shapes], "params": [[k, list(s)] for k, s in param_shapes],
                  "first_labels": first_labels, "conv1_diff": conv1_diff, "loss": train_loss.tolist(),
                  "accuracy": accuracy, "iter": solver.iter}))
'''


def _digits_lmdb(path, images, labels) -> None:
    with LmdbWriter(path) as db:
        for i, (image, label) in enumerate(zip(images, labels)):
            db.put(f"{i:08d}", make_datum(image.reshape(1, 8, 8).astype(np.uint8), int(label)))


def test_the_lenet_notebook_flow_runs_unchanged(tmp_path):
    from sklearn.datasets import load_digits

    digits = load_digits()
    _digits_lmdb(tmp_path / "train_lmdb", digits.images[:1500], digits.target[:1500])
    _digits_lmdb(tmp_path / "test_lmdb", digits.images[1500:], digits.target[1500:])
    (tmp_path / "notebook.py").write_text(NOTEBOOK)
    done = run_cli("run", "notebook.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["shapes"] == [["data", [64, 1, 8, 8]], ["label", [64]], ["conv1", [64, 20, 6, 6]],
                             ["pool1", [64, 20, 3, 3]], ["fc1", [64, 100]], ["score", [64, 10]], ["loss", []]]
    assert out["params"] == [["conv1", [20, 1, 3, 3]], ["fc1", [100, 180]], ["score", [10, 100]]]
    assert out["first_labels"] == digits.target[:8].tolist()  # the Data layer reads the LMDB in key order
    assert out["conv1_diff"] > 0 and out["iter"] == 81
    loss = np.asarray(out["loss"])
    assert loss[-10:].mean() < 0.5 * loss[:10].mean(), loss
    assert out["accuracy"][-1] > 0.8, out["accuracy"]  # chance is 0.1
