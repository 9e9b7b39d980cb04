"""The Inference Extension endpoint picker: Envoy's ext_proc, answered from the registry (docs/gateway.md)."""
