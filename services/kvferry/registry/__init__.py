"""The KV-metadata registry: engines and the KV they retain, in etcd under leases.

Entry points: ``kvferry registry`` (``kvferry.registry.cli``) and, in-process,
``kvferry.registry.server.create_registry``.
"""
