#!/usr/bin/env python3
"""A disaggregating proxy for two vLLM servers joined by pdkv's connector: each request
goes to prefill first (one token, so prefill computes the prompt and pdkv carries its KV
into decode's CPU buffer), then to decode with the parameters prefill answered, which
name the KV to load; decode's answer is the client's.

    python examples/vllm/proxy.py --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 \\
        --decode-control tcp://127.0.0.1:5600 [--port 8000]

``--decode-control`` is decode's pdkv control address (its ``kv_connector_extra_config``
``control``), handed to prefill in each request's ``kv_transfer_params``; prefill's own
extra config may name it instead (``decode``), and then the flag may be left out. OpenAI
``/v1/completions`` and ``/v1/chat/completions``, streaming or not. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ROUTES = ("/v1/completions", "/v1/chat/completions")


def post(url: str, body: dict, timeout: float) -> urllib.request.addinfourl:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def make_handler(a: argparse.Namespace) -> type[BaseHTTPRequestHandler]:
    class Proxy(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _reply(self, code: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            if self.path not in ROUTES:
                self._reply(404, json.dumps({"error": f"{self.path}: the proxy serves {', '.join(ROUTES)}"}).encode())
                return
            try:
                req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            except ValueError as exc:
                self._reply(400, json.dumps({"error": f"request body is not JSON: {exc}"}).encode())
                return
            # prefill: the prompt only (one token, no streaming), its KV sent to decode's buffer
            params = {"do_remote_decode": True, "pdkv_request_id": f"px-{uuid.uuid4().hex}"}
            if a.decode_control:
                params["pdkv_decode"] = a.decode_control
            first = {**req, "max_tokens": 1, "stream": False, "kv_transfer_params": params}
            first.pop("max_completion_tokens", None)
            first.pop("stream_options", None)
            try:
                with post(a.prefill + self.path, first, a.timeout) as r:
                    done = json.loads(r.read())
            except (urllib.error.URLError, OSError, ValueError) as exc:
                self._reply(502, json.dumps({"error": f"prefill at {a.prefill} failed: {exc}"}).encode())
                return
            kv = done.get("kv_transfer_params")
            if not kv:
                self._reply(502, json.dumps({"error": "prefill answered no kv_transfer_params (connector?)"}).encode())
                return
            # decode: the whole request, loading the KV prefill sent
            try:
                r = post(a.decode + self.path, {**req, "kv_transfer_params": kv}, a.timeout)
            except urllib.error.HTTPError as exc:
                self._reply(exc.code, exc.read())
                return
            except (urllib.error.URLError, OSError) as exc:
                self._reply(502, json.dumps({"error": f"decode at {a.decode} failed: {exc}"}).encode())
                return
            with r:
                if not req.get("stream"):
                    self._reply(r.status, r.read(), r.headers.get("Content-Type", "application/json"))
                    return
                self.send_response(r.status)
                self.send_header("Content-Type", r.headers.get("Content-Type", "text/event-stream"))
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                while chunk := r.read1(65536):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")

        def log_message(self, fmt: str, *args: object) -> None:
            if a.verbose:
                super().log_message(fmt, *args)

    return Proxy


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", required=True, help="prefill server's base URL (kv_producer)")
    ap.add_argument("--decode", required=True, help="decode server's base URL (kv_consumer)")
    ap.add_argument("--decode-control", default="", help="decode's pdkv control address (tcp://host:port)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds for each upstream call")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args()
    server = ThreadingHTTPServer((a.host, a.port), make_handler(a))
    print(f"proxy on http://{a.host}:{server.server_port}: prefill {a.prefill}, decode {a.decode}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
