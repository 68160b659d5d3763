"""The TEST-phase net an export (or a verification) starts from.

``load_test_net(prototxt, weights=None, checkpoint=None)``:

* ``weights``: a caffemodel copied in by layer name (Caffe's ``CopyTrainedLayersFrom``);
* ``checkpoint``: a caffe-compat checkpoint (``caffe_compat.checkpoint``).  Its weights are copied into the
  TEST-phase net of ``prototxt`` **by layer name**, exactly like a caffemodel (a checkpoint saved from the
  TRAIN net therefore fits the deploy net, whose data and loss layers it simply lacks).  Without
  ``prototxt`` the checkpoint's own net is rebuilt in the TEST phase;
* neither: the layers keep their Caffe filler values (seed 0), useful only for tests and shape checks.
"""

from __future__ import annotations

from pathlib import Path

from caffe_compat.errors import CaffeCompatError

__all__ = ["load_test_net"]


def _existing(path, what: str) -> str:
    if not Path(path).is_file():
        raise CaffeCompatError(f"{path}: no such {what} file")
    return str(path)


def load_test_net(prototxt=None, weights=None, checkpoint=None):
    """A TEST-phase :class:`~caffe_compat.net.CaffeNet` (see the module docstring)."""
    from caffe_compat.net import CaffeNet

    if weights is not None and checkpoint is not None:
        raise CaffeCompatError("give either weights (a caffemodel) or a checkpoint, not both")
    if prototxt is None and checkpoint is None:
        raise CaffeCompatError("a net prototxt is required (or a checkpoint that carries its net)")
    stored = None
    if checkpoint is not None:
        from caffe_compat.checkpoint import checkpoint_prototxt, load_checkpoint

        stored = load_checkpoint(_existing(checkpoint, "checkpoint"))
        if prototxt is None:
            prototxt = checkpoint_prototxt(stored)
    elif isinstance(prototxt, (str, Path)) and Path(prototxt).suffix == ".prototxt":
        _existing(prototxt, "prototxt")
    if weights is not None:
        weights = _existing(weights, "caffemodel")
    net = CaffeNet(str(prototxt) if isinstance(prototxt, Path) else prototxt, phase="test", weights=weights)
    if stored is not None:
        net.load_caffemodel(stored.to_netparameter())
    return net.eval()
