"""deploy/prometheus: the alert rules through promtool (check + unit tests), the scrape config, and
every metric an alert uses is one llama-guard exports."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import yaml
from needs import unavailable

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "prometheus"
RULES = DEPLOY / "llama-guard.rules.yml"


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        unavailable("promtool not installed (Debian package prometheus; .ci/run installs it); "
                    "the YAML is still checked below")
    return found


def test_rules_pass_promtool_check_and_unit_tests() -> None:
    tool = promtool()
    out = subprocess.run([tool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr
    out = subprocess.run([tool, "test", "rules", "llama-guard.rules.test.yml"], cwd=DEPLOY,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_scrape_config_passes_promtool(tmp_path: Path) -> None:
    tool = promtool()
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    config["rule_files"] = [str(RULES)]  # the installed path, pointed at the repository's file
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    out = subprocess.run([tool, "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_rules_yaml_structure_and_metric_names() -> None:
    doc = yaml.safe_load(RULES.read_text())
    rules = [r for g in doc["groups"] for r in g["rules"]]
    names = {r["alert"] for r in rules}
    assert {"LlamaServerCrashLoop", "LlamaGuardGpuLost", "LlamaGuardResetBudgetSpent", "LlamaGuardGpuHot",
            "LlamaServerNotReady", "LlamaServerDecayRestartsFrequent"} <= names
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"]
    source = (ROOT / "supervisor" / "llama_guard" / "exporter" / "metrics.py").read_text()
    used = {m for r in rules for m in re.findall(r"\bllama_guard_[a-z_]+", r["expr"])}
    for metric in used:
        base = metric.removesuffix("_total")
        assert f'"{base}"' in source, f"{metric} is used by an alert but not exported"
