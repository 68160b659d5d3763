"""The Solver's construction: reading the solver file and building its TRAIN and TEST nets, as Caffe's
``Solver::Init`` / ``InitTrainNet`` / ``InitTestNets`` do (a mixin of :class:`~caffe_compat.solver.Solver`).

Nets come from ``net`` / ``net_param`` / ``train_net`` / ``train_net_param`` (exactly one) and
``test_net`` / ``test_net_param`` (or the train net's file with the TEST state), with each
``test_state``; relative paths are resolved against the solver file's folder, then the working directory.
Caffe's log lines come with them: ``Creating training net from net file: <net>`` (or ``specified in
net_param.``, ...), ``Creating test net (#i) specified by <source>``, ``Solver scaffolding done.``, and
``UpgradeSnapshotPrefixProperty``'s ``snapshot_prefix was not specified and is set to <prefix>``.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

from caffe_compat.errors import CaffeCompatError, FormatError, WeightsMismatchWarning, naming_file
from caffe_compat.io import read_net, read_solver, upgrade_solver
from caffe_compat.io.safe_open import check_regular_file
from caffe_compat.net import CaffeNet
from caffe_compat.proto import caffe_pb2

log = logging.getLogger("caffe_compat.solver")


_PHASE_NAMES = {caffe_pb2.TRAIN: "train", caffe_pb2.TEST: "test"}


def _net_state(default_phase: int, net_param: caffe_pb2.NetParameter, state) -> caffe_pb2.NetState:
    """Caffe's NetState for a solver's net (``InitTrainNet`` / ``InitTestNets``): the solver's default phase
    (TRAIN, TEST), then ``MergeFrom`` the net's own ``state``, then ``MergeFrom`` the solver's ``train_state``
    / ``test_state`` (``state``, may be None).  A phase set explicitly in either wins: a net file saying
    ``state { phase: TEST }`` trains in the TEST phase, as in Caffe; stages accumulate."""
    merged = caffe_pb2.NetState(phase=default_phase)
    merged.MergeFrom(net_param.state)
    if state is not None:
        merged.MergeFrom(state)
    return merged


class SolverSetup:
    """Reading the solver parameter and building the nets (see the module docstring)."""

    @staticmethod
    def _is_path(solver) -> bool:
        """Whether the solver was given as a file (not text nor a SolverParameter)."""
        from caffe_compat.io.path_or_text import is_existing_file

        return is_existing_file(solver)

    def _upgrade_snapshot_prefix(self, path: str) -> None:
        """Caffe's ``UpgradeSnapshotPrefixProperty``: no prefix -> the solver path without its extension;
        a prefix naming a directory -> ``<directory>/<solver file stem>``."""
        if not self.param.HasField("snapshot_prefix"):
            self.param.snapshot_prefix = os.path.splitext(path)[0]
            log.info("snapshot_prefix was not specified and is set to %s", self.param.snapshot_prefix)
        elif os.path.isdir(self.param.snapshot_prefix):
            self.param.snapshot_prefix = os.path.join(self.param.snapshot_prefix, Path(path).stem)
            log.info("snapshot_prefix is a directory and is set to %s", self.param.snapshot_prefix)

    @staticmethod
    def _read_param(solver) -> caffe_pb2.SolverParameter:
        if isinstance(solver, caffe_pb2.SolverParameter):
            param = caffe_pb2.SolverParameter()
            param.CopyFrom(solver)
            upgrade_solver(param, "<SolverParameter>")
            return param
        return read_solver(solver)

    def _resolve(self, path: str) -> str:
        """Caffe opens relative paths against the working directory; fall back to the solver's folder."""
        if os.path.isabs(path) or os.path.exists(path):
            return path
        candidate = self.base_dir / path
        return str(candidate) if candidate.exists() else path

    @staticmethod
    def _copy_weights(net, paths, strict: bool = False, quiet: bool = False) -> None:
        """Caffe's ``CopyLayers``: each weights file in order into ``net``, an HDF5 one (a ``.caffemodel.h5``
        snapshot) read as HDF5 (:func:`~caffe_compat.net_weights.copy_weights_files`).  ``quiet``: layer names
        that do not match are not reported (a TEST net lacks the train-only layers; Caffe only logs them)."""
        from caffe_compat.net import copy_weights_files

        if not quiet:
            copy_weights_files(net, paths, strict=strict)
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", WeightsMismatchWarning)
            copy_weights_files(net, paths)

    @staticmethod
    def _weight_list(weights) -> list[str]:
        """The caffemodel names in ``weights`` (a string, or a list of them: the solver's ``weights`` field),
        as Caffe's ``LoadNetWeights`` reads each entry: split at ``,``, each name trimmed of surrounding
        blanks (``boost::trim``).  An empty name (``"a.caffemodel,"``) is refused: Caffe fails to read it."""
        if weights is None or (isinstance(weights, str) and not weights):
            return []
        entries = [weights] if isinstance(weights, (str, os.PathLike)) else list(weights)
        names = []
        for entry in entries:
            for name in os.fspath(entry).split(","):
                if not name.strip():
                    raise FormatError(f"weights {os.fspath(entry)!r}: an empty caffemodel name (Caffe's "
                                      f"LoadNetWeights splits the list at ',' and cannot read '')")
                names.append(name.strip())
        return names

    def _read_net_file(self, path: str, field: str = "net") -> caffe_pb2.NetParameter:
        resolved = self._resolve(path)
        if not os.path.exists(resolved):
            folders = list(dict.fromkeys(str(Path(d).resolve()) for d in (os.getcwd(), self.base_dir)))
            where = self.solver_path if self.solver_path is not None else "solver (SolverParameter message)"
            raise FormatError(f"{where}: the net file of its '{field}' field, {path!r}, was not found (looked in "
                              + " and ".join(folders) + ")")
        where = self.solver_path if self.solver_path is not None else "solver"
        check_regular_file(resolved, f"{where} field '{field}'")
        return read_net(resolved)

    def _train_net(self, seed: int) -> CaffeNet:
        p = self.param
        given = [f for f in ("train_net_param", "train_net", "net_param", "net")
                 if (p.HasField(f) if f.endswith("param") else bool(getattr(p, f)))]
        if len(given) != 1:
            raise FormatError("solver: give exactly one of train_net_param, train_net, net_param or net "
                              f"(found {given or 'none'})")
        source = given[0]
        net_param = (getattr(p, source) if source.endswith("param")
                     else self._read_net_file(getattr(p, source), source))
        net_param = self._with_state(net_param, _net_state(caffe_pb2.TRAIN, net_param,
                                                           p.train_state if p.HasField("train_state") else None))
        if source.endswith("param"):
            log.info("Creating training net specified in %s.", source)
        else:
            log.info("Creating training net from %s file: %s", source, getattr(p, source))
        return self._build_net(net_param, _PHASE_NAMES[net_param.state.phase], seed,
                               None if source.endswith("param") else getattr(p, source))

    def _build_net(self, net_param, phase: str, seed: int, file: str | None) -> CaffeNet:
        """``net_class(net_param)``; a setup error (which names the layer) names the net's file too, or the
        solver file that holds the net (as load_net)."""
        try:
            return self.net_class(net_param, phase=phase, seed=seed)
        except CaffeCompatError as exc:
            raise naming_file(exc, self._resolve(file) if file else self.solver_path) from exc

    @staticmethod
    def _with_state(net_param, state: caffe_pb2.NetState) -> caffe_pb2.NetParameter:
        """A copy of ``net_param`` whose ``state`` is ``state`` (Caffe's ``mutable_state()->CopyFrom``)."""
        copy = caffe_pb2.NetParameter()
        copy.CopyFrom(net_param)
        copy.state.CopyFrom(state)
        return copy

    def _test_nets(self, seed: int) -> list[CaffeNet]:
        p = self.param
        sources = [n for n in p.test_net_param] + [self._read_net_file(f, "test_net") for f in p.test_net]
        files = [None] * len(p.test_net_param) + list(p.test_net)
        generic = None
        if p.HasField("net_param"):
            generic = p.net_param
        elif p.net:
            generic = self._read_net_file(p.net, "net")
        remaining = len(p.test_iter) - len(sources)
        if generic is not None and remaining > 0:
            sources += [generic] * remaining
            files += [p.net or None] * remaining
        if len(p.test_state) not in (0, len(sources)):
            raise FormatError(f"test_state must be unspecified or given once per test net ({len(sources)}), got "
                              f"{len(p.test_state)}")
        if sources and p.test_interval <= 0:  # InitTestNets: CHECK_GT(test_interval, 0) once there is a test net
            where = self.solver_path if self.solver_path is not None else "solver"
            raise FormatError(f"{where}: test_interval must be > 0 with {len(sources)} test net(s) (Caffe's "
                              f"InitTestNets: CHECK_GT(test_interval, 0)), got {p.test_interval}")
        given = len(p.test_net_param) + len(p.test_net)
        generic_name = "net_param" if p.HasField("net_param") else f"net file: {p.net}"
        names = (["test_net_param"] * len(p.test_net_param) + [f"test_net file: {f}" for f in p.test_net]
                 + [generic_name] * (len(sources) - given))
        nets = []
        for i, net_param in enumerate(sources):
            state = _net_state(caffe_pb2.TEST, net_param, p.test_state[i] if p.test_state else None)
            log.info("Creating test net (#%d) specified by %s", i, names[i])
            nets.append(self._build_net(self._with_state(net_param, state), _PHASE_NAMES[state.phase], seed,
                                        files[i]))
        log.info("Solver scaffolding done.")
        return nets
