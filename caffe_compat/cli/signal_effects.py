"""``caffe train``'s signal handling (Caffe's ``SignalHandler``, flags ``-sigint_effect`` and
``-sighup_effect``): while training, SIGINT (Ctrl-C) and SIGHUP do not kill the process; each asks the
solver for its effect after the current iteration:

* ``stop`` (SIGINT's default): end training there; the solver writes its snapshot after training (unless
  that iteration already wrote one; ``snapshot_after_train: false`` writes none) and the command exits 0;
* ``snapshot`` (SIGHUP's default): write a snapshot and go on;
* ``none``: ignore the signal.

Added to Caffe: once a stop is pending, a second SIGINT interrupts at once (exit 130, no snapshot), where
Caffe's binary can then only be killed.
"""

from __future__ import annotations

import signal
from contextlib import contextmanager

EFFECTS = ("stop", "snapshot", "none")


class SignalEffects:
    """The solver's ``action_request``: the effect of the last signal received since the previous call."""

    def __init__(self, sigint: str = "stop", sighup: str = "snapshot"):
        self.effects = {signal.SIGINT: sigint}
        if hasattr(signal, "SIGHUP"):  # not on Windows
            self.effects[signal.SIGHUP] = sighup
        self.pending: str | None = None
        self.previous: dict = {}

    def _handle(self, signum, frame) -> None:
        effect = self.effects[signum]
        if effect == "none":
            return
        if effect == "stop":
            # the stop is taken after this iteration; a second Ctrl-C interrupts at once
            signal.signal(signum, self.previous.get(signum, signal.default_int_handler))
        if self.pending != "stop":
            self.pending = effect

    def __call__(self) -> str | None:
        effect, self.pending = self.pending, None
        return effect

    @contextmanager
    def installed(self):
        """The handlers while the block runs (the previous ones restored after)."""
        for signum in self.effects:
            self.previous[signum] = signal.signal(signum, self._handle)
        try:
            yield self
        finally:
            for signum, handler in self.previous.items():
                signal.signal(signum, handler)
