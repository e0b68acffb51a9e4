"""GRPO vs PPO (critic on the shared base, and a separate critic) vs RLOO vs REINFORCE++, measured.

The seeds' table (GRPO needs no critic, so less memory, faster and steadier
steps) on the quickstart task: two-digit addition, the embedded
SmolLM2-135M-Instruct, LoRA r=16. Every algorithm runs its shipped recipe
with one switch, each run in a fresh process, until its training rollouts
have generated the same number of tokens (``--tokens``; the run stops after
the epoch that reaches it):

* ``grpo``: ``lit-grpo fit --config configs/quickstart.yaml`` on two-digit
  sums at lr 1e-4 (``TWO_DIGIT``: the quickstart recipe of the time; 4 prompts
  x G=8, one step per epoch, beta=0.04 as a k3 KL in the loss);
* ``rloo`` / ``reinforce_pp``: the same plus ``--data.advantage.estimator
  rloo`` / ``reinforce_pp`` (REINFORCE++ moves the beta=0.04 KL into its
  per-token rewards, as k1);
* ``ppo_shared``: ``lit-grpo ppo fit --config configs/ppo_quickstart.yaml``
  (16 prompts x G=2, 2 passes of 2 micro-batches: 4 steps per epoch, GAE,
  critic = a second LoRA adapter + value head on the actor's frozen base);
* ``ppo_separate``: the same with ``--model.critic.name_or_path`` the policy's
  model: a second copy of the model, with its own LoRA adapter, as critic.

All sample 32 completions of at most 24 tokens per epoch. Measured per run:
peak RSS of the process (``ru_maxrss``: model load, rollouts, steps and
evaluations), training seconds per epoch and per optimizer step (the clock
runs through rollouts and steps, never through the evaluations), greedy
validation accuracy before training and every ``--eval_every`` epochs,
against those training minutes; for stability, the k3 KL of the policy to the
reference on the latest rollout at each evaluation, the gradient norm of the
actor's trainable weights at every step (PPO's critic left out) and whether
the run collapsed: a skipped non-finite step, entropy under 0.05 nats/token
or completions under 2 tokens at the end, or a final accuracy 0.25 or more
below the run's best. A seed sets ``seed_everything`` and ``data.seed``
(prompt order, the task's rows, sampling); every algorithm sees the same
prompts and validation set for a seed.

Output: a markdown table (mean ± sample std over the seeds) on stdout and in
``OUT/table.md``, ``OUT/accuracy_vs_minutes.png`` (mean ± std band, each
seed's curve interpolated onto a common minute grid), ``OUT/results.json``.
Finished runs are cached in ``OUT/runs/<algorithm>-<seed>.json`` and reused
unless ``--fresh``; runs' CSV logs are in ``OUT/logs``.

The full table with the defaults (5 algorithms x 3 seeds, 4-6 epochs each;
estimated, not measured, at 30-40 minutes on this project's 2-core CPU, a
third of it process start-up and evaluations; raise ``--tokens`` for a longer
race)::

    python benchmarks/algorithms.py --tokens 3072 --seeds 0 1 2 --eval_every 2 --out runs/algorithms

A smoke test on a tiny random model (under 4 minutes here, nearly all of it
the start-up of the 5 processes)::

    python benchmarks/algorithms.py --model tiny --tokens 600 --seeds 0 --eval_every 1 --val_size 4 \\
        --out /tmp/algorithms_smoke
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
# name -> (label, lit-grpo command, config, extra arguments; {model} is the policy's name_or_path)
# The GRPO quickstart recipe this table was measured with (the shipped quickstart has since moved to
# a task mix, dynamic sampling and a decaying, higher learning rate): two-digit sums only, as PPO's
# quickstart trains on.
TWO_DIGIT = [
    '--data.source.task_args={"digits": 2, "ops": "+"}',
    "--data.held_out.slices=null",
    "--data.dynamic_sampling=false",
    "--model.scheduler=null",
    "--model.optimizer.init_args.lr=1e-4",
]
ALGORITHMS: dict[str, tuple[str, str, str, list[str]]] = {
    "grpo": ("GRPO", "fit", "configs/quickstart.yaml", TWO_DIGIT),
    "ppo_shared": ("PPO (critic on shared base)", "ppo", "configs/ppo_quickstart.yaml", []),
    "ppo_separate": (
        "PPO (separate critic)",
        "ppo",
        "configs/ppo_quickstart.yaml",
        ["--model.critic.name_or_path", "{model}"],
    ),
    "rloo": ("RLOO", "fit", "configs/quickstart.yaml", [*TWO_DIGIT, "--data.advantage.estimator", "rloo"]),
    "reinforce_pp": (
        "REINFORCE++",
        "fit",
        "configs/quickstart.yaml",
        [*TWO_DIGIT, "--data.advantage.estimator", "reinforce_pp"],
    ),
}
COLLAPSE_ENTROPY, COLLAPSE_LENGTH, COLLAPSE_DROP = 0.05, 2.0, 0.25


def _recorder_class():
    import lightning as L

    class Recorder(L.Callback):
        """Clocks training, evaluates greedily every ``eval_every`` epochs, stops at the token budget."""

        def __init__(self, tokens: int, eval_every: int) -> None:
            self.budget, self.eval_every = tokens, eval_every
            self.tokens, self.seconds, self.steps = 0, 0.0, 0
            self.curve: list[tuple[float, float]] = []  # (training minutes, greedy accuracy)
            self.kl: list[tuple[int, float]] = []  # (epoch, k3 KL to the reference on its rollout)
            self.grad_norms: list[float] = []
            self.epochs: list[dict] = []

        def on_fit_start(self, trainer, module) -> None:
            self.mark = time.perf_counter()  # Lightning runs the first rollout before on_train_start

        def on_train_start(self, trainer, module) -> None:
            self.seconds += time.perf_counter() - self.mark
            self.curve.append((0.0, module.held_out_metrics()["val/accuracy"]))  # no update yet
            self.mark = time.perf_counter()

        def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
            grads = [
                p.grad.norm()
                for name, p in module.named_parameters()
                if p.grad is not None and name.startswith("policy.") and ".critic." not in name
            ]
            self.grad_norms.append(float(torch.linalg.vector_norm(torch.stack(grads))) if grads else 0.0)
            self.steps += 1

        def on_train_epoch_end(self, trainer, module) -> None:
            self.seconds += time.perf_counter() - self.mark
            data, metrics = trainer.datamodule, trainer.callback_metrics
            rows = data.last_result.rows
            self.tokens += round(data.last_stats["completion/length_mean"] * len(rows["completion_ids"]))
            self.epochs.append(
                {
                    name: float(metrics[name])
                    for name in ("reward/total", "train/entropy", "completion/length_mean")
                    if name in metrics
                }
            )
            epoch = trainer.current_epoch
            trainer.should_stop = self.tokens >= self.budget
            if trainer.should_stop or (epoch + 1) % self.eval_every == 0:
                self.curve.append((self.seconds / 60, module.held_out_metrics()["val/accuracy"]))
                self.kl.append((epoch, _rollout_kl(module, rows, data.sampling.temperature)))
            self.mark = time.perf_counter()

    return Recorder


def _rollout_kl(module, rows: dict, temperature: float) -> float:
    """Mean k3 KL of the current policy to the reference over the rollout's real tokens."""
    logprobs = module.rollout_logprobs(rows, temperature, reference=False)  # [N, C]
    log_ratio = module.rollout_logprobs(rows, temperature, reference=True) - logprobs  # [N, C]
    real = rows["completion_mask"].bool()
    return float((log_ratio.exp() - log_ratio - 1)[real].mean())


