"""``caffe-compat device-query -gpu ID`` (also ``device_query``, ``--gpu=ID``): Caffe's ``caffe device_query``.

``-gpu`` takes what Caffe's does: one device ID, a comma-separated list of IDs (each queried in turn) or
``all`` (every device torch sees).  The first line is Caffe's ``Querying GPUs <flag>``; then, per device,
the lines of Caffe's ``Caffe::DeviceQuery()`` that ``torch.cuda.get_device_properties`` can supply
honestly, with Caffe's labels and alignment::

    Device id:                     <the ID>
    Major revision number:         major
    Minor revision number:         minor
    Name:                          name
    Total global memory:           total_memory (bytes, Caffe's totalGlobalMem)
    Total shared memory per block: shared_memory_per_block (bytes; torch >= 2.7, else the line is left out)
    Warp size:                     warp_size (a torch without it: the line is left out)
    Number of multiprocessors:     multi_processor_count

Caffe's other lines are left out, not invented: torch exposes no ``regsPerBlock`` (only registers per
multiprocessor), ``memPitch``, ``maxThreadsPerBlock``, ``maxThreadsDim``, ``maxGridSize``, ``totalConstMem``,
``textureAlignment``, ``deviceOverlap`` or ``kernelExecTimeoutEnabled``, and its ``clockRate`` (Caffe's
``Clock rate:``) is not part of the properties every torch build has.  Caffe logs these lines through glog
(stderr, with glog's prefix); here they are plain lines on stdout, as ``caffe-compat time`` prints its own.

Without ``-gpu`` (or with an empty one) it queries nothing, as Caffe 1.0's ``get_gpus`` gives no device
then: the line ``Querying GPUs `` alone and exit 0, CUDA or not (Caffe rc2's ``Need a device ID to query.``
check went when ``-gpu`` took lists).  Errors exit 2 with one line and nothing printed before it: an ID
that is not a non-negative integer, a torch without CUDA
(:func:`caffe_compat.evaluate.inputs.cuda_missing`) and an ID at or beyond the device count (where Caffe's
``cudaSetDevice`` fails with ``invalid device ordinal``).
"""

from __future__ import annotations

from caffe_compat.cli.caffe_flags import accept_caffe_flags

#: Caffe's label (padded as ``Caffe::DeviceQuery`` pads it) and the torch property each value comes from.
FIELDS = (
    ("Major revision number:", "major"),
    ("Minor revision number:", "minor"),
    ("Name:", "name"),
    ("Total global memory:", "total_memory"),
    ("Total shared memory per block:", "shared_memory_per_block"),
    ("Warp size:", "warp_size"),
    ("Number of multiprocessors:", "multi_processor_count"),
)
LABEL_WIDTH = 31  # "Total shared memory per block: ": the values start in the same column on every line


def register(sub) -> None:
    p = sub.add_parser("device-query", aliases=["device_query"],
                       help="show CUDA device properties in Caffe's lines (caffe device_query)")
    p.add_argument("--gpu", "-gpu", metavar="ID",
                   help="Caffe's flag: the CUDA device ID to query, a comma-separated list of IDs, or 'all'")
    accept_caffe_flags(p)  # the caffe binary's other flags, accepted and unread (gflags)
    p.set_defaults(func=run)


def device_lines(index: int, props) -> list[str]:
    """Caffe's ``DeviceQuery`` lines of device ``index`` from a ``torch.cuda.get_device_properties`` result;
    a property this torch does not expose leaves its line out."""
    lines = [f"{'Device id:':<{LABEL_WIDTH}}{index}"]
    for label, name in FIELDS:
        value = getattr(props, name, None)
        if value is not None:
            lines.append(f"{label:<{LABEL_WIDTH}}{value}")
    return lines


def requested_ids(gpu) -> list[int] | None:
    """The IDs of ``-gpu`` (:func:`caffe_compat.tools.netsetup.gpu_ids`: a list of integers, or ``None`` for
    ``all``, known once CUDA is checked); no ``-gpu`` (or an empty one) is none, as Caffe's ``get_gpus``."""
    from caffe_compat.tools.netsetup import gpu_ids

    if gpu is None or not str(gpu):
        return []
    return gpu_ids(gpu)


def query(gpu) -> list[str]:
    """All the lines ``device_query -gpu <gpu>`` prints, checked before any is printed."""
    import torch

    from caffe_compat.errors import CaffeCompatError
    from caffe_compat.evaluate.inputs import cuda_missing

    ids = requested_ids(gpu)
    if ids == []:  # Caffe: the Querying line, then no device to query
        return [f"Querying GPUs {gpu or ''}"]
    if not torch.cuda.is_available():
        raise cuda_missing(f"-gpu {gpu}", "device_query shows CUDA devices only (train, test and time run on "
                                          "the CPU without -gpu)")
    count = torch.cuda.device_count()
    if ids is None:
        ids = list(range(count))
    for index in ids:
        if index >= count:
            raise CaffeCompatError(f"-gpu {gpu}: no CUDA device {index}; this machine has {count} "
                                   f"(IDs 0..{count - 1})")
    lines = [f"Querying GPUs {gpu}"]
    for index in ids:
        lines += device_lines(index, torch.cuda.get_device_properties(index))
    return lines


def run(args) -> int:
    print("\n".join(query(args.gpu)), flush=True)
    return 0
