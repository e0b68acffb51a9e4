"""The ``lit-grpo`` command: LightningCLI over GRPOModule and OnPolicyDataModule.

``lit-grpo fit --config configs/quickstart.yaml`` trains; ``--help`` lists
every option (generated from the constructors' docstrings);
``lit-grpo dpo fit --config configs/dpo_quickstart.yaml`` trains DPOModule on
a PreferenceDataModule instead (``lit-grpo dpo --help``);
``lit-grpo plot RUN_DIR`` draws a finished run's curves.

Whatever stops a run, the last line on stderr says what: ``lit-grpo: <message>``,
naming the field or file, the value and what was expected
(:mod:`lit_grpo.cli_errors`). Checks that need the whole command run here,
before the first rollout: YAML files by file and line, the checkpoint of
``--ckpt_path``, the batch arithmetic, and every output folder's permissions.
"""

from __future__ import annotations

import inspect
import logging
import os
import shlex
import sys
import time
import warnings
from importlib.util import find_spec

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar, TQDMProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lit_grpo.algorithms.grpo import GRPOModule
from lit_grpo.cli_checks import (
    OneLineErrorParser,
    as_list,
    check_moved_keys,
    check_writable,
    check_yaml_files,
    checkpoint_dir,
    default_last_checkpoint,
    is_checkpoint_file,
    replaced_environments,
)
from lit_grpo.cli_errors import USER_ERROR_EXIT, report_failure
from lit_grpo.data.grpo import OnPolicyDataModule
from lit_grpo.data.setup_checks import check_batch_arithmetic
from lit_grpo.training.checkpointing import AtomicCheckpointIO, check_lightning_checkpoint, check_policy
from lit_grpo.training.multiprocess import (
    GRACE_S,
    end_child_processes,
    exit_on_signal,
    is_collective_failure,
    print_failure,
    set_collective_timeout,
    set_signal_grace,
)
from lit_grpo.training.preemption import Preempted, PreemptionCheckpoint
from lit_grpo.training.summary import RunProgressBar, run_summary

# Lightning 2.6 logs an advertisement for its cloud logger at every Trainer start (logger_connector.py);
# the commands leave it out of their output.
logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(
    lambda record: not str(record.msg).startswith("💡 Tip: For seamless cloud logging")
)


