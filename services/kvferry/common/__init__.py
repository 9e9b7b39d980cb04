"""Pieces every kvferry service shares: logging, ids, gRPC helpers (the P/D contract is kvferry.pd)."""
