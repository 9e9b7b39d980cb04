"""What kvferry reads from vLLM's Prometheus exposition (prometheus_client's parser). Pure."""

from __future__ import annotations

from kvferry.pd.engine_metrics import XFER_BYTES, XFER_COUNT, XFER_SECONDS, metric_sums, parse_metrics


def test_metrics_parse_the_counters_kvferry_reads() -> None:
    text = "\n".join(
        [
            "# HELP vllm:prompt_tokens_by_source_total x",
            'vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 30.0',
            'vllm:prompt_tokens_by_source_total{engine="0",source="external_kv_transfer"} 352.0',
            'vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 352.0',
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25',
            'vllm:prompt_tokens_total{engine="0",model_name="m"} 382.0',
        ]
    )
    metrics = parse_metrics(text)
    assert metrics.prompt_tokens_by_source == {"local_compute": 30.0, "external_kv_transfer": 352.0}
    assert metrics.external_prefix_cache_hits == 352.0
    assert metrics.kv_cache_usage == 0.25 and metrics.prompt_tokens_total == 382.0
    assert metrics.running_requests == 0.0


def test_label_values_with_commas_quotes_and_braces_parse() -> None:
    # The hand parser this replaced split labels on commas: a model name with one lost its source.
    text = "\n".join(
        [
            "# TYPE vllm:prompt_tokens_by_source counter",
            'vllm:prompt_tokens_by_source_total{model_name="a,b=\\"c\\"}",source="local_compute"} 7.0',
            'vllm:prompt_tokens_by_source_created{model_name="a,b",source="local_compute"} 1.7e9',
            'vllm:num_requests_running{model_name="x y"} 2.0',
            'vllm:num_requests_waiting{model_name="x"} NaN',
        ]
    )
    metrics = parse_metrics(text)
    assert metrics.prompt_tokens_by_source == {"local_compute": 7.0}
    assert metrics.running_requests == 2.0 and metrics.waiting_requests == 0.0


def test_histogram_sums_and_counts_add_up_over_label_sets() -> None:
    text = "\n".join(
        [
            "# TYPE vllm:nixl_xfer_time_seconds histogram",
            'vllm:nixl_xfer_time_seconds_bucket{engine="0",le="+Inf"} 3.0',
            'vllm:nixl_xfer_time_seconds_sum{engine="0"} 0.5',
            'vllm:nixl_xfer_time_seconds_count{engine="0"} 3.0',
            'vllm:nixl_xfer_time_seconds_sum{engine="1"} 0.25',
            'vllm:nixl_xfer_time_seconds_count{engine="1"} 1.0',
        ]
    )
    sums = metric_sums(text, (XFER_SECONDS, XFER_COUNT, XFER_BYTES))
    assert sums == {XFER_SECONDS: 0.75, XFER_COUNT: 4.0, XFER_BYTES: 0.0}
