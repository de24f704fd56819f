"""Months of the ledger older than the retention archived to files and dropped from Postgres
(`budgetgate ledger archive`), and brought back (`budgetgate ledger restore`).

A series is the tables partitioned by one month that go together (a decision and its
evaluations; usage records; the outbox). Its months are archived oldest first. Decisions and
usage, each month in one transaction:
1. the month's partitions are locked SHARE (nothing writes them while they are copied), and what
   still needs them is asked: a month holding a run still open (a reservation or hold held, not
   settled to its end, ...: the view ledger_open_runs) is refused, with the reasons and the first
   runs; one whose decisions chargeback reports of a kept month still read waits;
2. each partition is copied out (COPY, CSV with a header) to `<partition>.csv.gz` in
   `<directory>/<series>/<YYYY-MM>/`, under a temporary name, flushed to disk and renamed; it is
   then read back: its records are counted (they must be as many as the partition's rows) and its
   SHA-256 taken;
3. `manifest.json` beside the files names the month, each file's table, partition, columns, rows
   and digest, and how to restore it;
4. the partitions are detached and dropped, and `ledger_archives` records the month;
5. the transaction commits.
A failure or a crash anywhere before the commit leaves the database as it was (the files written
so far are written again by the next run); after it, the month is archived and a run again skips
it. Detaching takes a brief ACCESS EXCLUSIVE lock on the table (not CONCURRENTLY: Postgres refuses
that while the table has a default partition, which is what keeps a write of an unexpected month
from failing); it waits at most `lock_timeout` and is tried again a few times.

The outbox has no default partition, and is detached CONCURRENTLY, which cannot run inside a
transaction: its month is written out and verified as above (refused while a row of it is not
published yet), then detached without blocking the relays, then checked again (as many rows as
the file holds, else written again), dropped and recorded. A run stopped in between finds the
partition detaching (it finishes the detach) or detached (it checks, drops and records it).

Restoring reads a manifest, checks every file's digest and rows, loads each into a new table and
attaches it as its month's partition again (rows of that month that arrived since, in the default
partition, are moved in), and forgets the archive record, in one transaction."""

from __future__ import annotations

import asyncio
import csv
import gzip
import hashlib
import json
import logging
import os
import re
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg

from budgetgate.core.windows import rfc3339
from budgetgate.ledger import partitions as months
from budgetgate.ledger.queries import sql

log = logging.getLogger(__name__)

FORMAT = "budgetgate-ledger-archive/1"
MANIFEST = "manifest.json"
_PARTITION = re.compile(r"^([a-z_]+)_p(\d{4})(\d{2})$")
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Series:
    """Tables partitioned by the same month, archived together. `needs` (a query of the month's
    bounds) says what refuses a month, `waits` (of the bounds and the retention cutoff) what
    defers it; each answers (reason, runs, examples): how many `noun`s, and the first few."""

    name: str
    tables: tuple[str, ...]
    needs: str
    waits: str | None = None
    noun: str = "run"  # what the reasons count
    concurrently: bool = False  # one table without a default partition, detached CONCURRENTLY


# Usage before decisions: a month's decisions wait while usage of their runs is kept.
SERIES: tuple[Series, ...] = (
    Series("usage", ("usage_records",), needs=sql("archive_needs_usage")),
    Series("decisions", ("decisions", "decision_evaluations"), needs=sql("archive_needs_decisions"), waits=sql("archive_waits_decisions")),
    Series("outbox", ("outbox",), needs=sql("archive_needs_outbox"), noun="row", concurrently=True),
)


class ArchiveError(RuntimeError):
    """An archive could not be written, verified or restored; nothing in the database changed."""


@dataclass(frozen=True)
class Reason:
    reason: str
    runs: int
    examples: tuple[str, ...]
    noun: str = "run"

    def __str__(self) -> str:
        if not self.runs:
            return self.reason
        shown = ", ".join(repr(r) for r in self.examples)
        more = f" and {self.runs - len(self.examples)} more" if self.runs > len(self.examples) else ""
        return f"{self.runs} {self.noun}(s) because {self.reason} ({shown}{more})"


