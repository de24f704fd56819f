"""A click group whose sub-commands are imported when they are run, not when the command line
starts: `budgetgate submit` no longer loads the benchmarks, the fault campaign and the
adapters first (the pattern of click's documentation, "Lazily Loading Subcommands")."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import click


class LazyGroup(click.Group):
    """`lazy`: each sub-command's name and where it is defined (`"module:attribute"`)."""

    def __init__(self, *args: Any, lazy: Mapping[str, str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.lazy:
            return self._load(cmd_name)
        return super().get_command(ctx, cmd_name)

    def _load(self, name: str) -> click.Command:
        module, _, attribute = self.lazy[name].partition(":")
        command = getattr(importlib.import_module(module), attribute)
        if not isinstance(command, click.Command):
            raise TypeError(f"{self.lazy[name]} is not a click command (sub-command {name!r} of {self.name!r})")
        if command.name != name:
            raise ValueError(f"{self.lazy[name]} is the command {command.name!r}, listed as {name!r} under {self.name!r}")
        return command
