"""What kvferry reads from a vLLM engine's Prometheus endpoint (``/metrics``), parsed by prometheus_client."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

PROMPT_TOKENS = "vllm:prompt_tokens_total"
# By ``source`` label: local_compute, local_cache_hit, external_kv_transfer, ...
PROMPT_TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source_total"
EXTERNAL_PREFIX_CACHE_HITS = "vllm:external_prefix_cache_hits_total"
EXTERNAL_PREFIX_CACHE_QUERIES = "vllm:external_prefix_cache_queries_total"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
RUNNING_REQUESTS = "vllm:num_requests_running"
WAITING_REQUESTS = "vllm:num_requests_waiting"
# NIXL transfers (on P: its pulls from D; on D: its pulls from P) and the engine's own TTFT.
XFER_SECONDS = "vllm:nixl_xfer_time_seconds_sum"
XFER_COUNT = "vllm:nixl_xfer_time_seconds_count"
XFER_BYTES = "vllm:nixl_bytes_transferred_sum"
TTFT_SECONDS = "vllm:time_to_first_token_seconds_sum"
TTFT_COUNT = "vllm:time_to_first_token_seconds_count"


@dataclass(frozen=True)
class EngineMetrics:
    """Counters from the engine's Prometheus endpoint (summed over label sets)."""

    prompt_tokens_total: float
    # vllm:prompt_tokens_by_source, by ``source`` label.
    prompt_tokens_by_source: Mapping[str, float]
    external_prefix_cache_hits: float
    external_prefix_cache_queries: float
    kv_cache_usage: float
    running_requests: float
    waiting_requests: float


def samples(text: str) -> Iterable[Sample]:
    """Every sample of a Prometheus text exposition, NaN and infinite values left out."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if math.isfinite(sample.value):
                yield sample


def metric_sums(text: str, names: Iterable[str]) -> dict[str, float]:
    """Sum of each named series over its label sets (0 for a series the text lacks)."""
    sums = dict.fromkeys(names, 0.0)
    for sample in samples(text):
        if sample.name in sums:
            sums[sample.name] += sample.value
    return sums


def parse_metrics(text: str) -> EngineMetrics:
    """The counters kvferry reads from vLLM's Prometheus text format."""
    sums: dict[str, float] = {}
    by_source: dict[str, float] = {}
    for sample in samples(text):
        sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
        source = sample.labels.get("source")
        if sample.name == PROMPT_TOKENS_BY_SOURCE and source is not None:
            by_source[source] = by_source.get(source, 0.0) + sample.value
    return EngineMetrics(
        prompt_tokens_total=sums.get(PROMPT_TOKENS, 0.0),
        prompt_tokens_by_source=by_source,
        external_prefix_cache_hits=sums.get(EXTERNAL_PREFIX_CACHE_HITS, 0.0),
        external_prefix_cache_queries=sums.get(EXTERNAL_PREFIX_CACHE_QUERIES, 0.0),
        kv_cache_usage=sums.get(KV_CACHE_USAGE, 0.0),
        running_requests=sums.get(RUNNING_REQUESTS, 0.0),
        waiting_requests=sums.get(WAITING_REQUESTS, 0.0),
    )
