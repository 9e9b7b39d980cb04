"""Pieces every kvferry component shares: the digest chain, logging, ids, gRPC helpers."""
