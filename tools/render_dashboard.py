#!/usr/bin/env python3
"""Renders kvferry's Grafana dashboard to a PNG from a real Prometheus, without Grafana.

Grafana is not in any package registry reachable here; Prometheus is (Debian's `prometheus`). This asks
Prometheus for every panel's queries exactly as the dashboard JSON writes them (variables substituted:
`$namespace` as `.*`, `$__rate_interval`, the textbox variables' values or `--var NAME=VALUE`), over a time
range, and draws the panels where the dashboard places them (its 24-column grid): time series as lines with
their legends, stats as their last value. Panels whose queries return nothing are drawn "No data" and
listed on stdout: a panel that shows nothing after a run that exercised it is a panel to fix.

    tools/render_dashboard.py --prometheus http://127.0.0.1:9090 --minutes 15 --output docs/images/x.png

docs/observability.md ("The dashboard, rendered") gives the run behind docs/images/kvferry-dashboard.png.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import matplotlib

matplotlib.use("Agg")
import matplotlib.dates as mdates
import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter

REPO = Path(__file__).resolve().parent.parent
DASHBOARD = REPO / "deploy" / "k8s" / "components" / "observability" / "kvferry-dashboard.json"
# Grafana's dark theme, roughly: the PNG should read like the dashboard.
BACKGROUND, PANEL, TEXT, GRID = "#111217", "#181b1f", "#ccccdc", "#2c3235"
PALETTE = ["#73bf69", "#f2cc0c", "#8ab8ff", "#ff780a", "#f2495c", "#5794f2", "#b877d9", "#fade2a", "#c4162a"]
GRID_UNIT_INCHES = 0.36  # one grid row; 24 columns span the figure's width


@dataclass
class Series:
    legend: str
    times: list[float]
    values: list[float]


@dataclass
class PanelData:
    title: str
    kind: str
    unit: str
    grid: dict[str, int]
    series: list[Series] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def substitute(expr: str, variables: dict[str, str]) -> str:
    # Longest names first, so $__rate_interval is not read as $__rate followed by text.
    for name in sorted(variables, key=len, reverse=True):
        expr = expr.replace("${" + name + "}", variables[name]).replace("$" + name, variables[name])
    return expr


def legend_of(template: str, labels: dict[str, str]) -> str:
    if not template:
        return "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template)


def query_panels(
    dashboard: dict[str, Any],
    prometheus: str,
    start: float,
    end: float,
    step: float,
    variables: dict[str, str],
) -> list[PanelData]:
    panels: list[PanelData] = []
    with httpx.Client(base_url=prometheus, timeout=30) as client:
        for panel in dashboard["panels"]:
            unit = ((panel.get("fieldConfig") or {}).get("defaults") or {}).get("unit", "short")
            data = PanelData(panel.get("title", ""), panel["type"], unit, panel["gridPos"])
            for target in panel.get("targets") or []:
                expr = substitute(target["expr"], variables)
                answer = client.get(
                    "/api/v1/query_range", params={"query": expr, "start": start, "end": end, "step": step}
                ).json()
                if answer.get("status") != "success":
                    data.errors.append(f"{target.get('refId')}: {answer.get('error')}")
                    continue
                for result in answer["data"]["result"]:
                    points = [(float(t), float(v)) for t, v in result["values"] if math.isfinite(float(v))]
                    if points:
                        times, values = zip(*points, strict=True)
                        legend = legend_of(target.get("legendFormat", ""), result["metric"])
                        data.series.append(Series(legend, list(times), list(values)))
            panels.append(data)
    return panels


def formatter(unit: str) -> FuncFormatter:
    def scaled(value: float, steps: list[tuple[float, str]], suffix: str) -> str:
        for factor, prefix in steps:
            if abs(value) >= factor:
                return f"{value / factor:.3g} {prefix}{suffix}"
        return f"{value:.3g} {suffix}".strip()

    binary = [(2.0**40, "Ti"), (2.0**30, "Gi"), (2.0**20, "Mi"), (2.0**10, "Ki")]
    decimal = [(1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")]

    def format_value(value: float, _: object = None) -> str:
        if unit == "percentunit":
            return f"{value * 100:.3g}%"
        if unit == "s":
            return f"{value * 1000:.3g} ms" if abs(value) < 1 else f"{value:.3g} s"
        if unit == "bytes":
            return scaled(value, binary, "B")
        if unit in ("Bps", "binBps"):
            return scaled(value, decimal, "B/s")
        if unit in ("ops", "reqps"):
            return scaled(value, decimal, "/s")
        return scaled(value, decimal, "")

    return FuncFormatter(format_value)


def draw(panels: list[PanelData], title: str, subtitle: str, output: Path, span: float) -> None:
    rows = max(p.grid["y"] + p.grid["h"] for p in panels)
    width, header = 24 * 0.95, 1.1
    height = rows * GRID_UNIT_INCHES + header
    figure = plt.figure(figsize=(width, height), facecolor=BACKGROUND)
    figure.text(0.01, 1 - 0.35 / height, title, color=TEXT, fontsize=18, weight="bold", va="center")
    figure.text(0.01, 1 - 0.8 / height, subtitle, color="#8e8e8e", fontsize=10, va="center")
    pad = 0.06  # inches between panels
    for panel in panels:
        g = panel.grid
        left = g["x"] / 24 + pad / width
        panel_width = g["w"] / 24 - 2 * pad / width
        top = 1 - (header + g["y"] * GRID_UNIT_INCHES) / height
        panel_height = (g["h"] * GRID_UNIT_INCHES - 2 * pad) / height
        if panel.kind == "row":
            figure.text(
                left, top - panel_height / 2, panel.title, color=TEXT, fontsize=13, weight="bold", va="center"
            )
            continue
        # The panel's frame, then the plot inside it below the title.
        frame = figure.add_axes((left, top - panel_height, panel_width, panel_height))
        frame.set_facecolor(PANEL)
        frame.set_xticks([])
        frame.set_yticks([])
        for spine in frame.spines.values():
            spine.set_color(GRID)
        frame.text(
            0.01,
            0.97,
            panel.title,
            color=TEXT,
            fontsize=10.5,
            weight="bold",
            va="top",
            transform=frame.transAxes,
        )
        if not panel.series:
            message = "No data" if not panel.errors else "Query error: " + "; ".join(panel.errors)[:120]
            frame.text(
                0.5, 0.45, message, color="#8e8e8e", fontsize=12, ha="center", transform=frame.transAxes
            )
            continue
        fmt = formatter(panel.unit)
        if panel.kind == "stat":
            series = panel.series[0]
            frame.text(
                0.5, 0.42, fmt(series.values[-1]), color=PALETTE[0], fontsize=30, weight="bold",
                ha="center", va="center", transform=frame.transAxes,
            )  # fmt: skip
            spark = figure.add_axes((left, top - panel_height, panel_width, panel_height * 0.3))
            spark.fill_between([*map(_when, series.times)], series.values, color=PALETTE[0], alpha=0.2)
            spark.set_axis_off()
            continue
        legend_rows = min(len(panel.series), 4)
        plot_bottom = top - panel_height + panel_height * (0.12 + 0.075 * legend_rows)
        plot = figure.add_axes(
            (left + 0.035, plot_bottom, panel_width - 0.045, top - plot_bottom - panel_height * 0.16)
        )
        plot.set_facecolor(PANEL)
        for index, series in enumerate(panel.series):
            plot.plot(
                [*map(_when, series.times)], series.values, color=PALETTE[index % len(PALETTE)],
                linewidth=1.4, label=series.legend[:60],
            )  # fmt: skip
        plot.yaxis.set_major_formatter(fmt)
        plot.xaxis.set_major_locator(mdates.AutoDateLocator(minticks=3, maxticks=7))
        plot.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S" if span < 900 else "%H:%M"))
        plot.tick_params(colors="#8e8e8e", labelsize=8)
        plot.grid(color=GRID, linewidth=0.6)
        for spine in plot.spines.values():
            spine.set_visible(False)
        handles, labels = plot.get_legend_handles_labels()
        plot.legend(
            handles[:8], labels[:8], loc="upper left", bbox_to_anchor=(0, -0.12), ncol=2, frameon=False,
            fontsize=8, labelcolor=TEXT,
        )  # fmt: skip
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=80, facecolor=BACKGROUND)
    plt.close(figure)


def _when(timestamp: float) -> float:
    return float(mdates.date2num(datetime.datetime.fromtimestamp(timestamp, tz=datetime.UTC)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090", help="Prometheus base URL")
    parser.add_argument("--dashboard", type=Path, default=DASHBOARD)
    parser.add_argument("--minutes", type=float, default=15, help="time range: the last N minutes")
    parser.add_argument("--end", type=float, default=0, help="end of the range, Unix seconds (default: now)")
    parser.add_argument("--step", type=float, default=5, help="seconds between points")
    parser.add_argument("--rate-interval", default="30s", help="$__rate_interval (4 scrape intervals)")
    parser.add_argument("--var", action="append", default=[], help="NAME=VALUE for a dashboard variable")
    parser.add_argument("--subtitle", default="", help="a line under the title (what run this shows)")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    dashboard = json.loads(args.dashboard.read_text())
    variables = {"namespace": ".*", "__rate_interval": args.rate_interval}
    for variable in (dashboard.get("templating") or {}).get("list") or []:
        if variable.get("type") in ("textbox", "constant"):
            variables[variable["name"]] = str(variable.get("query", ""))
    for item in args.var:
        name, _, value = item.partition("=")
        variables[name] = value
    end = args.end or time.time()
    panels = query_panels(dashboard, args.prometheus, end - args.minutes * 60, end, args.step, variables)
    draw(panels, dashboard.get("title", "dashboard"), args.subtitle, args.output, args.minutes * 60)
    empty = [p.title for p in panels if p.kind != "row" and not p.series]
    print(f"render_dashboard: {args.output}: {len(panels)} panels, {len(empty)} without data")
    for title in empty:
        errors = next(p.errors for p in panels if p.title == title)
        print(f"  no data: {title}" + (f" ({'; '.join(errors)})" if errors else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
