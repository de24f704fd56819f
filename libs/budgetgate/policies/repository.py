"""Policy repositories in Git: which revision a directory is at, and applying a bundle."""

from __future__ import annotations

import hashlib
import json
import subprocess
import uuid
from datetime import UTC, datetime
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import asyncpg
from google.protobuf.timestamp_pb2 import Timestamp

from budgetgate.contracts import topics, wire
from budgetgate.core.loader import SourceDocument, directory_files, documents_to_json
from budgetgate.core.policy_files import path_order
from budgetgate.core.policy import PolicyBundle
from budgetgate.ledger.queries import owned_by
from budgetgate.policies.override_store import after_git_apply
from budgetgate.v1 import policies_pb2

sql = owned_by("budgetgate.policies")


class RepositoryError(RuntimeError):
    """The policy directory's Git state does not allow applying it."""


def _git(directory: Path, *args: str) -> str:
    return _git_bytes(directory, *args).decode("utf-8", "replace").strip()


def _git_bytes(directory: Path, *args: str) -> bytes:
    try:
        result = subprocess.run(["git", "-C", str(directory), *args], capture_output=True, check=False)
    except FileNotFoundError as exc:
        raise RepositoryError("git is not installed") from exc
    if result.returncode != 0:
        message = (result.stderr or result.stdout).decode("utf-8", "replace").strip()
        raise RepositoryError(f"git {' '.join(args)} failed in {directory}: {message}")
    return result.stdout


@dataclass(frozen=True, slots=True)
class Revision:
    """Where a policy directory's documents come from: a commit, or (dirty) the working tree.
    `left_out`: a commit read on purpose although the working tree has uncommitted changes."""

    sha: str
    head: str | None
    dirty: bool
    left_out: bool = False

    def describe(self) -> str:
        """What the documents are, as `policy diff` and `policy what-if` say it."""
        if self.head is None:
            return "working tree (not in a Git repository with a commit)"
        if self.dirty:
            return "working tree (uncommitted changes)"
        if self.left_out:
            return f"commit {self.sha[:12]} (committed only: uncommitted changes left out)"
        return f"working tree at commit {self.sha[:12]} (no uncommitted changes)"


def revision(directory: Path, *, allow_dirty: bool, committed: bool = False) -> Revision:
    """The Git commit the directory's policies are at.

    A tree with uncommitted changes under the directory is refused unless `allow_dirty`; then the
    documents are the working tree's files Git would commit (ignored files are not), and the
    SHA gets a digest suffix (see `dirty_sha`). With `committed`, the documents are HEAD's
    whatever the working tree holds (there must be a commit)."""
    if not directory.is_dir():
        raise RepositoryError(f"{directory} is not a directory")
    try:
        head = _git(directory, "rev-parse", "HEAD")
        dirty = bool(_git(directory, "status", "--porcelain", "--", "."))
    except RepositoryError as exc:
        if committed or not allow_dirty:
            hint = "commit the policies, or leave out --committed" if committed else "commit the policies or pass --allow-dirty"
            raise RepositoryError(f"{directory} is not in a Git repository with a commit ({exc}); {hint}") from exc
        return Revision("nogit", None, True)
    if committed:
        return Revision(head, head, False, left_out=dirty)
    if dirty and not allow_dirty:
        raise RepositoryError(f"{directory} has uncommitted changes; commit them (policies are applied at a Git SHA) or pass --allow-dirty")
    return Revision(head, head, dirty)


def dirty_sha(rev: Revision, documents: list[SourceDocument]) -> str:
    """The SHA a dirty tree is applied under: two different dirty trees never share one."""
    if not rev.dirty:
        return rev.sha
    digest = hashlib.sha256(documents_to_json(documents).encode()).hexdigest()[:12]
    return f"{rev.sha}-dirty.{digest}"


def policy_files(directory: Path, rev: Revision) -> list[tuple[str, bytes | OSError]]:
    """(name relative to `directory`, content) of every *.yaml / *.yml file the revision holds.

    A clean revision is read from the commit itself, never from the working tree; a dirty one
    from the files Git would commit. A symlink is followed only within the repository."""
    if rev.head is None:
        return directory_files(directory)
    top = Path(_git(directory, "rev-parse", "--show-toplevel")).resolve()
    prefix = directory.resolve().relative_to(top).as_posix()
    prefix = "" if prefix == "." else prefix + "/"
    if rev.dirty:
        return _worktree_files(directory, top, prefix)
    return _commit_files(directory, rev.sha, prefix)


