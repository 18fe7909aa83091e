"""Prometheus metrics of a decode instance and of prefill senders, with ``prometheus_client``
(``pip install 'pdkv[metrics]'``).

:class:`DecodeMetrics` exports a :class:`~pdkv.scheduling.scheduler.DecodeScheduler` (and optionally its
:class:`~pdkv.transfer.DecodeReceiver`) into a ``CollectorRegistry``: counters and gauges read
at scrape time from the scheduler's and receiver's own counters (nothing is counted twice),
histograms of grant -> received and swap (received -> ready) latency and a counter of ended
requests by outcome and peer, fed by a scheduler listener. :meth:`DecodeMetrics.serve`
starts prometheus_client's HTTP endpoint (opt-in, loopback by default).

Names follow Prometheus conventions: a ``pdkv_decode_`` prefix, units in the name,
``_total`` counters, the pool, state and transport as labels.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from .scheduling.scheduler import DecodeScheduler, Event

__all__ = ["DecodeMetrics", "PrefillMetrics"]

_COUNTERS = {  # scheduler counter -> (metric, help, labels)
    "reservations_gpu": ("reservations", "Reservations by outcome", {"outcome": "gpu"}),
    "reservations_buffer": ("reservations", "Reservations by outcome", {"outcome": "buffer"}),
    "reservations_queued": ("reservations", "Reservations by outcome", {"outcome": "queued"}),
    "reservations_rejected": ("reservations", "Reservations by outcome", {"outcome": "rejected"}),
    "grants_from_queue": ("grants_from_queue", "Queued reservations granted", {}),
    "queue_timeouts": ("queue_timeouts", "Queued reservations that timed out", {}),
    "layers_landed": ("layers_landed", "Request layers landed (all ranks written)", {}),
    "requests_received": ("requests", "Requests by event", {"event": "received"}),
    "requests_ready": ("requests", "Requests by event", {"event": "ready"}),
    "requests_finished": ("requests", "Requests by event", {"event": "finished"}),
    "requests_failed": ("requests", "Requests by event", {"event": "failed"}),
    "requests_expired": ("requests", "Requests by event", {"event": "expired"}),
    "requests_aborted": ("requests", "Requests by event", {"event": "aborted"}),
    "late_messages_rejected": ("late_messages_rejected", "Writes or messages with a stale or forged token", {}),
    "swaps_submitted": ("swaps", "Swaps by event", {"event": "submitted"}),
    "swaps_completed": ("swaps", "Swaps by event", {"event": "completed"}),
    "swaps_failed": ("swaps", "Swaps by event", {"event": "failed"}),
    "swap_bytes": ("swap_bytes", "Bytes swapped from the buffer into GPU blocks", {}),
    "swap_busy_seconds": ("swap_busy_seconds", "Time with at least one swap in flight", {}),
    "prefill_wait_avoided_seconds_sum": (
        "prefill_wait_avoided_seconds",
        "Time requests spent in the buffer that prefill would have waited without it",
        {},
    ),
    "quarantined_blocks_released": ("quarantined_blocks_released", "Quarantined blocks released", {}),
    "prefix_blocks_reused": ("prefix_blocks_reused", "Prompt blocks decode held and did not receive", {}),
    "prefix_holds_expired": ("prefix_holds_expired", "Held prefixes whose lease ran out unclaimed", {}),
}
_RECEIVER = {  # DecodeReceiver.stats key -> (metric, help)
    "connections_refused": ("connections_refused", "Connections refused (limits, bad hello)"),
    "auth_failed": ("auth_failed", "Peers that failed authentication"),
    "peers_dead": ("peers_dead", "Peers declared dead (silence, closed connection)"),
    "messages_rejected": ("messages_rejected", "Control messages rejected (malformed, out of place)"),
    "frames_rejected": ("frames_rejected", "tcp data frames rejected"),
}
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
MAX_PEER_LABELS = 64  # distinct peer names the ended-requests counter labels, at most
MAX_SCRAPES = 8  # metrics connections served at once (a thread each)
MAX_SCRAPES_PER_SOURCE = 4  # of them from one address
SCRAPE_TIMEOUT_S = 5.0  # a metrics connection idle this long is closed


class _Exposed:
    """A registry served over HTTP: the exposition text, ``serve`` and ``close``."""

    registry: Any
    _server: Any = None

    def text(self) -> str:
        """The exposition text, as a scrape gets it."""
        from prometheus_client import generate_latest

        return str(generate_latest(self.registry).decode())

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``addr:port`` (0: any free port) from a daemon thread; the
        port. prometheus_client's WSGI app behind pdkv's bounded server
        (:mod:`pdkv.httpserver`): at most ``MAX_SCRAPES`` connections at once and
        ``MAX_SCRAPES_PER_SOURCE`` from one address, each for at most ``SCRAPE_TIMEOUT_S``;
        a new scrape closes the oldest connection that has not sent its request, so idle
        connections never keep a scrape out."""
        import socket
        import socketserver
        from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

        from prometheus_client import make_wsgi_app

        from .httpserver import BoundedHandlerMixin, BoundedServerMixin

        if self._server is not None:
            raise RuntimeError("already serving")

        class _Quiet(BoundedHandlerMixin, WSGIRequestHandler):
            timeout = SCRAPE_TIMEOUT_S  # the socket's, for every read and write

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
                return None

        class _Server(BoundedServerMixin, socketserver.ThreadingMixIn, WSGIServer):
            address_family = socket.AF_INET6 if ":" in addr else socket.AF_INET
            max_conns, max_per_source, deadline_s = MAX_SCRAPES, MAX_SCRAPES_PER_SOURCE, SCRAPE_TIMEOUT_S

        server = _Server((addr, port), _Quiet)
        server.set_app(make_wsgi_app(self.registry))
        threading.Thread(target=server.serve_forever, name="pdkv-metrics", daemon=True).start()
        self._server = server
        return int(server.server_port)

    def close(self) -> None:
        """Stop serving."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class DecodeMetrics(_Exposed):
    """The metrics of one decode instance in a registry of their own (or ``registry``).

    >>> m = DecodeMetrics(scheduler, receiver)       # doctest: +SKIP
    >>> m.serve(9400)                                # http://127.0.0.1:9400/metrics
    """

    def __init__(self, scheduler: DecodeScheduler, receiver: Any = None, registry: Any = None) -> None:
        try:
            from prometheus_client import CollectorRegistry, Counter, Histogram
        except ImportError:
            raise ImportError("pdkv.metrics needs prometheus_client: pip install 'pdkv[metrics]'") from None
        self.scheduler, self.receiver = scheduler, receiver
        self.registry = registry if registry is not None else CollectorRegistry()
        self.grant_to_received = Histogram(
            "pdkv_decode_grant_to_received_seconds",
            "Grant to every layer received, per request",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.swap_latency = Histogram(
            "pdkv_decode_swap_seconds",
            "Received in the buffer to ready in GPU blocks, per request (swap wait and copy)",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ended = Counter(
            "pdkv_decode_requests_ended",
            "Requests that ended without being served, by outcome and peer (the first "
            f"{MAX_PEER_LABELS} peer names, then other)",
            ["outcome", "peer"],
            registry=self.registry,
        )
        self._lock = threading.Lock()
        self._granted: dict[str, float] = {}
        self._received: dict[str, float] = {}
        self._peer: dict[str, str] = {}
        self._labels: set[str] = set()  # the peer names labels were made for (MAX_PEER_LABELS)
        self.registry.register(_Collector(self))
        scheduler.add_listener(self._on_event)
        self._listening = True

    def _label(self, peer: str) -> str:
        """A peer's ``peer`` label: its name for the first MAX_PEER_LABELS names seen, then
        ``other`` (a peer chooses its name: it may not grow the series without bound)."""
        if peer in self._labels or not peer:
            return peer
        if len(self._labels) >= MAX_PEER_LABELS:
            return "other"
        self._labels.add(peer)
        return peer

    def _on_event(self, ev: Event) -> None:
        rid, kind = ev.request_id, ev.kind
        with self._lock:
            if kind in ("reserved", "granted"):
                self._granted[rid] = ev.t
                try:
                    self._peer[rid] = self._label(self.scheduler.request(rid).peer)
                except Exception:  # already ended: no peer to name
                    self._peer[rid] = ""
            elif kind == "received":
                t0 = self._granted.pop(rid, None)
                if t0 is not None:
                    self.grant_to_received.observe(ev.t - t0)
                self._received[rid] = ev.t
            elif kind == "ready":
                t0 = self._granted.pop(rid, None)
                if t0 is not None:  # straight into GPU blocks: received is ready
                    self.grant_to_received.observe(ev.t - t0)
                t1 = self._received.pop(rid, None)
                if t1 is not None:
                    self.swap_latency.observe(ev.t - t1)
                self._peer.pop(rid, None)
            elif kind.terminal:
                self._granted.pop(rid, None)
                self._received.pop(rid, None)
                self.ended.labels(outcome=str(kind), peer=self._peer.pop(rid, "")).inc()

    def close(self) -> None:
        """Stop serving and stop listening to the scheduler (a second call does nothing)."""
        if self._listening:
            self._listening = False
            self.scheduler.remove_listener(self._on_event)
        super().close()


class _Collector:
    def __init__(self, m: DecodeMetrics) -> None:
        self.m = m

    def describe(self) -> list[Any]:
        return []  # collected at scrape time only

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.m.scheduler.metrics()
        fams: dict[str, Any] = {}
        for key, (name, doc, labels) in _COUNTERS.items():
            fam = fams.get(name)
            if fam is None:
                fam = fams[name] = CounterMetricFamily(f"pdkv_decode_{name}", doc, labels=list(labels))
            fam.add_metric(list(labels.values()), float(s.get(key, 0.0)))
        yield from fams.values()
        for pool in ("gpu", "buffer"):
            if f"{pool}_blocks_total" not in s:
                continue
            g = GaugeMetricFamily(f"pdkv_decode_{pool}_blocks", f"{pool} blocks by state", labels=["state"])
            g.add_metric(["free"], float(s[f"{pool}_blocks_free"]))
            g.add_metric(["used"], float(s[f"{pool}_blocks_total"] - s[f"{pool}_blocks_free"]))
            yield g
            yield GaugeMetricFamily(
                f"pdkv_decode_{pool}_blocks_capacity", f"{pool} pool size", value=float(s[f"{pool}_blocks_total"])
            )
        yield GaugeMetricFamily(
            "pdkv_decode_buffer_blocks_peak", "Most buffer blocks in use at once", value=float(s["buffer_blocks_peak"])
        )
        live = GaugeMetricFamily("pdkv_decode_requests_live", "Live requests by state", labels=["state"])
        for k, v in s.items():
            if k.startswith("live_"):
                live.add_metric([k[5:]], float(v))
        yield live
        yield GaugeMetricFamily("pdkv_decode_queue_length", "Reservations queued now", value=float(s["queue_length"]))
        yield GaugeMetricFamily(
            "pdkv_decode_quarantined_blocks", "Blocks in quarantine now", value=float(s["quarantined_blocks"])
        )
        rx = self.m.receiver
        if rx is None:
            return
        by = rx.received_by_transport()
        b = CounterMetricFamily("pdkv_decode_received_bytes", "Bytes landed, by transport", labels=["transport"])
        n = CounterMetricFamily(
            "pdkv_decode_received_layers", "Request layers landed, by transport", labels=["transport"]
        )
        for t, (nbytes, layers) in sorted(by.items()):
            b.add_metric([t], float(nbytes))
            n.add_metric([t], float(layers))
        yield b
        yield n
        for key, (name, doc) in _RECEIVER.items():
            yield CounterMetricFamily(f"pdkv_decode_{name}", doc, value=float(rx.stats.get(key, 0)))


class PrefillMetrics(_Exposed):
    """The metrics of one or more :class:`~pdkv.transfer.PrefillSender` (a prefill
    instance's ranks), read at scrape time: bytes, frames and layers sent by transport,
    grant and outcome messages, requests by outcome, and a histogram of each layer's time
    from ``send_layer`` to its writes done (``pdkv_prefill_layer_seconds``), labelled by rank."""

    def __init__(self, senders: Any, registry: Any = None) -> None:
        try:
            from prometheus_client import CollectorRegistry
        except ImportError:
            raise ImportError("pdkv.metrics needs prometheus_client: pip install 'pdkv[metrics]'") from None
        from prometheus_client import Histogram

        self.senders = list(senders) if isinstance(senders, (list, tuple)) else [senders]
        self.registry = registry if registry is not None else CollectorRegistry()
        # the collector first: each scrape feeds the histogram the layers logged since the last
        self.registry.register(_PrefillCollector(self))
        self.layer_seconds = Histogram(
            "pdkv_prefill_layer_seconds",
            "send_layer to the layer's writes done",
            ["rank"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._seq: dict[int, int] = {}  # sender id -> layers of its layer_log observed

    def _feed(self, tx: Any) -> None:
        new, self._seq[id(tx)] = tx.layer_log.since(self._seq.get(id(tx), 0))
        h = self.layer_seconds.labels(rank=str(tx.layout.tp_rank))
        for entry in new:
            h.observe(entry[1])


class _PrefillCollector:
    def __init__(self, m: PrefillMetrics) -> None:
        self.m = m

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        labels = ["rank", "transport"]
        fams = {
            k: CounterMetricFamily(f"pdkv_prefill_{name}", doc, labels=labels)
            for k, name, doc in (
                ("bytes", "sent_bytes", "Bytes written into decode"),
                ("frames", "sent_frames", "tcp data frames sent"),
                ("layers", "sent_layers", "Layers sent (one per send_layer call)"),
                ("grant_messages", "grant_messages", "Grant messages received"),
                ("outcome_messages", "outcome_messages", "Outcome messages received"),
            )
        }
        out = CounterMetricFamily("pdkv_prefill_requests", "Requests by outcome", labels=["rank", "outcome"])
        for tx in self.m.senders:
            rank = str(tx.layout.tp_rank)
            with tx._stats_lock:
                stats = dict(tx.stats)
                outcomes = dict(tx.outcomes)
            tr = tx.transport or "none"
            for k, fam in fams.items():
                fam.add_metric([rank, tr], float(stats.get(k, 0)))
            for state, n in sorted(outcomes.items()):
                out.add_metric([rank, state], float(n))
            self.m._feed(tx)
        yield from fams.values()
        yield out
