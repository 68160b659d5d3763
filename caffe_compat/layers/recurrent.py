"""Recurrent layers: Caffe's abstract RecurrentLayer machinery, RNN, LSTM and LSTMUnit.

Caffe builds each RNN/LSTM layer as a small *unrolled net* (``FillUnrolledNet``) of InnerProduct, Scale,
Eltwise, TanH and LSTMUnit layers over the ``T`` time steps of its input, and exposes that net's
learnable blobs, in the net's layer order, as its own.  The ports compute the same unrolled net in
plain tensor operations (an ONNX trace unrolls it at the fixed ``T``) and keep Caffe's blob order and
shapes, so a caffemodel's RNN/LSTM blobs load one for one:

* LSTM: ``W_xc (4H, D)``, ``b_c (4H,)``, [``W_xc_static (4H, D_s)``], ``W_hc (4H, H)``;
* RNN: ``W_xh (H, D)``, ``b_h (H,)``, [``W_xh_static (H, D_s)``], ``W_hh (H, H)``, ``W_ho (H, H)``,
  ``b_o (H,)``;

with ``H = recurrent_param.num_output``, ``D`` the count of ``x``'s axes from 2 on and ``D_s`` that of
``x_static`` from axis 1 on.  The time-step layers share their weights by name (``W_hc``, ``W_hh``,
``W_ho``/``b_o``), so each appears once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from caffe_compat.errors import FormatError, ShapeMismatchError
from caffe_compat.layers.facts import BlobCount, Shapes, count
from caffe_compat.layers.fillers import fill_blob
from caffe_compat.layers.registry import CaffeLayer, register_layer

Tensor = torch.Tensor


# ------------------------------------------------------------------------------------------ LSTM unit


def _lstm_unit_values(c_prev: Tensor, gates: Tensor, cont: Tensor):
    """Caffe's LSTMUnit forward on ``(N, H)`` / ``(N, 4H)`` / ``(N,)``: gate activations and ``c``, ``h``."""
    hidden = c_prev.shape[-1]
    i = torch.sigmoid(gates[..., :hidden])
    keep = cont.unsqueeze(-1)
    f = torch.where(keep == 0, torch.zeros_like(keep), keep * torch.sigmoid(gates[..., hidden:2 * hidden]))
    o = torch.sigmoid(gates[..., 2 * hidden:3 * hidden])
    g = torch.tanh(gates[..., 3 * hidden:])
    c = f * c_prev + i * g
    return i, f, o, g, c, o * torch.tanh(c)


class _LSTMUnitFunction(torch.autograd.Function):
    """LSTMUnit with ``LSTMUnitLayer::Backward_cpu``'s formulas (see :class:`LSTMUnit`)."""

    @staticmethod
    def forward(ctx, c_prev, gates, cont):
        i, f, o, g, c, h = _lstm_unit_values(c_prev, gates, cont)
        ctx.save_for_backward(c_prev, i, f, o, g, c)
        return c, h

    @staticmethod
    def backward(ctx, c_diff, h_diff):
        c_prev, i, f, o, g, c = ctx.saved_tensors
        tanh_c = torch.tanh(c)
        c_term = c_diff + h_diff * o * (1 - tanh_c * tanh_c)
        gates_diff = torch.cat([c_term * g * i * (1 - i),  # Caffe's f·(1 − f) with f = cont·σ(x_f)
                                c_term * c_prev * f * (1 - f),
                                h_diff * tanh_c * o * (1 - o),
                                c_term * i * (1 - g * g)], dim=-1)
        return c_term * f, gates_diff, None


def _flat_from(x: Tensor, axis: int) -> Tensor:
    """``x`` as ``shape[:axis] + (count(axis),)`` (a trailing 1 when it has no axis past ``axis``)."""
    return x.flatten(axis) if x.dim() > axis else x.unsqueeze(axis)


def lstm_unit(c_prev: Tensor, gates: Tensor, cont: Tensor) -> tuple[Tensor, Tensor]:
    """``(c, h)`` of Caffe's LSTMUnit for ``c_prev (N, H)``, ``gates (N, 4H)``, ``cont (N,)`` (no gradient to
    ``cont``); the gradient is Caffe's CPU formula, the plain forward runs without autograd and in export."""
    cont = cont.detach()
    if torch.onnx.is_in_onnx_export() or not torch.is_grad_enabled() or not (
            c_prev.requires_grad or gates.requires_grad):
        return _lstm_unit_values(c_prev, gates, cont)[4:]
    return _LSTMUnitFunction.apply(c_prev, gates, cont)


