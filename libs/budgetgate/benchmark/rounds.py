"""Figures measured over several rounds of a benchmark: on a shared machine whose speed drifts,
the median of paired rounds is the figure to quote, with the lowest and highest beside it."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any


def spread(values: Iterable[float | None], *, digits: int = 3) -> dict[str, Any] | None:
    """The median of the known values, with the lowest, the highest and how many there were;
    None when none is known."""
    known = [v for v in values if v is not None]
    if not known:
        return None
    return {"median": round(statistics.median(known), digits), "low": min(known), "high": max(known), "rounds": len(known)}


def spread_text(summary: dict[str, Any] | None, *, digits: int = 0) -> str:
    """A `spread` as `median (low-high)`, each with `digits` decimals; `-` when nothing was known."""
    return "-" if summary is None else f"{summary['median']:.{digits}f} ({summary['low']:.{digits}f}-{summary['high']:.{digits}f})"
