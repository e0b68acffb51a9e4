"""GRPO steps on one GPU: seconds per step, rollout tokens/s and peak memory, on random models of real shapes.

    python benchmarks/gpu_steps.py --out steps.md              # on a CUDA GPU (scripts/gpu_check.sh runs it)
    python benchmarks/gpu_steps.py --dry-run --out steps.md    # on any CPU in seconds: tiny shape, 1-2 new tokens
    python benchmarks/gpu_steps.py --environment               # versions and unmet requirements

No weights can be downloaded where this runs, so every model is built from the
configuration of a real one (SmolLM2-135M and Qwen2.5-1.5B with LoRA and with
QLoRA, Qwen2.5-7B with QLoRA) with random weights (:mod:`lit_grpo.model.random_models`),
saved to a temporary folder and loaded from there like any other model.
Completions run to the full length (``SamplingSpec(ignore_eos=True)``): the
speed and the memory are real, the learning is not.

A row is one GRPO step through the product's own path: ``GRPOModule`` and
``OnPolicyDataModule`` under a Lightning Trainer, bf16 weights with
``precision="bf16-mixed"``, LoRA r=16 on every linear layer (QLoRA: on a 4-bit
NF4 base computing in bf16), beta=0.04 (the reference pass runs), one optimizer
step per rollout (micro-batches of at most 16 completions, gradients
accumulated). The step is timed from the start of the rollout to the end of
its epoch, after a warm-up step of 2 new tokens in the same process. Peak
memory is ``torch.cuda.max_memory_allocated`` (weights included), peak RSS on
a CPU. On a GPU each (model, adapter) runs in a process of its own, so one's
memory never counts towards the next, and no new one starts once
``--budget-s`` is spent; a dry run runs them all in one process.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import subprocess
import sys
import tempfile
import time
from importlib.metadata import PackageNotFoundError, requires, version
from pathlib import Path

# (shape, adapter), in the order they run: the cheapest first, so a spent budget costs the costliest.
JOBS = [
    ("smollm2-135m", "lora"),
    ("smollm2-135m", "qlora"),
    ("qwen2.5-1.5b", "lora"),
    ("qwen2.5-1.5b", "qlora"),
    ("qwen2.5-7b", "qlora"),
]
DRY_JOBS = [("tiny", "lora"), ("tiny", "qlora")]
RECIPES = [(8, 8, 256), (1, 8, 1024)]  # prompts x group size x new tokens
DRY_RECIPES = [(2, 2, 2), (1, 2, 1)]
WARMUP_TOKENS = 2
MAX_MICRO_BATCH = 16
RESULT = "RESULT "
COLUMNS = (
    "model",
    "adapter",
    "prompts × G × new tokens",
    "micro-batch",
    "s/step",
    "rollout s",
    "rollout tokens/s",
    "peak MiB",
    "status",
)


def distinct_characters(prompts, completions, **columns) -> list[float]:
    """A reward that differs between the samples of a group, so advantages are not all zero."""
    return [float(len(set(c))) for c in completions]


# ------------------------------------------------------------------- child
def run_jobs(jobs: list[str], models: Path, dry_run: bool) -> None:
    """Run ``SHAPE:ADAPTER`` jobs one after the other in this process."""
    for job in jobs:
        run_job(*job.split(":"), models, dry_run)


def run_job(shape: str, adapter: str, models: Path, dry_run: bool) -> None:
    """Load one (model, adapter) and print one ``RESULT`` line per recipe."""
    import torch

    from lit_grpo.algorithms.grpo import GRPOModule
    from lit_grpo.model.policy import LoraSpec, PolicySpec
    from lit_grpo.model.random_models import parameter_count, save_random_model

    gpu = torch.cuda.is_available()
    folder = save_random_model(shape, models / shape, device="cuda" if gpu else "cpu")
    if gpu:
        torch.cuda.empty_cache()  # the initialisation's memory is not the step's
    spec = PolicySpec(
        name_or_path=str(folder), dtype="bfloat16", lora=LoraSpec(r=16, alpha=32), load_in_4bit=adapter == "qlora"
    )
    module = GRPOModule(policy=spec, beta=0.04, progress=False, log_samples=0, validate_before_training=False)
    recipes = DRY_RECIPES if dry_run else RECIPES
    prompts, group_size, _ = recipes[0]
    fit_one_step(module, prompts, group_size, WARMUP_TOKENS, gpu)
    params = parameter_count(shape)
    for prompts, group_size, new_tokens in recipes:
        if gpu:
            torch.cuda.reset_peak_memory_stats()
        seconds, stats = fit_one_step(module, prompts, group_size, new_tokens, gpu)
        if gpu:
            peak_mib = torch.cuda.max_memory_allocated() / 2**20
        else:
            peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
        print(
            RESULT
            + json.dumps(
                {
                    "shape": shape,
                    "model": f"{shape} ({_count(params)})",
                    "adapter": adapter,
                    "recipe": [prompts, group_size, new_tokens],
                    "micro_batch": min(prompts * group_size, MAX_MICRO_BATCH),
                    "step_s": seconds,
                    "rollout_s": stats["time/generate"],
                    "tokens_per_s": stats["rollout/tokens_per_s"],
                    "peak_mib": peak_mib,
                }
            ),
            flush=True,
        )


def _count(params: int) -> str:
    return next(
        f"{params / scale:.3g}{unit}"
        for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K"), (1, ""))
        if params >= scale
    )


def fit_one_step(module, prompts: int, group_size: int, new_tokens: int, gpu: bool) -> tuple[float, dict]:
    """One epoch (one rollout, one optimizer step); returns its seconds and the rollout's statistics."""
    import lightning as L
    import torch

    from lit_grpo.data.grpo import OnPolicyDataModule
    from lit_grpo.data.specs import HeldOutSpec, SourceSpec
    from lit_grpo.generation.rollout import SamplingSpec

    class TimedRollouts(OnPolicyDataModule):
        # Lightning iterates the epoch's loader, which runs the rollout, before
        # on_train_epoch_start: the step's clock has to start here.
        def rollout_buffer(self):
            self.rollout_started = time.perf_counter()
            return super().rollout_buffer()

    class StepClock(L.Callback):
        def on_train_epoch_end(self, trainer, module):
            if gpu:
                torch.cuda.synchronize()
            self.seconds = time.perf_counter() - trainer.datamodule.rollout_started

    rows = prompts * group_size
    micro_batch = min(rows, MAX_MICRO_BATCH)
    sampling = SamplingSpec(group_size=group_size, temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True)
    data = TimedRollouts(
        source=SourceSpec("arithmetic", train_size=64),
        held_out=HeldOutSpec(size=1),
        prompts_per_epoch=prompts,
        batch_size=micro_batch,
        sampling=sampling,
        rewards=[distinct_characters],
    )
    clock = StepClock()
    trainer = L.Trainer(
        accelerator="gpu" if gpu else "cpu",
        devices=1,
        precision="bf16-mixed",
        max_epochs=1,
        accumulate_grad_batches=rows // micro_batch,
        reload_dataloaders_every_n_epochs=1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[clock],
    )
    trainer.fit(module, data)
    return clock.seconds, data.last_stats


