"""The connector's log lines have the services' shape (engine tests find them by their leading '{"ts"')."""

from __future__ import annotations

import json
import logging

from kvferry.connector.logs import KvferryJsonFormatter
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