@register_layer("LSTMUnit")
class LSTMUnit(CaffeLayer):
    """Caffe's LSTMUnitLayer, one LSTM step: bottoms ``c_prev (1, N, H)``, ``X (1, N, 4H)``, ``cont (1, N)``;
    tops ``c (1, N, H)`` then ``h (1, N, H)`` (in that order).

    Gate order ``[i, f, o, g]`` along ``X``'s last axis: ``i = σ(X_i)``, ``f = cont·σ(X_f)`` (exactly 0 when
    ``cont == 0``), ``o = σ(X_o)``, ``g = tanh(X_g)``; ``c = f·c_prev + i·g``, ``h = o·tanh(c)``.  No
    parameters.  BVLC Caffe clips nothing here (its RecurrentParameter has no clipping threshold; the LRCN
    branch's ``clipping_threshold`` never reached BVLC): values pass as computed.

    Backward is ``LSTMUnitLayer::Backward_cpu``: with ``c̄ = dc + dh·o·(1 − tanh²c)``, ``dc_prev = c̄·f``,
    ``dX_i = c̄·g·i(1 − i)``, ``dX_f = c̄·c_prev·f(1 − f)``, ``dX_o = dh·tanh c·o(1 − o)``,
    ``dX_g = c̄·i·(1 − g²)``.  Quirk kept: for a non-binary ``cont`` the forget-gate term uses
    ``f(1 − f)`` of ``f = cont·σ``, not the derivative ``cont·σ(1 − σ)`` (equal for ``cont`` ∈ {0, 1}).
    ``cont`` gets no gradient (Caffe CHECK-fails on a request for it).  Setup checks (Caffe's CHECKs):
    ``c_prev`` and ``X`` have 3 axes, ``cont`` 2, all lead with ``1, N``, and ``X``'s last axis is ``4H``.
    """

    bottoms = BlobCount.exact(3)
    tops = BlobCount.exact(2)
    in_caffe_1_0 = True

    @classmethod
    def infer(cls, layer, bottoms):
        c_prev, gates, cont = (tuple(b) for b in bottoms)
        where = f"layer '{layer.name}' (LSTMUnit)"
        for name, shape, axes in (("c_prev", c_prev, 3), ("gate input", gates, 3), ("cont", cont, 2)):
            if len(shape) != axes:
                raise FormatError(f"{where}: the {name} bottom must have {axes} axes, got shape {shape}")
            if shape[0] != 1 or shape[1] != c_prev[1]:
                raise FormatError(f"{where}: the {name} bottom must lead with (1, {c_prev[1]}), got shape {shape}")
        if gates[2] != 4 * c_prev[2]:
            raise FormatError(f"{where}: the gate input's last axis must be 4 x {c_prev[2]} (i, f, o, g), got "
                              f"{gates[2]}")
        return Shapes([c_prev, c_prev])

    def __init__(self, param, bottom_shapes, phase="test"):
        super().__init__(param, bottom_shapes, phase)
        self.rule()

    def forward(self, c_prev, gates, cont):
        c, h = lstm_unit(c_prev[0], gates[0], cont[0].to(gates.dtype))
        return c.unsqueeze(0), h.unsqueeze(0)


# ------------------------------------------------------------------------------------- Recurrent base


