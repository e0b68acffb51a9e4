"""Sampling ahead of training (``data.staleness``) against sampling in line, per epoch.

Trains the quickstart's shape (the embedded SmolLM2-135M-Instruct, LoRA r=16,
4 prompts x 8 completions x 24 new tokens, one optimizer step per epoch) for
``--epochs`` epochs at each staleness, one after the other, and prints a row
per epoch after the first (which has nothing to overlap with):

* ``step s``: the epoch's wall time, rollout included;
* ``gen s``: seconds the sampler spent generating;
* ``train s``: seconds of the training thread's own work (scoring passes,
  rewards, forward, backward, optimizer);
* ``wait s``: seconds the training thread waited for generation (in line: all of it; ahead: the
  round sampled ahead, plus dynamic sampling's further rounds, sampled in line);
* ``sampler idle s``: seconds the sampler waited for the weights it samples with;
* ``tokens/s``: generated tokens over the step's wall time.

Then the check the design asks for: at staleness 1 the trainer's wait per
step is at most ``max(0, gen - train)`` plus 10% of the step. On a CPU both
threads share the same cores, so the overlap shows in the wait, not in a
large gain of the step.

    python benchmarks/async_rollouts.py --epochs 6 --staleness 0 1
    python benchmarks/async_rollouts.py --epochs 6 --staleness 0 1 --oversampling 2
    python benchmarks/async_rollouts.py --epochs 6 --staleness 0 1 --dynamic_sampling false
    python benchmarks/async_rollouts.py --epochs 6 --staleness 0 1 --server http://127.0.0.1:8000

``--server`` runs the same with a vLLM server of the embedded model that is
already running (docs/engines.md shows its command line) in place of the
native engine.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import lightning as L

from lit_grpo.algorithms.grpo import GRPOModule
from lit_grpo.data.grpo import OnPolicyDataModule
from lit_grpo.data.specs import HeldOutSpec, SourceSpec
from lit_grpo.generation import GenerationSpec
from lit_grpo.generation.rollout import SamplingSpec
from lit_grpo.model.hardware import cpu_name
from lit_grpo.model.policy import LoraSpec, PolicySpec
from lit_grpo.rewards import Accuracy

TRAINING_PHASES = ("reward", "reference", "old_logprobs", "policy_forward", "policy_backward", "optimizer")


class EpochClock(L.Callback):
    """Each epoch's wall time and its logged timings."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.started = time.perf_counter()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
        step = time.perf_counter() - self.started
        generate = metrics.get("time/generate", 0.0)
        wait = metrics.get("time/rollout_wait", generate)  # in line, the trainer waits for all of generation
        self.rows.append(
            {
                "step s": step,
                "gen s": generate,
                "train s": sum(metrics.get(f"time/{p}", 0.0) for p in TRAINING_PHASES),
                "wait s": wait,
                "sampler idle s": metrics.get("time/sampler_waited_for_weights", float("nan")),
                "tokens/s": metrics.get("rollout/generated_tokens", 0.0) / step,
            }
        )


def run(
    staleness: int, epochs: int, seed: int, server: str | None, oversampling: float, dynamic_sampling: bool
) -> list[dict[str, float]]:
    L.seed_everything(seed)
    generation = GenerationSpec(backend="vllm_server", urls=[server]) if server else GenerationSpec()
    module = GRPOModule(
        policy=PolicySpec(lora=LoraSpec(r=16, alpha=32)),
        progress=False,
        validate_before_training=False,
        generation=generation,
    )
    data = OnPolicyDataModule(
        source=SourceSpec(
            task_args=[{"digits": 2, "ops": "+"}, {"digits": [2, 3], "ops": "+"}, {"digits": [3, 3], "ops": "+"}]
        ),
        held_out=HeldOutSpec(size=1),
        prompts_per_epoch=4,
        batch_size=32,
        dynamic_sampling=dynamic_sampling,
        oversampling=oversampling,
        staleness=staleness,
        seed=seed,
        sampling=SamplingSpec(group_size=8, temperature=0.8, max_new_tokens=24),
        rewards=[Accuracy()],
    )
    clock = EpochClock()
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        reload_dataloaders_every_n_epochs=1,
        callbacks=[clock],
        default_root_dir=tempfile.mkdtemp(),
    )
    trainer.fit(module, data)
    return clock.rows[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server", default=None, help="a running vLLM server's URL: sample there")
    parser.add_argument(
        "--oversampling", type=float, default=1.0, help="data.oversampling: prompts sampled per round, x the epoch's"
    )
    parser.add_argument(
        "--dynamic_sampling",
        choices=["true", "false"],
        default="true",
        help="data.dynamic_sampling (the quickstart's: true)",
    )
    args = parser.parse_args()
    engine = "vLLM server " + args.server if args.server else "native"
    dynamic = args.dynamic_sampling == "true"
    print(f"CPU: {cpu_name()}; engine: {engine}; dynamic sampling: {dynamic}; oversampling: {args.oversampling}")
    columns = ("step s", "gen s", "train s", "wait s", "sampler idle s", "tokens/s")
    print("| staleness | epoch | " + " | ".join(columns) + " |")
    print("|---|---|" + "---|" * len(columns))
    medians = {}
    for staleness in args.staleness:
        rows = run(staleness, args.epochs, args.seed, args.server, args.oversampling, dynamic)
        for epoch, row in enumerate(rows, start=1):
            print(f"| {staleness} | {epoch} | " + " | ".join(f"{row[c]:.2f}" for c in columns) + " |")
        medians[staleness] = {c: statistics.median(row[c] for row in rows) for c in columns}
    print("\nmedians: | staleness | " + " | ".join(columns) + " |")
    for staleness, row in medians.items():
        print(f"| {staleness} | " + " | ".join(f"{row[c]:.2f}" for c in columns) + " |")
    for staleness, row in medians.items():
        if staleness > 0:
            bound = max(0.0, row["gen s"] - row["train s"]) + 0.1 * row["step s"]
            verdict = "met" if row["wait s"] <= bound else "NOT met"
            print(
                f"staleness {staleness}: trainer wait {row['wait s']:.2f} s <= max(0, gen - train) + 10% of the "
                f"step = {bound:.2f} s: {verdict}"
            )


if __name__ == "__main__":
    main()