@dataclass(frozen=True)
class Kept:
    """A month old enough to be archived that was not: `refused` when something still works on
    it (or its lock was not granted), else it waits for something that goes by itself."""

    series: str
    month: datetime
    reasons: tuple[Reason, ...]
    refused: bool

    def __str__(self) -> str:
        verdict = "refused" if self.refused else "waits"
        return f"{self.series} {months.month_label(self.month)} {verdict}: " + "; ".join(str(r) for r in self.reasons)


@dataclass(frozen=True)
class ArchivedTable:
    table: str
    partition: str
    file: str
    rows: int
    sha256: str
    columns: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class ArchivedMonth:
    series: str
    month: datetime
    manifest: Path
    tables: tuple[ArchivedTable, ...]

    @property
    def rows(self) -> int:
        return sum(t.rows for t in self.tables)


@dataclass
class Report:
    """What a run of `archive` did: the months archived, kept (refused or waiting) and, for a
    dry run, those it would archive."""

    cutoff: datetime
    archived: list[ArchivedMonth] = field(default_factory=list)
    kept: list[Kept] = field(default_factory=list)
    would_archive: list[tuple[str, datetime, dict[str, str]]] = field(default_factory=list)

    @property
    def refused(self) -> list[Kept]:
        return [k for k in self.kept if k.refused]


def month_directory(directory: Path, series: str, month: datetime) -> Path:
    return directory / series / months.month_label(month)


async def archive(
    conn: asyncpg.Connection,
    *,
    retention_months: int,
    directory: Path,
    dry_run: bool = False,
    ahead: int = months.DEFAULT_AHEAD,
    lock_timeout: float = 5.0,
    tries: int = 3,
    series: Sequence[Series] = SERIES,
    say: Callable[[str], None] = lambda _line: None,
) -> Report:
    """Archive every month of `series` that ended `retention_months` or more calendar months ago
    (by Postgres's clock) into `directory`, oldest first; a month still needed is kept, with why.
    Partitions ahead are created first (and rows of the default partitions moved to their months)."""
    now: datetime = await conn.fetchval("SELECT now()")
    cutoff = months.retention_cutoff(now, retention_months)
    report = Report(cutoff)
    if not dry_run:
        await months.ensure(conn, ahead=ahead, lock_timeout=lock_timeout)
    for s in series:
        by_month: dict[datetime, dict[str, str]] = {}
        for p in await months.partitions(conn, s.tables):
            if p.start is not None and p.end is not None and p.end <= cutoff:
                by_month.setdefault(p.start, {})[p.parent] = p.name
        # Detached by a run that stopped before it dropped them: finished whatever their month.
        for parent, name, month in await months.detached(conn, s.tables):
            by_month.setdefault(month, {})[parent] = name
        for month in sorted(by_month):
            m = _Month(s, month, months.add_months(month, 1), cutoff, by_month[month], month_directory(directory, s.name, month))
            if dry_run:
                reasons = await _reasons(conn, m)
                if reasons:
                    report.kept.append(reasons)
                else:
                    report.would_archive.append((s.name, month, m.named))
                continue
            done = await _tried(conn, m, lock_timeout=lock_timeout, tries=tries)
            if isinstance(done, Kept):
                report.kept.append(done)
                say(str(done))
            else:
                report.archived.append(done)
                say(f"archived {s.name} {months.month_label(month)}: {done.rows} row(s) to {done.manifest}")
    return report


@dataclass(frozen=True)
class _Month:
    """One month of a series to archive: its bounds, its partitions by table, where it goes."""

    series: Series
    start: datetime
    end: datetime
    cutoff: datetime  # the retention's: what `waits` asks about
    named: dict[str, str]
    folder: Path

    def kept(self, reasons: Sequence[Reason], *, refused: bool) -> Kept:
        return Kept(self.series.name, self.start, tuple(reasons), refused=refused)

    def archived(self, manifest: Path, written: Sequence[ArchivedTable]) -> ArchivedMonth:
        return ArchivedMonth(self.series.name, self.start, manifest, tuple(written))


