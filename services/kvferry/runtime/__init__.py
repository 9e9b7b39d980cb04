"""kvferry's service kit: what the registry, the sidecar and the router share, done one way.

- ``host``: ``ServiceHost`` (start, serve, graceful stop; a failed start cleans up the same way) and
  ``run_service`` (a CLI's main: signals, exit status);
- ``flags``: command-line flags backed by environment variables;
- ``errors``: domain errors, the one table to gRPC / HTTP statuses, and the gRPC handler decorators;
- ``clock``: the ``Clock`` Protocol, ``SystemClock`` and ``ManualClock`` (tests);
- ``backoff``: ``BackoffPolicy`` (settings) and ``Backoff`` (one retry loop's state);
- ``deadline``: ``finish_within`` (await something for at most so long; on timeout, an error naming it);
- ``timestamps``: protobuf ``Timestamp`` to and from float seconds;
- ``metrics``: serving ``/metrics`` and the series more than one service updates;
- ``tracing``: the tracer provider and the gRPC tracing interceptors;
- ``grpc_server``, ``logs``, ``ids``: a gRPC server with health and reflection, JSON log lines, id checks.
"""
