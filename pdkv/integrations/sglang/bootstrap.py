"""SGLang's bootstrap for pdkv: where each prefill rank's pull endpoint is, and its layout.

SGLang starts one bootstrap server per prefill instance (on ``--disaggregation-bootstrap-port``)
and names it in every request (``bootstrap_host``). Prefill ranks register there; a decode
rank reads the table before it asks a prefill rank for a request's KV. The server and client
are HTTP with JSON bodies (stdlib only): ``PUT /pdkv/ranks`` one rank's entry, ``GET
/pdkv/ranks`` all of them. Each entry carries an HMAC-SHA256 of its fields under the pair's
secret: the server stores only entries it can verify, and decode uses only entries it can
verify, so a peer without the secret can neither replace an entry nor make decode use one.

Freshness: an entry is signed with the time it was issued (``issued``, milliseconds of the
wall clock). The server stores an entry only when it is newer than the rank's stored one and
within :data:`MAX_SKEW_S` of its own clock, so a recorded registration replayed later (the
same, or an earlier one of a process now dead) changes nothing; decode uses only entries
issued within :data:`STALE_S`. A prefill rank registers again every :data:`REREGISTER_S`
(:class:`Registration`), so a table the server lost (its restart) or a rank that restarted
is right again within that, and a rank that died goes stale. Hosts of a pair keep their
clocks within :data:`MAX_SKEW_S` (NTP).

The server is bounded as every small HTTP server of pdkv (:mod:`pdkv.httpserver`): at most
:data:`MAX_CONNS` connections, :data:`MAX_CONNS_PER_SOURCE` from one address, each for at
most :data:`DEADLINE_S`; bodies are capped (:data:`MAX_BODY`), and a client waits at most
its timeout.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ...errors import PdkvError
from ...httpserver import BoundedHandlerMixin, BoundedServerMixin
from ...layout import KVLayout

__all__ = ["MAX_BODY", "BootstrapServer", "Registration", "entry_for", "fetch_ranks", "register_rank"]

_log = logging.getLogger(__name__)
MAX_BODY = 16 << 10  # an entry is ~400 bytes
MAX_RANKS = 1024
MAX_CONNS = 64  # connections at once (a thread each)
MAX_CONNS_PER_SOURCE = 16  # of them from one address (a host runs a decode's or prefill's ranks)
DEADLINE_S = 5.0  # a connection lives this long at most
MAX_SKEW_S = 60.0  # the server takes entries issued within this of its own clock
POLL_S = 0.05  # the server's loop looks for close() this often
REREGISTER_S = 10.0  # a prefill rank registers again this often
STALE_S = 3 * REREGISTER_S + MAX_SKEW_S  # decode uses entries issued within this
_MAC = b"pdkv-sglang-bootstrap-2"
_FIELDS = ("rank", "tp_size", "desk", "layout", "instance", "issued")


def _mac(secret: bytes, entry: dict[str, Any]) -> str:
    body = json.dumps({k: entry[k] for k in _FIELDS}, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(secret, _MAC + body, hashlib.sha256).hexdigest()


def _now_ms() -> int:
    return int(time.time() * 1000)


def entry_for(secret: bytes, layout: KVLayout, desk: str, instance: str, issued: int | None = None) -> dict[str, Any]:
    """A prefill rank's signed entry, issued now (or at ``issued`` ms)."""
    e: dict[str, Any] = {
        "rank": layout.tp_rank,
        "tp_size": layout.tp_size,
        "desk": desk,
        "layout": dataclasses.asdict(layout),
        "instance": instance,
        "issued": _now_ms() if issued is None else int(issued),
    }
    e["mac"] = _mac(secret, e)
    return e


def check_entry(secret: bytes, e: object) -> str:
    """What is wrong with an entry ('' when it is well formed and signed under ``secret``)."""
    if not isinstance(e, dict) or set(e) != {*_FIELDS, "mac"}:
        return "an entry has exactly the fields " + ", ".join((*_FIELDS, "mac"))
    if not isinstance(e["mac"], str) or not hmac.compare_digest(e["mac"], _mac(secret, e)):
        return "the entry's MAC does not verify (wrong or missing secret)"
    if not isinstance(e["rank"], int) or not isinstance(e["tp_size"], int) or not 0 <= e["rank"] < e["tp_size"]:
        return "rank must be in [0, tp_size)"
    if not isinstance(e["desk"], str) or not e["desk"].startswith("tcp://") or len(e["desk"]) > 256:
        return "desk must be a tcp:// address"
    if not isinstance(e["issued"], int) or isinstance(e["issued"], bool):
        return "issued must be milliseconds"
    return ""


def layout_of(e: dict[str, Any]) -> KVLayout:
    try:
        return KVLayout(**e["layout"])
    except (TypeError, ValueError) as exc:
        raise PdkvError(f"prefill rank {e.get('rank')}: its layout is not a pdkv layout: {exc}") from None


