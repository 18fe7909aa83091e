"""pdkv.metrics: a scrape of the HTTP endpoint during transfers parses with
prometheus_client's parser and counts what was transferred."""

from __future__ import annotations

import subprocess
import sys
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
