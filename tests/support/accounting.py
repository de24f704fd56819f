"""A stand-in external accounting system (Waldur-style `remaining_budget` per tenant): a real
aiohttp server on a free port that can answer, be slow, be down, or answer nonsense."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from tests.support.servers import free_port


class AccountingStandIn:
    """`mode` is one of: ok (answers `remaining`), slow (answers after `delay` seconds),
    not-json, missing, nan, boolean, error (500), unknown (404). `stop()` takes it down."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/api/budgets/{{tenant}}/"
        self.mode = "ok"
        self.remaining: Any = 100.0
        self.delay = 5.0
        self.asked: list[str] = []
        self._runner: web.AppRunner | None = None

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        self.asked.append(request.match_info["tenant"])
        mode = self.mode
        if mode == "slow":
            await asyncio.sleep(self.delay)  # the slowness simulated: a source that answers late
        if mode in ("ok", "slow"):
            return web.json_response({"uuid": "c0ffee", "remaining_budget": self.remaining})
        return {
            "not-json": lambda: web.Response(text="<html>maintenance</html>", content_type="text/html"),
            "missing": lambda: web.json_response({"budget": 100}),
            "nan": lambda: web.Response(text='{"remaining_budget": NaN}', content_type="application/json"),
            "boolean": lambda: web.json_response({"remaining_budget": True}),
            "error": lambda: web.json_response({"detail": "boom"}, status=500),
            "unknown": lambda: web.json_response({"detail": "not found"}, status=404),
        }[mode]()

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/api/budgets/{tenant}/", self._answer)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
