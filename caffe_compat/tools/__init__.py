"""Caffe's command-line tools on PyTorch, one module per tool (the CLI only parses and calls these).

* :mod:`~caffe_compat.tools.score` — ``caffe test``: score a TEST net over N forward passes;
* :mod:`~caffe_compat.tools.timing` — ``caffe time``: per-layer forward/backward milliseconds;
* :mod:`~caffe_compat.tools.features` — ``extract_features``: named blobs into LMDB (Datum), ``.npy`` or HDF5;
* :mod:`~caffe_compat.tools.parse_log` — ``tools/extra/parse_log.py`` and the training-curve PNG of
  ``plot_training_log.py``;
* :mod:`~caffe_compat.tools.netsetup` — what the tools share: Caffe's ``-gpu``/``-phase``/``-stage``
  flags, building the net with its weights, feeding Input layers from files.

``python/draw_net.py`` is :mod:`caffe_compat.draw` (pycaffe's ``caffe.draw`` API names).  glog's line
format, which the solver writes and ``parse_log`` reads, is a file format: :mod:`caffe_compat.io.glog`.
"""
