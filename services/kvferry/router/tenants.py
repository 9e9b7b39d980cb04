"""API keys mapped to tenants, loaded from a JSON or TOML file (format in docs/router.md).

TOML::

    [[tenants]]
    name = "acme"
    api_keys = ["sk-acme-1"]                 # plain keys, or
    api_key_sha256 = ["9f86d081884c7d65..."]  # hex SHA-256 of keys, so the file holds no secret
    models = ["qwen3-tiny"]                  # optional: models the tenant may use (default: all)
    tokens_per_second = 2000                 # optional: prompt plus generated tokens per second on each
                                             # router (default: --tokens-per-second-per-tenant; 0: no cap)

JSON: the same structure, ``{"tenants": [{"name": ..., "api_keys": [...], ...}]}``.

Keys are looked up by their SHA-256, so a lookup never compares secrets byte by byte.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvferry.runtime.errors import PermissionDenied, Unauthenticated
from kvferry.runtime.ids import check_id

_BEARER = "bearer "


@dataclass(frozen=True)
class Tenant:
    name: str
    # Models this tenant may use; None means every served model.
    models: frozenset[str] | None = None
    # Tokens (prompt plus generated) per second on each router; None: the router's default, 0: no cap.
    tokens_per_second: float | None = None

    def check_model(self, model: str) -> None:
        if self.models is not None and model not in self.models:
            raise PermissionDenied(
                f"tenant {self.name!r} may not use model {model!r}; allowed: {sorted(self.models)}",
                param="model",
            )


def key_digest(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


class TenantConfigError(ValueError):
    """The tenants file is malformed; the message names the file and the entry."""


class ApiKeys:
    """Resolves ``authorization`` header values to tenants."""

    def __init__(self, tenants_by_key_digest: Mapping[str, Tenant]) -> None:
        self._by_digest = dict(tenants_by_key_digest)

    def __len__(self) -> int:
        return len(self._by_digest)

    @classmethod
    def from_pairs(cls, pairs: Iterable[tuple[str, str]]) -> ApiKeys:
        """From (api key, tenant name) pairs; every tenant may use every model."""
        return cls({key_digest(key): Tenant(name=tenant) for key, tenant in pairs})

    def merged(self, other: ApiKeys) -> ApiKeys:
        """Both tables (the tenants file's and --api-keys'); TenantConfigError when they give one tenant
        other settings (its limits are kept by name) or one key to two tenants."""
        settings = {tenant.name: tenant for tenant in self._by_digest.values()}
        for digest, tenant in other._by_digest.items():
            if settings.get(tenant.name, tenant) != tenant:
                raise TenantConfigError(
                    f"tenant {tenant.name!r} is given by both the tenants file and --api-keys, with other "
                    "models or tokens_per_second; give its keys in one place"
                )
            mine = self._by_digest.get(digest)
            if mine is not None and mine.name != tenant.name:
                raise TenantConfigError(
                    f"an API key of tenant {tenant.name!r} (--api-keys) is tenant {mine.name!r}'s in the "
                    "tenants file"
                )
        return ApiKeys({**self._by_digest, **other._by_digest})

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant of an ``authorization`` value (``Bearer <key>``), or UNAUTHENTICATED."""
        if not authorization:
            raise Unauthenticated(
                "missing API key: send `authorization: Bearer <key>` (HTTP header or gRPC metadata)",
            )
        if not authorization[: len(_BEARER)].lower() == _BEARER:
            raise Unauthenticated("the authorization value must have the form `Bearer <key>`")
        tenant = self._by_digest.get(key_digest(authorization[len(_BEARER) :].strip()))
        if tenant is None:
            raise Unauthenticated("unknown API key: check the key the router was given")
        return tenant


