"""Git repositories of policies, as an operator keeps them: `git` in a checkout, a fresh
repository to commit policy files to (the `repo` fixture), and `commit`."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest


def git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Git repository (branch main) at tmp_path/policies, the working directory
    tmp_path, and no BUDGETGATE_HOME: no stack of a developer's is found."""
    root = tmp_path / "policies"
    root.mkdir()
    git("init", "-q", "-b", "main", cwd=root)
    git("config", "user.email", "t@example.com", cwd=root)
    git("config", "user.name", "t", cwd=root)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("BUDGETGATE_HOME", raising=False)
    return root


def commit(repo: Path, files: dict[str, str], message: str = "policies") -> str:
    """Write `files` (path in the repository: text) and commit everything; the commit's SHA."""
    for name, text in files.items():
        path = repo / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    git("add", "-A", cwd=repo)
    git("commit", "-q", "-m", message, cwd=repo)
    return git("rev-parse", "HEAD", cwd=repo)
