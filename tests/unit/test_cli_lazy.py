"""The command line imports a sub-command's module only when that command runs: every listed
command loads under its own name, and running one leaves the others' modules unimported."""

from __future__ import annotations

import subprocess
import sys

import click
import pytest

from budgetgate.cli.lazy import LazyGroup
from budgetgate.cli.main import cli
from budgetgate.cli.policy import policy


@pytest.mark.parametrize("group", [cli, policy], ids=["budgetgate", "policy"])
def test_every_listed_command_loads_under_its_own_name(group: LazyGroup) -> None:
    ctx = click.Context(group)
    names = group.list_commands(ctx)
    assert names == sorted(names) and set(group.lazy) <= set(names)
    for name in names:
        command = group.get_command(ctx, name)
        assert command is not None and command.name == name


def test_a_command_runs_without_importing_the_others() -> None:
    probe = (
        "import sys\n"
        "from budgetgate.cli.main import cli\n"
        "try:\n"
        "    cli(['submit', '--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(sorted(m for m in sys.modules if m.startswith(('budgetgate.cli.', 'budgetgate.benchmark', 'budgetgate.chaos'))))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    loaded = done.stdout.strip().splitlines()[-1]
    assert "budgetgate.cli.submit" in loaded
    assert "budgetgate.benchmark" not in loaded and "budgetgate.chaos" not in loaded and "budgetgate.cli.bench" not in loaded


def test_a_listing_that_names_the_wrong_command_says_so() -> None:
    group = LazyGroup(name="g", lazy={"submit": "budgetgate.cli.quote:quote", "quote-x": "budgetgate.cli.main:COMMANDS"})
    ctx = click.Context(group)
    with pytest.raises(ValueError, match="is the command 'quote', listed as 'submit'"):
        group.get_command(ctx, "submit")
    with pytest.raises(TypeError, match="not a click command"):
        group.get_command(ctx, "quote-x")
