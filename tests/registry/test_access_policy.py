"""The registry's access rules as plain Python (kvferry.registry.access), no server: identities from
certificate names, and which identity may call which method for which engine."""

from __future__ import annotations

import pytest
from kvferry.registry.access import (
    RULES,
    Identity,
    Role,
    authorize,
    identity_from_auth_context,
    identity_of,
    visible_retention,
)
from kvferry.runtime.errors import NotFound, PermissionDenied, Unauthenticated
from kvferry.v1 import registry_service_pb2 as registry
from kvferry.v1 import resources_pb2 as resources

ENGINE = Identity(Role.ENGINE, "decode-0")
ROUTER = Identity(Role.ROUTER)
ADMIN = Identity(Role.ADMIN)


@pytest.mark.parametrize(
    ("uris", "names", "expected"),
    [
        (["spiffe://cluster.local/ns/llm/kvferry/engine/decode-0"], [], ENGINE),
        (["spiffe://example.org/kvferry/router"], ["whatever"], ROUTER),
        ([], ["engine:decode-0"], ENGINE),
        ([], ["router"], ROUTER),
        ([], ["admin"], ADMIN),
        # A URI SAN wins over the CN.
        (["spiffe://td/kvferry/admin"], ["router"], ADMIN),
        # Nothing kvferry knows: no identity.
        ([], ["engine"], None),
        ([], ["registry"], None),
        (["https://example.org/kvferry/router"], [], None),
        (["spiffe://td/kvferry/engine/bad/id"], [], None),
        (["spiffe://td/kvferry/engine/has space"], [], None),
        # Two URIs naming two identities: ambiguous, none.
        (["spiffe://td/kvferry/router", "spiffe://td/kvferry/admin"], [], None),
    ],
)
def test_identities_from_certificate_names(
    uris: list[str], names: list[str], expected: Identity | None
) -> None:
    assert identity_of(uris, names) == expected


def test_a_certificate_without_an_identity_is_unauthenticated() -> None:
    assert identity_from_auth_context({"x509_common_name": [b"router"]}) == ROUTER
    with pytest.raises(Unauthenticated, match="names no kvferry role"):
        identity_from_auth_context({"x509_common_name": [b"nobody"]})


def test_every_registry_method_has_a_rule() -> None:
    methods = set(registry.DESCRIPTOR.services_by_name["RegistryService"].methods_by_name)
    assert methods == set(RULES)


def test_dev_mode_allows_everything() -> None:
    for method in RULES:
        authorize(None, method, registry.ListEnginesRequest())


def test_unknown_methods_are_refused_to_identities() -> None:
    with pytest.raises(PermissionDenied, match="unlisted-methods"):
        authorize(ADMIN, "DropEverything", registry.ListEnginesRequest())


def test_engines_act_only_for_themselves() -> None:
    own = registry.RegisterEngineRequest(engine=resources.Engine(engine_id="decode-0"))
    other = registry.RegisterEngineRequest(engine=resources.Engine(engine_id="decode-1"))
    authorize(ENGINE, "RegisterEngine", own)
    with pytest.raises(PermissionDenied, match="only-engines-register-themselves") as refused:
        authorize(ENGINE, "RegisterEngine", other)
    assert "engine:decode-0" in refused.value.message and "'decode-1'" in refused.value.message
    authorize(ENGINE, "HeartbeatEngine", registry.HeartbeatEngineRequest(engine_id="decode-0", incarnation=7))
    with pytest.raises(PermissionDenied, match="engines-name-their-incarnation"):
        authorize(ENGINE, "HeartbeatEngine", registry.HeartbeatEngineRequest(engine_id="decode-0"))
    others = resources.Retention(engine_id="decode-1")
    publish = registry.PublishRetentionRequest(retention=others, incarnation=7)
    with pytest.raises(PermissionDenied, match="only-engines-publish-their-own-retentions"):
        authorize(ENGINE, "PublishRetention", publish)
    authorize(ENGINE, "WatchRetentions", registry.WatchRetentionsRequest(engine_id="decode-0"))
    with pytest.raises(PermissionDenied, match="engines-watch-their-own-retentions-or-admin"):
        authorize(ENGINE, "WatchRetentions", registry.WatchRetentionsRequest(engine_id="decode-1"))
    authorize(ADMIN, "WatchRetentions", registry.WatchRetentionsRequest(engine_id="decode-1"))


@pytest.mark.parametrize(
    "method", ["RenewRetention", "RenewRetentions", "ReleaseRetention", "BeginTurn", "EndTurn"]
)
def test_only_routers_act_for_tenants(method: str) -> None:
    authorize(ROUTER, method, registry.RenewRetentionRequest())
    for caller in (ENGINE, ADMIN):
        with pytest.raises(PermissionDenied, match="only-routers-act-for-tenants"):
            authorize(caller, method, registry.RenewRetentionRequest())


@pytest.mark.parametrize(
    "method", ["RegisterEngine", "HeartbeatEngine", "PublishRetention", "EndEngineRetention"]
)
def test_routers_and_admins_do_not_speak_for_engines(method: str) -> None:
    for caller in (ROUTER, ADMIN):
        with pytest.raises(PermissionDenied, match="only engine may"):
            authorize(caller, method, registry.RegisterEngineRequest())


def test_an_engine_sees_only_its_own_retentions() -> None:
    mine = resources.Retention(engine_id="decode-0", conversation_id="c")
    theirs = resources.Retention(engine_id="decode-1", conversation_id="c")
    assert visible_retention(ENGINE, mine) is mine
    assert visible_retention(ROUTER, theirs) is theirs
    assert visible_retention(None, theirs) is theirs
    with pytest.raises(NotFound):
        visible_retention(ENGINE, theirs)
