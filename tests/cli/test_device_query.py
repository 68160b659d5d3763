"""caffe-compat device_query (Caffe's ``caffe device_query -gpu ID``): its checks on this CUDA-less machine,
and its lines on fake devices (torch.cuda's functions patched with known properties)."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from caffe_compat.cli import main
from tests.cli.test_cli_errors import assert_usage_error, run_cli
from tests.conftest import REPO

H200 = SimpleNamespace(name="NVIDIA H200", major=9, minor=0, total_memory=150_109_880_320,
                       shared_memory_per_block=49152, warp_size=32, multi_processor_count=132,
                       regs_per_multiprocessor=65536, L2_cache_size=62_914_560)
T4 = SimpleNamespace(name="Tesla T4", major=7, minor=5, total_memory=15_828_320_256,
                     shared_memory_per_block=49152, warp_size=32, multi_processor_count=40)


def _lines(index, props):
    return [f"Device id:                     {index}",
            f"Major revision number:         {props.major}",
            f"Minor revision number:         {props.minor}",
            f"Name:                          {props.name}",
            f"Total global memory:           {props.total_memory}",
            f"Total shared memory per block: {props.shared_memory_per_block}",
            f"Warp size:                     {props.warp_size}",
            f"Number of multiprocessors:     {props.multi_processor_count}"]


@pytest.fixture
def two_gpus(monkeypatch):
    devices = [H200, T4]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(devices))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: devices[index])
    return devices


def test_without_gpu_it_queries_nothing_and_exits_0(capsys):
    """Caffe 1.0's device_query: ``LOG(INFO) << "Querying GPUs " << FLAGS_gpu``, then ``get_gpus`` gives no
    device for an empty -gpu (``CHECK_EQ(gpus->size(), 0)``), so nothing more and status 0, without CUDA too."""
    for argv in (["device_query"], ["device-query"], ["device_query", "-gpu", ""], ["device_query", "--gpu="]):
        assert main(argv) == 0, argv
        captured = capsys.readouterr()
        assert captured.out == "Querying GPUs \n" and captured.err == "", argv


def test_on_a_machine_without_cuda_it_names_what_is_missing():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the real CLI cannot miss it here (the CUDA paths are the fake-device "
                    "tests below)")
    done = run_cli("device_query", "-gpu", "0")
    build = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", built without CUDA")
    assert_usage_error(done, "device_query", f"-gpu 0: CUDA is not available ({build}; torch.cuda.is_available() "
                                             "is False); device_query shows CUDA devices only (train, test and "
                                             "time run on the CPU without -gpu)")
    assert done.stdout == ""


@pytest.mark.parametrize("flag", [["-gpu", "1"], ["--gpu=1"], ["-gpu=1"]])
def test_one_device_in_caffes_lines(two_gpus, capsys, flag):
    assert main(["device_query", *flag]) == 0
    assert capsys.readouterr().out.splitlines() == ["Querying GPUs 1", *_lines(1, T4)]


def test_all_queries_every_device_in_order(two_gpus, capsys):
    assert main(["device-query", "-gpu", "all"]) == 0
    assert capsys.readouterr().out.splitlines() == ["Querying GPUs all", *_lines(0, H200), *_lines(1, T4)]


def test_a_list_queries_each_device_it_names(two_gpus, capsys):
    assert main(["device_query", "-gpu", "1,0"]) == 0
    assert capsys.readouterr().out.splitlines() == ["Querying GPUs 1,0", *_lines(1, T4), *_lines(0, H200)]


def test_a_property_this_torch_lacks_leaves_its_line_out(monkeypatch, capsys):
    old = SimpleNamespace(name="GeForce GTX 1080", major=6, minor=1, total_memory=8_513_978_368,
                          multi_processor_count=20)  # a torch before warp_size and shared_memory_per_block
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: old)
    assert main(["device_query", "-gpu", "0"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "Querying GPUs 0",
        "Device id:                     0",
        "Major revision number:         6",
        "Minor revision number:         1",
        "Name:                          GeForce GTX 1080",
        "Total global memory:           8513978368",
        "Number of multiprocessors:     20"]


@pytest.mark.parametrize("gpu, message", [
    ("2", "-gpu 2: no CUDA device 2; this machine has 2 (IDs 0..1)"),
    ("0,5", "-gpu 0,5: no CUDA device 5; this machine has 2 (IDs 0..1)"),
    ("0,,1", "-gpu must be a device id, a comma-separated list of ids or 'all', got '0,,1'"),
    ("x", "-gpu must be a device id, a comma-separated list of ids or 'all', got 'x'"),
    ("-1", "-gpu must be a device id, a comma-separated list of ids or 'all', got '-1'"),
])
def test_a_bad_or_missing_device_exits_2_before_printing(two_gpus, capsys, gpu, message):
    assert main(["device_query", "-gpu", gpu]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"caffe-compat device_query: error: {message}\n"


def test_one_device_out_of_range_on_a_one_device_machine(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: H200)
    assert main(["device_query", "-gpu", "1"]) == 2
    assert capsys.readouterr() == ("", ("caffe-compat device_query: error: -gpu 1: no CUDA device 1; this machine "
                                        "has 1 (IDs 0..0)\n"))


def test_the_command_module_imports_no_torch():
    code = "import sys, caffe_compat.cli.device_query_cmd; assert 'torch' not in sys.modules, 'torch imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
