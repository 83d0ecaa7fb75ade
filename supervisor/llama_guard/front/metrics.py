"""The front door's Prometheus metrics (prometheus-client), registered in the exporter's registry.

Names and labels are rows of the one metrics table, docs/metrics.md; the ``reason`` label takes the values of
:class:`llama_guard.front.admission.FailReason`.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from llama_guard.front.admission import FailReason

# Held time buckets (seconds): from a blip to a 27B model's load on a slow disk.
HELD_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class FrontMetrics:
    """Counters, the held-time histogram and live gauges (read through callables on scrape)."""

    def __init__(self, registry: CollectorRegistry | None, *, waiting: Callable[[], int],
                 in_flight: Callable[[], int], connections: Callable[[], int]) -> None:
        reg = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.requests = Counter("llama_guard_front_requests", "client requests answered, by the status the "
                                "client got (cut: begun, then cut by a server failure; gone: the client left "
                                "before its answer was complete)", ["code"], registry=reg)
        self.held_seconds = Histogram("llama_guard_front_held_seconds", "how long a held request waited for a "
                                      "ready server", buckets=HELD_BUCKETS, registry=reg)
        self.held = Counter("llama_guard_front_requests_held", "requests held while the server was not ready",
                            registry=reg)
        self.replayed = Counter("llama_guard_front_requests_replayed", "requests sent again to the next "
                                "server (a server failed it before its answer began)", registry=reg)
        self.resumed = Counter("llama_guard_front_streams_resumed", "streams of generated text cut by a server's "
                               "end and continued by the next server from the text already sent", registry=reg)
        self.crash_refusals = Counter("llama_guard_front_crash_refusals", "requests (a fingerprint: method, "
                                      "route, body as computed) charged with llama-server crashes, refused "
                                      "from then on for [front].crash_refuse_s", registry=reg)
        self.failed = Counter("llama_guard_front_requests_failed", "requests that failed around a restart, "
                              "by reason", ["reason"], registry=reg)
        for reason in FailReason:
            self.failed.labels(reason.value)
        for name, text, read in (("llama_guard_front_requests_waiting", "requests held now", waiting),
                                 ("llama_guard_front_requests_in_flight", "requests being answered now", in_flight),
                                 ("llama_guard_front_connections", "client connections open now", connections)):
            Gauge(name, text, registry=reg).set_function(_as_float(read))


def _as_float(read: Callable[[], int]) -> Callable[[], float]:
    return lambda: float(read())
