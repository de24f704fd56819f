"""Recorded DCGM exporter pages (tests/fixtures/dcgm) served on loopback, as node exporters."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tests.support.servers import free_port

PAGES = Path(__file__).resolve().parents[1] / "fixtures" / "dcgm"


class Exporters:
    """Two node exporters on loopback serving recorded pages; node A's pod `train-resnet-0`
    ends after `train_scrapes` scrapes."""

    def __init__(self, *, train_scrapes: int) -> None:
        self.scrapes = {"a": 0, "b": 0}
        exporters = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                node = self.path.strip("/").split("/")[0]
                exporters.scrapes[node] += 1
                name = {"a": "node-a.prom" if exporters.scrapes["a"] <= train_scrapes else "node-a-train-ended.prom", "b": "node-b.prom"}[node]
                body = (PAGES / name).read_bytes()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