class BootstrapServer:
    """The table of one prefill instance's ranks, served over HTTP on ``host:port`` (port 0:
    any) from a thread of its own. ``secret``: entries are stored only when they verify."""

    def __init__(self, host: str, port: int, secret: bytes) -> None:
        self._secret = secret
        self._lock = threading.Lock()
        self._ranks: dict[int, dict[str, Any]] = {}
        self.refused = 0
        outer = self

        class Handler(BoundedHandlerMixin, BaseHTTPRequestHandler):
            timeout = DEADLINE_S  # each read and write; the whole connection: DEADLINE_S too

            def log_message(self, fmt: str, *args: Any) -> None:
                _log.debug("pdkv bootstrap: " + fmt, *args)

            def _reply(self, code: int, body: dict[str, Any]) -> None:
                raw = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path != "/pdkv/ranks":
                    return self._reply(404, {"error": "GET /pdkv/ranks"})
                with outer._lock:
                    ranks = {str(r): e for r, e in outer._ranks.items()}
                self._reply(200, {"ranks": ranks})

            def do_PUT(self) -> None:  # noqa: N802
                n = int(self.headers.get("Content-Length") or 0)
                if self.path != "/pdkv/ranks" or not 0 < n <= MAX_BODY:
                    outer.refused += 1
                    return self._reply(400, {"error": f"PUT /pdkv/ranks with a body of 1-{MAX_BODY} bytes"})
                try:
                    e = json.loads(self.rfile.read(n))
                except ValueError:
                    e = None
                why = check_entry(outer._secret, e)
                if not why and abs(e["issued"] - _now_ms()) > MAX_SKEW_S * 1000:
                    why = f"the entry was not issued within {MAX_SKEW_S:g} s of this server's clock (replayed?)"
                with outer._lock:
                    old = outer._ranks.get(e["rank"]) if not why else None
                    if not why and old is None and len(outer._ranks) >= MAX_RANKS:
                        why = f"more than {MAX_RANKS} ranks"
                    if not why and old is not None and e["issued"] <= old["issued"]:
                        why = "the rank's stored entry is as new or newer (replayed?)"
                    if not why:
                        outer._ranks[e["rank"]] = e
                if why:
                    outer.refused += 1
                    return self._reply(400, {"error": why})
                self._reply(200, {"ok": True})

        class Server(BoundedServerMixin, ThreadingHTTPServer):
            max_conns, max_per_source, deadline_s = MAX_CONNS, MAX_CONNS_PER_SOURCE, DEADLINE_S

        self._httpd = Server((host, port), Handler)
        self.host, self.port = self._httpd.server_address[:2]
        # close() returns within one poll (the default 0.5 s would hold SGLang's shutdown that long)
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, args=(POLL_S,), name="pdkv-sglang-bootstrap", daemon=True
        )
        self._thread.start()

    @property
    def address(self) -> str:
        return f"{self.host!s}:{self.port}"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def register_rank(address: str, entry: dict[str, Any], timeout_s: float = 5.0) -> None:
    """Put a prefill rank's entry into the bootstrap server at ``host:port``."""
    req = urllib.request.Request(
        f"http://{address}/pdkv/ranks",
        data=json.dumps(entry).encode(),
        method="PUT",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:  # noqa: S310 (http only, an address we were given)
            r.read(MAX_BODY)
    except (OSError, urllib.error.URLError) as exc:
        raise PdkvError(f"pdkv bootstrap at {address}: registering rank {entry['rank']} failed: {exc}") from exc


def fetch_ranks(address: str, secret: bytes, timeout_s: float = 5.0) -> dict[int, dict[str, Any]]:
    """The verified entries of the prefill instance whose bootstrap server is ``host:port``,
    each issued within :data:`STALE_S`: all of its ranks (0..tp_size-1, one TP size), or
    PdkvError naming what is missing."""
    try:
        with urllib.request.urlopen(f"http://{address}/pdkv/ranks", timeout=timeout_s) as r:  # noqa: S310
            raw = r.read(MAX_BODY * 64 + 1)
    except (OSError, urllib.error.URLError) as exc:
        raise PdkvError(f"pdkv bootstrap at {address}: {exc}") from exc
    try:
        got = json.loads(raw)["ranks"]
        entries = list(got.values()) if isinstance(got, dict) else []
    except (ValueError, KeyError, TypeError):
        raise PdkvError(f"pdkv bootstrap at {address}: not a pdkv bootstrap server") from None
    now = _now_ms()
    ok = {e["rank"]: e for e in entries if not check_entry(secret, e) and abs(now - e["issued"]) <= STALE_S * 1000}
    sizes = {e["tp_size"] for e in ok.values()}
    if len(sizes) != 1 or set(ok) != set(range(next(iter(sizes)))):
        raise PdkvError(
            f"pdkv bootstrap at {address}: prefill ranks {sorted(ok)} registered, verified and fresh "
            f"(TP sizes {sorted(sizes)}); all ranks of one TP size are needed"
        )
    return ok


class Registration:
    """A prefill rank's entry kept registered: now (PdkvError if that fails), then every
    :data:`REREGISTER_S` from a thread of its own, each freshly issued (a failure then is
    logged and tried again next time). Ownership: the thread (:meth:`close`)."""

    def __init__(self, address: str, make: Any, every_s: float = REREGISTER_S) -> None:
        self.address, self._make, self.every_s = address, make, every_s
        self.registered = 0
        register_rank(address, make())
        self.registered += 1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdkv-sglang-register", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                register_rank(self.address, self._make())
                self.registered += 1
            except PdkvError as exc:
                _log.warning("%s (retried in %g s)", exc, self.every_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
