"""The connector's log lines: JSON on stderr in the services' shape (``ts`` first, then ``level``,
``logger``, ``msg`` and the record's ``extra`` fields), from python-json-logger, which vLLM itself
requires. The connector runs inside vLLM and imports no server code.

Lines are formatted and written on a background thread (the standard library's queue handler and
listener): the worker logs each pull's fence verdict before vLLM hears the pull is done, and formatting
that line (50-300 us) would otherwise add to every pull's wait. A line on such a path can go further
with :func:`log_off_path`: its record, fields included, is made on that thread too (making a record
and handing it over cost another 20-100 us).
"""

from __future__ import annotations

import atexit
import logging
import queue
import sys
import time
from collections.abc import Callable
from logging.handlers import QueueHandler, QueueListener
from typing import Any, TextIO

from pythonjsonlogger.json import JsonFormatter

# The decode engine's lines that readers outside the engine parse (the faults oracle, the benchmarks): their
# ``msg``. Here, away from the modules that import vLLM, so readers can import them.
READY_LOG = "kvferry connector scheduler ready"
RETAINED_LOG = "retained"
EVICTED_LOG = "evicting least recently used retention (over budget); freed once the registry confirms"
FREED_LOG = "freed retained blocks"
BUMPED_LOG = "generations bumped"
# The host tier's (kvferry.connector.host_tier).
COPIED_LOG = "copied to the host pool"
MOVED_LOG = "moved to the host tier; the KV-cache blocks go once the registry accepts the move"
POOL_FULL_LOG = "evicting least recently used host-tier retention (pool full)"
HANDSHAKE_AHEAD_LOG = "handshook with a peer ahead of its pulls"
PEER_WARMED_LOG = "warmed the reads from a peer ahead of its pulls"


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


# What the logging thread takes: a record, or a function that makes one there (log_off_path).
_Queued = logging.LogRecord | Callable[[], logging.LogRecord]


class _RecordListener(QueueListener):
    """Makes the records that :func:`log_off_path` queued as functions, then handles them as any."""

    def prepare(self, record: Any) -> logging.LogRecord:
        return record if isinstance(record, logging.LogRecord) else record()


_listener: QueueListener | None = None
_records: queue.SimpleQueue[_Queued] | None = None
# Lines log_off_path holds until hand_over_held() (waking the logging thread costs the caller ~10 us).
_held: list[Callable[[], logging.LogRecord]] = []
_MAX_HELD = 16


def log_off_path(
    logger: logging.Logger, level: int, message: str, fields: Callable[[], tuple[float, dict[str, Any]]]
) -> None:
    """Logs ``message`` with the ``extra`` fields that ``fields()`` returns with the line's Unix time.

    When kvferry's lines go through the logging thread, the line is held until :func:`hand_over_held`
    (or 16 are held, or logging stops) and its record is made on that thread: the caller pays a level
    check and a list append. Else it is logged now. For a ``kvferry.*`` logger without handlers or
    filters of its own, as the connector's are; ``fields`` must stay valid until it is called."""
    records = _records
    if records is None:
        _, extra = fields()
        logger.log(level, message, extra=extra)
        return
    if not logger.isEnabledFor(level):
        return

    def make() -> logging.LogRecord:
        created, extra = fields()
        record = logger.makeRecord(logger.name, level, "(logging thread)", 0, message, (), None, None, extra)
        record.created, record.msecs = created, (created % 1) * 1000
        return record

    _held.append(make)
    if len(_held) >= _MAX_HELD:
        hand_over_held()


def hand_over_held() -> None:
    """Queues the lines :func:`log_off_path` held for the logging thread (waking it); the connector calls
    it at each of vLLM's polls that finishes no pull."""
    records = _records
    if records is None or not _held:
        return
    for make in _held:
        records.put(make)
    _held.clear()


def stop_logging_thread() -> None:
    """Writes the queued lines and stops the logging thread (at exit; tests)."""
    global _listener, _records
    hand_over_held()
    _records = None
    _held.clear()
    if _listener is not None:
        _listener.stop()  # writes what is still queued
        _listener = None


def log_json_lines_to(stream: TextIO) -> None:
    """kvferry's loggers log JSON lines to ``stream`` from a background thread (replacing any earlier
    setting; the lines still queued at exit are written then)."""
    global _listener, _records
    stop_logging_thread()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(KvferryJsonFormatter())
    records: queue.SimpleQueue[_Queued] = queue.SimpleQueue()
    _listener = _RecordListener(records, handler)
    _listener.start()
    root = logging.getLogger("kvferry")
    root.handlers[:] = [_RecordQueueHandler(records)]
    _records = records
    root.setLevel(logging.INFO)
    root.propagate = False


def setup_logging() -> None:
    """kvferry's loggers log JSON lines to stderr (vLLM configures only its own loggers); once."""
    if not logging.getLogger("kvferry").handlers:
        log_json_lines_to(sys.stderr)


atexit.register(stop_logging_thread)
