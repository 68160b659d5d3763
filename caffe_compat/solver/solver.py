"""Solver: Caffe's ``Solver::Step`` / ``Solve`` / ``Snapshot`` / ``Restore`` over a :class:`CaffeNet`.

One iteration (``Solver::Step``): clear the diffs → (TEST nets every ``test_interval``) →
``iter_size`` × forward+backward, diffs accumulating → loss = mean of the sub-batch losses (float32) →
``ApplyUpdate`` with the lr policy evaluated at ``iter`` *before* the increment (clip, normalise,
regularise, update: :mod:`caffe_compat.solver.updates`) → ``iter += 1`` → snapshot every ``snapshot``
iterations.  The displayed loss is smoothed over the last ``average_loss`` iterations of the current
``step()`` call (Caffe resets the window at every ``Step``).

Nets: exactly one of ``train_net_param``/``train_net``/``net_param``/``net`` gives the TRAIN net;
``test_net_param``/``test_net`` and, for ``net``/``net_param``, one generic TEST net per remaining
``test_iter`` entry give the TEST nets (states from ``train_state``/``test_state``).  Relative net and
weight paths are resolved like Caffe (against the working directory) and, when nothing is there,
against the solver file's folder; ``snapshot_prefix`` is relative to the working directory, as in Caffe
(override it with the ``snapshot_prefix`` argument); unset, it is the solver path without extension, and
a prefix naming a directory gets the solver file's stem appended (``UpgradeSnapshotPrefixProperty``).

Inputs: the solver owns the values it feeds to Input tops, as Caffe's input blobs hold them between
steps.  ``solver.inputs`` maps each Input-layer top of the TRAIN net to a float32 numpy array
(zero-filled, like a fresh Caffe blob), ``solver.test_inputs[i]`` those of TEST net ``i``.  Old scripts
write the next batch into them or call ``solver.feed(data=..., label=...)``, then ``solver.step(1)``;
every forward of the step reads those values.  ``solver.data_source`` (an iterator of input dicts, e.g. a
DataLoader) takes precedence: each sub-batch pulls the next dict.  Layers that produce their own data
(MemoryData, Data, ...) need no feed.

The nets (``solver.net``, ``solver.test_nets``) are plain CaffeNets (the class ``net_class``); the solver
keeps no blob past its iteration (its ``observers`` are told about each forward of the TRAIN net).
pycaffe's solvers (``caffe_compat.pycaffe.SGDSolver`` etc., whose nets also answer ``blobs``,
``copy_from``, ...) are built on this class: :mod:`caffe_compat.pycaffe.solver`.

Added to Caffe: a NaN/inf loss, or a NaN/inf diff of a learnable blob (a NaN input that MAX pooling drops, as
Caffe's does, still reaches conv1's weight diff), raises :class:`~caffe_compat.errors.TrainingDiverged` naming
the iteration, before that iteration's update (weights and snapshots on disk stay the last good ones; with a
GradScaler, whose skipped steps handle inf diffs, only the loss is checked);
``snapshot_format: HDF5`` raises a FormatError (only BINARYPROTO is written).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from pathlib import Path

import numpy as np
import torch

from caffe_compat.errors import CaffeCompatError, FormatError, TrainingDiverged
from caffe_compat.net import CaffeNet, trained_layer_pairs
from caffe_compat.net_debug import listening
from caffe_compat.proto import caffe_pb2
from caffe_compat.solver.lr_policy import learning_rate
from caffe_compat.solver.updates import make_optimizer
from caffe_compat.io.glog import g6 as _g6  # a number as glog/iostream prints it
from caffe_compat.solver.observers import SolverObserver, notify
from caffe_compat.solver.setup import SolverSetup
from caffe_compat.solver.snapshots import SolverSnapshots

__all__ = ["Solver", "learnable_blobs", "zero_inputs"]

log = logging.getLogger("caffe_compat.solver")


def learnable_blobs(net: CaffeNet) -> list[torch.Tensor]:
    """Caffe's ``learnable_params``: every layer blob in net order, a shared blob once (its owner)."""
    seen, out = set(), []
    for blobs in net.params.values():
        for blob in blobs:
            if id(blob) not in seen:
                seen.add(id(blob))
                out.append(blob)
    return out


