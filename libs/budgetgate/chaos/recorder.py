"""The history of a campaign: one JSON object a line, written as it happens and flushed, so a
campaign that dies midway still leaves everything up to its last line.

Lines, by `type`:
- `setup`: the seed, duration, the plan's fingerprint, the budgets and the settings of the run;
- `op`: one client operation: `index` (its place in the plan), `kind`, `instance`, `invoke` and
  `complete` (seconds since the start, on the campaign's monotonic clock), `request`, and either
  `status` and `answer` (an HTTP answer), or `error` (no answer: `outcome` "info", indeterminate
  as Jepsen says, the request may or may not have taken effect), or `outcome` "skipped" (its
  precondition failed, e.g. a sample of a run never admitted);
- `fault`: one fault: `kind`, `target`, `start`, `end`, `params`, and `note` (what was done);
- `ledger`: the ledger sampled during the run (`source` postgres or redis; per ledger key its
  limit, held and consumed amounts, milli-GPU-seconds or micro-currency);
- `observation`: what the stores hold once the faults stopped and the stack settled;
- `end`: when the campaign ended.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO


class HistoryError(ValueError):
    """A history file that cannot be read: the message names the line."""


class Recorder:
    """Appends history lines to a file; safe to call from several threads."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO = path.open("w", encoding="utf-8")
        self._lock = threading.Lock()

    def write(self, line: dict[str, Any]) -> None:
        text = json.dumps(line, sort_keys=True, default=str, separators=(",", ":"))
        with self._lock:
            self._file.write(text + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read(path: Path) -> list[dict[str, Any]]:
    """Every line of a history file; a line that is not a JSON object is a HistoryError naming it
    (a last line cut short by a crash is skipped: the campaign died while writing it)."""
    return list(_lines(path))


def _lines(path: Path) -> Iterator[dict[str, Any]]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise HistoryError(f"cannot read the history {path}: {exc}") from exc
    raw = text.split("\n")
    complete = text.endswith("\n")
    for number, line in enumerate(raw, start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(raw) and not complete:
                return  # cut short by a crash mid-write
            raise HistoryError(f"{path}:{number}: not JSON ({exc.msg})") from None
        if not isinstance(value, dict) or "type" not in value:
            raise HistoryError(f"{path}:{number}: a history line is a JSON object with a 'type'")
        yield value
