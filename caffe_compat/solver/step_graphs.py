"""A training iteration as two recorded CUDA graphs, replayed at every iteration.

The iteration of :class:`~caffe_compat.solver.Solver` calls thousands of small operators from Python (the
authors' GoogLeNet + FAPPY at batch 8, profiled on the CPU: 4,344 leaf ATen calls in forward and backward,
638 in Caffe's update of its 116 blobs; on CUDA each computing one is a kernel launch); on a fast GPU
launching them costs more than running them.  Recorded once as CUDA graphs they launch at once:

* the **forward-backward graph**: the forward of the TRAIN net (its data layers run eagerly ahead of it
  and their tops, with the fed inputs, are copied into the graph's input tensors), the objective and its
  backward, which writes every diff (each replay writes them anew: a graph is recorded with the diffs
  unset, so the backward assigns them);
* the **update graph**: Caffe's ``ApplyUpdate`` (regularisation, the rule, ``w -= diff``) at the rates of
  the iteration it was recorded at; recorded again when the lr policy changes a rate (``step`` /
  ``multistep`` policies: once per change).

Between the two the solver reads the loss and checks the diffs on the host, as in eager mode (a diverged
iteration is not applied), and its observers see the iteration as before.  The first
:data:`WARMUP_ITERATIONS` iterations run eagerly on a side stream (cuDNN's algorithm search, cuBLAS's
handles and the allocator's first blocks happen outside a recording, as ``torch.cuda.graph`` requires);
recording does not run the iteration, the replay right after it does.  The numbers are the eager ones
(the same kernels); the layers that branch on values take their static forms while recording
(:mod:`caffe_compat.losses.static_form`: a training step never reads a value on the host, which the tests
prove on the meta device for every paper and fixture net).

Not recorded (:func:`refusal` says why; the iteration then runs eagerly, as without graphs): a device
other than CUDA, ``iter_size`` > 1 (diffs accumulated over several forwards), ``clip_gradients`` (reads
the diffs' norm on the host), fp16's GradScaler (reads the diffs for infinities), Adam (its bias
correction changes at every iteration), a data-parallel run (the gathers read the ranks' shares at run
time), user Python layers (the user's NumPy code), HDF5Output (it writes a file), a layer whose tops' sizes
follow the values (Filter), and observers acting around each forward
(``before_forward`` / ``after_forward``: pycaffe's net view).  A batch of another shape than the recorded
one runs eagerly too.  When recording fails (a computation that reads the host after all) the solver warns
once and goes on eagerly.

``backend`` exists for the tests: :class:`CudaGraphs` records and replays CUDA graphs; a stand-in with the
same methods (``warm_up``, ``record``, ``pool``, ``replay``) runs the recorded functions again at each
replay (the CPU tests of the orchestration).
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from caffe_compat.errors import CaffeCompatWarning
from caffe_compat.net import breaking_step, step_whose_port_says, with_data_tops
from caffe_compat.solver.updates import Adam

__all__ = ["CudaGraphs", "StepGraphs", "WARMUP_ITERATIONS", "refusal"]

#: Eager iterations (on a side stream) before the forward-backward graph is recorded.
WARMUP_ITERATIONS = 3


class CudaGraphs:
    """The CUDA backend: ``record(fn, pool)`` records ``fn()`` (whose result is a dict of tensors) as a
    ``torch.cuda.CUDAGraph`` in memory pool ``pool`` (None: a new one) and returns it; ``replay(graph)``
    launches it, its outputs (``graph.outputs``) then hold the new values; ``pool(graph)`` is its memory
    pool (the update graph shares the forward-backward graph's); ``warm_up()`` is the side stream's
    context for the eager warm-up iterations."""

    def __init__(self, device: torch.device):
        self.device = device
        self.side = torch.cuda.Stream(device)

    @contextlib.contextmanager
    def warm_up(self):
        current = torch.cuda.current_stream(self.device)
        self.side.wait_stream(current)
        with torch.cuda.stream(self.side):
            yield
        current.wait_stream(self.side)

    def record(self, fn, pool=None):
        graph = torch.cuda.CUDAGraph()
        # thread_local: the data layers' prefetch threads may copy to the device meanwhile
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            graph.outputs = fn()
        return graph

    @staticmethod
    def pool(graph):
        return graph.pool()

    @staticmethod
    def replay(graph) -> dict:
        graph.replay()
        return graph.outputs


def refusal(solver, need_cuda: bool = True) -> str | None:
    """Why ``solver``'s iterations cannot be recorded as CUDA graphs (module docstring), or None
    (``need_cuda=False``: the device aside, for a stand-in backend)."""
    param, optimizer = solver.param, solver.optimizer
    if need_cuda and solver.device.type != "cuda":
        return f"the device is {solver.device}, CUDA graphs need a CUDA device"
    if int(param.iter_size) != 1:
        return f"iter_size {param.iter_size} accumulates the diffs of several forwards"
    if optimizer.clip_gradients >= 0:
        return "clip_gradients reads the diffs' norm on the host"
    if solver.grad_scaler is not None:
        return "fp16's GradScaler reads the diffs on the host"
    if isinstance(optimizer, Adam):
        return "Adam's bias correction changes at every iteration"
    step = breaking_step(solver.net)
    if step is not None:
        return f"layer '{step.name}' ({step.type}) runs code a graph cannot hold (a user Python layer, a file write or a gather)"
    step = step_whose_port_says(solver.net, "sizes_follow_values")
    if step is not None:
        return f"layer '{step.name}' ({step.type}) makes tops whose sizes follow the values, a graph replays fixed sizes"
    watching = [o for o in solver.observers if hasattr(o, "before_forward") or hasattr(o, "after_forward")]
    if watching:
        return f"observer {watching[0]!r} acts around each forward"
    return None


class StepGraphs:
    """The recorded graphs of a solver's iterations (module docstring); the solver calls
    :meth:`forward_backward` and :meth:`update` in place of its eager ones while :attr:`active`."""

    def __init__(self, solver, backend=None):
        self.solver = solver
        self.reason = refusal(solver, need_cuda=backend is None)
        if backend is None and self.reason is None:
            backend = CudaGraphs(solver.device)
        self.backend = backend
        self.eager_iterations = 0
        self._fb = None          # the forward-backward graph
        self._inputs = None      # its input tensors, by blob name
        self._update = None      # (rates it was recorded at, graph)
        self._warned = False

    @property
    def active(self) -> bool:
        return self.reason is None

    @property
    def recorded(self) -> bool:
        """The forward-backward graph exists: the diffs are the graph's tensors, written by each replay."""
        return self._fb is not None

    def _give_up(self, why: str) -> None:
        """Warn (once) and run every following iteration eagerly; the graphs go (the diffs are no longer
        theirs: the solver clears them before each iteration again)."""
        if not self._warned:
            warnings.warn(f"CUDA graphs: {why}; the iterations run eagerly", CaffeCompatWarning, stacklevel=3)
            self._warned = True
        self.reason = why
        self._fb = self._inputs = self._update = None

    # ------------------------------------------------------------------------ forward and backward

    def _batch(self) -> dict:
        """The iteration's inputs: the fed ones, then the tops of the data layers, run here eagerly."""
        return with_data_tops(self.solver.net, self.solver._next_inputs())

    def _forward_backward_fn(self):
        solver, net, inputs = self.solver, self.solver.net, self._inputs
        forward = solver.forward_fn if solver.forward_fn is not None else net

        def forward_backward() -> dict:
            solver.optimizer.zero_grad(set_to_none=True)  # recorded unset: the backward assigns every diff
            autocast = (torch.autocast(solver.device.type, dtype=solver.autocast_dtype, cache_enabled=False)
                        if solver.autocast_dtype is not None else contextlib.nullcontext())
            with autocast:
                blobs = forward(**inputs)
                objective = net.objective(blobs)
            if objective.requires_grad:
                objective.backward()
            return {"objective": objective.detach(), **{n: blobs[n].detach() for n in net.output_names}}
        return forward_backward

    def forward_backward(self) -> float | None:
        """The iteration's forward and backward through the graph (recorded at the first iteration after
        the warm-up); the objective's value, or None when this iteration runs eagerly (the caller's path)."""
        if not self.active:
            return None
        solver = self.solver
        if self.eager_iterations < WARMUP_ITERATIONS:
            self.eager_iterations += 1
            with self.backend.warm_up():
                return self._eager(self._batch())
        batch = self._batch()
        if self._fb is None:
            self._inputs = {name: value.clone() for name, value in batch.items()}
            try:
                self._fb = self.backend.record(self._forward_backward_fn())
            except Exception as exc:  # noqa: BLE001 - any failure to record means: run eagerly
                self._give_up(f"recording the forward and backward failed ({type(exc).__name__}: {exc})")
                return self._eager(batch)
        elif any(batch[n].shape != t.shape or batch[n].dtype != t.dtype for n, t in self._inputs.items()):
            return self._eager(batch)  # another batch shape (e.g. a smaller last batch): this iteration eagerly
        with torch.no_grad():
            for name, tensor in self._inputs.items():
                tensor.copy_(batch[name])
        outputs = self.backend.replay(self._fb)
        solver.outputs = {n: outputs[n] for n in solver.net.output_names}
        return float(outputs["objective"])

    def _eager(self, batch: dict) -> float:
        """This iteration's forward and backward eagerly, on ``batch`` (its data already drawn).  Its diffs
        are new tensors, not the graph's: a recorded graph goes (recorded again at the next iteration)."""
        self.solver.optimizer.zero_grad(set_to_none=True)
        value = self.solver._forward_backward_on(batch)
        self._fb = self._inputs = self._update = None
        return value

    # ------------------------------------------------------------------------ Caffe's update

    def update(self) -> bool:
        """Caffe's update: through the update graph (recorded again when a rate changed), or eagerly on the
        side stream while no forward-backward graph exists; False when the graphs are not active."""
        if not self.active:
            return False
        optimizer = self.solver.optimizer
        iteration = optimizer.iter
        if self._fb is None:  # the warm-up (or a batch of another shape): eagerly, on the side stream
            with self.backend.warm_up():
                optimizer.step()
            return True
        rates = tuple(float(group["lr"]) for group in optimizer.param_groups)
        if self._update is None or self._update[0] != rates:
            self._update = None  # its memory goes back to the pool before the new recording
            step = optimizer.step

            def apply_update() -> dict:
                step()
                return {}
            try:
                self._update = (rates, self.backend.record(apply_update, pool=self.backend.pool(self._fb)))
            except Exception as exc:  # noqa: BLE001
                self._give_up(f"recording Caffe's update failed ({type(exc).__name__}: {exc})")
                return False
        self.backend.replay(self._update[1])
        optimizer.iter = iteration + 1  # what step() does on the host (a replay runs no Python)
        return True