# ------------------------------------------------------------------ parent
def run_all(dry_run: bool, budget_s: float) -> list[dict]:
    """Run every job until the budget is spent; one row per job and recipe."""
    jobs, recipes = (DRY_JOBS, DRY_RECIPES) if dry_run else (JOBS, RECIPES)
    reasons = {
        job: "skipped: bitsandbytes is not installed (scripts/gpu_check.sh --download-wheels fetches it)"
        for job in jobs
        if job[1] == "qlora" and importlib.util.find_spec("bitsandbytes") is None
    }
    runnable = [job for job in jobs if job not in reasons]
    results: dict[tuple[str, str], list[dict]] = {job: [] for job in jobs}
    deadline = time.monotonic() + budget_s
    with tempfile.TemporaryDirectory(prefix="lit_grpo_models_") as models:
        for batch in [runnable] if dry_run else [[job] for job in runnable]:
            reason = _run_process(batch, Path(models), dry_run, deadline, results)
            reasons.update({job: reason or "failed: no result" for job in batch if len(results[job]) < len(recipes)})
    return [
        row
        for job in jobs
        for row in results[job]
        + [
            {"model": job[0], "adapter": job[1], "recipe": recipe, "status": reasons[job]}
            for recipe in recipes[len(results[job]) :]
        ]
    ]