async def _reasons(conn: asyncpg.Connection, m: _Month) -> Kept | None:
    s = m.series
    needs = [Reason(r["reason"], r["runs"], tuple(r["examples"]), s.noun) for r in await conn.fetch(s.needs, m.start, m.end)]
    if needs:
        return m.kept(needs, refused=True)
    if s.waits is not None:
        waits = [Reason(r["reason"], r["runs"], tuple(r["examples"]), s.noun) for r in await conn.fetch(s.waits, m.start, m.end, m.cutoff)]
        if waits:
            return m.kept(waits, refused=False)
    return None


async def _archive_month(conn: asyncpg.Connection, m: _Month, *, lock_timeout: float) -> ArchivedMonth | Kept:
    """A month of tables with a default partition: locked, checked, written out and verified,
    detached and dropped, all in one transaction."""
    async with conn.transaction():
        await conn.execute("SELECT set_config('lock_timeout', $1, true)", _ms(lock_timeout))
        for partition in m.named.values():
            await conn.execute(f"LOCK TABLE {_ident(partition)} IN SHARE MODE")
        kept = await _reasons(conn, m)
        if kept is not None:
            return kept
        manifest, written = await _write_month(conn, m)
        for t in written:
            if await _state(conn, t.partition) != "detached":
                await conn.execute(f"ALTER TABLE {_ident(t.table)} DETACH PARTITION {_ident(t.partition)}")
            await _drop_and_record(conn, m, t, manifest)
    return m.archived(manifest, written)


async def _archive_concurrently(conn: asyncpg.Connection, m: _Month, *, lock_timeout: float) -> ArchivedMonth | Kept:
    """A month of a table without a default partition: written out and verified, detached
    CONCURRENTLY, checked again, dropped and recorded; each step resumed by a run again."""
    [(table, partition)] = m.named.items()
    state = await _state(conn, partition)
    if state == "attached":
        async with conn.transaction():
            await conn.execute("SELECT set_config('lock_timeout', $1, true)", _ms(lock_timeout))
            await conn.execute(f"LOCK TABLE {_ident(partition)} IN SHARE MODE")
            kept = await _reasons(conn, m)
            if kept is not None:
                return kept
            await _write_month(conn, m)
        await _outside_transaction(conn, f"ALTER TABLE {_ident(table)} DETACH PARTITION {_ident(partition)} CONCURRENTLY", lock_timeout)
    elif state == "detaching":  # a detach stopped half way
        await _outside_transaction(conn, f"ALTER TABLE {_ident(table)} DETACH PARTITION {_ident(partition)} FINALIZE", lock_timeout)
    async with conn.transaction():
        await conn.execute("SELECT set_config('lock_timeout', $1, true)", _ms(lock_timeout))
        await conn.execute(f"LOCK TABLE {_ident(partition)} IN ACCESS EXCLUSIVE MODE")
        manifest, written = await _written(conn, m)
        await _drop_and_record(conn, m, written[0], manifest)
    return m.archived(manifest, written)


async def _write_month(conn: asyncpg.Connection, m: _Month) -> tuple[Path, list[ArchivedTable]]:
    """Every partition of the month written out and verified, then its manifest."""
    m.folder.mkdir(parents=True, exist_ok=True)
    written = [await _write(conn, table, m.named[table], m.folder) for table in m.series.tables if table in m.named]
    manifest = m.folder / MANIFEST
    _write_manifest(manifest, m.series, m.start, m.end, written, schema=await _schema_version(conn), server=conn.get_server_version())
    return manifest, written


async def _written(conn: asyncpg.Connection, m: _Month) -> tuple[Path, list[ArchivedTable]]:
    """The month as its manifest has it, when every file there still is what the manifest says
    and holds as many rows as the (locked) table; else written out again."""
    manifest = m.folder / MANIFEST
    try:
        found = load_manifest(manifest)
        tables = []
        for t in found["tables"]:
            rows = await conn.fetchval(f"SELECT count(*) FROM {_ident(m.named[t['table']])}")
            if verify_file(m.folder / t["file"]) != (t["rows"], t["sha256"]) or rows != t["rows"]:
                raise ArchiveError(f"{t['file']} is not the table as it is now")
            tables.append(ArchivedTable(t["table"], t["partition"], t["file"], t["rows"], t["sha256"], tuple((c["name"], c["type"]) for c in t["columns"])))
        if {t.table for t in tables} == set(m.named):
            return manifest, tables
    except (ArchiveError, OSError, KeyError):
        pass
    return await _write_month(conn, m)


