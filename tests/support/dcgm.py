"""Recorded DCGM exporter pages (tests/fixtures/dcgm) served on loopback, as node exporters."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from tests.support.servers import PageServer

PAGES = Path(__file__).resolve().parents[1] / "fixtures" / "dcgm"


class Exporters:
    """Two node exporters on loopback serving recorded pages; node A's pod `train-resnet-0`
    ends after `train_scrapes` scrapes, and node A answers an empty page (as an exporter
    restarting may) at its scrapes numbered in `a_empty_at` (from 1)."""

    def __init__(self, *, train_scrapes: int, a_empty_at: Collection[int] = ()) -> None:
        self.scrapes = {"a": 0, "b": 0}
        self._train_scrapes = train_scrapes
        self._a_empty_at = frozenset(a_empty_at)
        self.pages = PageServer(self._page)
        self.url = self.pages.url

    def _page(self, path: str) -> tuple[bytes, str]:
        node = path.strip("/").split("/")[0]
        self.scrapes[node] += 1
        if node == "a" and self.scrapes["a"] in self._a_empty_at:
            return b"", "text/plain; version=0.0.4; charset=utf-8"
        name = {"a": "node-a.prom" if self.scrapes["a"] <= self._train_scrapes else "node-a-train-ended.prom", "b": "node-b.prom"}[node]
        return (PAGES / name).read_bytes(), "text/plain; version=0.0.4; charset=utf-8"

    def close(self) -> None:
        self.pages.close()
