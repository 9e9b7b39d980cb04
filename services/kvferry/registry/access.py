"""Who may call what on the registry: identities from client certificates, roles, and the rules (pure).

With mutual TLS (``--tls-*``) every caller presents a certificate from the deployment's CA, and its
identity names one role:

- ``engine:<engine-id>`` (URI SAN ``spiffe://<trust-domain>/.../kvferry/engine/<engine-id>``, or CN
  ``engine:<engine-id>``): registers, heartbeats, deregisters, publishes, ends and watches the retentions of
  that engine id only, naming its current incarnation in heartbeats and publishes; looks up a retention only
  while that engine holds it.
- ``router`` (URI SAN ``.../kvferry/router``, or CN ``router``): looks up, renews and releases tenants'
  conversations, marks turns, lists and watches engines and all retentions.
- ``admin`` (URI SAN ``.../kvferry/admin``, or CN ``admin``): lists and watches everything, looks up any
  retention, deregisters any engine.

A URI SAN wins over the CN. Each refusal is PERMISSION_DENIED naming the rule (:data:`RULES`); a certificate
that names no role is UNAUTHENTICATED. Without TLS (the local stack, tests) there is no identity and every
call is served as before: the network is the boundary then.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvferry.runtime.errors import NotFound, PermissionDenied, Unauthenticated
from kvferry.runtime.ids import check_id
from kvferry.v1 import resources_pb2 as resources

SPIFFE_SCHEME = "spiffe://"


class Role(enum.Enum):
    ENGINE = "engine"
    ROUTER = "router"
    ADMIN = "admin"


@dataclass(frozen=True)
class Identity:
    """A caller proven by its certificate: a role, and for engines the one engine id it speaks for."""

    role: Role
    engine_id: str = ""

    def __str__(self) -> str:
        return f"engine:{self.engine_id}" if self.role is Role.ENGINE else self.role.value


def _from_words(words: Sequence[str]) -> Identity | None:
    """``("engine", id)``, ``("router",)`` or ``("admin",)`` as an identity; None for anything else."""
    if len(words) == 2 and words[0] == Role.ENGINE.value and check_id("engine id", words[1]) is None:
        return Identity(Role.ENGINE, words[1])
    if len(words) == 1 and words[0] in (Role.ROUTER.value, Role.ADMIN.value):
        return Identity(Role(words[0]))
    return None


def identity_from_uri(uri: str) -> Identity | None:
    """The identity a SPIFFE-style URI names: the path's segments after its last ``kvferry`` segment."""
    if not uri.startswith(SPIFFE_SCHEME):
        return None
    segments = uri[len(SPIFFE_SCHEME) :].split("/")[1:]  # the first is the trust domain
    if "kvferry" not in segments:
        return None
    last = len(segments) - 1 - segments[::-1].index("kvferry")
    return _from_words(segments[last + 1 :])


def identity_from_common_name(common_name: str) -> Identity | None:
    role, colon, engine_id = common_name.partition(":")
    return _from_words([role, engine_id] if colon else [role])


def identity_of(uris: Sequence[str], common_names: Sequence[str]) -> Identity | None:
    """The one identity a certificate's URI SANs (else its CN) name; None when none, or when they disagree."""
    from_uris = {identity for identity in map(identity_from_uri, uris) if identity is not None}
    if from_uris:
        return from_uris.pop() if len(from_uris) == 1 else None
    from_names = {identity for identity in map(identity_from_common_name, common_names) if identity}
    return from_names.pop() if len(from_names) == 1 else None


def identity_from_auth_context(auth: Mapping[str, Sequence[bytes]]) -> Identity:
    """The caller's identity from grpc's auth context of a mutual-TLS call; Unauthenticated without one."""
    uris = [value.decode() for value in auth.get("peer_uri", ())]
    names = [value.decode() for value in auth.get("x509_common_name", ())]
    identity = identity_of(uris, names)
    if identity is None:
        raise Unauthenticated(
            f"the client certificate (URI SANs {uris or 'none'}, CN {names or 'none'}) names no kvferry "
            "role: give it a URI SAN spiffe://<trust-domain>/kvferry/{engine/<engine-id>|router|admin} "
            "or the CN engine:<engine-id>, router or admin"
        )
    return identity