def run_one(algorithm: str, seed: int, args: argparse.Namespace) -> dict:
    """Train one algorithm for one seed in this process; return its measurements."""
    from lit_grpo.algorithms.grpo import GRPOModule
    from lit_grpo.algorithms.ppo import PPOModule
    from lit_grpo.cli import GRPOCli
    from lit_grpo.data.grpo import OnPolicyDataModule

    _, command, config, extra = ALGORITHMS[algorithm]
    log_dir = Path(args.out) / "logs" / f"{algorithm}-{seed}"
    cli_args = [
        "--config",
        str(ROOT / config),
        "--seed_everything",
        str(seed),
        "--data.seed",
        str(seed),
        "--model.policy.name_or_path",
        args.model_path,
        "--data.held_out.size",
        str(args.val_size),
        "--trainer.max_epochs",
        str(args.max_epochs),
        "--trainer.limit_val_batches",
        "0",
        "--trainer.enable_checkpointing",
        "false",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.enable_model_summary",
        "false",
        "--trainer.default_root_dir",
        str(log_dir),
        "--trainer.logger.init_args.save_dir",
        str(log_dir),
        "--model.progress",
        "false",
        "--model.validate_before_training",
        "false",
        "--model.log_samples",
        "0",
        *[value.format(model=args.model_path) for value in extra],
    ]
    model_class = PPOModule if command == "ppo" else GRPOModule
    cli = GRPOCli(model_class, OnPolicyDataModule, args=cli_args, run=False, save_config_callback=None)
    recorder = _recorder_class()(args.tokens, args.eval_every)
    cli.trainer.callbacks.append(recorder)
    cli.trainer.fit(cli.model, cli.datamodule)
    last = recorder.epochs[-1] if recorder.epochs else {}
    accuracies = [acc for _, acc in recorder.curve]
    collapsed = (
        cli.model.guard.skipped > 0
        or last.get("train/entropy", 1.0) < COLLAPSE_ENTROPY
        or last.get("completion/length_mean", COLLAPSE_LENGTH) < COLLAPSE_LENGTH
        or accuracies[-1] <= max(accuracies) - COLLAPSE_DROP
    )
    return {
        "algorithm": algorithm,
        "seed": seed,
        "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "epochs": len(recorder.epochs),
        "steps": recorder.steps,
        "seconds": recorder.seconds,
        "tokens": recorder.tokens,
        "curve": recorder.curve,
        "kl": recorder.kl,
        "grad_norms": recorder.grad_norms,
        "last_epoch": last,
        "collapsed": bool(collapsed),
    }


