"""W3C trace context for the router: the caller's OpenTelemetry span, when OpenTelemetry is installed,
becomes the parent of the router's spans. Without it the SDK sends no trace headers."""

from __future__ import annotations

import functools
from collections.abc import Callable, MutableMapping


@functools.cache
def _injector() -> Callable[[MutableMapping[str, str]], None] | None:
    # Looked up on first use, not at import: `import kvferry.sdk` stays fast and needs no OpenTelemetry.
    try:
        from opentelemetry import propagate
    except ImportError:
        return None
    return propagate.inject


def trace_headers() -> dict[str, str]:
    """``traceparent`` / ``tracestate`` of the current span (empty without OpenTelemetry or a span)."""
    carrier: dict[str, str] = {}
    inject = _injector()
    if inject is not None:
        inject(carrier)
    return carrier
