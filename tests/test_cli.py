"""The `k3deploy` command (k3deploy/cli.py): the listing, and every subcommand's --help under its own name."""
from __future__ import annotations

import pytest

from k3deploy import cli


def test_listing_names_every_subcommand(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in cli.COMMANDS)
    assert cli.main(["nope"]) == 2 and "unknown command 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_subcommand_help(name, capsys):
    """Each subcommand's --help exits 0 and shows `usage: k3deploy <name>` (its module's parser under that prog)."""
    assert cli.main([name, "--help"]) == 0
    assert capsys.readouterr().out.startswith(f"usage: k3deploy {name}")


def test_plan_help_describes_the_plan_not_the_build(capsys):
    """`k3deploy plan --help` says what plan does; `build --help` keeps the pipeline's description."""
    assert cli.main(["plan", "--help"]) == 0
    plan = capsys.readouterr().out
    assert cli.main(["build", "--help"]) == 0
    build = capsys.readouterr().out
    assert "The deployment plan of a checkpoint" in plan and "The main job" not in plan
    assert "The main job" in build and "--enable-prefix-caching" in plan