class PolicyCli(LightningCLI):
    """LightningCLI for a :class:`~lit_grpo.algorithms.base.PolicyModule`: adds ``--export_adapter``,
    and checks the command line, the checkpoint to resume and the output folders
    before the first rollout."""

    def __init__(self, *args, parser_class: type[LightningArgumentParser] = OneLineErrorParser, **kwargs) -> None:
        self.started = time.perf_counter()  # the summary's minutes count the whole command
        super().__init__(*args, parser_class=parser_class, **kwargs)

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument(
            "--export_adapter",
            type=str | None,
            default=None,
            help="After fit, write the trained adapter (PEFT format) to this folder.",
        )
        parser.add_argument(
            "--collective_timeout",
            type=float | None,
            default=None,
            help="Seconds one rank may wait in a collective before a multi-process run "
            "fails with an error naming the hook (default 300 on CPUs, 1800 on GPUs, "
            "unless the strategy sets its own timeout).",
        )
        parser.add_argument(
            "--preemption_grace",
            type=float,
            default=GRACE_S,
            help="Seconds after SIGTERM/SIGINT within which the run saves last.ckpt and exits; "
            "a process still running then is ended. Keep it below the scheduler's own "
            "grace period (SLURM's KillWait, Kubernetes' terminationGracePeriodSeconds).",
        )
        # Lightning's module table measures FLOPs only with an example input, which a policy has
        # none of (it reads "FLOPs 0"); the module prints its trainable and total parameters instead.
        parser.set_defaults({"trainer.enable_model_summary": False})

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """``fit`` and ``validate``: Lightning's ``test``/``predict`` have nothing to run here."""
        return {name: keys for name, keys in LightningCLI.subcommands().items() if name in ("fit", "validate")}

    def parse_arguments(self, parser, args) -> None:
        """Parse the command line; first check the YAML files it names, then its ``--ckpt_path``."""
        argv = sys.argv[1:] if args is None else args
        if isinstance(argv, list):
            check_yaml_files(argv)
            if issubclass(self.datamodule_class, OnPolicyDataModule):  # its settings moved into groups
                check_moved_keys(argv)
            argv = replaced_environments(argv)
        super().parse_arguments(parser, argv)
        self._check_strategy()
        self._check_ckpt_path()

    def _command_config(self):
        """The parsed options of the subcommand (``fit``, ``validate``), or all of them without one
        (``self.subcommand`` is only set once parsing returns)."""
        subcommand = self.config.get("subcommand")
        return self.config.get(subcommand) if subcommand else self.config

    def _check_strategy(self) -> None:
        """Refuse a strategy given as a class name (``--trainer.strategy ModelParallelStrategy``):
        Lightning reads a string as a registered name and fails later with a message that
        does not say how to pass the class."""
        from lightning.pytorch import strategies

        value = (self._command_config().get("trainer") or {}).get("strategy")
        named = getattr(strategies, value, None) if isinstance(value, str) else None
        if isinstance(named, type) and issubclass(named, strategies.Strategy):
            raise ValueError(
                f"trainer.strategy={value!r} is a class name, and Lightning reads a string as a registered "
                f"strategy name (ddp, fsdp, ...); pass the class: --trainer.strategy.class_path {value} "
                f"(in YAML: strategy: {{class_path: {value}}})."
            )

    def _check_ckpt_path(self) -> None:
        """Read the checkpoint of ``--ckpt_path`` now and refuse one that cannot resume this run.

        LightningCLI next loads it itself and replaces the model's options with
        the ones saved in it, silently: a checkpoint of another policy would
        otherwise train that policy instead of the one asked for.
        """
        config = self._command_config()
        path = config.get("ckpt_path")
        if path == "last":
            path = default_last_checkpoint(config.get("trainer") or {})
        if not is_checkpoint_file(path):
            return
        checkpoint = AtomicCheckpointIO().load_checkpoint(path, weights_only=config.get("weights_only"))
        check_lightning_checkpoint(checkpoint, path)
        saved = checkpoint.get("hyper_parameters") or {}
        options = inspect.signature(self.model_class).parameters
        unknown = sorted(k for k in saved if not k.startswith("_") and k not in options)
        if unknown:
            raise ValueError(
                f"ckpt_path={path!r} was saved by another kind of model: its hyper-parameters {unknown} "
                f"are not options of {self.model_class.__name__}; pass a checkpoint of a "
                f"{self.model_class.__name__} run."
            )
        if "policy" in saved:
            policy = config.get("model", {}).get("policy")
            check_policy(saved["policy"], policy.as_dict() if policy else None, f"ckpt_path={path!r}")

    def instantiate_trainer(self, **kwargs) -> Trainer:
        """The Trainer, crash-safe by default, with the same outputs for every command.

        Added only where the config names none of its own: an
        :class:`~lit_grpo.training.checkpointing.AtomicCheckpointIO` plugin (atomic
        checkpoint files); a ``ModelCheckpoint`` writing ``last.ckpt`` at the end of
        every epoch into ``<default_root_dir>/checkpoints`` (not under the logger's
        per-run version folder, which a resumed run does not share), so
        ``--ckpt_path last`` finds the killed run's checkpoint; and a CSVLogger
        under ``default_root_dir``, so every run writes a ``metrics.csv`` that
        ``lit-grpo plot`` draws (``trainer.logger: false`` logs nothing).
        """
        config = self._get(self.config_init, "trainer", default={})
        if config.get("logger") in (None, True):
            kwargs["logger"] = CSVLogger(save_dir=config.get("default_root_dir") or os.getcwd())
        plugins = as_list(config.get("plugins"))
        if not any(isinstance(p, CheckpointIO) for p in plugins):
            kwargs["plugins"] = [*plugins, AtomicCheckpointIO()]
        callbacks = as_list(config.get("callbacks"))
        if config.get("enable_checkpointing") is not False and not any(
            isinstance(c, ModelCheckpoint) for c in callbacks
        ):
            # saved at the end of every training epoch, whatever check_val_every_n_epoch is
            callbacks = [
                *callbacks,
                # one file, last.ckpt, rewritten at the end of every epoch: the one Lightning's
                # ``--ckpt_path last`` finds (not a second copy named by epoch and step)
                ModelCheckpoint(
                    dirpath=checkpoint_dir(config),
                    filename="last",
                    enable_version_counter=False,
                    save_on_train_epoch_end=True,
                ),
            ]
        if not any(isinstance(c, PreemptionCheckpoint) for c in callbacks):
            callbacks = [*callbacks, PreemptionCheckpoint(announce=False, resume_hint=_resume_command())]
        if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in callbacks):
            callbacks = [*callbacks, RunProgressBar() if find_spec("rich") else TQDMProgressBar()]
        kwargs["callbacks"] = callbacks
        trainer = super().instantiate_trainer(**kwargs)
        set_collective_timeout(trainer.strategy, self._get(self.config, "collective_timeout"))
        set_signal_grace(self._get(self.config, "preemption_grace"))
        return trainer

    def before_fit(self) -> None:
        """Check every output folder before the first rollout, not when training is over."""
        locations = [
            ("export_adapter", self._get(self.config, "export_adapter")),
            ("trainer.default_root_dir", self.trainer.default_root_dir),
        ]
        locations += [
            ("the checkpoint folder (ModelCheckpoint.dirpath)", c.dirpath)
            for c in self.trainer.checkpoint_callbacks
            if isinstance(c, ModelCheckpoint)
        ]
        locations += [("trainer.logger.save_dir", getattr(logger, "save_dir", None)) for logger in self.trainer.loggers]
        for field, path in locations:
            check_writable(field, path)

    def after_fit(self) -> None:
        path = self._get(self.config, "export_adapter")
        if path:  # on every rank: gathering sharded weights is a collective
            self.model.export_adapter(path)
        if self.trainer.is_global_zero:
            print(run_summary(self.trainer, self.model, time.perf_counter() - self.started, path))