def parse_tenants(document: Mapping[str, Any], source: str, entry_lines: Sequence[int] = ()) -> ApiKeys:
    """Builds the key table from a parsed tenants document; ``source`` names it in errors, with the line of
    each entry where ``entry_lines`` gives one per entry (a TOML file's ``[[tenants]]`` headers)."""
    entries = document.get("tenants")
    if not isinstance(entries, list) or not entries:
        raise TenantConfigError(f"{source}: expected a non-empty `tenants` list")
    lines = list(entry_lines) if len(entry_lines) == len(entries) else []
    table: dict[str, Tenant] = {}
    entry_of: dict[str, str] = {}
    for index, entry in enumerate(entries):
        at = f"tenants[{index}]" + (f" (line {lines[index]})" if lines else "")
        where = f"{source}: {at}"
        if not isinstance(entry, Mapping):
            raise TenantConfigError(f"{where} must be a table/object")
        unknown = set(entry) - {"name", "api_keys", "api_key_sha256", "models", "tokens_per_second"}
        if unknown:
            raise TenantConfigError(f"{where} has unknown fields {sorted(unknown)}")
        name = entry.get("name")
        if not isinstance(name, str) or (problem := check_id("tenant name", name)) is not None:
            raise TenantConfigError(
                f"{where}: {problem if isinstance(name, str) else 'name must be a string'}"
            )
        models = entry.get("models")
        if models is not None and (
            not isinstance(models, list) or not all(isinstance(m, str) and m for m in models)
        ):
            raise TenantConfigError(f"{where}: models must be a list of model names")
        rate = entry.get("tokens_per_second")
        if rate is not None and (
            isinstance(rate, bool) or not isinstance(rate, int | float) or not math.isfinite(rate) or rate < 0
        ):
            raise TenantConfigError(f"{where}: tokens_per_second must be a number >= 0 (0: no cap)")
        if name in entry_of:
            # Limits are kept per tenant name: two entries would share one token bucket, each resetting it
            # to its own rate, and split the tenant's settings by key.
            raise TenantConfigError(
                f"{where}: tenant {name!r} is already defined by {entry_of[name]}; give each tenant one "
                "entry and list all its keys there"
            )
        entry_of[name] = at
        tenant = Tenant(
            name=name,
            models=frozenset(models) if models is not None else None,
            tokens_per_second=float(rate) if rate is not None else None,
        )
        digests = [key_digest(k) for k in _strings(entry.get("api_keys", []), f"{where}.api_keys")]
        for digest in _strings(entry.get("api_key_sha256", []), f"{where}.api_key_sha256"):
            if len(digest) != 64 or any(c not in "0123456789abcdefABCDEF" for c in digest):
                raise TenantConfigError(f"{where}.api_key_sha256: {digest[:12]!r}... is not a hex SHA-256")
            digests.append(digest.lower())
        if not digests:
            raise TenantConfigError(f"{where}: tenant {name!r} has no api_keys or api_key_sha256")
        for digest in digests:
            if digest in table and table[digest].name != name:
                raise TenantConfigError(f"{where}: an API key of {name!r} is also {table[digest].name!r}'s")
            table[digest] = tenant
    return ApiKeys(table)


def load_tenants(path: Path) -> ApiKeys:
    """Loads a tenants file; ``.toml`` is read as TOML, anything else as JSON."""
    try:
        text = path.read_text()
    except OSError as error:
        raise TenantConfigError(f"cannot read tenants file {path}: {error.strerror}") from None
    try:
        document = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as error:
        kind = "TOML" if path.suffix == ".toml" else "JSON"
        raise TenantConfigError(f"{path}: not valid {kind}: {error}") from None
    if not isinstance(document, Mapping):
        raise TenantConfigError(f"{path}: expected an object at the top level")
    return parse_tenants(document, str(path), _entry_lines(text) if path.suffix == ".toml" else ())


_TOML_ENTRY = re.compile(r"^[ \t]*\[\[[ \t]*tenants[ \t]*\]\]", re.MULTILINE)


def _entry_lines(text: str) -> list[int]:
    """The line of each ``[[tenants]]`` header of a TOML file, counted from 1."""
    return [text.count("\n", 0, match.start()) + 1 for match in _TOML_ENTRY.finditer(text)]


def parse_key_pairs(spec: str) -> ApiKeys:
    """From ``key=tenant,key2=tenant2`` (the ``--api-key`` flag / env form, handy for local stacks)."""
    pairs: list[tuple[str, str]] = []
    for number, item in enumerate(filter(None, (part.strip() for part in spec.split(","))), start=1):
        key, sep, tenant = item.partition("=")
        # The message names the entry by its place, never by its text: that would show part of a key.
        if not sep or not key or (problem := check_id("tenant name", tenant)) is not None:
            raise TenantConfigError(
                f"API key entry {number} (comma-separated, counted from 1): expected KEY=TENANT"
                + (f" ({problem})" if sep and key else "")
            )
        pairs.append((key, tenant))
    return ApiKeys.from_pairs(pairs)


def _strings(value: Any, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise TenantConfigError(f"{where} must be a list of non-empty strings")
    return list(value)
