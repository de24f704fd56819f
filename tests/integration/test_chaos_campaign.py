"""A real campaign with a bug planted on purpose is caught: the second admission instance decides
on a copy of the ledger, the two over-admit together, and the conservation checker says so, as
does the decisions checker (its decisions are not in the shared Postgres) (docs/promises.md,
"Catching a planted bug")."""

from __future__ import annotations

from pathlib import Path

from budgetgate.chaos import checkers, recorder
from budgetgate.chaos.campaign import Options, run


async def test_a_planted_over_admission_is_caught_by_the_conservation_checker(postgres_admin_dsn: str, tmp_path: Path) -> None:
    options = Options(
        seed=3,
        duration=20.0,
        rate=6.0,
        faults=False,
        settle_seconds=5.0,
        folder=tmp_path,
        plant="split-ledger",
        postgres="shared",
        server_dsn=postgres_admin_dsn,
    )
    outcome = await run(options, echo=lambda _m: None)

    caught = {v.checker for v in outcome.verdict.violations}
    assert "conservation" in caught, outcome.verdict.as_dict()
    # Told ALLOW, yet the shared ledger has no reservation of them: counted at their projection.
    over = [v for v in outcome.verdict.violations if v.checker == "conservation" and "ALLOWs the ledger never recorded" in v.message]
    assert over and all(v.operations for v in over), "the ledger samples name the ALLOWs involved"
    assert "decisions" in caught
    # The history is kept, and judged again from the file alone it gives the same violations.
    lines = recorder.read(outcome.history)
    assert lines[0]["type"] == "setup" and lines[0]["settings"]["planted_bug"] == "split-ledger"
    assert [v.as_dict() for v in outcome.verdict.violations] == [v.as_dict() for v in checkers.check(lines).violations]
