"""Optional Prometheus endpoint (``--metrics-port``): the daemon's stats as metrics.

Scrapes call ``LoaderServer.stats()`` from the exporter's thread; it only reads counters
and copies the session list, so it needs no lock. Bound to localhost unless configured
otherwise (``metrics_host``). Needs ``prometheus-client`` (``pip install .[metrics]``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any


def start_exporter(stats: Callable[[], dict[str, Any]], host: str, port: int) -> Any:
    """Serve ``/metrics`` on ``host:port``; returns the HTTP server (``.shutdown()``)."""
    try:
        from prometheus_client import start_http_server
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            Metric,
        )
        from prometheus_client.registry import Collector, CollectorRegistry
    except ImportError as e:
        raise ValueError(
            "--metrics-port needs prometheus-client: pip install 'dflash-loader[metrics]'"
        ) from e

    class _Collector(Collector):
        def collect(self) -> Iterator[Metric]:
            st = stats()
            yield GaugeMetricFamily("dflash_loader_sessions", "Open sessions", len(st["sessions"]))
            yield CounterMetricFamily("dflash_loader_errors", "Rejected requests", st["errors"])
            yield GaugeMetricFamily("dflash_loader_uptime_seconds", "Uptime", st["uptime_s"])
            labels = ["job", "rank"]
            families: dict[str, Any] = {
                "batches": CounterMetricFamily(
                    "dflash_loader_batches", "Batches served", labels=labels
                ),
                "tokens": CounterMetricFamily(
                    "dflash_loader_tokens", "Tokens served", labels=labels
                ),
                "ring_fill": GaugeMetricFamily(
                    "dflash_loader_ring_fill", "Slots in flight", labels=labels
                ),
                "client_wait_s": GaugeMetricFamily(
                    "dflash_loader_client_wait_seconds",
                    "Client time blocked on data",
                    labels=labels,
                ),
                "epoch": GaugeMetricFamily(
                    "dflash_loader_epoch", "Epoch being produced", labels=labels
                ),
            }
            for s in st["sessions"]:
                key = [s["job"], str(s["rank"])]
                for name, fam in families.items():
                    fam.add_metric(key, s["pos"][0] if name == "epoch" else s[name])
            yield from families.values()

    registry = CollectorRegistry()
    registry.register(_Collector())
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as e:  # not the ZeroMQ endpoint: say which address failed
        raise OSError(
            e.errno, f"metrics endpoint {host}:{port} (metrics_host, --metrics-port): {e.strerror}"
        ) from None
    return server
