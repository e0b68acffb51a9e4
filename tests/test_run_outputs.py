"""What a finished run leaves and says, from the real CLI on a tiny model: the summary with a final
validation, one metrics history across a resume, metrics.csv for every command, and batch arithmetic
refused before any folder exists."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from lit_grpo import cli
from lit_grpo.evaluation.plots import find_metrics, read_metrics

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def grpo_args(tiny_model_dir: str, root: Path, *extra: str) -> list[str]:
    return [
        "fit",
        "--config",
        str(CONFIGS / "quickstart.yaml"),
        f"--model.policy.name_or_path={tiny_model_dir}",
        "--model.policy.lora.r=4",
        f"--trainer.default_root_dir={root}",
        f"--trainer.logger.init_args.save_dir={root}",
        "--trainer.enable_progress_bar=false",
        "--trainer.callbacks=[]",
        "--trainer.check_val_every_n_epoch=2",
        "--data.held_out.size=4",
        "--data.held_out.slices=null",
        "--data.prompts_per_epoch=2",
        "--data.batch_size=4",
        "--data.sampling.group_size=2",
        "--data.sampling.max_new_tokens=4",
        f"--export_adapter={root / 'adapter'}",
        *extra,
    ]


def rows(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def numbers(row: dict) -> dict[str, float]:
    return {k: float(v) for k, v in row.items() if v}


def test_summary_after_a_final_validation(tmp_path, tiny_model_dir, capsys):
    cli.main(grpo_args(tiny_model_dir, tmp_path, "--trainer.max_epochs=3"))
    out = capsys.readouterr().out
    lines = out.splitlines()
    # validation ran after epoch 1 only; the run still ends with held-out figures, and the epoch-2 line
    # does not repeat epoch 1's
    assert [line for line in lines if line.startswith("epoch 2:")][0].count("val/accuracy") == 0
    assert [line for line in lines if line.startswith("epoch 1:")][0].count("val/accuracy") == 1
    # no progress bar: each phase says in one line what it ran and for how long
    phases = [line for line in lines if " in " in line and line.endswith(" s") and ": " in line]
    assert any(line.startswith("rollout: ") and " step" in line for line in phases), phases
    assert any(line.startswith("held-out prompts (greedy): 4 prompts in ") for line in phases), phases
    assert any(line.startswith("reference log-probs: 4 rows in ") for line in phases), phases  # beta > 0
    summary = lines[lines.index(next(line for line in lines if line.startswith("finished:"))) :]
    assert summary[0].startswith("finished: 3 epochs, 3 optimizer steps (this command: ")
    assert summary[1].startswith("  val/accuracy: ") and " before -> " in summary[1] and summary[1].endswith(" after")
    run = tmp_path / "lightning_logs" / "version_0"
    assert summary[2] == f"  metrics: {run / 'metrics.csv'} (curves: lit-grpo plot {run})"
    assert summary[3] == f"  adapter: {tmp_path / 'adapter'}"
    assert summary[4] == f"  last checkpoint: {tmp_path / 'checkpoints' / 'last.ckpt'}"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["last.ckpt"]
    validated = [r for r in rows(run / "metrics.csv") if r.get("val/accuracy")]
    assert [(r["epoch"], r["step"]) for r in validated] == [("", "0"), ("1", "1"), ("2", "3")]


def test_resumed_run_carries_on_the_metrics_history(tmp_path, tiny_model_dir, capsys):
    cli.main(grpo_args(tiny_model_dir, tmp_path, "--trainer.max_epochs=2"))
    first = rows(tmp_path / "lightning_logs" / "version_0" / "metrics.csv")
    cli.main(grpo_args(tiny_model_dir, tmp_path, "--trainer.max_epochs=4", "--ckpt_path=last"))
    out = capsys.readouterr().out
    newest = find_metrics(tmp_path)
    assert newest.parent.name == "version_1"
    resumed = rows(newest)
    assert [numbers(r) for r in resumed[: len(first)]] == [numbers(r) for r in first]
    series = read_metrics(newest)
    assert [epoch for epoch, _ in series["reward/total"]] == [0, 1, 2, 3]
    assert [epoch for epoch, _ in series["val/accuracy"]] == [-1, 1, 3]
    # the resumed run's summary compares with the first run's held-out figures before training
    before = next(r["val/accuracy"] for r in first if r["val/accuracy"] and not r["epoch"])
    line = next(line for line in out.splitlines() if line.startswith("  val/accuracy: "))
    assert line.startswith(f"  val/accuracy: {float(before):.3f} before -> ")


def test_sft_writes_metrics_csv_without_a_configured_logger(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli.main(
        [
            "sft",
            "fit",
            "--config",
            str(CONFIGS / "sft_quickstart.yaml"),
            f"--model.policy.name_or_path={tiny_model_dir}",
            "--model.policy.lora.r=4",
            f"--trainer.default_root_dir={tmp_path / 'sft'}",
            "--trainer.enable_progress_bar=false",
            "--trainer.max_epochs=1",
            "--data.train_size=8",
            "--data.val_size=4",
            "--data.val_max_new_tokens=4",
        ]
    )
    (metrics,) = (tmp_path / "sft").rglob("metrics.csv")
    assert any(r.get("val/loss") for r in rows(metrics))
    assert sorted(p.name for p in (tmp_path / "sft" / "checkpoints").iterdir()) == ["last.ckpt"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--data.batch_size=32"],
            "lit-grpo: data.batch_size=32 does not divide the 4 completions each rank samples per epoch "
            "(prompts_per_epoch/world_size=2 x group_size=2); pick a divisor of 4.",
        ),
        (
            ["--data.batch_size=2", "--trainer.accumulate_grad_batches=4"],
            "lit-grpo: trainer.accumulate_grad_batches=4 does not divide the 2 micro-batches of an epoch "
            "(data.num_iterations=1 x 4 completions per rank / data.batch_size=2): every optimizer step would "
            "not see the same number of completions; pick a divisor of 2, or a smaller data.batch_size.",
        ),
    ],
)
def test_batch_arithmetic_refused_before_any_folder(tmp_path, tiny_model_dir, capsys, monkeypatch, extra, message):
    monkeypatch.setattr(cli, "end_child_processes", lambda: None)
    with pytest.raises(SystemExit) as exit_:
        cli.main(grpo_args(tiny_model_dir, tmp_path / "run", "--trainer.max_epochs=1", *extra))
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == message
    assert not (tmp_path / "run").exists()
