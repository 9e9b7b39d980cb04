"""``kvferry health ADDRESS``: is a kvferry service healthy? Exit status 0 yes, 1 no (one line on stderr):
what Kubernetes exec probes and compose healthchecks run.

ADDRESS ``host:port`` or ``unix:/path`` checks gRPC health (``grpc.health.v1``; ``--service`` names one
service, "" the server); ``http://host:port/path`` checks HTTP (a 2xx passes). ``--any-status`` passes
whenever the server answers, whatever it says: liveness. A registry waiting for etcd, a sidecar waiting for
its engine, a router with no engines yet answer NOT_SERVING (or HTTP 503) and must not be restarted for it;
they reconnect by themselves. Readiness leaves it out. Imports nothing of the services: a probe runs often.
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request
from pathlib import Path


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.splitlines()[0] if __doc__ else None
    parser.add_argument("address", help="host:port or unix:/path (gRPC health), or http(s)://host:port/path")
    parser.add_argument("--service", default="", help='gRPC service whose health to check ("": the server)')
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    parser.add_argument(
        "--any-status",
        action="store_true",
        help="pass whenever the server answers (liveness), not only when it says SERVING / 2xx (readiness)",
    )
    tls = parser.add_argument_group("TLS (gRPC)")
    tls.add_argument("--tls-ca", type=Path, help="CA certificate to verify the server with (turns TLS on)")
    tls.add_argument("--tls-cert", type=Path, help="client certificate, for servers that ask for one")
    tls.add_argument("--tls-key", type=Path, help="the client certificate's key")
    tls.add_argument("--server-name", help="the name the server's certificate must carry (default: the host)")


def run(args: argparse.Namespace) -> int:
    check = _http if args.address.startswith(("http://", "https://")) else _grpc
    problem = check(args)
    if problem is not None:
        print(f"kvferry health {args.address}: {problem}", file=sys.stderr)
        return 1
    return 0


def _grpc(args: argparse.Namespace) -> str | None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if args.tls_ca is not None:
        key = args.tls_key.read_bytes() if args.tls_key else None
        cert = args.tls_cert.read_bytes() if args.tls_cert else None
        credentials = grpc.ssl_channel_credentials(args.tls_ca.read_bytes(), key, cert)
        options = [("grpc.ssl_target_name_override", args.server_name)] if args.server_name else []
        channel = grpc.secure_channel(args.address, credentials, options)
    else:
        channel = grpc.insecure_channel(args.address)
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
        )
    except grpc.RpcError as error:
        code: grpc.StatusCode = error.code()  # type: ignore[attr-defined]
        if args.any_status and code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return None  # it answered, if only to say it does not know the service
        return f"{code.name}: {error.details()}"  # type: ignore[attr-defined]
    finally:
        channel.close()
    if reply.status == health_pb2.HealthCheckResponse.SERVING or args.any_status:
        return None
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def _http(args: argparse.Namespace) -> str | None:
    try:
        with urllib.request.urlopen(args.address, timeout=args.timeout) as response:
            status = int(response.status)
    except urllib.error.HTTPError as error:  # a 4xx/5xx answer
        status = error.code
    except (urllib.error.URLError, TimeoutError, OSError) as error:
        return f"no answer: {getattr(error, 'reason', error)}"
    if 200 <= status < 300 or args.any_status:
        return None
    return f"HTTP {status}"
