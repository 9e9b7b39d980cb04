"""The connector's log lines: JSON on stderr in the services' shape (``ts`` first, then ``level``,
``logger``, ``msg`` and the record's ``extra`` fields), from python-json-logger, which vLLM itself
requires. The connector runs inside vLLM and imports no server code."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

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


def setup_logging() -> None:
    """kvferry's loggers log JSON lines to stderr (vLLM configures only its own loggers); once."""
    root = logging.getLogger("kvferry")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(KvferryJsonFormatter())
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False
