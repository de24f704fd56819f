"""`budgetgate policy …`: validate, diff and apply a policy repository."""

from __future__ import annotations

import asyncio
import getpass
import json
from pathlib import Path

import click

from budgetgate.cli import backend
from budgetgate.cli.lazy import LazyGroup
from budgetgate.core.accounts import attached_to, describe
from budgetgate.core.loader import LoadedPolicies, PolicyValidationError, bundle_from_json, load_files, load_path
from budgetgate.core.policy import PolicyBundle
from budgetgate.policies.override_store import plan_with_overrides
from budgetgate.core.policy_plan import Change, emptiness, limit_text, window_text
from budgetgate.policies.repository import RepositoryError, Revision, apply_bundle, dirty_sha, policy_files, revision


# (`what-if` imports this module, so it is named here and imported when run)
@click.group(cls=LazyGroup, lazy={"what-if": "budgetgate.cli.whatif:what_if"})
def policy() -> None:
    """Budgets as code: YAML policy documents in Git."""


def _report(loaded: LoadedPolicies) -> None:
    for skipped in loaded.skipped:
        click.echo(f"skipped: {skipped}", err=True)


def _fail(exc: PolicyValidationError, where: Path) -> SystemExit:
    for error in exc.errors:
        click.echo(f"error: {error}", err=True)
    return SystemExit(f"{len(exc.errors)} error(s) in {where}")


@policy.command()
@click.argument("path", type=click.Path(path_type=Path))
def validate(path: Path) -> None:
    """Check every document of a folder, or of one file; print each error with file and line."""
    try:
        loaded = load_path(path, git_sha="validate")
    except PolicyValidationError as exc:
        raise _fail(exc, path) from None
    _report(loaded)
    bundle = loaded.bundle
    click.echo(
        f"ok: {len(loaded.documents)} document(s), {len(bundle.policies)} budget(s), {len(bundle.rate_cards)} rate card(s)"
        + (f", {len(bundle.accounts.accounts)} account(s)" if bundle.accounts else "")
        + (f", {len(loaded.skipped)} skipped" if loaded.skipped else "")
    )
    if bundle.accounts:
        click.echo("accounts (each covers its own scope and every account below it):")
        budgets: dict[str | None, list[str]] = {}
        for policy in bundle.policies:
            budgets.setdefault(attached_to(policy.scope.scope_id), []).append(f"{policy.id}: {limit_text(policy)} per {window_text(policy.window)}")
        for account, depth in bundle.accounts.walk():
            on_it = budgets.get(account.id)
            click.echo(f"  {'  ' * depth}{describe(account)}" + (f"  [{'; '.join(on_it)}]" if on_it else ""))


def load_revision(directory: Path, *, allow_dirty: bool, committed: bool = False) -> tuple[Revision, LoadedPolicies]:
    """The documents Git holds for `directory` at its revision (the working tree's, if dirty and
    allowed; HEAD's whatever the working tree holds, if `committed`), validated under the SHA
    they will be applied at."""
    try:
        rev = revision(directory, allow_dirty=allow_dirty, committed=committed)
        files = policy_files(directory, rev)
    except RepositoryError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        loaded = load_files(files, git_sha=rev.sha)
        sha = dirty_sha(rev, loaded.documents)
        if sha != rev.sha:
            loaded = load_files(files, git_sha=sha)
    except PolicyValidationError as exc:
        raise _fail(exc, directory) from None
    return rev, loaded


async def _active(conn: object) -> PolicyBundle | None:
    from budgetgate.ledger.queries import sql

    row = await conn.fetchrow(sql("active_bundle"))  # type: ignore[attr-defined]
    if row is None:
        return None
    try:
        return bundle_from_json(row["documents"], git_sha=row["git_sha"])
    except PolicyValidationError as exc:
        raise click.ClickException(f"the active bundle {row['git_sha']} no longer validates: {exc.errors[0]}") from None


def print_plan(active: PolicyBundle | None, changes: list[Change], new: PolicyBundle) -> None:
    head = f"plan against active bundle {active.git_sha}" if active is not None else "plan: no bundle is active yet"
    click.echo(f"{head} -> {new.git_sha}")
    for change in changes:
        click.echo(f"  {change}")
    if not changes:
        click.echo("  no changes")


def load_candidate(directory: Path, *, committed: bool = False) -> tuple[Revision, LoadedPolicies]:
    """The documents `policy diff` and `policy what-if` judge: the working tree's files Git would
    commit, uncommitted changes included (ignored files are not; a folder outside Git is read
    as it is), or with `committed` HEAD's; `Revision.describe` says which."""
    return load_revision(directory, allow_dirty=not committed, committed=committed)


@policy.command()
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--committed", is_flag=True, help="diff HEAD's commit only, leaving uncommitted changes out")
@click.option("--allow-dirty", is_flag=True, hidden=True, help="accepted for older scripts: the working tree is what is diffed anyway")
def diff(directory: Path, committed: bool, allow_dirty: bool) -> None:
    """Print what applying DIRECTORY would change against the active bundle.

    DIRECTORY is read as its working tree, uncommitted changes included (what `policy what-if`
    replays), unless --committed."""
    if committed and allow_dirty:
        raise click.UsageError("--committed leaves uncommitted changes out; --allow-dirty is for taking them in")
    rev, loaded = load_candidate(directory, committed=committed)
    click.echo(f"candidate: {directory}, {rev.describe()}")
    _report(loaded)
    settings = backend.stack_settings()

    async def run() -> None:
        async with backend.postgres(settings.postgres_dsn) as conn:
            active = await _active(conn)
            print_plan(active, await plan_with_overrides(conn, active, loaded.bundle), loaded.bundle)

    asyncio.run(run())


