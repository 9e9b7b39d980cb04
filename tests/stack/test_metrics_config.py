"""`kvferry up --metrics-port`: the Prometheus config it writes scrapes every service under the job labels
the shipped dashboard and alerts select on (deploy/k8s/components/observability)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvferry.stack.settings import StackConfig
from kvferry.stack.up import _metrics_args, _write_prometheus_config

OBSERVABILITY = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "components" / "observability"


def test_the_scrape_config_covers_the_dashboards_jobs(tmp_path: Path) -> None:
    config = StackConfig(metrics_base_port=9300)
    engines = [("prefill-0", "http://127.0.0.1:8100"), ("decode-0", "http://127.0.0.1:8101")]
    path = _write_prometheus_config(config, tmp_path, "127.0.0.1:2379", engines)
    scrape = json.loads(path.read_text())
    targets = {
        job["job_name"]: [t for group in job["static_configs"] for t in group["targets"]]
        for job in scrape["scrape_configs"]
    }
    assert targets == {
        "kvferry-registry": ["127.0.0.1:9300"],
        "kvferry-router": ["127.0.0.1:9301"],
        "kvferry-sidecar": ["127.0.0.1:9302", "127.0.0.1:9303"],
        "vllm": ["127.0.0.1:8100", "127.0.0.1:8101"],
        "kvferry-etcd": ["127.0.0.1:2379"],
    }
    used = set()
    for name in ("kvferry-dashboard.json", "prometheus-rule.yaml"):
        used |= set(re.findall(r'job=\\?"([a-z-]+)\\?"', (OBSERVABILITY / name).read_text()))
    assert used and used <= set(targets), used - set(targets)
    # The sidecars' addresses are the ones they are told to serve on.
    assert _metrics_args(config, 2) == ["--metrics-address", "127.0.0.1:9302"]
    assert _metrics_args(StackConfig(), 2) == []
