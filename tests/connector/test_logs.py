"""The connector's log lines have the services' shape (engine tests find them by their leading '{"ts"')."""

from __future__ import annotations

import io
import json
import logging

from kvferry.connector.logs import KvferryJsonFormatter, log_json_lines_to, stop_logging_thread
from kvferry.runtime.logs import JsonFormatter


def test_the_connector_writes_the_services_json_line_shape() -> None:
    record = logging.makeLogRecord(
        {"name": "kvferry.connector", "levelname": "INFO", "levelno": 20, "msg": "kv pull", "blocks": 3}
    )
    connector_line = KvferryJsonFormatter().format(record)
    service_line = JsonFormatter().format(record)
    assert connector_line.startswith('{"ts"')
    assert list(json.loads(connector_line)) == list(json.loads(service_line))
    assert json.loads(connector_line) == json.loads(service_line)


def test_lines_are_written_by_the_logging_thread_with_their_fields_and_traceback() -> None:
    root = logging.getLogger("kvferry")
    before = (root.handlers[:], root.level, root.propagate)
    sink = io.StringIO()
    try:
        log_json_lines_to(sink)
        logger = logging.getLogger("kvferry.connector.fence")
        logger.info("kv pull fence %s", "checked", extra={"blocks": 3, "fenced": False})
        try:
            raise ValueError("bad descriptor")
        except ValueError:
            logger.exception("fence read failed")
        log_json_lines_to(io.StringIO())  # stops the first listener: what it had queued is written
    finally:
        stop_logging_thread()
        root.handlers[:], root.level, root.propagate = before  # caplog in later tests sees kvferry's records
    first, second = (json.loads(line) for line in sink.getvalue().splitlines())
    assert first["msg"] == "kv pull fence checked" and first["blocks"] == 3 and first["fenced"] is False
    assert first["logger"] == "kvferry.connector.fence"
    assert second["level"] == "error" and "ValueError: bad descriptor" in second["exc"]
