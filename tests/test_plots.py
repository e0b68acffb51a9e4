"""Curves from a real tiny run's metrics.csv, by callback and by ``lit-grpo plot``."""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lit_grpo.algorithms.answers import BeforeAfterAnswers
from lit_grpo.algorithms.grpo import GRPOModule
from lit_grpo.cli import main
from lit_grpo.data.grpo import OnPolicyDataModule
from lit_grpo.data.specs import HeldOutSpec, SourceSpec
from lit_grpo.evaluation.plots import BEFORE_TRAINING, PlotCallback, find_metrics, read_metrics
from lit_grpo.generation.rollout import SamplingSpec
from lit_grpo.model.policy import PolicySpec

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def length_reward(prompts, completions, **columns):
    return [float(len(c)) for c in completions]


def build(tiny_model_dir):
    module = GRPOModule(
        policy=PolicySpec(name_or_path=tiny_model_dir),
        progress=False,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
    )
    data = OnPolicyDataModule(
        prompts_per_epoch=2,
        batch_size=4,
        held_out=HeldOutSpec(size=4, batch_size=4),
        source=SourceSpec(train_size=40),
        sampling=SamplingSpec(group_size=4, max_new_tokens=6),
        rewards=[length_reward],
    )
    return module, data


def fit_trainer(root, logger, callbacks, epochs=2):
    return L.Trainer(
        max_epochs=epochs,
        reload_dataloaders_every_n_epochs=1,
        accelerator="cpu",
        logger=logger,
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        num_sanity_val_steps=0,
    )


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, tiny_model_dir):
    """One 2-epoch fit with a CSVLogger, the PlotCallback and before/after answers."""
    root = tmp_path_factory.mktemp("run")
    module, data = build(tiny_model_dir)
    plots, answers = PlotCallback(each=True), BeforeAfterAnswers(count=3)
    logger = CSVLogger(root, name="plots")
    fit_trainer(root, logger, [plots, answers]).fit(module, data)
    return root, Path(logger.log_dir), plots, answers


def is_png(path: Path) -> bool:
    return path.stat().st_size > 1000 and path.read_bytes()[:8] == PNG_MAGIC


def test_callback_writes_grid_and_one_png_per_metric(tiny_run):
    root, log_dir, plots, _ = tiny_run
    assert plots.written[0] == log_dir / "curves.png" and is_png(plots.written[0])
    each = {p.name for p in plots.written[1:]}
    assert {"reward_total.png", "val_accuracy.png", "train_kl.png", "completion_length_mean.png"} <= each
    assert all(is_png(p) for p in plots.written)


def test_run_metrics_read_as_epoch_series(tiny_run):
    _, log_dir, _, _ = tiny_run
    series = read_metrics(log_dir / "metrics.csv")
    # validation scored before training (no epoch column -> -1) and after each of the 2 epochs
    assert [epoch for epoch, _ in series["val/accuracy"]] == [BEFORE_TRAINING, 0, 1]
    for name in (
        "reward/total",
        "reward/length_reward",
        "train/kl",
        "train/entropy",
        "train/loss_epoch",
        "completion/length_mean",
        "rollout/collapsed_fraction",
    ):
        assert [epoch for epoch, _ in series[name]] == [0, 1], name
    assert not any(name.endswith("_step") for name in series)


def test_sparse_rows_last_value_of_an_epoch_wins(tmp_path):
    (tmp_path / "metrics.csv").write_text(
        "epoch,step,reward/total,train/loss_step,val/accuracy\n"
        ",0,,,0.25\n"  # logged before training
        "0,0,,3.0,\n"  # a step-level column: skipped
        "0,1,0.5,,\n"
        "0,1,,,0.5\n"
        "1,3,0.75,,\n"
        "1,3,,,0.5\n"
        "1,3,,,1.0\n"  # validated twice in epoch 1: the later value is kept
    )
    series = read_metrics(tmp_path / "metrics.csv")
    assert series == {"reward/total": [(0, 0.5), (1, 0.75)], "val/accuracy": [(-1, 0.25), (0, 0.5), (1, 1.0)]}


def test_cli_plot_reads_the_newest_run(tiny_run, tmp_path, capsys):
    root, log_dir, _, _ = tiny_run
    stale = root / "plots" / "version_old" / "metrics.csv"
    stale.parent.mkdir(parents=True)
    stale.write_text("epoch,step,nothing_we_plot\n0,0,1.0\n")
    os.utime(stale, (1, 1))  # older than the real run
    assert find_metrics(root) == log_dir / "metrics.csv"
    out = tmp_path / "out"
    main(["plot", str(root), "--out", str(out), "--panels", "reward", "train/kl"])
    assert is_png(out / "curves.png")
    assert str(out / "curves.png") in capsys.readouterr().out


def test_cli_plot_writes_into_run_dir_by_default(tmp_path):
    (tmp_path / "v0").mkdir()
    (tmp_path / "v0" / "metrics.csv").write_text("epoch,step,train/kl\n0,0,0.0\n1,1,0.01\n")
    main(["plot", str(tmp_path)])
    assert is_png(tmp_path / "curves.png")


def test_cli_plot_without_metrics_names_the_fix(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plot", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "CSVLogger" in capsys.readouterr().err


def test_plot_callback_refuses_a_trainer_without_csv_logger(tmp_path, tiny_model_dir):
    module, data = build(tiny_model_dir)
    with pytest.raises(ValueError, match="trainer.logger"):
        fit_trainer(tmp_path, False, [PlotCallback()]).fit(module, data)


def test_before_after_answers_from_the_same_fit(tiny_run):
    _, _, _, answers = tiny_run
    table = answers.table()
    assert [row["prompt"] for row in table] == [row["prompt"] for row in answers.rows] and len(table) == 3
    assert all(isinstance(row["before"], str) and isinstance(row["after"], str) for row in table)
    assert all(row[key] in (0.0, 1.0) for row in table for key in ("before_score", "after_score"))
    markdown = answers.to_markdown().splitlines()
    assert markdown[0].startswith("| prompt | before (score") and len(markdown) == 2 + 3


def test_reward_panel_draws_raw_values_faintly_under_their_moving_average():
    from lit_grpo.evaluation.plots import PANELS, moving_average, plot_panels

    # Trailing 5-epoch mean: epoch 5 averages epochs 1-5 = (1+0+1+0+1)/5.
    assert moving_average([0, 1, 0, 1, 0, 1], 5) == [0, 0.5, 1 / 3, 0.5, 0.4, 0.6]
    series = {"reward/total": [(e, float(e % 2)) for e in range(6)]}
    ax = plot_panels(series, [PANELS["reward"]]).axes[0]
    raw, mean = ax.lines
    assert list(raw.get_ydata()) == [0, 1, 0, 1, 0, 1] and raw.get_alpha() == 0.3
    assert (
        list(mean.get_ydata()) == [0, 0.5, 1 / 3, 0.5, 0.4, 0.6] and mean.get_label() == "reward/total (5-epoch mean)"
    )
