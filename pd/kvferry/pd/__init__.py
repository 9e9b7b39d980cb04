"""The P/D contract: what kvferry's router, connector, stack, benchmarks and tools agree on.

One floor above the generated API (``kvferry.v1``); it imports nothing else of kvferry, so it can ship as its
own distribution. Pure modules (the connector, inside vLLM, imports only these):

- :mod:`kvferry.pd.vllm_params`: every key of vLLM's ``kv_transfer_params`` kvferry reads or writes, typed;
- :mod:`kvferry.pd.kvferry_params`: kvferry's own keys in ``kv_transfer_params``, with their version history;
- :mod:`kvferry.pd.digest`: the block digest chain the connector publishes and the router checks;
- :mod:`kvferry.pd.block_runs`: how consecutive a list of block ids is (pull descriptors, pull cost);
- :mod:`kvferry.pd.reuse`: which retained prefix a prefill may pull, and until when;
- :mod:`kvferry.pd.engine_api`: the requests and answers of one engine in P/D mode, and the engine port.

With the HTTP stack (aiohttp, prometheus_client), for the router, the stack, the benchmarks and tools:

- :mod:`kvferry.pd.engine_client`: the typed async client of one vLLM engine;
- :mod:`kvferry.pd.engine_metrics`: what kvferry reads from an engine's Prometheus endpoint;
- :mod:`kvferry.pd.sequence`: the one prefill-then-decode sequence of a turn.
"""
