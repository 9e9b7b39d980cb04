"""Shared fixtures live in tests/fixtures/, one module per real dependency."""

pytest_plugins = [
    "tests.fixtures.etcd",
    "tests.fixtures.registry",
    "tests.fixtures.sidecar",
    "tests.fixtures.router",
    "tests.fixtures.engines",
]
