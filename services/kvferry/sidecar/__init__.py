"""The engine sidecar: registers one vLLM engine in the registry and relays its retentions.

Logic lives in plain asyncio classes with injected clocks and registry/engine interfaces
(registration, releases, publishing); ``service`` holds the thin gRPC handlers and ``app`` wires
everything together.
"""
