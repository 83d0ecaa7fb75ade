"""Prometheus text exposition (llama-server's ``/metrics``), parsed by ``prometheus_client.parser``.

The one parser of ``/metrics`` text in llama-guard (liveness counters, decay speed): the reference
parser handles the ``llamacpp:`` colon names, HELP/TYPE lines, exponents, labels and escapes.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["MetricsError", "parse_metrics"]


class MetricsError(ValueError):
    """``/metrics`` text that cannot be parsed, or lacks a counter llama-guard needs."""


def parse_metrics(text: str) -> dict[str, float]:
    """Parse Prometheus text exposition into ``{sample name: value}``.

    Unlabelled samples are keyed by their name (``llamacpp:tokens_predicted_total``); labelled
    ones by ``name{k="v",...}`` with labels sorted. Raises :class:`MetricsError` on malformed text.
    """
    out: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = sample.name
                if sample.labels:
                    key += "{" + ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items())) + "}"
                out[key] = float(sample.value)
    except (ValueError, TypeError, IndexError) as exc:  # the parser's error types for bad input
        raise MetricsError(f"cannot parse /metrics text: {exc}") from exc
    return out