class Recurrent(CaffeLayer):
    """Caffe's abstract RecurrentLayer (not a type of its own): ``x (T, N, ...)`` time-major, ``cont (T, N)``.

    Bottoms: ``x``, ``cont``, optional ``x_static (N, ...)``, then with ``recurrent_param.expose_hidden``
    the initial states (``h_0``; LSTM ``h_0, c_0``), each ``(1, N, H)``.  Tops: the output ``(T, N, H)``,
    then with ``expose_hidden`` the final states.  ``cont_t[n] = 0`` starts a new sequence in stream ``n``:
    the previous hidden state is multiplied by ``cont_t`` (Caffe's Scale layer ``h_conted``).

    Quirks of ``RecurrentLayer`` kept:

    * without ``expose_hidden`` the layer is stateful: each forward starts from the previous forward's
      final states (zero at first), as Caffe copies ``h_T`` into ``h_0``; a batch continues the previous
      one unless its first ``cont`` is 0.  No gradient crosses batches.  :meth:`reset_state` zeroes them
      (Caffe's ``Reset``); a new ``N`` starts from zeros;
    * with ``expose_hidden`` the given initial states get no gradient and the final-state tops pass none
      back (Caffe shares their data, not their diffs);
    * ``cont`` gets no gradient; ``T`` is fixed at setup ("input number of timesteps changed");
    * ``debug_info`` only makes Caffe log the unrolled net: accepted, no effect.

    An ONNX trace unrolls the ``T`` steps; it starts from the state held at export (zeros for a fresh net).
    """

    param_message = "recurrent_param"
    #: Recurrent state names, the order of the exposed bottoms/tops.
    state_names: tuple[str, ...] = ("h",)
    #: Gate rows per hidden unit (LSTM: 4).
    gates: int = 1

    @classmethod
    def _num_states(cls, layer) -> int:
        return len(cls.state_names) if layer.recurrent_param.expose_hidden else 0

    @classmethod
    def check_blob_counts(cls, layer, num_bottoms: int, check_tops: bool = True) -> None:
        """Caffe's ``MinBottomBlobs`` (2, plus the states with ``expose_hidden``), one more for ``x_static``;
        ``ExactNumTopBlobs`` 1 plus the states with ``expose_hidden``."""
        exposed = cls._num_states(layer)
        where = f"layer '{layer.name}' ({layer.type})"
        BlobCount(2 + exposed, 3 + exposed).check(num_bottoms, where, "bottom")
        if check_tops:
            BlobCount.exact(1 + exposed).check(len(layer.top), where, "top")

    @classmethod
    def geometry(cls, layer, bottoms):
        """``(T, N, H, D, static shape or None)`` after Caffe's setup CHECKs."""
        where = f"layer '{layer.name}' ({layer.type})"
        cls.check_blob_counts(layer, len(bottoms), check_tops=False)
        hidden = int(layer.recurrent_param.num_output)
        if hidden <= 0:
            raise FormatError(f"{where}: recurrent_param.num_output must be positive")
        x, cont = tuple(bottoms[0]), tuple(bottoms[1])
        if len(x) < 2:
            raise FormatError(f"{where}: bottom 0 must have at least 2 axes (#timesteps, #streams, ...), got {x}")
        if len(cont) != 2 or cont != x[:2]:
            raise FormatError(f"{where}: bottom 1 (cont) must have exactly 2 axes (#timesteps, #streams) = {x[:2]}, "
                              f"got {cont}")
        steps, streams = x[:2]
        if not steps:
            raise FormatError(f"{where}: bottom 0 has no timestep (T = 0, shape {x}): Caffe's unrolled net would slice "
                              f"it into no top and concatenate no output (Slice's and Concat's blob-count CHECKs)")
        exposed = cls._num_states(layer)
        static = tuple(bottoms[2]) if len(bottoms) > 2 + exposed else None
        if static is not None and (len(static) < 1 or static[0] != streams):
            raise FormatError(f"{where}: bottom 2 (x_static) must lead with the {streams} streams, got {static}")
        for k, shape in enumerate(bottoms[len(bottoms) - exposed:]):
            if tuple(shape) != (1, streams, hidden):
                raise FormatError(f"{where}: bottom {len(bottoms) - exposed + k} ({cls.state_names[k]}_0) must have the "
                                  f"hidden state shape {(1, streams, hidden)}, got {tuple(shape)}")
        return steps, streams, hidden, count(x, 2), static

    @classmethod
    def blob_names(cls, static: bool) -> list[str]:
        raise NotImplementedError

    @classmethod
    def blob_shapes(cls, hidden: int, inputs: int, static_inputs: int | None) -> list[tuple[int, ...]]:
        raise NotImplementedError

    @classmethod
    def infer(cls, layer, bottoms):
        steps, streams, hidden, inputs, static = cls.geometry(layer, bottoms)
        static_inputs = None if static is None else count(static, 1)
        params = cls.blob_shapes(hidden, inputs, static_inputs)
        rows = cls.gates * hidden
        macs = steps * streams * rows * (inputs + hidden) + (0 if static is None else streams * rows * static_inputs)
        macs += cls.extra_macs(steps, streams, hidden)
        tops = [(steps, streams, hidden)] + [(1, streams, hidden)] * cls._num_states(layer)
        return Shapes(tops, params, macs)

    @classmethod
    def extra_macs(cls, steps: int, streams: int, hidden: int) -> int:
        return 0

    def __init__(self, param, bottom_shapes, phase="test"):
        super().__init__(param, bottom_shapes, phase)
        self.steps, streams, self.hidden, self.inputs, static = self.geometry(param, self.bottom_shapes)
        self.static_input = static is not None
        self.expose_hidden = bool(param.recurrent_param.expose_hidden)
        shapes = self.rule().params
        self._blob_names = self.blob_names(self.static_input)
        for name, shape in zip(self._blob_names, shapes):
            self.register_parameter(name, nn.Parameter(torch.zeros(shape)))
        for name in self.state_names:
            self.register_buffer(f"_{name}_state", torch.zeros(1, streams, self.hidden), persistent=False)

    def caffe_blobs(self):
        return [getattr(self, name) for name in self._blob_names]

    def fill(self, generator=None):
        p = self.param.recurrent_param
        for name, blob in zip(self._blob_names, self.caffe_blobs()):
            fill_blob(blob.data, p.bias_filler if name.startswith("b_") else p.weight_filler, generator)

    def reset_state(self) -> None:
        """Zero the carried states (Caffe's ``RecurrentLayer::Reset``)."""
        for name in self.state_names:
            setattr(self, f"_{name}_state", torch.zeros_like(getattr(self, f"_{name}_state")))

    def _initial_states(self, streams: int, like: Tensor, given) -> list[Tensor]:
        if self.expose_hidden:
            return [s.detach()[0].to(like.dtype) for s in given]
        states = []
        for name in self.state_names:
            held = getattr(self, f"_{name}_state")
            if held.shape[1] != streams:
                held = torch.zeros(1, streams, self.hidden, dtype=like.dtype, device=like.device)
            states.append(held[0].to(dtype=like.dtype, device=like.device))
        return states

    def forward(self, x, cont, *rest):
        where = f"layer '{self.layer_name}' ({self.caffe_type})"
        if x.dim() < 2 or x.shape[0] != self.steps:
            raise ShapeMismatchError(f"{where}: input number of timesteps changed: set up for {self.steps}, got shape "
                                     f"{tuple(x.shape)}")
        steps, streams = int(x.shape[0]), int(x.shape[1])
        if tuple(cont.shape) != (steps, streams):
            raise ShapeMismatchError(f"{where}: cont must have shape {(steps, streams)}, got {tuple(cont.shape)}")
        static = rest[0] if self.static_input else None
        given = rest[1:] if self.static_input else rest
        cont = cont.detach().to(x.dtype)
        states = self._initial_states(streams, x, given)
        # flatten, not reshape(..., -1): that is ambiguous for no stream (N = 0, Caffe's empty top)
        static_term = None if static is None else F.linear(_flat_from(static, 1), self.static_weight())
        x = _flat_from(x, 2)
        if x.shape[2] != self.inputs:  # the unrolled InnerProduct's Reshape CHECK_EQ(K_, new_K)
            raise ShapeMismatchError(f"{where}: set up for {self.inputs} input values per step and stream, got "
                                     f"{x.shape[2]}")
        outputs, finals = self.unroll(x, cont, static_term, states)
        if not self.expose_hidden and not torch.jit.is_tracing():
            for name, final in zip(self.state_names, finals):
                setattr(self, f"_{name}_state", final.detach().clone().unsqueeze(0))
        tops = (outputs,)
        if self.expose_hidden:
            tops += tuple(final.detach().unsqueeze(0) for final in finals)
        return tops

    def static_weight(self) -> Tensor:
        raise NotImplementedError

    def unroll(self, x, cont, static_term, states):
        """``(output (T, N, H), final states)`` of the unrolled net; ``x`` is ``(T, N, D)``."""
        raise NotImplementedError

    def extra_repr(self):
        return (f"{super().extra_repr()}, T={self.steps}, num_output={self.hidden}, static_input={self.static_input}, "
                f"expose_hidden={self.expose_hidden}")


