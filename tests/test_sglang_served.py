"""Real SGLang 0.5.23 servers serving through pdkv behind SGLang's own router, against a
colocated SGLang server's tokens (``tests/sglang_serve.py`` says how SGLang runs on a CPU
host, and why each flag).

One prefill (pdkv) serves two decodes, each behind its own router:

- ``device``: decode receives into its KV pool (SGLang's device destination; on a CPU host
  the pool is host memory and pdkv writes it directly), over tcp;
- ``host``: decode receives into its HiCache host pool (``--disaggregation-decode-host-receive-
  threshold 0``: pdkv's decode host receive) with decode's radix cache on, over NIXL (UCX tcp
  on loopback);

and SGLang's own default backend (Mooncake, TCP) serves a pair of its own, side by side. The
prefills compute in chunks of 64 tokens (chunked prefill: each chunk is sent as it is
computed), as does the colocated server.

Skips, naming the extra, where SGLang is not installed. CI's fourth part runs it with
everything installed (``.ci/run``), one module at a time (``-p no:xdist``): the servers are
started once for the module.
"""

from __future__ import annotations

import json
import os
import random
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from extras import need
from ports import free_port

need("sglang.srt.disaggregation.base.conn", "sglang")
need("sglang_router", "sglang")  # SGLang's router: pip install sglang-router

import sglang_serve as ss  # noqa: E402

# the servers start once for the module: about three minutes on two cores
pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(900)]

CHUNK = ["--chunked-prefill-size", "64"]
NEW = 16  # tokens generated per request


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


class Stack:
    """The servers and routers of the module (ports in ``url``)."""

    def __init__(self, tmp: Path) -> None:
        self.model = ss.tiny_model(tmp / "model")
        self.ports = {k: free_port() for k in ("colo", "p", "pb", "d", "h", "mp", "mpb", "md", "rd", "rh", "rm")}
        self.url = {k: f"http://127.0.0.1:{p}" for k, p in self.ports.items()}
        self.tmp = tmp
        self.procs: dict[str, ss.Proc] = {}

    def start(self) -> None:
        p, m = self.ports, self.model
        log = self.tmp
        self.procs["colo"] = ss.server(m, p["colo"], log / "colo.log", extra=CHUNK)
        self.procs["p"] = self._prefill()
        self.procs["d"] = ss.server(m, p["d"], log / "d.log", mode="decode")
        self.procs["h"] = ss.server(
            m,
            p["h"],
            log / "h.log",
            mode="decode",
            extra=ss.HOST_POOL,
            env={"PDKV_SGLANG_TRANSPORTS": "nixl,tcp", "UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"},
        )
        # SGLang's own default backend (Mooncake over TCP), a pair of its own
        self.procs["mp"] = ss.server(
            m, p["mp"], log / "mp.log", mode="prefill", backend="mooncake", bootstrap_port=p["mpb"], extra=CHUNK
        )
        self.procs["md"] = ss.server(m, p["md"], log / "md.log", mode="decode", backend="mooncake")
        ss.wait_all(list(self.procs.values()))
        self._routers((("rd", "p", "d"), ("rh", "p", "h"), ("rm", "mp", "md")))

    def _routers(self, pairs: tuple[tuple[str, str, str], ...]) -> None:
        p = self.ports
        for r, pre, dec in pairs:
            self.procs[r] = ss.router(p[r], (p[pre], p[pre + "b"]), p[dec], self.tmp / f"{r}.log", free_port())
        ss.wait_all(list(self.procs.values()))

    def _prefill(self) -> ss.Proc:
        # auto: each decode's first transport (the device decode's tcp, the host decode's nixl)
        env = {"PDKV_SGLANG_TRANSPORT": "auto", "UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
        p = self.ports
        return ss.server(
            self.model, p["p"], self.tmp / "p.log", mode="prefill", bootstrap_port=p["pb"], extra=CHUNK, env=env
        )

    def restart_prefill(self) -> None:
        self.procs["p"].close()
        self.procs["p"] = self._prefill()
        self.procs["p"].wait_ready()
        # the routers see it again at their next health check
        for r in ("rd", "rh"):
            self.procs[r].wait_ready()

    def close(self) -> None:
        ss.close_all(list(self.procs.values()))


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("sglang"))
    try:
        s.start()
        yield s
    finally:
        s.close()
    deadline = time.monotonic() + 15
    while [n for n in os.listdir("/dev/shm") if n.startswith("pdkv-")]:
        assert time.monotonic() < deadline, f"a pdkv segment outlived its server: {os.listdir('/dev/shm')}"
        time.sleep(0.2)


def _want(stack: Stack, ids: list[int], n: int = NEW) -> list[int]:
    return ss.generate(stack.url["colo"], ids, n)["output_ids"]


ROUTERS = {"device": "rd", "host": "rh", "mooncake": "rm"}