def _spread(values: list[float], digits: int = 3) -> str:
    """``mean ± sample std`` (just the mean for one value)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def accuracy_at(curve: list[tuple[float, float]], minutes: float) -> float:
    """Greedy accuracy at ``minutes`` of training, linearly interpolated (held after the last point)."""
    points = sorted(curve)
    for (m0, a0), (m1, a1) in zip(points, points[1:]):
        if m0 <= minutes <= m1:
            return a0 if m1 == m0 else a0 + (a1 - a0) * (minutes - m0) / (m1 - m0)
    return points[-1][1] if minutes > points[-1][0] else points[0][1]


# Table columns after the algorithm and its seed count: header, value of one run (given the
# minutes every run reached), decimals. Each cell is the mean ± sample std over the seeds.
COLUMNS: list[tuple[str, object, int]] = [
    ("peak RSS MiB", lambda r, common: r["peak_mib"], 0),
    ("s / epoch", lambda r, common: r["seconds"] / max(r["epochs"], 1), 1),
    ("s / step", lambda r, common: r["seconds"] / max(r["steps"], 1), 1),
    ("tokens", lambda r, common: r["tokens"], 0),
    ("val acc before", lambda r, common: r["curve"][0][1], 3),
    ("val acc at {common:.1f} min", lambda r, common: accuracy_at(r["curve"], common), 3),
    ("val acc at end", lambda r, common: r["curve"][-1][1], 3),
    ("end minutes", lambda r, common: r["curve"][-1][0], 1),
    ("KL (k3) at end", lambda r, common: r["kl"][-1][1] if r["kl"] else math.nan, 3),
    ("max KL", lambda r, common: max((kl for _, kl in r["kl"]), default=math.nan), 3),
    ("grad norm mean", lambda r, common: statistics.fmean(r["grad_norms"]) if r["grad_norms"] else math.nan, 2),
    ("grad norm max", lambda r, common: max(r["grad_norms"], default=math.nan), 2),
]


def table(results: list[dict]) -> str:
    """The markdown table: one row per algorithm, mean ± std over its seeds."""
    common = min(r["curve"][-1][0] for r in results)  # minutes every run reached
    headers = ["algorithm", "seeds", *(header.format(common=common) for header, _, _ in COLUMNS), "collapsed"]
    lines = ["| " + " | ".join(headers) + " |", "|---" * len(headers) + "|"]
    for algorithm, (label, *_) in ALGORITHMS.items():
        runs = [r for r in results if r["algorithm"] == algorithm]
        if runs:
            cells = [_spread([value(r, common) for r in runs], digits) for _, value, digits in COLUMNS]
            collapsed = f"{sum(r['collapsed'] for r in runs)} / {len(runs)}"
            lines.append("| " + " | ".join([label, str(len(runs)), *cells, collapsed]) + " |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> Path:
    """Greedy accuracy against training minutes: per algorithm the seeds' mean and a ± std band."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for algorithm, (label, *_) in ALGORITHMS.items():
        runs = [r for r in results if r["algorithm"] == algorithm]
        if not runs:
            continue
        end = min(r["curve"][-1][0] for r in runs)
        grid = [end * i / 50 for i in range(51)]
        values = [[accuracy_at(r["curve"], m) for r in runs] for m in grid]
        mean = [statistics.fmean(v) for v in values]
        std = [statistics.stdev(v) if len(v) > 1 else 0.0 for v in values]
        (line,) = axes.plot(grid, mean, label=f"{label} (n={len(runs)})")
        axes.fill_between(
            grid,
            [m - s for m, s in zip(mean, std)],
            [m + s for m, s in zip(mean, std)],
            color=line.get_color(),
            alpha=0.2,
        )
    axes.set_xlabel("training minutes (rollouts + steps; evaluations excluded)")
    axes.set_ylabel("greedy validation accuracy")
    axes.set_title("Quickstart task, same generated-token budget: mean ± std over seeds")
    axes.legend(loc="best", fontsize="small")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return path