def _run_process(
    jobs: list[tuple[str, str]],
    models: Path,
    dry_run: bool,
    deadline: float,
    results: dict[tuple[str, str], list[dict]],
) -> str:
    """Run ``jobs`` in one process, adding its rows to ``results``; return why it stopped early, or ``""``."""
    left = deadline - time.monotonic()
    if left < 10:
        return "not run: the time budget (--budget-s) was spent"
    names = [f"{shape}:{adapter}" for shape, adapter in jobs]
    command = [sys.executable, __file__, "--jobs", *names, "--models", str(models)] + (["--dry-run"] if dry_run else [])
    print(f"{' '.join(names)}: running ({left:.0f} s left)", flush=True)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=left)
        stdout, stderr, reason = done.stdout, done.stderr, "" if done.returncode == 0 else "failed"
    except subprocess.TimeoutExpired as expired:
        stdout, stderr, reason = _text(expired.stdout), _text(expired.stderr), "timed out (--budget-s)"
    for line in stdout.splitlines():
        if line.startswith(RESULT):
            row = {**json.loads(line[len(RESULT) :]), "status": "ok"}
            results[row["shape"], row["adapter"]].append(row)
            print(f"  {_cells(row)}", flush=True)
    if reason:
        last = [line for line in stderr.splitlines() if line.strip()][-1:] or ["(no output)"]
        reason = f"{reason}: {last[0][:200]}"
        print(f"  {reason}\n{stderr[-3000:]}", flush=True)
    return reason


def _text(output) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def _cells(row: dict) -> list[str]:
    recipe = " × ".join(str(n) for n in row["recipe"])
    if row["status"] != "ok":  # a reason quoting an error may hold a "|", which would split the cell
        return [row["model"], row["adapter"], recipe, "", "", "", "", "", row["status"].replace("|", "/")]
    return [
        row["model"],
        row["adapter"],
        recipe,
        str(row["micro_batch"]),
        f"{row['step_s']:.2f}",
        f"{row['rollout_s']:.2f}",
        f"{row['tokens_per_s']:.0f}",
        f"{row['peak_mib']:.0f}",
        "ok",
    ]


def table(rows: list[dict]) -> str:
    """The rows as a markdown table, and what its memory column measures."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cells(row)) + " |" for row in rows]
    lines += [
        "",
        "peak MiB: `torch.cuda.max_memory_allocated` over the step, weights included "
        "(on a CPU: the process's peak RSS so far).",
    ]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------- environment
def environment() -> str:
    """Markdown lines: the versions that matter and lit_grpo's requirements not met here (nothing imported)."""
    names = ("torch", "transformers", "lightning", "peft", "bitsandbytes", "lit_grpo")
    lines = [
        f"- python {sys.version.split()[0]}, " + ", ".join(f"{name} {_version(name) or 'missing'}" for name in names)
    ]
    unmet = unmet_requirements()
    lines.append("- unmet requirements: " + (", ".join(unmet) if unmet else "none"))
    return "\n".join(lines) + "\n"


def unmet_requirements() -> list[str]:
    """lit_grpo's dependencies (extras aside) that are missing here or installed in a version it excludes."""
    from packaging.requirements import Requirement

    try:
        lines = requires("lit_grpo") or []
    except PackageNotFoundError:
        return ["lit_grpo itself is not installed, so its requirements were not checked"]
    unmet = []
    for line in lines:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue  # an extra's (test, bench)
        installed = _version(requirement.name)
        if installed is None:
            unmet.append(f"{requirement.name} (missing)")
        elif not requirement.specifier.contains(installed, prereleases=True):
            unmet.append(f"{requirement.name} {installed} (needs {requirement.specifier})")
    return unmet


def _version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="Write the markdown table here (else print it).")
    parser.add_argument("--dry-run", action="store_true", help="Tiny shape and 1-2 new tokens, on any device.")
    parser.add_argument("--budget-s", type=float, default=330.0, help="Start no process after this many seconds.")
    parser.add_argument("--environment", action="store_true", help="Print versions and unmet requirements.")
    parser.add_argument("--jobs", nargs="+", metavar="SHAPE:ADAPTER", help=argparse.SUPPRESS)
    parser.add_argument("--models", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.environment:
        print(environment(), end="")
        return
    if args.jobs:
        run_jobs(args.jobs, args.models, args.dry_run)
        return
    rows = run_all(args.dry_run, args.budget_s)
    if args.out:
        args.out.write_text(table(rows))
    else:
        print(table(rows), end="")
    sys.exit(1 if any(row["status"].startswith("failed") for row in rows) else 0)


if __name__ == "__main__":
    main()
