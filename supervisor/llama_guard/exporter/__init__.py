"""The Prometheus exporter: the metrics and the [metrics] listener."""
