"""The Marquez audit reads listings paged by offset while runs keep arriving: a run that a page
shift shows twice is counted once, as its latest reading."""

from __future__ import annotations

from typing import Any

import httpx

from budgetgate.evidence.audit import WindowFilter, marquez_report, marquez_runs
from budgetgate.evidence.facet import FACET_KEY

SCOPE = "ns=vision-prod;team=vision"
WINDOW = "2026-07-01T00:00:00Z/2026-08-01T00:00:00Z"


def _run(run_id: str, decision: str, updated: str) -> dict[str, Any]:
    budget = {"stage": "decision", "decision": decision, "evaluations": [{"scope_id": SCOPE, "window_key": WINDOW}]}
    return {"id": run_id, "updatedAt": updated, "facets": {FACET_KEY: budget}}


class ShiftingListing:
    """One namespace and job; its runs, newest first, change after the first page is read: r4
    arrives and r2 (DELAYed) is admitted on a retry, moving both to the head of the list."""

    def __init__(self) -> None:
        self.before = [_run("r3", "ALLOW", "2026-07-03T00:00:00Z"), _run("r2", "DELAY", "2026-07-02T00:00:00Z"), _run("r1", "DENY", "2026-07-01T00:00:00Z")]
        self.after = [
            _run("r2", "ALLOW", "2026-07-05T00:00:00.5Z"),
            _run("r4", "ALLOW", "2026-07-04T00:00:00Z"),
            self.before[0],
            self.before[2],
        ]
        self.pages = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path, limit, offset = request.url.path, int(request.url.params["limit"]), int(request.url.params["offset"])
        if path.endswith("/runs"):
            runs = self.before if self.pages == 0 else self.after
            self.pages += 1
            return httpx.Response(200, json={"runs": runs[offset : offset + limit]})
        key, name = ("jobs", "train") if path.endswith("/jobs") else ("namespaces", "vision-prod")
        return httpx.Response(200, json={key: [{"name": name}] if offset == 0 else []})


def test_a_run_seen_twice_across_shifting_pages_counts_once_as_its_latest_reading() -> None:
    runs = list(marquez_runs("http://marquez", page=2, transport=httpx.MockTransport(ShiftingListing())))
    # Page 1 (offset 0): r3, r2 (DELAY). Page 2 (offset 2), after the shift: r3 again, r1.
    assert sorted(r["id"] for r in runs) == ["r1", "r2", "r3"]
    [denial] = marquez_report(runs, SCOPE, WindowFilter())["denial_rate"]
    assert (denial["runs"], denial["allowed"], denial["denied"], denial["delayed"]) == (3, 1, 1, 1)


def test_the_later_reading_of_a_run_wins_whichever_page_shows_it_first() -> None:
    listing = ShiftingListing()
    r3, r2_delayed, r1 = listing.before
    listing.before = [listing.after[0], r3]  # r2's ALLOW on the first page, its older DELAY on the next
    listing.after = [r3, r1, r2_delayed]
    runs = {r["id"]: r for r in marquez_runs("http://marquez", page=2, transport=httpx.MockTransport(listing))}
    assert runs["r2"]["facets"][FACET_KEY]["decision"] == "ALLOW"
