"""deploy/monitoring/ as the monitoring tests read it: the dashboards' queries and the alerts' expressions."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
MONITORING = REPO_ROOT / "deploy" / "monitoring"
RULES_FILE = MONITORING / "alerts.rules.yaml"
PROMETHEUS_RULE_FILE = MONITORING / "prometheusrule.yaml"
POD_MONITORS_FILE = MONITORING / "podmonitors.yaml"
SCRAPE_CONFIG_FILE = MONITORING / "prometheus-scrape-config.yaml"
DASHBOARD_FILES = sorted((MONITORING / "dashboards").glob("*.json"))
ALERT_TESTS_FILE = Path(__file__).resolve().parent / "alerts.test.yaml"
# The job label of each component's targets, as podmonitors.yaml and prometheus-scrape-config.yaml set it.
JOBS = ("memory-service", "inference-node", "inference-router")


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str
    panel: str
    ref_id: str
    expr: str

    def __str__(self) -> str:
        return f"{self.dashboard} / {self.panel} / {self.ref_id}"


def dashboards() -> dict[str, dict[str, Any]]:
    """Each dashboard's JSON by file name."""
    return {path.name: json.loads(path.read_text()) for path in DASHBOARD_FILES}


def all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, those nested in collapsed rows included."""
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels", []))


def panel_queries() -> list[PanelQuery]:
    return [PanelQuery(name, panel["title"], target["refId"], target["expr"])
            for name, dashboard in dashboards().items() for panel in all_panels(dashboard["panels"])
            for target in panel.get("targets", [])]


def rule_groups(path: Path = RULES_FILE) -> list[dict[str, Any]]:
    return yaml.safe_load(path.read_text())["groups"]


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in rule_groups() for rule in group["rules"]]
