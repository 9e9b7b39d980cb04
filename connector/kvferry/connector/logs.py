"""The connector's log lines: JSON on stderr in the services' shape (``ts`` first, then ``level``,
``logger``, ``msg`` and the record's ``extra`` fields), from python-json-logger, which vLLM itself
requires. The connector runs inside vLLM and imports no server code.

Lines are formatted and written on a background thread (the standard library's queue handler and
listener): the worker logs each pull's fence verdict before vLLM hears the pull is done, and formatting
that line (50-300 us) would otherwise add to every pull's wait.
"""

from __future__ import annotations

import atexit
import logging
import queue
import sys
import time
from logging.handlers import QueueHandler, QueueListener
from typing import Any, TextIO

from pythonjsonlogger.json import JsonFormatter


class KvferryJsonFormatter(JsonFormatter):
    """python-json-logger configured for the services' line shape."""

    def __init__(self) -> None:
        super().__init__(
            "{ts}{levelname}{name}{message}",
            style="{",
            rename_fields={"levelname": "level", "name": "logger", "message": "msg", "exc_info": "exc"},
        )

    def add_fields(
        self, log_record: dict[str, Any], record: logging.LogRecord, message_dict: dict[str, Any]
    ) -> None:
        super().add_fields(log_record, record, message_dict)
        # Tests and log tooling find kvferry's lines by their leading '{"ts"', as the services write them.
        log_record["ts"] = (
            time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        )
        log_record["level"] = record.levelname.lower()


class _RecordQueueHandler(QueueHandler):
    """Queues the record itself (its ``extra`` fields and ``exc_info`` intact, for the JSON formatter on
    the listener's side), with its message merged while the caller's arguments are still current."""

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        record.msg = record.getMessage()
        record.args = None
        return record


_listener: QueueListener | None = None


def stop_logging_thread() -> None:
    """Writes the queued lines and stops the logging thread (at exit; tests)."""
    global _listener
    if _listener is not None:
        _listener.stop()  # writes what is still queued
        _listener = None


def log_json_lines_to(stream: TextIO) -> None:
    """kvferry's loggers log JSON lines to ``stream`` from a background thread (replacing any earlier
    setting; the lines still queued at exit are written then)."""
    global _listener
    stop_logging_thread()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(KvferryJsonFormatter())
    records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    _listener = QueueListener(records, handler)
    _listener.start()
    root = logging.getLogger("kvferry")
    root.handlers[:] = [_RecordQueueHandler(records)]
    root.setLevel(logging.INFO)
    root.propagate = False


def setup_logging() -> None:
    """kvferry's loggers log JSON lines to stderr (vLLM configures only its own loggers); once."""
    if not logging.getLogger("kvferry").handlers:
        log_json_lines_to(sys.stderr)


atexit.register(stop_logging_thread)