def learnable_blob_names(net: CaffeNet) -> dict[int, str]:
    """``id`` of each blob :func:`learnable_blobs` lists -> ``layer 'name' blob i`` (a shared blob: its owner's)."""
    names: dict[int, str] = {}
    for layer, blobs in net.params.items():
        for i, blob in enumerate(blobs):
            names.setdefault(id(blob), f"layer '{layer}' blob {i}")
    return names


def zero_inputs(net: CaffeNet) -> dict[str, np.ndarray]:
    """Each Input top of ``net`` -> a zero-filled float32 array of its shape (a fresh Caffe input blob)."""
    return {name: np.zeros(net.blob_shapes[name], dtype=np.float32) for name in net.input_names}


class Solver(SolverSetup, SolverSnapshots):
    """A Caffe solver (see the module docstring).

    ``solver``: solver prototxt path, prototxt text or SolverParameter.  ``weights``: caffemodel path(s)
    (a list, or Caffe's comma-separated string) copied into the TRAIN net after the solver's own
    ``weights``, then into each TEST net (Caffe's ``InitTrainNet`` and ``InitTestNets``).  ``device``: default
    ``cuda:<device_id>`` when the solver sets ``solver_mode: GPU`` and CUDA is available, else CPU (``caffe
    train``: an unset ``solver_mode``, though its proto default is GPU, is CPU).  ``solver_type`` overrides
    ``type`` (pycaffe's ``SGDSolver(...)`` etc.).
    Caffemodel layer names that do not match the TRAIN net give one
    :class:`~caffe_compat.errors.WeightsMismatchWarning` for all the weights; ``strict_weights=True``
    makes that a FormatError (see :meth:`~caffe_compat.net.CaffeNet.load_caffemodels`).
    ``solver_weights=False`` leaves the solver's own ``weights`` field out (``caffe train`` clears it when
    given ``-weights`` or ``-snapshot``).
    """

    #: the class of the TRAIN and TEST nets built (called as ``net_class(net_param, phase=..., seed=...)``)
    net_class: type[CaffeNet] = CaffeNet

    def __init__(self, solver, weights=None, device=None, solver_type: str | None = None,
                 snapshot_prefix: str | None = None, strict_weights: bool = False,
                 train_state: caffe_pb2.NetState | None = None, solver_weights: bool = True):
        self.param = self._read_param(solver)
        if train_state is not None:  # caffe train's -level / -stage: set_level, add_stage on the solver's own
            self.param.train_state.MergeFrom(train_state)
        if solver_type is not None:
            self.param.type = solver_type
        self.base_dir = Path(solver).resolve().parent if self._is_path(solver) else Path.cwd()
        self.solver_path = str(solver) if self._is_path(solver) else None
        if snapshot_prefix is not None:
            self.param.snapshot_prefix = str(snapshot_prefix)
        elif self._is_path(solver):
            self._upgrade_snapshot_prefix(str(solver))
        if int(self.param.average_loss) < 1:  # Solver::Init's CHECK_GE(average_loss, 1)
            raise FormatError(f"average_loss must be >= 1 (Caffe: 'average_loss should be non-negative'), got "
                              f"{self.param.average_loss}")
        self.iter = 0
        self.check_snapshot_write_permissions()  # Caffe's Solver::Init, before the nets are built
        if int(self.param.iter_size) < 1:
            raise FormatError(f"iter_size must be >= 1, got {self.param.iter_size}")
        if device is None:  # caffe train: GPU only for a solver_mode GPU the file sets (unset, its default GPU: CPU)
            gpu = (self.param.HasField("solver_mode") and self.param.solver_mode == caffe_pb2.SolverParameter.GPU
                   and torch.cuda.is_available())
            device = f"cuda:{self.param.device_id}" if gpu else "cpu"
        self.device = torch.device(device)
        seed = int(self.param.random_seed)
        if seed >= 0:
            torch.manual_seed(seed)
        self.net = self._train_net(max(seed, 0))
        paths = [self._resolve(path) for path in
                 (self._weight_list(list(self.param.weights)) if solver_weights else []) + self._weight_list(weights)]
        if paths:
            self._copy_weights(self.net, paths, strict=strict_weights)
        self.net.to(self.device)
        self.test_nets = [n.to(self.device) for n in self._test_nets(max(seed, 0))]
        for test_net in self.test_nets:  # InitTestNets loads the weights into every TEST net too
            self._copy_weights(test_net, paths, quiet=True)
        if len(self.param.test_iter) != len(self.test_nets):
            raise FormatError(f"test_iter must be given once per test net: {len(self.test_nets)} test net(s), "
                              f"{len(self.param.test_iter)} test_iter value(s)")
        self.inputs: dict = zero_inputs(self.net)  # Input top -> the array the TRAIN forwards read
        self.test_inputs: list[dict] = [zero_inputs(net) for net in self.test_nets]  # one per TEST net
        self.optimizer = make_optimizer(self.param, learnable_blobs(self.net))
        self._blob_names = learnable_blob_names(self.net)  # id -> layer 'name' blob i, for messages
        self.iter = 0
        self.current_step = 0
        self.smoothed_loss = 0.0
        self._losses: list[float] = []
        self.data_source = None
        self.test_data_sources: list = [None] * len(self.test_nets)
        self.autocast_dtype: torch.dtype | None = None
        self.grad_scaler = None
        # objects told of each iteration's events, in list order (see caffe_compat.solver.observers)
        self.observers: list = []
        # (losses, smoothed_loss, window_start): the next step() continues this average_loss window instead
        # of starting a new one (train(resume=...) sets it from the .trainstate); used once
        self.resumed_loss_window: tuple[list[float], float, int] | None = None
        self._window_start = 0
        self.forward_fn = None  # e.g. torch.compile(self.net); default: self.net
        self.step_graphs = None  # a StepGraphs: the iterations as CUDA graphs (caffe_compat.solver.step_graphs)
        self.memory_format = torch.contiguous_format  # 4-D inputs are converted to it (channels_last)
        self.last_loss = float("nan")
        self.outputs: dict[str, torch.Tensor] = {}
        self.last_lr = float("nan")
        self.test_scores: list[dict[str, np.ndarray]] = []
        # Caffe's SetActionFunction: called after each iteration's update, returns "snapshot", "stop" or None
        # (caffe train's SIGHUP/SIGINT effects); a "stop" ends step() and sets requested_early_exit
        self.action_request = None
        self.requested_early_exit = False

    # ----------------------------------------------------------------------------- feeding

    def feed(self, **blobs) -> None:
        """Set the input values every following forward reads (until fed again), by blob name."""
        allowed = set(self.net.feedable_names)
        unknown = [n for n in blobs if n not in allowed]
        if unknown:
            raise FormatError(f"solver: cannot feed {unknown}; the train net's feedable blobs are "
                              f"{self.net.feedable_names}")
        self.inputs.update(blobs)

    def _prepare(self, inputs: dict) -> dict:
        out = {}
        for name, value in inputs.items():
            if not torch.is_tensor(value):
                value = torch.tensor(np.asarray(value, dtype=np.float32))
            value = value.to(self.device, non_blocking=True)
            if value.dim() == 4 and self.memory_format != torch.contiguous_format:
                value = value.contiguous(memory_format=self.memory_format)
            out[name] = value
        return out

    def _next_inputs(self) -> dict:
        if self.data_source is not None:
            try:
                batch = next(self.data_source)
            except StopIteration:
                raise CaffeCompatError(f"solver: the data source ran out at iteration {self.iter}") from None
            return self._prepare(batch)
        return self._prepare(self.inputs)

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    # ----------------------------------------------------------------------------- observers

    def add_callback(self, on_start, on_gradients_ready) -> SolverObserver:
        """pycaffe's ``solver.add_callback(on_start, on_gradients_ready)``: two functions without arguments,
        called at the start of every iteration and before every update (Caffe's ``Solver::Callback``);
        appended to ``observers`` (see :mod:`caffe_compat.solver.observers`), and returned."""
        observer = SolverObserver(on_start=lambda solver: on_start(),
                                  on_gradients_ready=lambda solver: on_gradients_ready())
        self.observers.append(observer)
        return observer

    # ----------------------------------------------------------------------------- one iteration

    def forward_backward(self) -> float:
        """Caffe's ``Net::ForwardBackward`` on the next inputs: the objective's value; diffs accumulate."""
        if self.step_graphs is not None:
            value = self.step_graphs.forward_backward()
            if value is not None:
                return value
        return self._forward_backward_on(self._next_inputs())

    def _forward_backward_on(self, inputs: dict) -> float:
        """:meth:`forward_backward` eagerly on ``inputs`` (prepared: :meth:`_next_inputs`)."""
        with self._autocast():
            notify(self, "before_forward", self.net)
            blobs = self._train_forward(inputs)
            notify(self, "after_forward", self.net, blobs)
            objective = self.net.objective(blobs)
        if objective.requires_grad:
            self._train_backward(objective, blobs)
        debug = getattr(blobs, "debug", None)
        if debug is not None:  # Net::Backward's debug lines (net_debug), the diffs unscaled as the update sees them
            debug.log_backward(whole=True, diff_scale=1.0 if self.grad_scaler is None else
                               1.0 / float(self.grad_scaler.get_scale()))
        self.outputs = {name: blobs[name].detach() for name in self.net.output_names}
        return float(objective.detach())

    def _train_forward(self, inputs: dict):
        """The TRAIN net's forward of one iteration (``forward_fn`` when set): its blobs."""
        # `is not None`: a torch.compile'd module must not be truth-tested (bool() on it raises TypeError)
        forward = self.forward_fn if self.forward_fn is not None else self.net
        if forward is not self.net and self.net.debug_info and listening():
            forward = self.net  # an iteration that logs Caffe's debug lines runs eagerly (net_debug)
        return forward(**inputs)

    def _train_backward(self, objective: torch.Tensor, blobs) -> None:
        """The TRAIN net's backward of one iteration: the objective's gradient accumulated into ``.grad``."""
        scaled = self.grad_scaler.scale(objective) if self.grad_scaler is not None else objective
        scaled.backward()

    def _nonfinite_diff(self) -> str | None:
        """``layer 'name' blob i`` of the first learnable blob whose diff holds NaN or ±inf, else None: one
        max-|diff| per blob and a single read on the host."""
        blobs = [p for group in self.optimizer.param_groups for p in group["params"]
                 if p.grad is not None and p.grad.numel()]
        if not blobs:
            return None
        peaks = torch.stack([torch.linalg.vector_norm(p.grad, ord=math.inf).float() for p in blobs])
        if bool(torch.isfinite(peaks).all()):
            return None
        bad = next(p for p, peak in zip(blobs, peaks.tolist()) if not math.isfinite(peak))
        return self._blob_names.get(id(bad), "a learnable blob")

    def _update_smoothed_loss(self, loss: float, start_iter: int) -> None:
        """Caffe's ``UpdateSmoothedLoss``, every operation in float (``Dtype smoothed_loss_``): while fewer
        than ``average_loss`` losses are held ``(s·(n-1) + loss) / n``, then ``s += (loss - oldest) / average``."""
        average = max(int(self.param.average_loss), 1)
        f32, smoothed, loss = np.float32, np.float32(self.smoothed_loss), np.float32(loss)
        if len(self._losses) < average:
            self._losses.append(float(loss))
            size = len(self._losses)
            self.smoothed_loss = float(f32(f32(smoothed * f32(size - 1)) + loss) / f32(size))
        else:
            idx = (self.iter - start_iter) % average
            self.smoothed_loss = float(smoothed + f32(f32(loss - f32(self._losses[idx])) / f32(average)))
            self._losses[idx] = float(loss)

    def apply_update(self) -> float:
        """Caffe's ``ApplyUpdate``: the policy's rate at ``iter``, then clip/normalise/regularise/update."""
        rate, self.current_step = learning_rate(self.param, self.iter, self.current_step)
        self.last_lr = rate
        if self._displaying():
            log.info("Iteration %d, lr = %s", self.iter, _g6(rate))
        for group in self.optimizer.param_groups:
            group["lr"] = rate
        self.optimizer.iter = self.iter
        if self.grad_scaler is not None:
            self.grad_scaler.step(self.optimizer)
            self.grad_scaler.update()
        elif self.step_graphs is None or not self.step_graphs.update():
            self.optimizer.step()
        if self.optimizer.last_clip is not None:
            norm, scale = self.optimizer.last_clip
            log.info("Gradient clipping: scaling down gradients (L2 norm %s > %s) by scale factor %s", _g6(norm),
                     _g6(self.param.clip_gradients), _g6(scale))
        return rate

    def _displaying(self) -> bool:
        return bool(self.param.display) and self.iter % self.param.display == 0

    def step(self, iters: int = 1) -> float:
        """Run ``iters`` iterations (Caffe's ``Solver::Step``); returns the last smoothed loss.  After each
        update, ``action_request()`` (when set) may ask for a snapshot or to stop (``requested_early_exit``)."""
        start_iter, stop_iter = self.iter, self.iter + int(iters)
        if self.resumed_loss_window is not None:
            losses, smoothed, start_iter = self.resumed_loss_window
            self._losses, self.smoothed_loss, self.resumed_loss_window = list(losses), float(smoothed), None
        else:
            self._losses, self.smoothed_loss = [], 0.0
        self._window_start = start_iter
        self._display_clock, self._iterations_last = time.perf_counter(), self.iter
        iter_size = int(self.param.iter_size)
        while self.iter < stop_iter:
            if self.step_graphs is None or not self.step_graphs.recorded:  # (a replay writes every diff anew)
                self.optimizer.zero_grad(set_to_none=True)
            if (self.param.test_interval and self.iter % self.param.test_interval == 0
                    and (self.iter > 0 or self.param.test_initialization)):
                self.test_all()
                if self.requested_early_exit:  # a stop asked for while testing: out before this iteration
                    break
            notify(self, "on_start")
            # Solver::Step: net_->set_debug_info(display && param_.debug_info()), for this iteration's passes
            self.net.debug_info = self._displaying() and bool(self.param.debug_info)
            loss = np.float32(0.0)
            for _ in range(iter_size):
                loss = np.float32(loss + np.float32(self.forward_backward()))
            loss = float(np.float32(loss / np.float32(iter_size)))
            self.last_loss = loss
            if not math.isfinite(loss):
                raise TrainingDiverged(f"the loss is {loss} at iteration {self.iter}: training diverged; this "
                                       f"iteration's update was not applied (the weights are those after "
                                       f"{self.iter} updates, snapshots on disk are untouched)")
            bad = None if self.grad_scaler is not None else self._nonfinite_diff()
            if bad is not None:
                raise TrainingDiverged(f"the diff of {bad} holds NaN or inf at iteration {self.iter} (loss {loss}): "
                                       f"training diverged; this iteration's update was not applied (the weights "
                                       f"are those after {self.iter} updates, snapshots on disk are untouched)")
            self._update_smoothed_loss(loss, start_iter)
            if self._displaying():
                self._log_outputs()
            notify(self, "on_gradients_ready")
            self.apply_update()
            self.iter += 1
            request = self.action_request() if self.action_request is not None else None
            if (self.param.snapshot and self.iter % self.param.snapshot == 0) or request == "snapshot":
                self.snapshot()
            notify(self, "on_iteration")
            if request == "stop":  # Solver::Step: after the iteration (and its snapshot), out of the loop
                self.requested_early_exit = True
                break
        return self.smoothed_loss

    def loss_window(self) -> tuple[list[float], float, int]:
        """The current average_loss window: (losses, smoothed_loss, iteration the window started at)."""
        return list(self._losses), float(self.smoothed_loss), int(self._window_start)

    def _log_display_loss(self) -> None:
        """Caffe's display line ``Iteration N (x iter/s, ys/D iters), loss = z`` (``Solver::Step``): speed and
        seconds since the previous display (or the start of ``step()``)."""
        now = time.perf_counter()
        start, last = getattr(self, "_display_clock", now), getattr(self, "_iterations_last", self.iter)
        lapse = now - start
        per_s = (self.iter - last) / (lapse if lapse else 1.0)
        log.info("Iteration %d (%s iter/s, %ss/%d iters), loss = %s", self.iter, _g6(per_s), _g6(lapse),
                 int(self.param.display), _g6(self.smoothed_loss))
        self._display_clock, self._iterations_last = now, self.iter

    def log_solving(self) -> None:
        """Caffe's ``Solving <net>`` and ``Learning Rate Policy: <policy>`` lines at the start of ``Solve``
        (``parse_log`` counts its seconds from the first)."""
        log.info("Solving %s", self.net.name)
        log.info("Learning Rate Policy: %s", self.param.lr_policy)

    def _log_outputs(self) -> None:
        self._log_display_loss()
        index = 0
        for name, value in self.outputs.items():
            weight = self.net.loss_weights.get(name, 0.0)
            for v in value.reshape(-1).float().cpu().tolist():
                extra = f" (* {_g6(weight)} = {_g6(np.float32(weight) * np.float32(v))} loss)" if weight else ""
                log.info("    Train net output #%d: %s = %s%s", index, name, _g6(v), extra)
                index += 1

    def solve(self, resume_file=None) -> None:
        """Caffe's ``Solver::Solve``: optionally restore, train to ``max_iter``, then :meth:`finish_solve`."""
        if self.param.snapshot_format == caffe_pb2.SolverParameter.HDF5 and (
                self.param.snapshot or self.param.snapshot_after_train):
            raise FormatError("snapshot_format: HDF5 is not supported; use BINARYPROTO")
        self.log_solving()
        if resume_file is not None:
            log.info("Restoring previous solver status from %s", resume_file)
            self.restore(resume_file)
        start_iter = self.iter
        self.requested_early_exit = False
        self.step(int(self.param.max_iter) - self.iter)
        self.finish_solve(start_iter)

    def finish_solve(self, start_iter: int) -> None:
        """What ``Solver::Solve`` does after its ``Step`` (begun at ``start_iter``): a snapshot after training
        (unless the last iteration already wrote one); after a stop request (``action_request``) only
        "Optimization stopped early."; else, when the last iteration is a display one, one more TRAIN forward
        whose loss enters the smoothed loss, logged as ``Iteration N, loss = z`` (no speed, unlike ``Step``'s
        lines), the final test at a test interval, and "Optimization Done."."""
        if self.param.snapshot_after_train and (not self.param.snapshot or self.iter % self.param.snapshot != 0):
            self.snapshot()
        if self.requested_early_exit:
            log.info("Optimization stopped early.")
            return
        if self._displaying():
            with torch.no_grad(), self._autocast():
                blobs = self.net(**self._next_inputs())
                loss = float(self.net.objective(blobs))
            self._update_smoothed_loss(loss, start_iter)
            log.info("Iteration %d, loss = %s", self.iter, _g6(self.smoothed_loss))
        if self.param.test_interval and self.iter % self.param.test_interval == 0:
            self.test_all()
        log.info("Optimization Done.")

    # ----------------------------------------------------------------------------- testing

    @torch.no_grad()
    def _share_weights(self, test_net: CaffeNet) -> None:
        """Caffe's ``ShareTrainedLayersWith``: each TRAIN net layer's blobs go to the first TEST net layer of its
        name (copied here; :func:`~caffe_compat.net_weights.trained_layer_pairs` checks counts and shapes)."""
        for _, source, blobs in trained_layer_pairs(self.net, test_net, f"test net '{test_net.name}'"):
            for target, value in zip(blobs, source):
                target.copy_(value)

    @torch.no_grad()
    def test(self, index: int = 0) -> dict[str, np.ndarray]:
        """Caffe's ``Solver::Test``: ``test_iter[index]`` forwards of TEST net ``index``; the mean of every
        output blob over the iterations (element-wise, summed and divided in float as Caffe does), keyed by
        blob name.  With ``test_compute_loss``, Caffe
        also sums each forward's objective (Σ loss_weight · loss, in float) and logs the mean as
        ``Test loss: <mean>`` before the outputs.  Before each forward ``action_request`` is asked until it
        has nothing more (a "snapshot" snapshots at once, a "stop" sets ``requested_early_exit``); a stop
        ends the test there with ``Test interrupted.`` and no scores (an empty dict; ``test_scores`` keeps
        the last complete ones)."""
        net = self.test_nets[index]
        log.info("Iteration %d, Testing net (#%d)", self.iter, index)
        self._share_weights(net)
        sums: dict[str, np.ndarray] = {}
        iters = int(self.param.test_iter[index])
        source = self.test_data_sources[index]
        loss = np.float32(0.0)
        for _ in range(iters):
            request = self.action_request() if self.action_request is not None else None
            while request is not None:
                if request == "snapshot":
                    self.snapshot()
                elif request == "stop":
                    self.requested_early_exit = True
                request = self.action_request()
            if self.requested_early_exit:
                log.info("Test interrupted.")
                return {}
            inputs = self._prepare(next(source) if source is not None else self.test_inputs[index])
            with self._autocast():
                blobs = net(**inputs)
            if self.param.test_compute_loss:
                loss = np.float32(loss + np.float32(float(net.objective(blobs))))
            for name in net.output_names:  # Caffe's float test_score: the first iteration's values, then +=
                value = blobs[name].float().cpu().numpy().astype(np.float32)
                sums[name] = value if name not in sums else (sums[name] + value).astype(np.float32)
        scores = {name: (total / np.float32(iters)).astype(np.float32) for name, total in sums.items()}
        if self.param.test_compute_loss:
            with np.errstate(invalid="ignore"):
                log.info("Test loss: %s", _g6(float(loss / np.float32(iters))))
        k = 0
        for name, value in scores.items():
            weight = net.loss_weights.get(name, 0.0)
            for v in np.ravel(value).tolist():
                extra = f" (* {_g6(weight)} = {_g6(np.float32(weight) * np.float32(v))} loss)" if weight else ""
                log.info("    Test net output #%d: %s = %s%s", k, name, _g6(v), extra)
                k += 1
        return scores

    def test_all(self) -> list[dict[str, np.ndarray]]:
        """Caffe's ``TestAll``: :meth:`test` of each TEST net in turn while no stop is requested; returns
        (and keeps as ``test_scores``) their scores, unless a stop cut the tests short (then ``test_scores``
        stays as it was and the completed ones are returned)."""
        scores = []
        for i in range(len(self.test_nets)):
            if self.requested_early_exit:
                return scores
            result = self.test(i)
            if self.requested_early_exit:
                return scores
            scores.append(result)
        self.test_scores = scores
        return scores