@register_layer("LSTM")
class LSTM(Recurrent):
    """Caffe's LSTMLayer (Donahue et al.'s LRCN LSTM), ``recurrent_param { num_output H weight_filler
    bias_filler debug_info expose_hidden }``; see :class:`Recurrent` for the bottoms, tops and quirks.

    Per step ``t = 1..T`` (Caffe's unrolled net): ``h' = cont_t·h_{t−1}``;
    ``gate_t = W_hc·h' + (W_xc·x_t + b_c) [+ W_xc_static·x_static]``; ``c_t, h_t = LSTMUnit(c_{t−1}, gate_t,
    cont_t)`` (gates ``[i, f, o, g]``, the cell flushed through ``f = 0`` when ``cont_t = 0``, see
    :class:`LSTMUnit` for its backward).  Top: ``h_1..h_T`` ``(T, N, H)``; exposed states ``h_0, c_0`` in and
    ``h_T, c_T`` out.  Blobs ``W_xc (4H, D)``, ``b_c (4H,)``, [``W_xc_static (4H, D_s)``], ``W_hc (4H, H)``;
    weights from ``weight_filler``, ``b_c`` from ``bias_filler`` (defaults: constant 0).
    """

    bottoms = BlobCount(2, 5)
    tops = BlobCount(1, 3)
    in_caffe_1_0 = True
    state_names = ("h", "c")
    gates = 4

    @classmethod
    def blob_names(cls, static):
        return ["W_xc", "b_c"] + (["W_xc_static"] if static else []) + ["W_hc"]

    @classmethod
    def blob_shapes(cls, hidden, inputs, static_inputs):
        rows = 4 * hidden
        return [(rows, inputs), (rows,)] + ([(rows, static_inputs)] if static_inputs is not None else []) + [
            (rows, hidden)]

    def static_weight(self):
        return self.W_xc_static

    def unroll(self, x, cont, static_term, states):
        h, c = states
        x_terms = F.linear(x, self.W_xc, self.b_c)
        outputs = []
        for t in range(x.shape[0]):
            gate = F.linear(h * cont[t].unsqueeze(-1), self.W_hc) + x_terms[t]
            if static_term is not None:
                gate = gate + static_term
            c, h = lstm_unit(c, gate, cont[t])
            outputs.append(h)
        return torch.stack(outputs), (h, c)