def _child(algorithm: str, seed: int, args: argparse.Namespace) -> dict | None:
    """Run one measurement in a fresh process (so one run's memory never counts towards the next)."""
    cache = Path(args.out) / "runs" / f"{algorithm}-{seed}.json"
    if cache.exists() and not args.fresh:
        return json.loads(cache.read_text())
    command = [
        sys.executable,
        __file__,
        "--one",
        algorithm,
        "--seed",
        str(seed),
        "--tokens",
        str(args.tokens),
        "--eval_every",
        str(args.eval_every),
        "--val_size",
        str(args.val_size),
        "--max_epochs",
        str(args.max_epochs),
        "--model",
        args.model,
        "--out",
        args.out,
    ]
    start = time.perf_counter()
    out = subprocess.run(command, capture_output=True, text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        print(f"{algorithm} seed {seed} failed:\n{out.stderr[-3000:]}", file=sys.stderr)
        return None
    result = json.loads(lines[-1][len("RESULT ") :])
    print(
        f"{algorithm} seed {seed}: {result['epochs']} epochs, accuracy {result['curve'][0][1]:.3f} -> "
        f"{result['curve'][-1][1]:.3f}, {time.perf_counter() - start:.0f} s in all",
        file=sys.stderr,
    )
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(result))
    return result


def _model_path(args: argparse.Namespace) -> str:
    """``tiny``: a random tiny Llama saved under ``OUT`` (smoke tests); anything else is a ``name_or_path``."""
    if args.model != "tiny":
        return args.model
    from lit_grpo.model.random_models import save_random_model

    return str(save_random_model("tiny", Path(args.out) / "tiny-model", dtype=torch.float32))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=3072, help="generated tokens per run (training rollouts)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--algorithms", nargs="+", choices=list(ALGORITHMS), default=list(ALGORITHMS))
    parser.add_argument("--eval_every", type=int, default=2, help="epochs between greedy evaluations")
    parser.add_argument("--val_size", type=int, default=64, help="validation prompts")
    parser.add_argument("--max_epochs", type=int, default=100, help="a cap in case the budget is never reached")
    parser.add_argument("--model", default="embedded", help="policy name_or_path, or 'tiny' (random, for smoke tests)")
    parser.add_argument("--out", default="runs/algorithms")
    parser.add_argument("--fresh", action="store_true", help="rerun runs cached in OUT/runs")
    parser.add_argument("--one", choices=list(ALGORITHMS), help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.model_path = _model_path(args)
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one, args.seed, args)))
        return
    results = [r for seed in args.seeds for algorithm in args.algorithms if (r := _child(algorithm, seed, args))]
    if not results:
        sys.exit("no run finished")
    out = Path(args.out)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    heading = (
        f"Quickstart task ({args.model}), {args.tokens} generated tokens per run, "
        f"seeds {args.seeds}; mean ± sample std over seeds."
    )
    text = f"{heading}\n\n{table(results)}\n"
    (out / "table.md").write_text(text)
    print(text)
    print(f"plot: {plot(results, Path(args.out) / 'accuracy_vs_minutes.png')}")


if __name__ == "__main__":
    main()