class GRPOCli(PolicyCli):
    """LightningCLI with the trainer settings GRPO depends on."""

    def add_arguments_to_parser(self, parser) -> None:
        super().add_arguments_to_parser(parser)
        # Each epoch is one rollout round: the DataModule must regenerate.
        parser.set_defaults({"trainer.reload_dataloaders_every_n_epochs": 1})

    def before_fit(self) -> None:
        """Also refuse an epoch that does not split into groups, micro-batches and optimizer steps, before
        the Trainer creates any folder."""
        data, trainer = self.datamodule, self.trainer
        check_batch_arithmetic(
            data.hparams.prompts_per_epoch,
            data.sampling.group_size,
            data.hparams.batch_size,
            data.hparams.num_iterations,
            trainer.accumulate_grad_batches,
            trainer.world_size,
        )
        super().before_fit()


def _resume_command() -> str:
    """This command line with ``--ckpt_path last`` in place of any ``--ckpt_path`` it had."""
    argv, kept, skip = sys.argv[1:], [], False
    for word in argv:
        if skip:
            skip = False
            continue
        if word == "--ckpt_path":
            skip = True
            continue
        if not word.startswith("--ckpt_path="):
            kept.append(shlex.quote(word))
    return " ".join(["lit-grpo", *kept, "--ckpt_path", "last"])


