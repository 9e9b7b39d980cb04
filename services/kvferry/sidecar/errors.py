"""The error the sidecar's logic raises towards its connector: a gRPC code and an actionable message."""

from __future__ import annotations

import grpc


class SidecarError(Exception):
    """Returned to the connector as ``code`` with ``message``."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