@register_layer("RNN")
class RNN(Recurrent):
    """Caffe's RNNLayer (an Elman net with a separate output layer), ``recurrent_param { num_output H
    weight_filler bias_filler debug_info expose_hidden }``; see :class:`Recurrent` for bottoms, tops, quirks.

    Per step: ``h_t = tanh(W_hh·(cont_t·h_{t−1}) + (W_xh·x_t + b_h) [+ W_xh_static·x_static])``,
    ``o_t = tanh(W_ho·h_t + b_o)``.  Top: ``o_1..o_T`` ``(T, N, H)``; exposed state ``h_0`` in, ``h_T`` out.
    Blobs ``W_xh (H, D)``, ``b_h (H,)``, [``W_xh_static (H, D_s)``], ``W_hh (H, H)``, ``W_ho (H, H)``,
    ``b_o (H,)``; weights from ``weight_filler``, biases from ``bias_filler`` (defaults: constant 0).
    """

    bottoms = BlobCount(2, 4)
    tops = BlobCount(1, 2)
    in_caffe_1_0 = True
    state_names = ("h",)

    @classmethod
    def blob_names(cls, static):
        return ["W_xh", "b_h"] + (["W_xh_static"] if static else []) + ["W_hh", "W_ho", "b_o"]

    @classmethod
    def blob_shapes(cls, hidden, inputs, static_inputs):
        return [(hidden, inputs), (hidden,)] + ([(hidden, static_inputs)] if static_inputs is not None else []) + [
            (hidden, hidden), (hidden, hidden), (hidden,)]

    @classmethod
    def extra_macs(cls, steps, streams, hidden):
        return steps * streams * hidden * hidden  # W_ho

    def static_weight(self):
        return self.W_xh_static

    def unroll(self, x, cont, static_term, states):
        (h,) = states
        x_terms = F.linear(x, self.W_xh, self.b_h)
        outputs = []
        for t in range(x.shape[0]):
            pre = F.linear(h * cont[t].unsqueeze(-1), self.W_hh) + x_terms[t]
            if static_term is not None:
                pre = pre + static_term
            h = torch.tanh(pre)
            outputs.append(torch.tanh(F.linear(h, self.W_ho, self.b_o)))
        return torch.stack(outputs), (h,)