COMMANDS = {
    "fit": "train with GRPO: lit-grpo fit --config configs/quickstart.yaml",
    "validate": "greedy validation accuracy of a config's model, one pass",
    "eval": "score a base model or base + adapter: lit-grpo eval --config CONFIG --adapter DIR [--samples N]",
    "plot": "draw a finished run's curves: lit-grpo plot RUN_DIR",
    "dpo": "train with DPO: lit-grpo dpo fit --config configs/dpo_quickstart.yaml",
    "ppo": "train with PPO and a critic: lit-grpo ppo fit --config configs/ppo_quickstart.yaml",
    "sft": "supervised fine-tuning: lit-grpo sft fit --config configs/sft_quickstart.yaml",
    "rm": "train a reward model on preference pairs: lit-grpo rm fit --config configs/rm_quickstart.yaml",
}
HELP = "\n".join(
    [
        "usage: lit-grpo COMMAND [options]",
        "",
        "GRPO post-training of causal language models with PyTorch Lightning.",
        "",
        "commands:",
        *[f"  {name:<10}{line}" for name, line in COMMANDS.items()],
        "",
        "lit-grpo COMMAND --help lists a command's options.",
    ]
)


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``lit-grpo`` console script."""
    argv = sys.argv[1:] if args is None else args
    if argv[:1] in ([], ["-h"], ["--help"]):
        print(HELP)
        return
    if argv[0] not in COMMANDS and not argv[0].startswith("-"):  # options before fit/validate pass through
        sys.stderr.write(f"{HELP}\n\nlit-grpo: unknown command {argv[0]!r}; expected one of {list(COMMANDS)}.\n")
        sys.exit(USER_ERROR_EXIT)
    exit_on_signal()
    try:
        with warnings.catch_warnings():
            # We hand LightningCLI the command line ourselves (less the command for
            # eval/dpo); its warning about args beside sys.argv does not apply.
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
            _run(argv)
    except Preempted as stop:  # saved; the other ranks stop at the same step
        sys.stderr.write(f"lit-grpo: {stop}\n")
        sys.exit(stop.code)
    except Exception as error:
        end_child_processes()  # the other ranks would wait for this one in their next collective
        if is_collective_failure(error):
            print_failure(error, rank_zero_only.rank)
            sys.exit(1)
        sys.exit(report_failure(error))


def _run(argv: list[str]) -> None:
    if argv[0] == "plot":
        from lit_grpo.evaluation.plots import main as plot_main

        plot_main(argv[1:])
        return
    if argv[0] == "eval":
        from lit_grpo.evaluation.evaluate import main as eval_main

        eval_main(argv[1:])
        return
    if argv[0] == "ppo":
        from lit_grpo.algorithms.ppo import PPOModule

        GRPOCli(
            PPOModule,
            OnPolicyDataModule,
            args=argv[1:],
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"prog": "lit-grpo ppo"},
        )
        return
    if argv[0] == "dpo":
        from lit_grpo.algorithms.dpo import DPOModule
        from lit_grpo.data.preferences import PreferenceDataModule

        PolicyCli(
            DPOModule,
            PreferenceDataModule,
            args=argv[1:],
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"prog": "lit-grpo dpo"},
        )
        return
    if argv[0] in _DATASET_COMMANDS:
        module_class, datamodule_class = _DATASET_COMMANDS[argv[0]]()
        PolicyCli(
            module_class,
            datamodule_class,
            args=argv[1:],
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"prog": f"lit-grpo {argv[0]}"},
        )
        return
    GRPOCli(GRPOModule, OnPolicyDataModule, args=argv, save_config_kwargs={"overwrite": True})


def _sft_classes():
    from lit_grpo.algorithms.sft import SFTModule
    from lit_grpo.data.sft import SFTDataModule

    return SFTModule, SFTDataModule


def _rm_classes():
    from lit_grpo.algorithms.reward_model import RewardModelModule
    from lit_grpo.data.reward_pairs import RewardDataModule

    return RewardModelModule, RewardDataModule


# Subcommands that train on a fixed dataset: name -> () -> (module class, DataModule class).
_DATASET_COMMANDS = {"sft": _sft_classes, "rm": _rm_classes}


if __name__ == "__main__":
    main()
