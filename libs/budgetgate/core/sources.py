"""Where a policy document came from, and what is wrong in one: the leaf every other policy
module builds on, so none of them needs to import another just for these."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Source:
    """Where a document came from, for error messages and audit."""

    file: str
    line: int


@dataclass(frozen=True, slots=True)
class PolicyError:
    file: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.message}"
