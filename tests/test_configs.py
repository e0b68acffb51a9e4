"""Every shipped YAML parses with the command its header documents.

Each config's comment names how to run it (``# lit-grpo fit --config ...``);
the test runs exactly that subcommand with ``--print_config``, which builds
the whole parser and validates every value without loading a model or data.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from lit_grpo.cli import main

CONFIGS = sorted((Path(__file__).parent.parent / "configs").rglob("*.yaml"))
USAGE = re.compile(r"^# lit-grpo (.+?) --config", re.MULTILINE)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_config_parses(config, capsys):
    usage = USAGE.search(config.read_text())
    assert usage, f"{config.name} does not document its command ('# lit-grpo <subcommand> --config ...')"
    with pytest.raises(SystemExit) as exit_info:
        main([*usage.group(1).split(), "--config", str(config), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert (
        printed["model"]["policy"]["name_or_path"]
        == yaml.safe_load(config.read_text())["model"]["policy"]["name_or_path"]
    )
