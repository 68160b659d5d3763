"""The committed caffe_pb2.py on whatever protobuf runtime is first on the path (CI runs it with
protobuf 4.21, 4.25, 5.29 and 6.33 installed into separate folders, beside the suite's own 7.x):
import, the authors' fields, prototxt (fast path and protobuf's parser), a real caffemodel read both
ways, binary round trip, and the 147/148 dialect of a BVLC-master file.

    PYTHONPATH=/tmp/pb4 python tests/proto/runtime_check.py
Exits 1 with the first failed check.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
FIXTURE = REPO / "tests" / "fixtures" / "nets" / "googlenet_small"


def main() -> int:
    import google.protobuf
    from google.protobuf import text_format
    from google.protobuf.internal import api_implementation

    from caffe_compat.io import read_net, read_weights
    from caffe_compat.io.fast_text import merge_fast
    from caffe_compat.io.weights import from_netparameter
    from caffe_compat.proto import caffe_pb2

    checks = []

    def check(what: str, ok: bool) -> None:
        checks.append(what)
        if not ok:
            raise SystemExit(f"protobuf {google.protobuf.__version__}: FAILED: {what}")

    fields = caffe_pb2.LayerParameter.DESCRIPTOR.fields_by_name
    check("LayerParameter 147/148 are the authors' fields",
          fields["cosine_similarity_batch_param"].number == 147 and fields["fappy_loss_param"].number == 148)
    check("authors' defaults", caffe_pb2.FAPPYLossParameter().delta == np.float32(0.001)
          and caffe_pb2.CosineSimilarityBatchParameter().neg_label == -1.0)
    text = (FIXTURE / "deploy.prototxt").read_text()
    fast, slow = caffe_pb2.NetParameter(), caffe_pb2.NetParameter()
    check("fast prototxt path taken", merge_fast(text, fast))
    text_format.Parse(text, slow)
    check("fast path equals protobuf's parser", fast == slow)
    net = read_net(FIXTURE / "deploy.prototxt")
    check("read_net on the deploy file", len(net.layer) == len(slow.layer) > 10)
    model = read_net(FIXTURE / "weights.caffemodel")
    stored = read_weights(FIXTURE / "weights.caffemodel")
    reference = from_netparameter(model)
    check("read_weights equals the parsed NetParameter",
          [n for n, _ in stored] == [n for n, _ in reference]
          and all(np.array_equal(a.values, b.values) and a.shape == b.shape
                  for (_, x), (_, y) in zip(stored, reference) for a, b in zip(x, y)))
    data = model.SerializeToString()
    check("binary round trip", caffe_pb2.NetParameter.FromString(data) == model)
    swish = caffe_pb2.NetParameter()
    layer = swish.layer.add(name="s", type="Swish")
    layer.swish_param.beta = 2.5
    from caffe_compat.io.dialects import to_binary_dialect
    upstream = to_binary_dialect(swish).SerializeToString()
    check("Swish written as BVLC-master's field 147", bytes([0x9A, 0x09]) in upstream)  # key 147 << 3 | 2
    back = read_net(upstream)
    check("BVLC-master Swish (field 147) reads back", back.layer[0].swish_param.beta == 2.5)
    print(f"protobuf {google.protobuf.__version__} ({api_implementation.Type()}): {len(checks)} checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
