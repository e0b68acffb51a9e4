"""The first screens of the ``lit-grpo`` command: what it offers, and no warnings."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from lit_grpo.cli import main


def lit_grpo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([shutil.which("lit-grpo"), *args], capture_output=True, text=True, timeout=120)


def test_help_lists_the_commands_and_prints_no_warning():
    result = lit_grpo("--help")
    assert result.returncode == 0 and result.stderr == ""
    listed = [line.split()[0] for line in result.stdout.splitlines() if line.startswith("  ")]
    assert listed == ["fit", "validate", "eval", "plot", "dpo", "ppo", "sft", "rm"]


def test_lightning_commands_that_do_nothing_here_are_gone(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["test"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "lit-grpo: unknown command 'test'; expected one of "
        "['fit', 'validate', 'eval', 'plot', 'dpo', 'ppo', 'sft', 'rm']."
    )
    fit_help = lit_grpo("fit", "--help")
    assert fit_help.returncode == 0 and "--export_adapter" in fit_help.stdout and "Warning" not in fit_help.stderr


def help_text(capsys, *args: str) -> str:
    """``lit-grpo ARGS --help`` in this process (the warnings of a fresh one are checked above)."""
    with pytest.raises(SystemExit) as stop:
        main([*args, "--help"])
    assert stop.value.code == 0
    return capsys.readouterr().out


def test_eval_help_shows_its_options(capsys):
    text = help_text(capsys, "eval")
    for option in ("--adapter", "--samples", "--pass_k", "--out", "--data.source", "--model.policy"):
        assert option in text, option


def test_sft_and_rm_help_show_their_options(capsys):
    for command, option in (("sft", "--data.val_max_new_tokens"), ("rm", "--data.max_completion_length")):
        text = help_text(capsys, command, "fit")
        assert "--model.policy" in text and option in text
