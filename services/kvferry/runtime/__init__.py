"""kvferry's service kit: what the registry, the sidecar and the router share, done one way.

- ``clock``: the ``Clock`` Protocol, ``SystemClock`` and ``ManualClock`` (tests);
- ``backoff``: ``BackoffPolicy`` (settings) and ``Backoff`` (one retry loop's state);
- ``timestamps``: protobuf ``Timestamp`` to and from float seconds;
- ``errors``: domain errors and the one table to gRPC / HTTP statuses, and the gRPC handler decorators;
- ``flags``: command-line flags backed by environment variables.
"""
