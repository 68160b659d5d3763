"""glog's line format, as Caffe writes its logs, and the way back.

A Caffe log line is ``<L><date> <HH:MM:SS.micro> <thread> <file>:<line>] <message>`` where ``<L>`` is
``I``/``W``/``E``/``F`` and ``<date>`` is ``MMDD`` in the glog Caffe 1.0 shipped with, ``YYYYMMDD`` in
glog >= 0.7 (``I1124 21:48:49.577123 1234 solver.cpp:218] Iteration 100, lr = 0.01`` and
``I20261124 21:48:49.577123 1234 ...``).  :class:`GlogFormatter` writes the first form (or the second with
``long_date=True``); :func:`parse_line` reads both.  :func:`caffe_log` sends the project's log records
(``caffe_compat.*`` loggers: the solver's ``Iteration N, lr = ...`` lines) to a file or stderr in that
format, which is what ``caffe-compat train --caffe-log`` does, so that Caffe's own
``tools/extra/parse_log.py`` and ``caffe-compat parse-log`` read our logs like Caffe's.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import logging
import math
import os
import re
import sys
import threading

__all__ = ["GlogFormatter", "GlogLine", "caffe_log", "g6", "parse_line"]


def g6(value: float) -> str:
    """A number the way glog/iostream prints a float (``%g``, 6 significant digits; glibc prints a NaN with its
    sign, ``-nan`` for x86's default NaN)."""
    value = float(value)
    if math.isnan(value):
        return "-nan" if math.copysign(1.0, value) < 0 else "nan"
    return f"{value:.6g}"


_LEVELS = {logging.DEBUG: "I", logging.INFO: "I", logging.WARNING: "W", logging.ERROR: "E", logging.CRITICAL: "F"}


class GlogFormatter(logging.Formatter):
    """``I1124 21:48:49.577123 12345 solver.py:325] message`` (``long_date``: ``I20261124 ...``)."""

    def __init__(self, long_date: bool = False):
        super().__init__()
        self.long_date = long_date

    def format(self, record: logging.LogRecord) -> str:
        when = _dt.datetime.fromtimestamp(record.created)
        level = _LEVELS.get(record.levelno, "I" if record.levelno < logging.WARNING else "E")
        date = when.strftime("%Y%m%d" if self.long_date else "%m%d")
        thread = (threading.get_native_id() if record.thread == threading.get_ident() else record.process) or 0
        head = f"{level}{date} {when.strftime('%H:%M:%S.%f')} {thread:5d} {record.filename}:{record.lineno}] "
        text = record.getMessage()
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        if getattr(record, "glog_bare_continuation", False):  # glog prefixes a message's first line only
            return head + text
        return "\n".join(head + part for part in text.split("\n"))


_PREFIX = re.compile(r"^\s*([IWEF])(\d{8}|\d{4})\s+(\d{1,2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?"
                     r"(?:\s+\d+)?(?:\s+[^\s\]]+:\d+\])?\s?(?P<message>.*)$")


class GlogLine:
    """One parsed glog line: ``level``, ``month``, ``day``, ``year`` (None for ``MMDD``), ``time`` (seconds
    since midnight, fractional) and ``message``."""

    __slots__ = ("level", "year", "month", "day", "time", "message")

    def __init__(self, level, year, month, day, time, message):
        self.level, self.year, self.month, self.day, self.time, self.message = level, year, month, day, time, message

    def timestamp(self, year: int) -> _dt.datetime:
        """The line's date and time; ``year`` is used when the line has no year (``MMDD``)."""
        day = _dt.datetime(self.year if self.year is not None else year, self.month, self.day)
        return day + _dt.timedelta(seconds=self.time)


def parse_line(line: str) -> GlogLine | None:
    """The glog prefix of ``line`` parsed, or None when the line has none (a continuation, a traceback,
    a prototxt dump).  Dates that are not calendar dates count as no prefix."""
    match = _PREFIX.match(line)
    if match is None:
        return None
    level, date, hour, minute, second, fraction = match.groups()[:6]
    year = int(date[:4]) if len(date) == 8 else None
    month, day = int(date[-4:-2]), int(date[-2:])
    if not (1 <= month <= 12 and 1 <= day <= 31 and int(hour) < 24 and int(minute) < 60 and int(second) < 61):
        return None
    seconds = int(hour) * 3600 + int(minute) * 60 + int(second) + (float(f"0.{fraction}") if fraction else 0.0)
    return GlogLine(level, year, month, day, seconds, match.group("message"))


@contextlib.contextmanager
def caffe_log(target, level: int = logging.INFO, long_date: bool = False, logger: str = "caffe_compat"):
    """Within the block, records of ``logger`` (and its children) at ``level`` and above are written to
    ``target`` in glog's format: a path (created or truncated, written line by line as Caffe's log file
    is) or ``"-"`` for stderr.  The logger's level is lowered to ``level`` for the block if needed."""
    from pathlib import Path

    from caffe_compat.io.atomic import write_error

    if target in (None, "-"):
        handler: logging.Handler = logging.StreamHandler(sys.stderr)
    else:
        try:
            parent = os.path.dirname(os.fspath(target))
            if parent:
                os.makedirs(parent, exist_ok=True)
        except OSError as exc:
            raise write_error(Path(target), exc) from None
        handler = _LogFileHandler(os.fspath(target))
    handler.setFormatter(GlogFormatter(long_date=long_date))
    handler.setLevel(level)
    log = logging.getLogger(logger)
    saved = log.level
    if log.getEffectiveLevel() > level:
        log.setLevel(level)
    log.addHandler(handler)
    try:
        yield handler
    finally:
        log.removeHandler(handler)
        log.setLevel(saved)
        try:
            handler.close()
        except OSError as exc:  # its last lines (a full disk): reported below unless the block failed
            handler.failed = handler.failed or exc
    failed = getattr(handler, "failed", None)
    if failed is not None:  # the run itself completed: its log did not
        raise write_error(Path(target), failed, "the log is incomplete")


class _LogFileHandler(logging.FileHandler):
    """A FileHandler opened with :func:`~caffe_compat.io.atomic.open_log` (a FIFO without a reader, a folder:
    WriteError at once, not a hang) that, when a write fails (a full disk), keeps the error in ``failed``
    and writes nothing more, instead of printing logging's traceback at every record."""

    def __init__(self, path: str):
        self.failed: OSError | None = None
        self.given = path  # errors name the path as given (baseFilename is absolute)
        super().__init__(path, mode="w", encoding="utf-8", delay=True)
        self.stream = self._open()

    def _open(self):
        from caffe_compat.io.atomic import open_log

        return open_log(self.given, self.mode, encoding=self.encoding, errors=self.errors)

    def emit(self, record) -> None:
        if self.failed is None:
            super().emit(record)

    def handleError(self, record) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError) and self.failed is None:
            self.failed = exc
            return
        super().handleError(record)

    def close(self) -> None:
        if self.failed is not None:  # flushing what failed would fail again
            with contextlib.suppress(OSError):
                super().close()
            return
        super().close()
