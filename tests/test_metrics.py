"""pdkv.metrics: a scrape of the HTTP endpoint during transfers parses with
prometheus_client's parser and counts what was transferred; and one scrape of known
figures gives every metric's exact name, labels, help text and value."""

from __future__ import annotations

import subprocess
import sys
import threading
import types
import urllib.request

import pytest

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from pdkv import PrefillSender  # noqa: E402
from pdkv.metrics import DecodeMetrics  # noqa: E402


def scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_scrape_during_transfers_counts_them(no_leaks):
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from test_transfer import Decode, prefill_cache, send_one, wait_until

    dec = Decode(transports=("shm", "tcp"))
    m = DecodeMetrics(dec.sched, dec.rx)
    try:
        port = m.serve(0)
        lay, arr, spec = prefill_cache(1, 0)
        with PrefillSender(lay, spec, dec.rx.control_address, transport="shm", timeout_s=5, instance="p1") as tx:
            assert send_one(tx, "a", [0, 1, 2]).ok
            tx.reserve("b", 8)  # granted, nothing sent yet: the scrape comes mid-transfer
            s = scrape(port)
            assert s[("pdkv_decode_received_bytes_total", (("transport", "shm"),))] == 3 * lay.block_bytes
            assert s[("pdkv_decode_received_layers_total", (("transport", "shm"),))] == 4
            assert s[("pdkv_decode_reservations_total", (("outcome", "buffer"),))] == 2
            assert s[("pdkv_decode_requests_live", (("state", "reserved"),))] == 1
            assert s[("pdkv_decode_buffer_blocks", (("state", "used"),))] >= 1
            assert s[("pdkv_decode_grant_to_received_seconds_count", ())] == 1
        wait_until(lambda: scrape(port)[("pdkv_decode_swap_seconds_count", ())] >= 1, 10, "a's swap observed")
        if "b" in dec.sched.live_requests():
            dec.sched.abort("b")
        s = scrape(port)
        assert s[("pdkv_decode_swaps_total", (("event", "completed"),))] == 1
        # b ended unserved (aborted here, or failed when its sender closed first), named by peer
        ended = {k[1]: v for k, v in s.items() if k[0] == "pdkv_decode_requests_ended_total"}
        assert sum(ended.values()) == 1 and all(dict(lab)["peer"] == "p1" for lab in ended)
        assert ("pdkv_decode_connections_refused_total", ()) in s
    finally:
        m.close()
        dec.close()


