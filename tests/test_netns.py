"""Network faults between two network namespaces joined by a veth pair (created here,
addresses only inside them): link down and up again, bandwidth throttled with tc tbf."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(__file__)
PEERS = os.path.join(HERE, "peers.py")


def sh(*cmd):
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


@pytest.fixture
def netns():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    tag = f"{os.getpid() % 100000}"
    d, p = f"pdkvd{tag}", f"pdkvp{tag}"
    vd, vp = f"vd{tag}", f"vp{tag}"
    try:
        sh("ip", "netns", "add", d)
        sh("ip", "netns", "add", p)
        sh("ip", "link", "add", vd, "type", "veth", "peer", "name", vp)
        sh("ip", "link", "set", vd, "netns", d)
        sh("ip", "link", "set", vp, "netns", p)
        sh("ip", "-n", d, "addr", "add", "10.213.0.1/24", "dev", vd)
        sh("ip", "-n", p, "addr", "add", "10.213.0.2/24", "dev", vp)
        for ns, dev in ((d, vd), (p, vp)):
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
    except (subprocess.CalledProcessError, OSError) as exc:
        for ns in (d, p):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        pytest.skip(f"cannot build network namespaces here: {exc}")
    yield {"d": d, "p": p, "vd": vd, "vp": vp}
    for ns in (d, p):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


class Proc:
    def __init__(self, ns, *args):
        self.p = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, PEERS, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def line(self, timeout=20):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.p.stdout.readline()
            if not line:
                raise AssertionError(f"peer exited: {self.p.stderr.read()[-2000:]}")
            return json.loads(line)
        raise AssertionError("no line in time")

    def until(self, pred, timeout, what):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            d = self.line(timeout)
            if pred(d):
                return d
        raise AssertionError(f"not within {timeout}s: {what}")

    def stop(self):
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(10)
        self.p.stdout.close()
        self.p.stderr.close()


@pytest.mark.netns
@pytest.mark.multiproc
def test_link_down_then_up(netns, no_leaks):
    dec = Proc(netns["d"], "decode", "--host", "10.213.0.1", "--timeout", "2", "--status")
    try:
        addr = dec.line()["control"]
        pre = Proc(
            netns["p"],
            "prefill",
            "--control",
            addr,
            "--transport",
            "tcp",
            "--blocks",
            "8",
            "--layer-sleep",
            "0.5",
            "--timeout",
            "4",  # the cut is found by this bound; 2 s read a loaded machine's pause as a dead decode
            "--instance",
            "cut",
        )
        try:
            pre.until(lambda d: d.get("layer") == 0, 20, "first layer sent")
            t0 = time.monotonic()
            sh("ip", "-n", netns["p"], "link", "set", netns["vp"], "down")
            out = pre.until(lambda d: "state" in d, 20, "prefill outcome after the cut")
            assert out["state"] in ("failed", "error")
            prefill_s = time.monotonic() - t0
            dec.until(
                lambda d: d.get("failed", 0) + d.get("expired", 0) >= 1 and d["live"] == 0 and d["buffer_free"] == 64,
                20,
                "decode failed the request and reclaimed its blocks",
            )
            decode_s = time.monotonic() - t0
            assert prefill_s < 15 and decode_s < 15
        finally:
            pre.stop()
        sh("ip", "-n", netns["p"], "link", "set", netns["vp"], "up")
        again = Proc(
            netns["p"],
            "prefill",
            "--control",
            addr,
            "--transport",
            "tcp",
            "--blocks",
            "4",
            "--timeout",
            "3",
            "--instance",
            "after",
        )
        try:
            out = again.until(lambda d: "state" in d, 30, "a new prefill served after the link came back")
            assert out["state"] == "received"
        finally:
            again.stop()
    finally:
        dec.stop()


@pytest.mark.netns
@pytest.mark.multiproc
def test_throttled_link_still_transfers(netns, no_leaks):
    sh(
        "ip",
        "netns",
        "exec",
        netns["p"],
        "tc",
        "qdisc",
        "add",
        "dev",
        netns["vp"],
        "root",
        "tbf",
        "rate",
        "80mbit",
        "burst",
        "64kb",
        "latency",
        "100ms",
    )
    dec = Proc(netns["d"], "decode", "--host", "10.213.0.1", "--timeout", "10")
    try:
        addr = dec.line()["control"]
        pre = Proc(
            netns["p"],
            "prefill",
            "--control",
            addr,
            "--transport",
            "tcp",
            "--blocks",
            "32",
            "--requests",
            "2",
            "--timeout",
            "10",
            "--instance",
            "slow",
        )
        try:
            t0 = time.monotonic()
            outs = [pre.until(lambda d: "state" in d, 60, "outcome over the throttled link") for _ in range(2)]
            dt = time.monotonic() - t0
            assert [o["state"] for o in outs] == ["received", "received"]
            # 2 requests x 32 blocks x 4 layers x 2 tensors x 2 KiB = 1 MiB at 80 Mbit/s: >= ~0.1 s
            assert dt > 0.09
        finally:
            pre.stop()
    finally:
        dec.stop()
