"""The Solver's snapshots: Caffe's ``Snapshot`` (``.caffemodel`` then ``.solverstate``, each written
atomically) and ``Restore`` (a mixin of :class:`~caffe_compat.solver.Solver`).

As Caffe's ``CheckSnapshotWritePermissions`` (in ``Solver::Init``), a solver with ``snapshot > 0`` checks
when it is built that a file ``<prefix>_iter_0.tempfile`` can be created (then removes it): a missing or
read-only folder fails at once, not after the first ``snapshot`` iterations of training."""

from __future__ import annotations

import contextlib
import logging
import os
import re
from pathlib import Path

import torch

from caffe_compat.errors import FormatError, WriteError
from caffe_compat.io import array_to_blob, blob_to_array, read_solverstate, write_net, write_solverstate
from caffe_compat.io.atomic import remove_stale_temporaries
from caffe_compat.io.blobs import set_packed_floats
from caffe_compat.io.safe_open import PROTOBUF_MAX_BYTES, check_regular_file
from caffe_compat.proto import caffe_pb2
from caffe_compat.solver.observers import around_snapshot, notify

log = logging.getLogger("caffe_compat.solver")


class SolverSnapshots:
    """Snapshot and restore (see the module docstring)."""

    def check_snapshot_write_permissions(self) -> None:
        """Caffe's ``CheckSnapshotWritePermissions`` (on rank 0, which writes the snapshots, as Caffe's root
        solver): with ``snapshot > 0``, a prefix must be set (else FormatError) and
        ``<prefix>_iter_<iter>.tempfile`` creatable (it is removed again; another process's probe may have
        removed it first); else WriteError.
        A folder of the prefix that does not exist yet passes when it can be created (the snapshot writers
        create it, unlike Caffe's): its nearest existing ancestor must be a writable folder."""
        if not self.param.snapshot or int(os.environ.get("RANK", "0") or 0) != 0:  # Caffe: the root solver's
            return
        prefix = self.param.snapshot_prefix
        if not self.param.HasField("snapshot_prefix"):  # set to "": Caffe writes <cwd>/_iter_N.*
            raise FormatError("In solver params, snapshot is specified but snapshot_prefix is not")
        probe = Path(self.snapshot_filename(".tempfile"))
        existing = probe.parent
        while not os.path.lexists(existing) and existing != existing.parent:
            existing = existing.parent
        if existing == probe.parent and existing.is_dir():
            try:
                with open(probe, "w"):
                    pass
                with contextlib.suppress(FileNotFoundError):  # another rank's probe of the same name removed it
                    os.remove(probe)
                return
            except OSError as exc:
                reason = f"{probe}: {exc.strerror or exc}"
        elif not existing.is_dir():
            reason = f"{existing} is not a folder"
        elif not os.access(existing, os.W_OK | os.X_OK):
            reason = f"cannot create folder {probe.parent} in {existing}"
        else:
            return
        raise WriteError(f"Cannot write to snapshot prefix '{prefix}'.  Make sure that the directory exists and is "
                         f"writeable ({reason})")

    def snapshot_filename(self, extension: str) -> str:
        return f"{self.param.snapshot_prefix}_iter_{self.iter}{extension}"

    def snapshot(self) -> tuple[str, str]:
        """Write ``<prefix>_iter_<iter>.caffemodel`` then ``.solverstate`` (each atomically: a crash never
        leaves a half-written file under either name), then tell the observers (``on_snapshot``).  Returns
        both paths.  An observer's ``around_snapshot`` may take this over (:mod:`~caffe_compat.solver.observers`).

        Temporaries of any ``<prefix>_iter_<N>.*`` snapshot left in the folder by a killed run (whose
        process is gone) are removed first (:func:`~caffe_compat.io.atomic.remove_stale_temporaries`)."""
        return around_snapshot(self, self._write_snapshot)()

    def _write_snapshot(self) -> tuple[str, str]:
        if self.param.snapshot_format == caffe_pb2.SolverParameter.HDF5:
            raise FormatError("snapshot_format: HDF5 is not supported; use BINARYPROTO")
        model_path = self.snapshot_filename(".caffemodel")
        state_path = self.snapshot_filename(".solverstate")
        folder, base = os.path.split(self.param.snapshot_prefix)
        remove_stale_temporaries(folder or ".", re.escape(base) + r"_iter_[0-9]+\.[A-Za-z0-9]+")
        net_param = self.net.to_netparameter()
        if self.param.snapshot_diff:
            self._add_diffs(net_param)
        log.info("Snapshotting to binary proto file %s", model_path)
        write_net(net_param, model_path, binary=True)
        state = caffe_pb2.SolverState(iter=self.iter, learned_net=model_path, current_step=self.current_step)
        for blob in self.optimizer.history_blobs():
            state.history.append(array_to_blob(blob.detach().to("cpu", torch.float32).numpy()))
        log.info("Snapshotting solver state to binary proto file %s", state_path)
        write_solverstate(state, state_path)
        notify(self, "on_snapshot", model_path, state_path)
        return model_path, state_path

    def _add_diffs(self, net_param: caffe_pb2.NetParameter) -> None:
        params = self.net.params
        for layer in net_param.layer:
            for blob, tensor in zip(layer.blobs, params.get(layer.name, [])):
                diff = tensor.grad if tensor.grad is not None else torch.zeros_like(tensor)
                set_packed_floats(blob, diff.detach().to("cpu", torch.float32).reshape(-1).numpy(), "diff")

    def restore(self, state_file) -> None:
        """Caffe's ``Restore`` from a ``.solverstate``: iteration, current_step, history, and the weights of
        ``learned_net`` (as written, else relative to the state file's folder)."""
        state_file = str(state_file)
        if state_file.endswith(".h5"):
            raise FormatError(f"{state_file}: HDF5 solver states are not supported; use a .solverstate")
        state = read_solverstate(state_file)
        if state.learned_net:
            learned = state.learned_net
            if not os.path.isabs(learned) and not os.path.exists(learned):
                beside = Path(state_file).resolve().parent / Path(learned).name
                learned = str(beside) if beside.exists() else learned
            check_regular_file(learned, f"{state_file} learned_net", PROTOBUF_MAX_BYTES)
            self.net.load_caffemodel(learned)
        log.info("SGDSolver: restoring history")
        self.optimizer.set_history([blob_to_array(b, source=f"{state_file} history") for b in state.history])
        self.iter = int(state.iter)
        self.current_step = int(state.current_step)
        self.optimizer.iter = self.iter