@pytest.mark.multiproc
def test_the_tool_serves_metrics_during_a_run(tmp_path, no_leaks):
    import time

    p = subprocess.Popen(
        [sys.executable, "-m", "pdkv.cli.transfer_tool", "--model", "tiny", "--requests", "200", "--rate", "40"]
        + ["--metrics-port", "0", "-q"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = p.stdout.readline()
        assert "metrics on http://127.0.0.1:" in line, line + (p.stderr.read() if p.poll() is not None else "")
        port = int(line.split("127.0.0.1:")[1].split("/")[0])
        deadline = time.monotonic() + 30
        got = 0.0
        while time.monotonic() < deadline and not got:
            s = scrape(port)
            got = sum(v for (n, _), v in s.items() if n == "pdkv_decode_received_bytes_total")
            time.sleep(0.2)
        assert got > 0 and p.poll() is None  # counted while the run goes on
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, out[-2000:] + err[-2000:]
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()


def test_prefill_metrics_count_each_layer_once(no_leaks):
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from test_transfer import Decode, prefill_cache, send_one

    from pdkv.metrics import PrefillMetrics

    dec = Decode(transports=("shm",))
    try:
        lay, arr, spec = prefill_cache(1, 0)
        with PrefillSender(lay, spec, dec.rx.control_address, transport="shm", timeout_s=5) as tx:
            m = PrefillMetrics([tx])
            port = m.serve(0)
            try:
                assert send_one(tx, "a", [0, 1]).ok
                s = scrape(port)
                assert s[("pdkv_prefill_requests_total", (("outcome", "received"), ("rank", "0")))] == 1
                assert s[("pdkv_prefill_sent_layers_total", (("rank", "0"), ("transport", "shm")))] == 4
                assert s[("pdkv_prefill_layer_seconds_count", (("rank", "0"),))] == 4
                assert send_one(tx, "b", [2]).ok
                s = scrape(port)  # the second scrape adds only the new layers
                assert s[("pdkv_prefill_layer_seconds_count", (("rank", "0"),))] == 8
                assert (
                    s[("pdkv_prefill_sent_bytes_total", (("rank", "0"), ("transport", "shm")))] == 3 * lay.block_bytes
                )
            finally:
                m.close()
    finally:
        dec.close()


# ---- every name, label, help text and value of one scrape, from a scheduler, receiver and
# senders whose figures are known (duck-typed stand-ins: the exposition is what is tested)

SCHED_FIGURES = {
    "reservations_gpu": 1, "reservations_buffer": 2, "reservations_queued": 3, "reservations_rejected": 4,
    "grants_from_queue": 5, "queue_timeouts": 6, "layers_landed": 7, "requests_received": 8,
    "requests_ready": 9, "requests_finished": 10, "requests_failed": 11, "requests_expired": 12,
    "requests_aborted": 13, "late_messages_rejected": 14, "swaps_submitted": 15, "swaps_completed": 16,
    "swaps_failed": 17, "swap_bytes": 18, "swap_busy_seconds": 19, "prefill_wait_avoided_seconds_sum": 20,
    "quarantined_blocks_released": 21, "prefix_blocks_reused": 22, "prefix_holds_expired": 23,
    "gpu_blocks_total": 100, "gpu_blocks_free": 30, "buffer_blocks_total": 50, "buffer_blocks_free": 45,
    "buffer_blocks_peak": 41, "live_queued": 2, "live_transferring": 3, "queue_length": 4, "quarantined_blocks": 6,
}  # fmt: skip

DECODE_EXPECTED = {
    ("pdkv_decode_reservations_total", (("outcome", "gpu"),)): 1,
    ("pdkv_decode_reservations_total", (("outcome", "buffer"),)): 2,
    ("pdkv_decode_reservations_total", (("outcome", "queued"),)): 3,
    ("pdkv_decode_reservations_total", (("outcome", "rejected"),)): 4,
    ("pdkv_decode_grants_from_queue_total", ()): 5,
    ("pdkv_decode_queue_timeouts_total", ()): 6,
    ("pdkv_decode_layers_landed_total", ()): 7,
    ("pdkv_decode_requests_total", (("event", "received"),)): 8,
    ("pdkv_decode_requests_total", (("event", "ready"),)): 9,
    ("pdkv_decode_requests_total", (("event", "finished"),)): 10,
    ("pdkv_decode_requests_total", (("event", "failed"),)): 11,
    ("pdkv_decode_requests_total", (("event", "expired"),)): 12,
    ("pdkv_decode_requests_total", (("event", "aborted"),)): 13,
    ("pdkv_decode_late_messages_rejected_total", ()): 14,
    ("pdkv_decode_swaps_total", (("event", "submitted"),)): 15,
    ("pdkv_decode_swaps_total", (("event", "completed"),)): 16,
    ("pdkv_decode_swaps_total", (("event", "failed"),)): 17,
    ("pdkv_decode_swap_bytes_total", ()): 18,
    ("pdkv_decode_swap_busy_seconds_total", ()): 19,
    ("pdkv_decode_prefill_wait_avoided_seconds_total", ()): 20,
    ("pdkv_decode_quarantined_blocks_released_total", ()): 21,
    ("pdkv_decode_prefix_blocks_reused_total", ()): 22,
    ("pdkv_decode_prefix_holds_expired_total", ()): 23,
    ("pdkv_decode_gpu_blocks", (("state", "free"),)): 30,
    ("pdkv_decode_gpu_blocks", (("state", "used"),)): 70,
    ("pdkv_decode_gpu_blocks_capacity", ()): 100,
    ("pdkv_decode_buffer_blocks", (("state", "free"),)): 45,
    ("pdkv_decode_buffer_blocks", (("state", "used"),)): 5,
    ("pdkv_decode_buffer_blocks_capacity", ()): 50,
    ("pdkv_decode_buffer_blocks_peak", ()): 41,
    ("pdkv_decode_requests_live", (("state", "queued"),)): 2,
    ("pdkv_decode_requests_live", (("state", "transferring"),)): 3,
    ("pdkv_decode_queue_length", ()): 4,
    ("pdkv_decode_quarantined_blocks", ()): 6,
    ("pdkv_decode_received_bytes_total", (("transport", "shm"),)): 2000,
    ("pdkv_decode_received_bytes_total", (("transport", "tcp"),)): 1000,
    ("pdkv_decode_received_layers_total", (("transport", "shm"),)): 5,
    ("pdkv_decode_received_layers_total", (("transport", "tcp"),)): 3,
    ("pdkv_decode_connections_refused_total", ()): 31,
    ("pdkv_decode_auth_failed_total", ()): 32,
    ("pdkv_decode_peers_dead_total", ()): 33,
    ("pdkv_decode_messages_rejected_total", ()): 34,
    ("pdkv_decode_frames_rejected_total", ()): 35,
}
DECODE_HELP = {
    "pdkv_decode_reservations": "Reservations by outcome",
    "pdkv_decode_grants_from_queue": "Queued reservations granted",
    "pdkv_decode_queue_timeouts": "Queued reservations that timed out",
    "pdkv_decode_layers_landed": "Request layers landed (all ranks written)",
    "pdkv_decode_requests": "Requests by event",
    "pdkv_decode_late_messages_rejected": "Writes or messages with a stale or forged token",
    "pdkv_decode_swaps": "Swaps by event",
    "pdkv_decode_swap_bytes": "Bytes swapped from the buffer into GPU blocks",
    "pdkv_decode_swap_busy_seconds": "Time with at least one swap in flight",
    "pdkv_decode_prefill_wait_avoided_seconds": "Time requests spent in the buffer that prefill would have waited "
    "without it",
    "pdkv_decode_quarantined_blocks_released": "Quarantined blocks released",
    "pdkv_decode_prefix_blocks_reused": "Prompt blocks decode held and did not receive",
    "pdkv_decode_prefix_holds_expired": "Held prefixes whose lease ran out unclaimed",
    "pdkv_decode_gpu_blocks": "gpu blocks by state",
    "pdkv_decode_gpu_blocks_capacity": "gpu pool size",
    "pdkv_decode_buffer_blocks": "buffer blocks by state",
    "pdkv_decode_buffer_blocks_capacity": "buffer pool size",
    "pdkv_decode_buffer_blocks_peak": "Most buffer blocks in use at once",
    "pdkv_decode_requests_live": "Live requests by state",
    "pdkv_decode_queue_length": "Reservations queued now",
    "pdkv_decode_quarantined_blocks": "Blocks in quarantine now",
    "pdkv_decode_received_bytes": "Bytes landed, by transport",
    "pdkv_decode_received_layers": "Request layers landed, by transport",
    "pdkv_decode_connections_refused": "Connections refused (limits, bad hello)",
    "pdkv_decode_auth_failed": "Peers that failed authentication",
    "pdkv_decode_peers_dead": "Peers declared dead (silence, closed connection)",
    "pdkv_decode_messages_rejected": "Control messages rejected (malformed, out of place)",
    "pdkv_decode_frames_rejected": "tcp data frames rejected",
    "pdkv_decode_grant_to_received_seconds": "Grant to every layer received, per request",
    "pdkv_decode_swap_seconds": "Received in the buffer to ready in GPU blocks, per request (swap wait and copy)",
    "pdkv_decode_requests_ended": "Requests that ended without being served, by outcome and peer (the first 64 "
    "peer names, then other)",
}


class _Sched:
    def __init__(self, figures):
        self.figures, self.listeners, self.peers = figures, [], {}

    def metrics(self):
        return {k: float(v) for k, v in self.figures.items()}

    def add_listener(self, f):
        self.listeners.append(f)

    def remove_listener(self, f):
        self.listeners.remove(f)

    def request(self, rid):
        return types.SimpleNamespace(peer=self.peers[rid])  # KeyError: the request has ended


class _Rx:
    stats = {"connections_refused": 31, "auth_failed": 32, "peers_dead": 33, "messages_rejected": 34,
             "frames_rejected": 35, "not_exported": 99}  # fmt: skip

    def received_by_transport(self):
        return {"tcp": (1000, 3), "shm": (2000, 5)}


def _samples(text):
    out, docs = {}, {}
    for fam in text_string_to_metric_families(text):
        if not fam.name.endswith("_created"):  # prometheus_client's creation times: not pdkv's
            docs[fam.name] = fam.documentation
        for s in fam.samples:
            if not s.name.endswith("_created"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out, docs


def test_decode_exposition_every_name_label_help_and_value():
    sched = _Sched(SCHED_FIGURES)
    m = DecodeMetrics(sched, _Rx())
    got, docs = _samples(m.text())
    # the two histograms and the ended counter have no samples yet beyond their zero buckets
    scraped = {k: v for k, v in got.items() if not k[0].startswith(("pdkv_decode_grant_to", "pdkv_decode_swap_sec"))}
    assert scraped == DECODE_EXPECTED
    assert docs == DECODE_HELP
    m.close()
    assert sched.listeners == []
    # without a receiver, without the pools: only the scheduler's own families
    bare = dict(SCHED_FIGURES)
    for k in ("gpu_blocks_total", "gpu_blocks_free"):
        del bare[k]
    got, _ = _samples(DecodeMetrics(_Sched(bare)).text())
    names = {n for n, _ in got}
    assert "pdkv_decode_buffer_blocks" in names and "pdkv_decode_gpu_blocks" not in names
    assert not any(n.startswith(("pdkv_decode_received", "pdkv_decode_auth")) for n in names)


def test_decode_latencies_and_ended_requests_from_events():
    from pdkv.metrics import LATENCY_BUCKETS
    from pdkv.scheduling.lifecycle import Event, EventKind

    sched = _Sched(SCHED_FIGURES)
    sched.peers = {"a": "p1", "b": "p2", "c": "p1"}
    m = DecodeMetrics(sched)
    on = sched.listeners[0]
    on(Event(EventKind.RESERVED, "a", t=1.0))
    on(Event(EventKind.RECEIVED, "a", t=1.25))  # grant -> received 0.25
    on(Event(EventKind.READY, "a", t=2.0))  # received -> ready 0.75
    on(Event(EventKind.GRANTED, "b", t=3.0))
    on(Event(EventKind.READY, "b", t=3.5))  # straight into GPU blocks: grant -> received 0.5, no swap
    on(Event(EventKind.RESERVED, "c", t=4.0))
    on(Event(EventKind.FAILED, "c", t=5.0, reason="x"))
    on(Event(EventKind.RESERVED, "gone", t=4.0))  # ended before its peer was read: no peer
    on(Event(EventKind.EXPIRED, "gone", t=6.0))
    on(Event(EventKind.RECEIVED, "never", t=6.0))  # no grant seen (metrics attached later): no latency
    on(Event(EventKind.ABORTED, "never", t=7.0))  # its received time goes with it
    got, _ = _samples(m.text())
    g = "pdkv_decode_grant_to_received_seconds"
    assert (got[(g + "_count", ())], got[(g + "_sum", ())]) == (2, 0.75)
    assert got[(g + "_bucket", (("le", "0.25"),))] == 1 and got[(g + "_bucket", (("le", "0.5"),))] == 2
    w = "pdkv_decode_swap_seconds"
    assert (got[(w + "_count", ())], got[(w + "_sum", ())]) == (1, 0.75)
    assert got[(w + "_bucket", (("le", "0.5"),))] == 0 and got[(w + "_bucket", (("le", "1.0"),))] == 1
    assert sorted(float(le) for (n, lb), _ in got.items() if n == g + "_bucket" for _, le in lb) == sorted(
        [*LATENCY_BUCKETS, float("inf")]
    )
    e = "pdkv_decode_requests_ended_total"
    ended = {lb: v for (n, lb), v in got.items() if n == e}
    assert ended == {
        (("outcome", "failed"), ("peer", "p1")): 1,
        (("outcome", "expired"), ("peer", "")): 1,
        (("outcome", "aborted"), ("peer", "")): 1,
    }
    assert m._granted == {} and m._received == {} and m._peer == {}  # nothing kept of ended requests
    m.close()


class _Tx:
    def __init__(self, rank, transport, stats, outcomes, layers):
        self.layout = types.SimpleNamespace(tp_rank=rank)
        self.transport, self.stats, self.outcomes = transport, stats, outcomes
        self._stats_lock = threading.Lock()
        self._layers = layers

    @property
    def layer_log(self):
        tx = self

        class _Log:
            def since(self, seq):
                return tx._layers[seq:], len(tx._layers)

        return _Log()


def test_prefill_exposition_every_name_label_help_and_value():
    from pdkv.metrics import PrefillMetrics

    t0 = _Tx(0, "tcp", {"bytes": 100, "frames": 4, "layers": 2, "grant_messages": 3, "outcome_messages": 1},
             {"received": 5, "failed": 1}, [(0, 0.25), (1, 0.5)])  # fmt: skip
    t1 = _Tx(1, None, {}, {}, [])
    m = PrefillMetrics([t0, t1])
    got, docs = _samples(m.text())
    for name, key in (("sent_bytes", "bytes"), ("sent_frames", "frames"), ("sent_layers", "layers"),
                      ("grant_messages", "grant_messages"), ("outcome_messages", "outcome_messages")):  # fmt: skip
        assert got[(f"pdkv_prefill_{name}_total", (("rank", "0"), ("transport", "tcp")))] == t0.stats[key]
        assert got[(f"pdkv_prefill_{name}_total", (("rank", "1"), ("transport", "none")))] == 0
    assert {lb: v for (n, lb), v in got.items() if n == "pdkv_prefill_requests_total"} == {
        (("outcome", "failed"), ("rank", "0")): 1,
        (("outcome", "received"), ("rank", "0")): 5,
    }
    h = "pdkv_prefill_layer_seconds"
    assert (got[(h + "_count", (("rank", "0"),))], got[(h + "_sum", (("rank", "0"),))]) == (2, 0.75)
    assert docs == {
        "pdkv_prefill_sent_bytes": "Bytes written into decode",
        "pdkv_prefill_sent_frames": "tcp data frames sent",
        "pdkv_prefill_sent_layers": "Layers sent (one per send_layer call)",
        "pdkv_prefill_grant_messages": "Grant messages received",
        "pdkv_prefill_outcome_messages": "Outcome messages received",
        "pdkv_prefill_requests": "Requests by outcome",
        "pdkv_prefill_layer_seconds": "send_layer to the layer's writes done",
    }
    t0._layers.append((2, 1.0))  # a scrape observes only the layers logged since the last
    got, _ = _samples(m.text())
    assert (got[(h + "_count", (("rank", "0"),))], got[(h + "_sum", (("rank", "0"),))]) == (3, 1.75)
    assert PrefillMetrics(t0).senders == [t0]  # one sender, not in a list


def test_missing_figures_read_as_zero_and_the_buckets_are_pdkvs():
    from pdkv.metrics import LATENCY_BUCKETS, PrefillMetrics

    class _Rx0(_Rx):
        stats = {}

    figures = {k: v for k, v in SCHED_FIGURES.items() if k not in ("swap_bytes", "requests_ready")}
    got, _ = _samples(DecodeMetrics(_Sched(figures), _Rx0()).text())
    assert got[("pdkv_decode_swap_bytes_total", ())] == 0
    assert got[("pdkv_decode_requests_total", (("event", "ready"),))] == 0
    assert got[("pdkv_decode_auth_failed_total", ())] == 0 and got[("pdkv_decode_frames_rejected_total", ())] == 0
    want = sorted([*LATENCY_BUCKETS, float("inf")])
    pm = PrefillMetrics(_Tx(0, "shm", {}, {}, [(0, 0.5)]))
    got, _ = _samples(pm.text())
    got_d, _ = _samples(DecodeMetrics(_Sched(SCHED_FIGURES)).text())
    for h in ("pdkv_decode_swap_seconds", "pdkv_decode_grant_to_received_seconds"):
        assert sorted(float(dict(lb)["le"]) for (n, lb) in got_d if n == h + "_bucket") == want
    assert sorted(float(dict(lb)["le"]) for (n, lb) in got if n == "pdkv_prefill_layer_seconds_bucket") == want


def test_registry_given_is_used_and_ready_of_an_unknown_request_is_ignored():
    from prometheus_client import CollectorRegistry

    from pdkv.metrics import PrefillMetrics
    from pdkv.scheduling.lifecycle import Event, EventKind

    r = CollectorRegistry()
    sched = _Sched(SCHED_FIGURES)
    m = DecodeMetrics(sched, registry=r)
    assert m.registry is r and "pdkv_decode_queue_length" in m.text()
    sched.listeners[0](Event(EventKind.READY, "unknown", t=1.0))  # never granted here: nothing to pop
    r2 = CollectorRegistry()
    assert PrefillMetrics(_Tx(0, "tcp", {}, {}, []), registry=r2).registry is r2


def test_metrics_without_prometheus_client_name_the_extra(monkeypatch):
    import sys as _sys

    from pdkv.metrics import PrefillMetrics

    monkeypatch.setitem(_sys.modules, "prometheus_client", None)  # import fails
    for make in (lambda: DecodeMetrics(_Sched(SCHED_FIGURES)), lambda: PrefillMetrics(_Tx(0, "tcp", {}, {}, []))):
        with pytest.raises(ImportError) as e:
            make()
        assert str(e.value) == "pdkv.metrics needs prometheus_client: pip install 'pdkv[metrics]'"


def test_serve_on_loopback_once_and_close_twice():
    from pdkv import BlockPool, DecodeScheduler

    m = DecodeMetrics(DecodeScheduler(num_layers=1, gpu=BlockPool(4), buffer=None))
    port = m.serve(0)
    try:
        assert m._server.server_address[0] == "127.0.0.1" and port == m._server.server_port
        with pytest.raises(RuntimeError) as e:
            m.serve(0)
        assert str(e.value) == "already serving"
        assert scrape(port)[("pdkv_decode_gpu_blocks_capacity", ())] == 4
    finally:
        m.close()
    m.close()  # a second close does nothing
    port = m.serve(0)  # and it may serve again
    m.close()


def test_peers_cannot_grow_the_ended_counters_labels_without_bound():
    """A peer chooses its name: 200 names ending requests make at most 64 name labels, then
    every other peer is ``other``."""
    from pdkv.metrics import MAX_PEER_LABELS
    from pdkv.scheduling.lifecycle import Event, EventKind

    sched = _Sched(SCHED_FIGURES)
    sched.peers = {f"r{i}": f"peer-{i}" for i in range(200)}
    m = DecodeMetrics(sched)
    on = sched.listeners[0]
    for i in range(200):
        on(Event(EventKind.RESERVED, f"r{i}", t=1.0))
        on(Event(EventKind.FAILED, f"r{i}", t=2.0, reason="x"))
    got, _ = _samples(m.text())
    peers = {dict(lb)["peer"]: v for (n, lb), v in got.items() if n == "pdkv_decode_requests_ended_total"}
    assert len(peers) == MAX_PEER_LABELS + 1 and peers["other"] == 200 - MAX_PEER_LABELS
    assert sum(peers.values()) == 200
    m.close()


def test_idle_metrics_connections_hold_a_bounded_number_of_threads(monkeypatch):
    """50 connections opened and left idle: at most MAX_SCRAPES of them hold a thread (the
    rest are closed at once), each closed after SCRAPE_TIMEOUT_S; then a scrape is served."""
    import socket
    import threading
    import time
    import urllib.request

    from pdkv import metrics as mod

    monkeypatch.setattr(mod, "SCRAPE_TIMEOUT_S", 0.5)
    m = DecodeMetrics(_Sched(SCHED_FIGURES))
    port = m.serve(0)
    base = threading.active_count()
    idle = []
    try:
        for _ in range(50):
            idle.append(socket.create_connection(("127.0.0.1", port)))
        time.sleep(0.3)
        assert threading.active_count() - base <= mod.MAX_SCRAPES
        time.sleep(1.0)  # past the idle timeout: every held connection closed
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            assert b"pdkv_decode_buffer_blocks" in r.read()
    finally:
        for s in idle:
            s.close()
        m.close()


def test_a_scrape_is_served_while_idle_connections_are_held():
    """Connections opened and left idle, as many as the server serves and more, from the
    scraper's own address: a scrape still gets through at once (it closes the oldest idle
    connection), not after the idle ones time out."""
    import socket
    import time
    import urllib.request

    from pdkv import metrics as mod

    m = DecodeMetrics(_Sched(SCHED_FIGURES))
    port = m.serve(0)
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(2 * mod.MAX_SCRAPES)]
    try:
        time.sleep(0.2)
        for _ in range(3):
            t0 = time.monotonic()
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=mod.SCRAPE_TIMEOUT_S) as r:
                assert b"pdkv_decode_buffer_blocks" in r.read()
            assert time.monotonic() - t0 < 1.0
        assert m._server.open_connections <= mod.MAX_SCRAPES
    finally:
        for s in idle:
            s.close()
        m.close()


def test_a_slow_metrics_client_is_cut_at_the_deadline(monkeypatch):
    """A client that sends its request a byte at a time is cut SCRAPE_TIMEOUT_S after it
    connected, however often it sends (the socket's idle timeout alone never fires)."""
    import socket
    import time

    from pdkv import metrics as mod

    monkeypatch.setattr(mod, "SCRAPE_TIMEOUT_S", 1.0)
    m = DecodeMetrics(_Sched(SCHED_FIGURES))
    port = m.serve(0)
    s = socket.create_connection(("127.0.0.1", port))
    try:
        t0 = time.monotonic()
        cut = None
        for b in b"GET /metrics HTTP/1.1\r\nHost: x\r\n" * 4:
            try:
                s.send(bytes([b]))
            except OSError:
                cut = time.monotonic() - t0
                break
            time.sleep(0.2)
        assert cut is not None and 0.9 <= cut <= 2.5, cut
    finally:
        s.close()
        m.close()