def _commit_files(directory: Path, sha: str, prefix: str) -> list[tuple[str, bytes | OSError]]:
    listing = _git_bytes(directory, "ls-tree", "-r", "-z", "--full-tree", sha, "--", prefix or ".")
    entries = []
    for entry in filter(None, listing.split(b"\0")):
        meta, _, raw_path = entry.partition(b"\t")
        mode, kind, obj = meta.decode().split()
        entries.append((raw_path.decode("utf-8", "replace"), mode, kind, obj))
    files: list[tuple[str, bytes | OSError]] = []
    # By path, as a folder is read: an entry's line starts with its mode and blob id, and
    # sorting those would order the policies by the hash of their content.
    for path, mode, kind, obj in sorted(entries, key=lambda e: path_order(e[0])):
        if PurePosixPath(path).suffix not in (".yaml", ".yml") or kind != "blob":
            continue
        name = path.removeprefix(prefix)
        if mode == "120000":
            target = _inside_repository(path, _git_bytes(directory, "cat-file", "blob", obj).decode("utf-8", "replace"))
            if target is None:
                files.append((name, OSError("a symlink to a file outside the repository; policies are only what Git holds")))
                continue
            try:
                files.append((name, _git_bytes(directory, "show", f"{sha}:{target}")))
            except RepositoryError:
                files.append((name, OSError(f"a symlink to {target}, which the commit does not hold")))
            continue
        files.append((name, _git_bytes(directory, "cat-file", "blob", obj)))
    return files


def _inside_repository(link: str, target: str) -> str | None:
    """The repository path a symlink at `link` points to, or None when it leaves the repository."""
    if target.startswith("/"):
        return None
    parts: list[str] = []
    for part in (*PurePosixPath(link).parent.parts, *PurePosixPath(target).parts):
        if part == "..":
            if not parts:
                return None
            parts.pop()
        elif part not in (".", ""):
            parts.append(part)
    return "/".join(parts)


def _worktree_files(directory: Path, top: Path, prefix: str) -> list[tuple[str, bytes | OSError]]:
    listing = _git_bytes(directory, "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--full-name", "--", ".")
    files: list[tuple[str, bytes | OSError]] = []
    for path in sorted({p.decode("utf-8", "replace") for p in listing.split(b"\0") if p}, key=path_order):
        if PurePosixPath(path).suffix not in (".yaml", ".yml"):
            continue
        on_disk = top / path
        if not on_disk.exists():
            continue  # deleted, not yet committed
        name = path.removeprefix(prefix)
        if not on_disk.resolve().is_relative_to(top):
            files.append((name, OSError("a symlink to a file outside the repository; policies are only what Git holds")))
            continue
        try:
            files.append((name, on_disk.read_bytes()))
        except OSError as exc:
            files.append((name, exc))
    return files


async def apply_bundle(conn: asyncpg.Connection, *, bundle: PolicyBundle, documents: list[SourceDocument], source: str, applied_by: str) -> int:
    """Store and activate a bundle, move open windows to its limits, keep or clear the tenant
    overrides (override_store.after_git_apply), announce it on budget.policies.v1 through the
    outbox and record who applied it in the admin log — all in one transaction. Returns the
    activation seq."""
    documents_json = documents_to_json(documents)
    now = datetime.now(UTC)
    stamp = Timestamp()
    stamp.FromDatetime(now)
    message = policies_pb2.PolicyBundlePublished(
        event_id=str(uuid.uuid4()), event_time=stamp, git_sha=bundle.git_sha, documents_json=documents_json, applied_by=applied_by, source=source
    )
    record = wire.encode(message, key=bundle.git_sha)
    async with conn.transaction():
        # First, as an override update takes it before the ledger lock: never a cycle between them.
        await conn.execute(sql("lock_overrides"))
        await conn.execute(sql("insert_bundle"), bundle.git_sha, documents_json, source, applied_by)
        if await conn.fetchval(sql("bundle_differs"), bundle.git_sha, documents_json):
            raise RepositoryError(
                f"a bundle with SHA {bundle.git_sha} was applied before with other documents; a SHA names one content (commit the change and apply the new SHA)"
            )
        seq = await conn.fetchval(sql("activate_bundle"), bundle.git_sha)
        for policy in bundle.policies:
            await conn.execute(sql("update_policy_limits"), policy.id, policy.limit.amount, bundle.git_sha, str(policy.limit.unit))
        await after_git_apply(conn, new=bundle, applied_by=applied_by)
        headers = json.dumps([[k, v.decode("latin-1")] for k, v in record.headers])
        await conn.execute(sql("insert_outbox"), topics.POLICIES, bundle.git_sha, record.value, headers)
        details = json.dumps({"source": source, "activation": seq, "budgets": len(bundle.policies)})
        await conn.execute(sql("log_admin_action"), applied_by, "policy.apply", bundle.git_sha, details)
    return seq
