"""Policy repositories in Git: which revision a directory is at, and applying a bundle."""

from __future__ import annotations

import hashlib
import json
import subprocess
import uuid
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
from google.protobuf.timestamp_pb2 import Timestamp

from budgetgate import topics, wire
from budgetgate.core.loader import SourceDocument, documents_to_json
from budgetgate.core.policy import PolicyBundle
from budgetgate.ledger.queries import sql
from budgetgate.v1 import policies_pb2


class RepositoryError(RuntimeError):
    """The policy directory's Git state does not allow applying it."""


def _git(directory: Path, *args: str) -> str:
    result = subprocess.run(["git", "-C", str(directory), *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RepositoryError(f"git {' '.join(args)} failed in {directory}: {result.stderr.strip() or result.stdout.strip()}")
    return result.stdout.strip()


def revision(directory: Path, *, allow_dirty: bool, documents: list[SourceDocument]) -> str:
    """The Git SHA the directory's policies are at.

    A tree with uncommitted changes under the directory is refused unless `allow_dirty`; then the
    SHA is suffixed with a digest of the documents, so two different dirty trees never share one.
    """
    try:
        head = _git(directory, "rev-parse", "HEAD")
        dirty = bool(_git(directory, "status", "--porcelain", "--", "."))
    except (RepositoryError, FileNotFoundError) as exc:
        if not allow_dirty:
            raise RepositoryError(f"{directory} is not in a Git repository with a commit ({exc}); commit the policies or pass --allow-dirty") from exc
        head, dirty = "nogit", True
    if not dirty:
        return head
    if not allow_dirty:
        raise RepositoryError(f"{directory} has uncommitted changes; commit them (policies are applied at a Git SHA) or pass --allow-dirty")
    digest = hashlib.sha256(documents_to_json(documents).encode()).hexdigest()[:12]
    return f"{head}-dirty.{digest}"


async def apply_bundle(conn: asyncpg.Connection, *, bundle: PolicyBundle, documents: list[SourceDocument], source: str, applied_by: str) -> int:
    """Store and activate a bundle, move open windows to its limits, and announce it on
    budget.policies.v1 through the outbox — all in one transaction. Returns the activation seq."""
    documents_json = documents_to_json(documents)
    now = datetime.now(UTC)
    stamp = Timestamp()
    stamp.FromDatetime(now)
    message = policies_pb2.PolicyBundlePublished(
        event_id=str(uuid.uuid4()), event_time=stamp, git_sha=bundle.git_sha, documents_json=documents_json, applied_by=applied_by, source=source
    )
    record = wire.encode(message, key=bundle.git_sha)
    async with conn.transaction():
        await conn.execute(sql("insert_bundle"), bundle.git_sha, documents_json, source, applied_by)
        seq = await conn.fetchval(sql("activate_bundle"), bundle.git_sha)
        for policy in bundle.policies:
            await conn.execute(sql("update_policy_limits"), policy.id, policy.limit.amount, bundle.git_sha, str(policy.limit.unit))
        headers = json.dumps([[k, v.decode("latin-1")] for k, v in record.headers])
        await conn.execute(sql("insert_outbox"), topics.POLICIES, bundle.git_sha, record.value, headers)
    return seq
