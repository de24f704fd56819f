"""A Marquez stand-in for the campaign: `POST /api/v1/lineage` answers 201 and keeps the event,
without deduplicating (as Marquez does), on a thread of the campaign's process. Only what the
evidence checker needs: the events received, in order.

The nemesis takes it down (`outage`): `503` answers every POST with Marquez's error body and
keeps nothing (Marquez's database gone, a proxy in front of it failing); `reset` reads the request
and closes the connection without an answer (Marquez killed mid-request, a load balancer
resetting). The evidence-emitter must hold its events and deliver every one once it is back."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class LineageSink:
    OUTAGES = ("503", "reset")

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.rejected = 0
        self.outage: str | None = None  # one of OUTAGES while the nemesis has it down
        self.refused = 0  # posts turned away by an outage
        self._lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_args: object) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - the http.server name
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                outage = sink.outage
                if outage is not None:
                    with sink._lock:
                        sink.refused += 1
                    if outage == "reset":
                        self.close_connection = True
                        return
                    self._answer(503, {"code": 503, "message": "the stand-in is down (a fault of the campaign)"})
                    return
                if self.path.split("?")[0] != "/api/v1/lineage":
                    self._answer(404, {"code": 404, "message": "no route"})
                    return
                try:
                    event = json.loads(body)
                except ValueError:
                    with sink._lock:
                        sink.rejected += 1
                    self._answer(400, {"code": 400, "message": "not JSON"})
                    return
                with sink._lock:
                    sink.events.append(event)
                self._answer(201, {})

            def do_GET(self) -> None:  # noqa: N802
                self._answer(200, {"namespaces": []}) if self.path.startswith("/api/v1/namespaces") else self._answer(404, {"code": 404})

            def _answer(self, status: int, payload: Any) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="lineage-sink", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> LineageSink:
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def decision_events(self) -> list[dict[str, Any]]:
        """(decision id, event type, event time) of every event carrying a budget decision."""
        with self._lock:
            events = list(self.events)
        found = []
        for event in events:
            decision_id = _find(event.get("run", {}).get("facets", {}), "decision_id")
            if decision_id:
                found.append(
                    {"decision_id": decision_id, "event_type": event.get("eventType"), "event_time": event.get("eventTime"), "stage": _find(event, "stage")}
                )
        return found


def _find(value: Any, key: str) -> Any:
    if isinstance(value, dict):
        if key in value and isinstance(value[key], str):
            return value[key]
        for item in value.values():
            found = _find(item, key)
            if found:
                return found
    elif isinstance(value, list):
        for item in value:
            found = _find(item, key)
            if found:
                return found
    return None
