"""The router: kvferry's front door (gRPC and OpenAI-compatible HTTP) and the per-turn orchestration of
prefill and decode engines with reuse of a conversation's retained KV."""