@pytest.mark.parametrize("pair", ["device", "host", "mooncake"])
def test_tokens_equal_the_colocated_servers(stack, pair):
    """A few, hundreds and a thousand prompt tokens (16 chunks of 64), one after another;
    ``mooncake``: SGLang's own backend under the same test, side by side."""
    url = stack.url[ROUTERS[pair]]
    for n, seed in ((5, 1), (300, 2), (1000, 3)):
        ids = _prompt(n, seed)
        got = ss.generate(url, ids, NEW)
        assert got["output_ids"] == _want(stack, ids), f"{pair}: a {n}-token prompt"
        assert got["meta_info"]["finish_reason"]["type"] == "length"


# two logprobs closer than this are a tie in bf16: logits below 4 in size are 1/64 apart
# (the colocated server's logprobs of one sequence, decoded and recomputed, differ by 0.008)
TIE = 0.03


def _colocated_choice(stack: Stack, ids: list[int], got: dict) -> None:
    """``got`` (a ``/generate`` answer with logprobs) is the colocated server's greedy
    choice at every step, up to a bf16 tie: the colocated server, given the prompt and
    ``got``'s tokens, ranks each token first or within ``TIE`` of first, and gives it the
    logprob ``got`` reports within ``TIE``."""
    out = got["output_ids"]
    ref = ss.generate(
        stack.url["colo"], ids + out, 1, return_logprob=True, top_logprobs_num=1, logprob_start_len=len(ids) - 1
    )["meta_info"]
    # entry k + 1 of the colocated answer scores out[k] given the prompt and out[:k]
    lp = [x[0] for x in ref["input_token_logprobs"][1:]]
    top = [x[0][0] for x in ref["input_top_logprobs"][1:]]
    mine = [x[0] for x in got["meta_info"]["output_token_logprobs"]]
    for k, tok in enumerate(out):
        assert top[k] - lp[k] <= TIE, f"token {k} ({tok}) is {top[k] - lp[k]:.4f} below the colocated first"
        assert abs(mine[k] - lp[k]) <= TIE, f"token {k} ({tok}): logprob {mine[k]:.4f}, colocated {lp[k]:.4f}"


@pytest.mark.parametrize("pair", ["device", "host", "mooncake"])
def test_concurrent_requests_each_get_their_own_tokens(stack, pair):
    """Eight prompts at once, so the prefill computes chunks of several in one batch and
    sends each as it is computed. The tokens cannot be compared with the colocated
    server's one by one: SGLang's own colocated server, given these prompts at once,
    answers other tokens than it does one at a time (bf16 logits tie often in this tiny
    model, and where a batch's chunks end moves the last bits), so each request's tokens
    are checked to be the colocated server's greedy choice given the same tokens before
    them, up to a tie (``TIE``); another request's tokens fail that (the control below).
    ``mooncake``: SGLang's own backend, side by side."""
    url = stack.url[ROUTERS[pair]]
    prompts = [_prompt(40 + 45 * i, 100 + i) for i in range(8)]
    with ThreadPoolExecutor(8) as ex:
        got = list(ex.map(lambda ids: ss.generate(url, ids, NEW, return_logprob=True, top_logprobs_num=1), prompts))
    for ids, g in zip(prompts, got):
        # NEW tokens, or fewer ending in the model's end token (one of these prompts' first)
        assert len(g["output_ids"]) == NEW or g["meta_info"]["finish_reason"]["type"] == "stop", g
        _colocated_choice(stack, ids, g)


def test_the_tie_check_refuses_another_requests_tokens(stack):
    """The control of the check above: one prompt's tokens and logprobs, judged against
    another prompt, fail it."""
    a, b = _prompt(130, 1), _prompt(175, 2)
    got = ss.generate(stack.url["colo"], a, NEW, return_logprob=True, top_logprobs_num=1)
    _colocated_choice(stack, a, got)
    with pytest.raises(AssertionError, match="colocated"):
        _colocated_choice(stack, b, got)


def test_a_prefix_decode_holds_is_not_sent_again(stack):
    """The host decode keeps its radix cache: a second request sharing 256 prompt tokens
    with the first finds them at decode (SGLang's ``decode_prefix_len``), pdkv sends only
    the rest, and the tokens are the colocated server's."""
    url = stack.url["rh"]
    shared = _prompt(256, 7)
    first, second = shared + _prompt(40, 8), shared + _prompt(60, 9)
    assert ss.generate(url, first, NEW)["output_ids"] == _want(stack, first)
    before = ss.metrics(stack.url["h"])
    assert ss.generate(url, second, NEW)["output_ids"] == _want(stack, second)
    after = ss.metrics(stack.url["h"])
    # decode's own prefix cache served the shared part of the second prompt
    assert after["sglang:cache_hit_rate"] > 0 or after.get("sglang:cached_tokens_total", 0) > before.get(
        "sglang:cached_tokens_total", 0
    ), after


