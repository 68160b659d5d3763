"""The data of :func:`~caffe_compat.solver.train.train`: endless dict batches from a user's iterable (a
DataLoader, a list, a sampler-driven iterable), restarted when exhausted, and resumable: a :class:`Feed`
reports how far into its current pass it is (``state_dict``) and continues there (``load_state_dict``),
see :mod:`caffe_compat.solver.trainstate`.
"""

from __future__ import annotations

import logging

import torch

from caffe_compat.errors import CaffeCompatError
from caffe_compat.solver.trainstate import encode_state, rng_states, set_rng_states

__all__ = ["Feed"]

log = logging.getLogger("caffe_compat.solver.train")  # train()'s messages, one logger for the whole loop


def _stateful(obj):
    return obj is not None and not isinstance(obj, torch.nn.Module) and callable(getattr(obj, "state_dict", None)) \
        and callable(getattr(obj, "load_state_dict", None))


class Feed:
    """Endless dict batches from an iterable (restarted when exhausted), resumable (module docstring)."""

    def __init__(self, data, names: list[str]):
        self.data, self.names = data, list(names)
        if _stateful(data):
            self.kind, self.stateful = "data", data
        else:
            self.kind, self.stateful = None, None
            for attr in ("batch_sampler", "sampler"):
                candidate = getattr(data, attr, None)
                if _stateful(candidate):
                    self.kind, self.stateful = "sampler", candidate
                    break
        self.iterator = None
        self.consumed = 0  # batches taken from the current pass
        self.from_iterator = 0  # batches the current iterator gave (an empty fresh pass is an error)
        self.pass_state = None  # the sampler's state_dict() just before the pass's iter()
        self.pass_rng = None  # the global RNG states just before the pass's iter()

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        while True:
            if self.iterator is None:
                self.pass_state = self.stateful.state_dict() if self.kind == "sampler" else None
                self.pass_rng = rng_states()
                self.consumed = self.from_iterator = 0
                self.iterator = iter(self.data)
            try:
                batch = next(self.iterator)
            except StopIteration:
                if self.from_iterator == 0 and self.consumed == 0:
                    raise CaffeCompatError("train: the data source yielded no batch") from None
                self.iterator = None
                continue
            self.consumed += 1
            self.from_iterator += 1
            return self._as_dict(batch)

    def _as_dict(self, batch) -> dict:
        if isinstance(batch, dict):
            return batch
        batch = list(batch)
        if len(batch) != len(self.names):
            raise CaffeCompatError(f"train: a batch of {len(batch)} items for the net inputs {self.names}; "
                                   f"yield dicts or one item per input")
        return dict(zip(self.names, batch))

    def state_dict(self) -> dict:
        state = {"kind": self.kind, "consumed": self.consumed, "pass_state": _savable(self.pass_state),
                 "pass_rng": self.pass_rng, "started": self.iterator is not None}
        if self.kind == "data":
            state["data_state"] = _savable(self.data.state_dict())
        return state

    def load_state_dict(self, state: dict, what: str) -> None:
        """Continue where the saved feed was; moves the global RNGs (the caller restores them afterwards)."""
        if not state.get("started"):
            return  # nothing was drawn yet: the first next() starts a pass, as in the uninterrupted run
        consumed, skip = int(state["consumed"]), 0
        pass_state = state.get("pass_state")
        if self.kind == "data" and state.get("data_state") is not None:
            self.data.load_state_dict(state["data_state"])
        elif self.kind == "sampler" and isinstance(pass_state, dict):
            position = dict(pass_state)
            if "batch" in position:  # a GlobalBatchSampler: go straight to the next batch
                position["batch"] = int(position["batch"]) + consumed
            else:
                skip = consumed
            self.stateful.load_state_dict(position)
        else:
            if state.get("kind") not in (None, self.kind):
                log.warning("resume: %s data was a %s source, now it has no state_dict(): replaying %d batches "
                            "of its current pass", what, state.get("kind"), consumed)
            skip = consumed
        if skip:
            log.info("resume: replaying %d batches of the %s data's current pass", skip, what)
        if state.get("pass_rng") is not None:
            set_rng_states(state["pass_rng"])
        self.iterator = iter(self.data)
        self.from_iterator = 0
        for i in range(skip):
            try:
                next(self.iterator)
            except StopIteration:
                log.warning("resume: the %s data's pass ended after %d of the %d batches taken before the "
                            "snapshot: it is not the data of the interrupted run; starting a new pass", what, i,
                            skip)
                self.iterator = None
                return
        self.consumed, self.pass_state, self.pass_rng = consumed, pass_state, state.get("pass_rng")


def _savable(state):
    """``state`` when the .trainstate can hold it, else None with a warning (a resume then replays the pass)."""
    try:
        encode_state(state)
    except CaffeCompatError as exc:
        log.warning("the data's state_dict() cannot be saved (%s): a resume will replay the current pass", exc)
        return None
    return state