async def _drop_and_record(conn: asyncpg.Connection, m: _Month, t: ArchivedTable, manifest: Path) -> None:
    await conn.execute(f"DROP TABLE {_ident(t.partition)}")
    await conn.execute(sql("record_archive"), t.partition, t.table, m.start, m.end, t.rows, t.sha256, str(manifest.resolve()))


async def _tried(conn: asyncpg.Connection, m: _Month, *, lock_timeout: float, tries: int) -> ArchivedMonth | Kept:
    """The month archived, tried again (after a pause) while a lock is not granted in time."""
    archiving = _archive_concurrently if m.series.concurrently else _archive_month
    for attempt in range(1, tries + 1):
        try:
            return await archiving(conn, m, lock_timeout=lock_timeout)
        except asyncpg.LockNotAvailableError as exc:
            label = months.month_label(m.start)
            log.warning("archiving %s %s: a lock was not granted within %ss (try %d of %d): %s", m.series.name, label, lock_timeout, attempt, tries, exc)
            if attempt < tries:
                await asyncio.sleep(min(2.0 * attempt, 10.0))
    reason = Reason(f"its tables stayed busy: a lock was not granted within {lock_timeout:g}s, {tries} times; run the archive again later", 0, ())
    return m.kept([reason], refused=True)


async def _state(conn: asyncpg.Connection, partition: str) -> str:
    """`attached`, `detaching` (a CONCURRENTLY detach stopped half way) or `detached`."""
    pending = await conn.fetchval("SELECT i.inhdetachpending FROM pg_inherits i WHERE i.inhrelid = $1::text::regclass", partition)
    return "detached" if pending is None else "detaching" if pending else "attached"


async def _outside_transaction(conn: asyncpg.Connection, statement: str, lock_timeout: float) -> None:
    """A statement Postgres refuses inside a transaction block, under the lock timeout."""
    previous = await conn.fetchval("SELECT current_setting('lock_timeout')")
    await conn.execute("SELECT set_config('lock_timeout', $1, false)", _ms(lock_timeout))
    try:
        await conn.execute(statement)
    finally:
        await conn.execute("SELECT set_config('lock_timeout', $1, false)", previous)


def _ms(seconds: float) -> str:
    return f"{max(1, round(seconds * 1000))}ms"


async def _write(conn: asyncpg.Connection, table: str, partition: str, folder: Path) -> ArchivedTable:
    """Copy `partition` out to `<folder>/<partition>.csv.gz`, flushed to disk, and read it back."""
    columns = tuple((r["name"], r["type"]) for r in await conn.fetch(_COLUMNS, partition))
    expected: int = await conn.fetchval(f"SELECT count(*) FROM {_ident(partition)}")
    path = folder / f"{partition}.csv.gz"
    part = path.with_name(path.name + ".part")
    with open(part, "wb") as raw:
        with gzip.GzipFile(filename=path.name, mode="wb", fileobj=raw, compresslevel=6, mtime=0) as zipped:

            async def out(chunk: bytes) -> None:
                zipped.write(chunk)

            status = await conn.copy_from_table(partition, columns=[c for c, _ in columns], output=out, format="csv", header=True)
        raw.flush()
        os.fsync(raw.fileno())
    copied = int(status.split()[-1])
    if copied != expected:
        raise ArchiveError(f"{partition}: COPY wrote {copied} rows, the partition holds {expected}; nothing was archived")
    os.replace(part, path)
    _fsync_directory(folder)
    rows, digest = verify_file(path)
    if rows != expected:
        raise ArchiveError(f"{path}: read back, it holds {rows} records, the partition {expected}; nothing was archived")
    return ArchivedTable(table, partition, path.name, rows, digest, columns)


