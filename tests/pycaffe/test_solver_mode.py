"""pycaffe's solvers run in Caffe's process-wide mode (``caffe.set_mode_cpu()`` by default,
``set_mode_gpu()``/``set_device``): pycaffe builds them with ``SolverRegistry::CreateSolver(param)``, which
never reads ``solver_mode`` (only tools/caffe.cpp's train does).  So a file saying ``solver_mode: GPU``
trains on the CPU in CPU mode."""

from __future__ import annotations

import torch

import caffe_compat.pycaffe as caffe

NET = """name: "m"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param { num_output: 1 } }
layer { name: "loss" type: "Reduction" bottom: "ip" top: "loss" loss_weight: 1 }
"""


def test_a_gpu_solver_file_runs_in_the_cpu_mode(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU would be there to take
    (tmp_path / "net.prototxt").write_text(NET)
    path = tmp_path / "solver.prototxt"
    path.write_text(f'net: "{tmp_path / "net.prototxt"}"\nbase_lr: 0.1\nlr_policy: "fixed"\nsolver_mode: GPU\n'
                    'device_id: 0\n')
    caffe.set_mode_cpu()
    for make in (caffe.SGDSolver, caffe.AdamSolver, caffe.get_solver):
        solver = make(str(path))
        assert solver.device == torch.device("cpu"), make
        solver.step(1)
        assert solver.iter == 1 and solver.net.params["ip"][0].data.shape == (1, 3)