@dataclass(frozen=True)
class Rule:
    """Who may call one method: the roles, and for engines the engine id the request names."""

    name: str
    roles: frozenset[Role]
    # The engine id the request acts for; an engine caller must be that engine.
    engine_of: Callable[[Any], str] | None = None
    # Engine callers must name their incarnation (field name) so a stale one is refused.
    incarnation_field: str | None = None


_ENGINE = frozenset({Role.ENGINE})
_ROUTER = frozenset({Role.ROUTER})
_READERS = frozenset({Role.ROUTER, Role.ADMIN})
_ENGINE_OR_ADMIN = frozenset({Role.ENGINE, Role.ADMIN})

# One rule per RegistryService method; a method without one is refused to everyone but in dev mode.
RULES: dict[str, Rule] = {
    "RegisterEngine": Rule("only-engines-register-themselves", _ENGINE, lambda r: r.engine.engine_id),
    "HeartbeatEngine": Rule(
        "only-engines-heartbeat-themselves", _ENGINE, lambda r: r.engine_id, incarnation_field="incarnation"
    ),
    "DeregisterEngine": Rule(
        "engines-deregister-themselves-or-admin", _ENGINE_OR_ADMIN, lambda r: r.engine_id
    ),
    "PublishRetention": Rule(
        "only-engines-publish-their-own-retentions",
        _ENGINE,
        lambda r: r.retention.engine_id,
        incarnation_field="incarnation",
    ),
    "EndEngineRetention": Rule("only-engines-end-their-own-retentions", _ENGINE, lambda r: r.engine_id),
    "WatchRetentions": Rule(
        "engines-watch-their-own-retentions-or-admin", _ENGINE_OR_ADMIN, lambda r: r.engine_id
    ),
    "GetRetention": Rule(
        "retentions-are-read-by-routers-admins-and-their-engine", frozenset({Role.ENGINE, *_READERS})
    ),
    "RenewRetention": Rule("only-routers-act-for-tenants", _ROUTER),
    "RenewRetentions": Rule("only-routers-act-for-tenants", _ROUTER),
    "ReleaseRetention": Rule("only-routers-act-for-tenants", _ROUTER),
    "BeginTurn": Rule("only-routers-act-for-tenants", _ROUTER),
    "EndTurn": Rule("only-routers-act-for-tenants", _ROUTER),
    "ListEngines": Rule("routers-and-admins-list-and-watch-all", _READERS),
    "WatchEngines": Rule("routers-and-admins-list-and-watch-all", _READERS),
    "WatchAllRetentions": Rule("routers-and-admins-list-and-watch-all", _READERS),
}


def authorize(caller: Identity | None, method: str, request: Any) -> None:
    """PermissionDenied naming the rule unless ``caller`` may call ``method`` with ``request``.
    ``caller`` None is dev mode (no TLS): every call is allowed."""
    if caller is None:
        return
    rule = RULES.get(method)
    if rule is None:
        raise PermissionDenied(f"{caller} may not call {method}: no rule allows it (rule 'unlisted-methods')")
    if caller.role not in rule.roles:
        allowed = " or ".join(sorted(role.value for role in rule.roles))
        raise PermissionDenied(f"{caller} may not call {method}: only {allowed} may (rule '{rule.name}')")
    if caller.role is not Role.ENGINE:
        return
    if rule.engine_of is not None and rule.engine_of(request) != caller.engine_id:
        raise PermissionDenied(
            f"{caller} may not call {method} for engine {rule.engine_of(request)!r}: an engine acts only "
            f"for its own engine id (rule '{rule.name}')"
        )
    if rule.incarnation_field is not None and not getattr(request, rule.incarnation_field):
        raise PermissionDenied(
            f"{caller} must name its incarnation (the RegisterEngine answer's) in "
            f"{method}.{rule.incarnation_field} (rule 'engines-name-their-incarnation')"
        )


def visible_retention(caller: Identity | None, retention: resources.Retention) -> resources.Retention:
    """``retention`` if ``caller`` may see it; an engine sees only what it holds (another engine's record is
    NOT_FOUND to it, which is what its sweep needs to know: not this engine's any more)."""
    if caller is not None and caller.role is Role.ENGINE and retention.engine_id != caller.engine_id:
        raise NotFound(
            f"engine {caller.engine_id} holds no retention of conversation {retention.conversation_id!r}"
        )
    return retention