def verify_file(path: Path) -> tuple[int, str]:
    """The records (after the header) of an archive file and the SHA-256 of its bytes;
    ArchiveError when it cannot be read whole (missing, truncated, not gzip or not CSV)."""
    digest = hashlib.sha256()
    limit = csv.field_size_limit(sys.maxsize)  # a decision's readings may be longer than csv's 128 KiB default
    try:
        with open(path, "rb") as raw:
            while chunk := raw.read(_CHUNK):
                digest.update(chunk)
        with gzip.open(path, "rt", encoding="utf-8", newline="") as text:
            reader = csv.reader(text)
            next(reader, None)
            rows = sum(1 for _ in reader)
    except (OSError, EOFError, UnicodeDecodeError, csv.Error) as exc:
        raise ArchiveError(f"{path}: cannot be read whole: {exc}") from None
    finally:
        csv.field_size_limit(limit)
    return rows, digest.hexdigest()


def _write_manifest(path: Path, s: Series, month: datetime, end: datetime, written: list[ArchivedTable], *, schema: str, server: Any) -> None:
    body = {
        "format": FORMAT,
        "series": s.name,
        "month": months.month_label(month),
        "range": {"from": rfc3339(month), "to": rfc3339(end)},
        "archived_at": rfc3339(datetime.now(UTC)),
        "schema": schema,
        "postgres": f"{server.major}.{server.minor}",
        "tables": [
            {
                "table": t.table,
                "partition": t.partition,
                "file": t.file,
                "rows": t.rows,
                "sha256": t.sha256,
                "columns": [{"name": c, "type": ty} for c, ty in t.columns],
                "copy": f"COPY {t.partition} ({', '.join(c for c, _ in t.columns)}) FROM STDIN WITH (FORMAT csv, HEADER true)",
            }
            for t in written
        ],
        "restore": f"budgetgate ledger restore {path.resolve()}",
    }
    part = path.with_name(path.name + ".part")
    with open(part, "w", encoding="utf-8") as f:
        json.dump(body, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)
    _fsync_directory(path.parent)


@dataclass(frozen=True)
class Restored:
    series: str
    month: str
    tables: tuple[tuple[str, int], ...]  # (partition, rows)
    moved_from_default: int


async def restore(conn: asyncpg.Connection, manifest_path: Path, *, lock_timeout: float = 5.0) -> Restored:
    """Bring a month back from its archive: every file checked against the manifest (digest and
    records), loaded into its month's partition again, the archive record forgotten; all in one
    transaction. ArchiveError says what is wrong, with nothing changed."""
    manifest = load_manifest(manifest_path)
    folder = manifest_path.parent
    for t in manifest["tables"]:
        rows, digest = verify_file(folder / t["file"])
        if digest != t["sha256"] or rows != t["rows"]:
            raise ArchiveError(
                f"{folder / t['file']}: {rows} records, SHA-256 {digest}; the manifest says {t['rows']} and {t['sha256']}: the file is not the one archived"
            )
    month = datetime.fromisoformat(manifest["range"]["from"].replace("Z", "+00:00"))
    loaded: list[tuple[str, int]] = []
    moved = 0
    async with conn.transaction():
        await conn.execute("SELECT set_config('lock_timeout', $1, true)", _ms(lock_timeout))
        for t in manifest["tables"]:
            table, partition = t["table"], t["partition"]
            if await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", partition):
                raise ArchiveError(f"{partition} exists: {manifest['month']} of {table} is not archived (restored already?); nothing was restored")
            known = {r["name"] for r in await conn.fetch(_COLUMNS, table)}
            columns = [c["name"] for c in t["columns"]]
            unknown = [c for c in columns if c not in known]
            if unknown:
                raise ArchiveError(f"{table} has no column(s) {', '.join(unknown)} that {t['file']} holds: restore it into a schema that has them")
            await conn.execute(
                f"CREATE TABLE {_ident(partition)} (LIKE {_ident(table)} INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING STORAGE INCLUDING COMPRESSION)"
            )
            status = await conn.copy_to_table(partition, source=_gunzip(folder / t["file"]), columns=columns, format="csv", header=True)
            if int(status.split()[-1]) != t["rows"]:
                raise ArchiveError(f"{t['file']}: {status.split()[-1]} rows loaded, the manifest says {t['rows']}; nothing was restored")
            if table == "decisions":  # a database that lost them (restored from an older backup) gets the keys back
                await conn.execute(
                    f"INSERT INTO decision_keys (decision_id, run_id, attempt, outcome, decided_at, ledger_seq) "
                    f"SELECT decision_id, run_id, attempt, outcome, decided_at, ledger_seq FROM {_ident(partition)} ON CONFLICT (decision_id) DO NOTHING"
                )
            moved += await conn.fetchval("SELECT budgetgate_attach_month($1, $2, $3)", table, partition, month)
            await conn.execute(sql("unarchive"), partition)
            loaded.append((partition, t["rows"]))
    return Restored(manifest["series"], manifest["month"], tuple(loaded), moved)


