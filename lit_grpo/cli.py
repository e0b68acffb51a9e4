"""The ``lit-grpo`` command: LightningCLI over GRPOModule and OnPolicyDataModule.

``lit-grpo fit --config configs/quickstart.yaml`` trains; ``--help`` lists
every option (generated from the constructors' docstrings);
``lit-grpo dpo fit --config configs/dpo_quickstart.yaml`` trains DPOModule on
a PreferenceDataModule instead (``lit-grpo dpo --help``);
``lit-grpo plot RUN_DIR`` draws a finished run's curves.
"""

from __future__ import annotations

import sys
from pathlib import Path

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lit_grpo.checkpointing import AtomicCheckpointIO
from lit_grpo.data import OnPolicyDataModule
from lit_grpo.module import GRPOModule
from lit_grpo.multiprocess import (
    end_child_processes, exit_on_signal, is_collective_failure, print_failure, set_collective_timeout,
)


class PolicyCli(LightningCLI):
    """LightningCLI for a :class:`~lit_grpo.policy_module.PolicyModule`: adds ``--export_adapter``."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument("--export_adapter", type=str | None, default=None,
                            help="After fit, write the trained adapter (PEFT format) to this folder.")
        parser.add_argument("--collective_timeout", type=float | None, default=None,
                            help="Seconds one rank may wait in a collective before a multi-process run "
                                 "fails with an error naming the hook (default 300 on CPUs, 1800 on GPUs, "
                                 "unless the strategy sets its own timeout).")

    def instantiate_trainer(self, **kwargs) -> Trainer:
        """The Trainer, crash-safe by default: atomic checkpoint files and a ``last.ckpt``.

        Added only where the config names none of its own: an
        :class:`~lit_grpo.checkpointing.AtomicCheckpointIO` plugin, and a
        ``ModelCheckpoint(save_last=True)`` in ``<default_root_dir>/checkpoints``
        (not under the logger's per-run version folder, which a resumed run does
        not share), so ``--ckpt_path last`` finds the killed run's checkpoint.
        """
        config = self._get(self.config_init, "trainer", default={})
        plugins = _as_list(config.get("plugins"))
        if not any(isinstance(p, CheckpointIO) for p in plugins):
            kwargs["plugins"] = [*plugins, AtomicCheckpointIO()]
        callbacks = _as_list(config.get("callbacks"))
        if config.get("enable_checkpointing") is not False and not any(
            isinstance(c, ModelCheckpoint) for c in callbacks
        ):
            root = Path(config.get("default_root_dir") or Path.cwd())
            kwargs["callbacks"] = [*callbacks, ModelCheckpoint(dirpath=root / "checkpoints", save_last=True)]
        trainer = super().instantiate_trainer(**kwargs)
        set_collective_timeout(trainer.strategy, self._get(self.config, "collective_timeout"))
        return trainer

    def after_fit(self) -> None:
        path = self._get(self.config, "export_adapter")
        if path:  # on every rank: gathering sharded weights is a collective
            self.model.export_adapter(path)
            if self.trainer.is_global_zero:
                print(f"adapter written to {path}")


class GRPOCli(PolicyCli):
    """LightningCLI with the trainer settings GRPO depends on."""

    def add_arguments_to_parser(self, parser) -> None:
        super().add_arguments_to_parser(parser)
        # Each epoch is one rollout round: the DataModule must regenerate.
        parser.set_defaults({"trainer.reload_dataloaders_every_n_epochs": 1})


def _as_list(value) -> list:
    return [] if value is None else list(value) if isinstance(value, list) else [value]


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``lit-grpo`` console script."""
    argv = sys.argv[1:] if args is None else args
    if argv[:1] == ["plot"]:
        from lit_grpo.plots import main as plot_main

        plot_main(argv[1:])
        return
    exit_on_signal()
    try:
        _run(argv)
    except Exception as error:
        end_child_processes()  # the other ranks would wait for this one in their next collective
        if not is_collective_failure(error):
            raise
        print_failure(error, rank_zero_only.rank)
        sys.exit(1)


def _run(argv: list[str]) -> None:
    if argv[:1] == ["dpo"]:
        from lit_grpo.dpo import DPOModule
        from lit_grpo.dpo_data import PreferenceDataModule

        PolicyCli(DPOModule, PreferenceDataModule, args=argv[1:], save_config_kwargs={"overwrite": True},
                  parser_kwargs={"prog": "lit-grpo dpo"})
        return
    GRPOCli(GRPOModule, OnPolicyDataModule, args=argv, save_config_kwargs={"overwrite": True})

if __name__ == "__main__":
    main()