def test_a_decode_given_no_kv_gives_other_tokens(stack):
    """The control: SGLang's fake transfer (bootstrap host 2.2.2.2, what its warm-up sends)
    runs decode on pages no KV reached; its tokens differ from the colocated server's, so
    equal tokens above mean the KV travelled."""
    ids = _prompt(300, 11)
    fake = ss.generate(stack.url["d"], ids, NEW, bootstrap_host="2.2.2.2", bootstrap_port=0, bootstrap_room=7)
    assert fake["output_ids"] != _want(stack, ids)


# ---------------------------------------------------------------------- nothing held


def _idle(stack: Stack, names: tuple[str, ...], timeout: float = 30.0) -> None:
    """Every queue of these servers empty and no KV token in use but what their radix
    caches keep (SGLang's ``kv_used_tokens`` counts neither free nor evictable tokens):
    nothing a request left behind holds a page."""
    deadline = time.monotonic() + timeout
    while True:
        held = {}
        for n in names:
            m = ss.metrics(stack.url[n])
            busy = {k: v for k, v in m.items() if v and (k.endswith("_queue_reqs") or k == "sglang:num_running_reqs")}
            if m["sglang:kv_used_tokens"] > 0:
                busy["sglang:kv_used_tokens"] = m["sglang:kv_used_tokens"]
            if busy:
                held[n] = busy
        if not held:
            break
        assert time.monotonic() < deadline, f"still held after {timeout} s: {held}"
        time.sleep(0.5)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("pdkv-")], os.listdir("/dev/shm")


def _ended_after_grant(stack: Stack, name: str) -> int:
    """Requests the server's pdkv ended while granted (``aborted (was reserved)`` or
    ``(was receiving)``: its KV partly written or about to be), from pdkv's log lines."""
    text = stack.procs[name].log.read_text(errors="replace")
    return len(re.findall(r"request 'sgl-\d+-d\d+of\d+' (?:aborted|failed) \(was (?:reserved|receiving)\)", text))


def _stream_and_hang_up(url: str, ids: list[int], after_s: float) -> None:
    """A streaming request whose client closes the connection ``after_s`` in."""
    body = json.dumps(
        {"input_ids": ids, "sampling_params": {"max_new_tokens": 64, "temperature": 0}, "stream": True}
    ).encode()
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    head = f"POST /generate HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(body)}\r\n\r\n"
    s.sendall(head.encode() + body)
    time.sleep(after_s)
    s.close()


@pytest.mark.parametrize("pair", ["device", "host"])
def test_a_client_that_hangs_up_mid_transfer_leaves_nothing_held(stack, pair):
    """Clients close their connections at several points of a 3000-token prompt's 47
    chunks; afterwards neither side holds a page or a queued request, and the next request
    gets the colocated tokens."""
    url = stack.url[ROUTERS[pair]]
    threads = [
        threading.Thread(target=_stream_and_hang_up, args=(url, _prompt(3000, 20 + i), t))
        for i, t in enumerate((0.02, 0.1, 0.3, 0.6, 1.0))
    ]
    dec = "d" if pair == "device" else "h"
    seen = _ended_after_grant(stack, dec)
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _idle(stack, ("p", dec))
    # some hung up after decode granted their pages (pdkv's own log: the state each ended in)
    assert _ended_after_grant(stack, dec) > seen
    ids = _prompt(300, 30)
    assert ss.generate(url, ids, NEW)["output_ids"] == _want(stack, ids)


def test_a_prefill_killed_mid_transfer_fails_its_requests_and_the_next_succeeds(stack):
    """SIGKILL of the whole prefill server while it sends two decodes long prompts: each
    request ends with an error within pdkv's bound (timeout + lease, 20 s here), the decodes
    hold nothing, and once the prefill is back the next request through each router gets
    the colocated tokens."""
    results: dict[str, object] = {}

    def one(name: str) -> None:
        try:
            results[name] = ss.generate(stack.url[ROUTERS[name]], _prompt(3000, 40), 64)
        except Exception as exc:  # the router answers an error status
            results[name] = repr(exc)
            if hasattr(exc, "close"):  # an HTTPError holds its response's socket open until closed
                exc.close()

    threads = [threading.Thread(target=one, args=(n,)) for n in ("device", "host")]
    for t in threads:
        t.start()
    time.sleep(0.4)
    t0 = time.monotonic()
    stack.procs["p"].kill()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a request outlived pdkv's bound"
    waited = time.monotonic() - t0
    for name, r in results.items():
        finished = isinstance(r, dict) and r.get("meta_info", {}).get("finish_reason", {}).get("type") == "length"
        assert not finished or len(r["output_ids"]) == 64, (name, r)
    _idle(stack, ("d", "h"))
    stack.restart_prefill()
    for name in ("device", "host"):
        ids = _prompt(300, 50)
        assert ss.generate(stack.url[ROUTERS[name]], ids, NEW)["output_ids"] == _want(stack, ids), name
    assert waited < 60