def load_manifest(path: Path) -> dict[str, Any]:
    """A manifest, checked: its format, and every table and partition one the ledger partitions."""
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ArchiveError(f"{path}: not a readable archive manifest: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArchiveError(f"{path}: not a budgetgate ledger archive manifest (format {FORMAT!r})")
    for t in manifest.get("tables", []):
        match = _PARTITION.match(str(t.get("partition", "")))
        if t.get("table") not in months.PARTITIONED or match is None or match[1] != t["table"] or "/" in str(t.get("file", "/")):
            raise ArchiveError(f"{path}: table entry {t.get('table')!r} / {t.get('partition')!r} / {t.get('file')!r} is not one of the ledger's partitions")
        if f"{match[2]}-{match[3]}" != manifest.get("month"):
            raise ArchiveError(f"{path}: partition {t['partition']} is not of month {manifest.get('month')}")
    return manifest


async def archived_decision(conn: asyncpg.Connection, run_id: str) -> ArchivedDecision | None:
    """The run's latest decision when it is archived (None: the run has no decision, or its
    latest one is in Postgres)."""
    row = await conn.fetchrow(sql("archived_decision"), run_id)
    if row is None:
        return None
    return ArchivedDecision(row["run_id"], str(row["decision_id"]), row["attempt"], row["decided_at"], row["partition"], row["location"])


@dataclass(frozen=True)
class ArchivedDecision:
    run_id: str
    decision_id: str
    attempt: int
    decided_at: datetime
    partition: str
    location: str

    def __str__(self) -> str:
        return (
            f"run {self.run_id!r}'s latest decision (attempt {self.attempt}, decision {self.decision_id}, decided at {rfc3339(self.decided_at)}) "
            f"is archived: its month ({self.partition}) was moved out of Postgres to {self.location}; "
            f"`budgetgate ledger restore {self.location}` brings it back"
        )

    def problem(self) -> dict[str, Any]:
        """The body of a 410 Gone."""
        return {
            "detail": str(self),
            "run_id": self.run_id,
            "attempt": self.attempt,
            "decision_id": self.decision_id,
            "decided_at": rfc3339(self.decided_at),
            "archive": self.location,
        }


async def archives_within(conn: asyncpg.Connection, table: str, start: datetime, end: datetime | None = None) -> list[dict[str, Any]]:
    """The archived months of `table` a reading of [start, end) (end None: from `start` on)
    cannot see."""
    return [
        {"partition": r["partition"], "from": rfc3339(r["range_start"]), "to": rfc3339(r["range_end"]), "rows": r["row_count"], "archive": r["location"]}
        for r in await conn.fetch(sql("archives_within"), table, start, end or datetime.max.replace(tzinfo=UTC))
    ]


def not_read(month: dict[str, Any]) -> str:
    """What a reading of a period says of an archived month of it (an `archives_within` entry)."""
    return f"not read: {month['rows']} row(s) of {month['from'][:7]} are archived in {month['archive']} (`budgetgate ledger restore` restores them)"


_COLUMNS = """
SELECT a.attname AS name, format_type(a.atttypid, a.atttypmod) AS type
FROM pg_attribute a WHERE a.attrelid = $1::text::regclass AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum
"""


async def _schema_version(conn: asyncpg.Connection) -> str:
    return await conn.fetchval("SELECT max(name) FROM schema_migrations") or ""


async def _gunzip(path: Path) -> AsyncIterator[bytes]:
    with gzip.open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            yield chunk


def _ident(name: str) -> str:
    """A table name of the ledger's, quoted; refuses anything else."""
    if not re.fullmatch(r"[a-z_][a-z0-9_]*", name):
        raise ArchiveError(f"{name!r} is not a table name of the ledger")
    return f'"{name}"'


def _fsync_directory(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
