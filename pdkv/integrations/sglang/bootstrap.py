"""SGLang's bootstrap for pdkv: where each prefill rank's pull endpoint is, and its layout.

SGLang starts one bootstrap server per prefill instance (on ``--disaggregation-bootstrap-port``)
and names it in every request (``bootstrap_host``). Prefill ranks register there; a decode
rank reads the table before it asks a prefill rank for a request's KV. The server and client
are HTTP with JSON bodies (stdlib only): ``PUT /pdkv/ranks`` one rank's entry, ``GET
/pdkv/ranks`` all of them. Each entry carries an HMAC-SHA256 of its fields under the pair's
secret: the server stores only entries it can verify, and decode uses only entries it can
verify, so a peer without the secret can neither replace an entry nor make decode use one.
Bodies are capped (:data:`MAX_BODY`), and a client waits at most its timeout.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import logging
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ...errors import PdkvError
from ...layout import KVLayout

__all__ = ["MAX_BODY", "BootstrapServer", "entry_for", "fetch_ranks", "register_rank"]

_log = logging.getLogger(__name__)
MAX_BODY = 16 << 10  # an entry is ~400 bytes
MAX_RANKS = 1024
_MAC = b"pdkv-sglang-bootstrap-1"
_FIELDS = ("rank", "tp_size", "desk", "layout", "instance")


def _mac(secret: bytes, entry: dict[str, Any]) -> str:
    body = json.dumps({k: entry[k] for k in _FIELDS}, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(secret, _MAC + body, hashlib.sha256).hexdigest()


def entry_for(secret: bytes, layout: KVLayout, desk: str, instance: str) -> dict[str, Any]:
    """A prefill rank's signed entry."""
    e: dict[str, Any] = {
        "rank": layout.tp_rank,
        "tp_size": layout.tp_size,
        "desk": desk,
        "layout": dataclasses.asdict(layout),
        "instance": instance,
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

        class Handler(BaseHTTPRequestHandler):
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
                with outer._lock:
                    if not why and e["rank"] not in outer._ranks and len(outer._ranks) >= MAX_RANKS:
                        why = f"more than {MAX_RANKS} ranks"
                    if not why:
                        outer._ranks[e["rank"]] = e
                if why:
                    outer.refused += 1
                    return self._reply(400, {"error": why})
                self._reply(200, {"ok": True})

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self.host, self.port = self._httpd.server_address[:2]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="pdkv-sglang-bootstrap", daemon=True)
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
    """The verified entries of the prefill instance whose bootstrap server is ``host:port``:
    all of its ranks (0..tp_size-1, one TP size), or PdkvError naming what is missing."""
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
    ok = {e["rank"]: e for e in entries if not check_entry(secret, e)}
    sizes = {e["tp_size"] for e in ok.values()}
    if len(sizes) != 1 or set(ok) != set(range(next(iter(sizes)))):
        raise PdkvError(
            f"pdkv bootstrap at {address}: prefill ranks {sorted(ok)} registered and verified "
            f"(TP sizes {sorted(sizes)}); all ranks of one TP size are needed"
        )
    return ok