@policy.command()
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--allow-dirty", is_flag=True, help="apply uncommitted changes (the SHA gets a -dirty suffix)")
@click.option("--allow-empty", is_flag=True, help="apply even a bundle without documents, or one that removes every budget")
@click.option(
    "--server", metavar="URL", help="apply through admission's API at URL with an operator token (BUDGETGATE_TOKEN, else the local stack's), not the database"
)
@click.option(
    "--wait",
    metavar="SECONDS",
    type=click.FloatRange(min=0),
    default=0,
    help="with --server: first wait up to SECONDS for admission to be ready but for a policy bundle, then for it to be ready with this one",
)
def apply(directory: Path, allow_dirty: bool, allow_empty: bool, server: str | None, wait: float) -> None:
    """Validate, print the plan, then store the bundle at its Git SHA and make it active everywhere."""
    if wait and not server:
        raise click.UsageError("--wait goes with --server")
    _, loaded = load_revision(directory, allow_dirty=allow_dirty)
    _report(loaded)
    if server:
        if wait:
            wait_for_admission(server, seconds=wait, with_bundle=False)
        apply_over_http(server, loaded, source=str(directory.resolve()), allow_empty=allow_empty)
        if wait:
            wait_for_admission(server, seconds=wait, with_bundle=True)
        return
    settings = backend.stack_settings()
    seq = asyncio.run(apply_loaded(settings.postgres_dsn, loaded, source=str(directory.resolve()), allow_empty=allow_empty))
    click.echo(f"applied {loaded.bundle.git_sha} ({len(loaded.bundle.policies)} budget(s)) as activation {seq}")


async def apply_loaded(dsn: str, loaded: LoadedPolicies, *, source: str, allow_empty: bool = False, applied_by: str | None = None) -> int:
    """Print the plan and apply; refuses an empty bundle, or one that removes every budget,
    unless `allow_empty`."""
    async with backend.postgres(dsn) as conn:
        active = await _active(conn)
        print_plan(active, await plan_with_overrides(conn, active, loaded.bundle), loaded.bundle)
        empty = emptiness(active, loaded.bundle, len(loaded.documents))
        if empty and not allow_empty:
            raise click.ClickException(f"refused: {empty}; pass --allow-empty if that is what you mean")
        try:
            return await apply_bundle(conn, bundle=loaded.bundle, documents=loaded.documents, source=source, applied_by=applied_by or getpass.getuser())  # type: ignore[arg-type]
        except RepositoryError as exc:
            raise click.ClickException(str(exc)) from None


def apply_over_http(server: str, loaded: LoadedPolicies, *, source: str, allow_empty: bool) -> None:
    """POST the bundle to admission's /v1/policies as an operator; print the plan it applied."""
    import httpx

    from budgetgate.runtime.settings import dev_token

    token = dev_token("operator")
    if not token:
        raise click.ClickException("no token: set BUDGETGATE_TOKEN to an operator token (`budgetgate token create --role operator`)")
    from budgetgate.core.loader import documents_to_json

    documents = json.loads(documents_to_json(loaded.documents))  # as stored: dates as strings
    body = {"git_sha": loaded.bundle.git_sha, "source": source, "documents": documents, "allow_empty": allow_empty}
    click.echo(f"budgetgate: admission at {server}", err=True)
    try:
        response = httpx.post(server.rstrip("/") + "/v1/policies", json=body, headers={"Authorization": f"Bearer {token}"}, timeout=60)
    except httpx.HTTPError as exc:
        raise click.ClickException(f"cannot reach {server}: {exc}") from None
    answer = response.json() if response.headers.get("content-type", "").endswith("json") else {"detail": response.text}
    if response.status_code != 200:
        for error in answer.get("errors", []):
            click.echo(f"error: {error['msg']}", err=True)
        raise click.ClickException(f"{server} refused the bundle ({response.status_code}): {answer.get('detail')}")
    previous = answer["previous_sha"]
    click.echo(f"plan against active bundle {previous} -> {answer['git_sha']}" if previous else f"plan: no bundle is active yet -> {answer['git_sha']}")
    for change in answer["changes"] or ["no changes"]:
        click.echo(f"  {change}")
    click.echo(f"applied {answer['git_sha']} ({answer['budgets']} budget(s)) as activation {answer['activation']} by {answer['applied_by']}")


# Admission's readiness check that only an applied bundle can pass.
BUNDLE_CHECK = "policy_bundle"


def wait_for_admission(server: str, *, seconds: float, with_bundle: bool) -> None:
    """Return once admission at `server` answers /readyz with every check ok — but for the policy
    bundle's unless `with_bundle` (before a first apply it has none, and stays unready until it
    does); a ClickException naming the failing checks after `seconds`."""
    import time

    import httpx

    click.echo(f"budgetgate: waiting up to {seconds:g}s for admission at {server} to be ready{'' if with_bundle else ' for a bundle'}", err=True)
    deadline = time.monotonic() + seconds
    while True:
        try:
            response = httpx.get(server.rstrip("/") + "/readyz", timeout=5)
            checks = response.json().get("checks") or {}
            failing = {name: found for name, found in checks.items() if found != "ok" and (with_bundle or name != BUNDLE_CHECK)}
            if response.status_code == 200 or (checks and not failing):
                return
            why = ", ".join(f"{name}: {found}" for name, found in failing.items()) or f"HTTP {response.status_code}"
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            why = str(exc) or type(exc).__name__
        if time.monotonic() >= deadline:
            raise click.ClickException(f"admission at {server} is not ready after {seconds:g}s ({why})")
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
