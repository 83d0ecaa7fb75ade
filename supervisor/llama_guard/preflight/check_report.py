"""``llama-guard check --json``: the preflight lines reduced to one node verdict and one recommended
action, the way node-health gates report (NVIDIA's GPU health validation prints one JSON verdict;
Kubernetes' node-problem-detector reads a custom plugin's exit code: 0 OK, 1 NonOK, 2 Unknown).

Pure: :func:`overall` takes the :class:`~llama_guard.vocab.verdicts.CheckResult` lines, :func:`document`
gives the JSON document. The exit codes are :mod:`llama_guard.vocab.exitcodes`' ``EXIT_GATE_*``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llama_guard.vocab.exitcodes import EXIT_GATE_FAIL, EXIT_GATE_PASS, EXIT_GATE_UNKNOWN
from llama_guard.vocab.verdicts import CheckResult, NodeAction, NodeVerdict, Verdict

SCHEMA = 1


@dataclass(frozen=True)
class Overall:
    """The node's verdict, the action it needs, and the lines that decided both (``name: detail``)."""

    verdict: NodeVerdict
    action: NodeAction
    reasons: tuple[str, ...]

    @property
    def exit_code(self) -> int:
        """0 pass or warn, 1 fail, 2 unknown."""
        if self.verdict is NodeVerdict.FAIL:
            return EXIT_GATE_FAIL
        if self.verdict is NodeVerdict.UNKNOWN:
            return EXIT_GATE_UNKNOWN
        return EXIT_GATE_PASS

    @property
    def summary(self) -> str:
        """One line for a node condition's message: ``fail (fix_config): vram budget: …`` (the first reason)."""
        head = f"{self.verdict.value} ({self.action.value})"
        return f"{head}: {self.reasons[0]}" if self.reasons else head


def _action(result: CheckResult) -> NodeAction:
    """A FAIL that names no action is a configuration problem; a WARN asks only what it names."""
    if result.verdict is Verdict.FAIL and result.action is NodeAction.NONE:
        return NodeAction.FIX_CONFIG
    return result.action


def overall(results: Sequence[CheckResult]) -> Overall:
    """``fail`` when any line FAILs (``warn`` when any WARNs, else ``pass``); the action is the most
    severe one of the lines at that verdict (``reboot`` > ``reset_gpu`` > ``fix_config`` > ``none``), and
    the reasons are those lines, the most severe first."""
    worst = (Verdict.FAIL if any(r.verdict is Verdict.FAIL for r in results)
             else Verdict.WARN if any(r.verdict is Verdict.WARN for r in results) else Verdict.OK)
    deciding = sorted((r for r in results if r.verdict is worst and worst is not Verdict.OK),
                      key=lambda r: -_action(r).severity)
    action = max((_action(r) for r in deciding), key=lambda a: a.severity, default=NodeAction.NONE)
    verdict = {Verdict.FAIL: NodeVerdict.FAIL, Verdict.WARN: NodeVerdict.WARN}.get(worst, NodeVerdict.PASS)
    return Overall(verdict, action, tuple(f"{r.name}: {r.detail}" for r in deciding))


def unknown(reason: str) -> Overall:
    """The check could not finish (``reason``: what stopped it)."""
    return Overall(NodeVerdict.UNKNOWN, NodeAction.NONE, (reason,))


def document(results: Sequence[CheckResult], node: Overall) -> dict[str, Any]:
    """The JSON document: the verdict, action and summary first, then every line (``data``: the VRAM
    budget). ``ok`` is kept for scripts written against the earlier form: true unless a line FAILs."""
    return {"schema": SCHEMA, "verdict": node.verdict.value, "action": node.action.value,
            "summary": node.summary, "exit_code": node.exit_code, "reasons": list(node.reasons),
            "ok": node.verdict in (NodeVerdict.PASS, NodeVerdict.WARN),
            "checks": [{"name": r.name, "verdict": r.verdict, "detail": r.detail,
                        **({"action": _action(r).value} if _action(r) is not NodeAction.NONE else {}),
                        **({"data": r.data} if r.data else {})} for r in results]}
