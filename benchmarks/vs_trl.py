"""lit_grpo against TRL's GRPOTrainer: seconds per step at equal settings.

    pip install -e .[bench]
    python benchmarks/vs_trl.py                       # both recipes, 2 rounds x 4 steps each
    python benchmarks/vs_trl.py --recipe small --steps 2 --rounds 1 --max-new-tokens 8   # smoke test
    python benchmarks/vs_trl.py --lit-dtype bfloat16 --trl-bf16   # both in bf16 (TRL's default)
    python benchmarks/vs_trl.py --recipe quickstart --beta 0 --systems lit_grpo [--lit-keep-zero-gradient-rows]
                                                      # one lit_grpo lever, before/after

Both systems train the embedded SmolLM2-135M-Instruct (the safetensors folder
of ``lit_grpo.model.sources.embedded_model_dir()``) with a LoRA adapter (r=16,
alpha=32, no dropout, all linear layers but the head) on the same prompts:
the built-in ``arithmetic`` task (two-digit additions) in the order lit_grpo's
DataModule draws them, chat-formatted by lit_grpo and handed to TRL as plain
text, scored by the same reward (``lit_grpo.rewards.accuracy``). One rollout
of ``prompts x G`` completions is exactly one optimizer step in both:
AdamW at lr 1e-4 (constant), beta=0.04 (so both score the reference policy,
the base model with the adapter disabled), clip epsilon 0.2, the per-sequence
mean loss (``loss_type="grpo"``), group-scaled advantages, gradient norm
clipped at 1.0, sampling at temperature 0.8 without top-k/top-p.

TRL defaults set equal to ours, and so stated in the output: gradient
checkpointing off (TRL: on), bf16 off unless ``--trl-bf16`` (TRL: on),
temperature 0.8 (TRL: 1.0), constant learning rate (TRL: linear decay to 0),
``loss_type="grpo"`` (TRL: ``dapo``), lr 1e-4 (TRL: 1e-6), no dataset
shuffling (so the prompt order is lit_grpo's). Left at TRL's default: its
fused AdamW, and the unbiased group std in the advantages (ours: population).

Each round runs every system in a fresh subprocess, alternating A, B, A, B, so
slow drift of a shared machine hits both. A step is timed from its start to
the end of its optimizer step, rollout included (lit_grpo: the DataModule's
``rollout_buffer`` -> a Callback's ``on_train_epoch_end``, one epoch being
one rollout; TRL: a TrainerCallback's ``on_step_begin`` -> ``on_step_end``).
Model loading is outside the timed window; peak RSS (``ru_maxrss`` of the
subprocess, from ``wait4``) includes it. The process CPU seconds of each step
(all threads) are reported beside the wall time: on a machine shared with
other jobs they move less than the wall time does, and each child's line
shows the load average before and after it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace

RECIPES = {
    "small": {"prompts": 1, "group_size": 8, "max_new_tokens": 64},
    "quickstart": {"prompts": 4, "group_size": 8, "max_new_tokens": 24},
}
SYSTEMS = ("lit_grpo", "trl")


@dataclass
class Settings:
    """One benchmark configuration, shared verbatim by both systems."""

    recipe: str
    prompts: int
    group_size: int
    max_new_tokens: int
    steps: int
    temperature: float = 0.8
    lr: float = 1e-4
    beta: float = 0.04
    epsilon: float = 0.2
    lora_r: int = 16
    lora_alpha: int = 32
    max_grad_norm: float = 1.0
    seed: int = 0
    lit_dtype: str = "float32"
    lit_attn: str | None = None
    lit_generation_dtype: str | None = None
    lit_skip_zero_gradient_rows: bool = True
    trl_bf16: bool = False
    fixed_length: bool = False  # every completion exactly max_new_tokens long (EOS ignored), on both sides
    micro_batch: int | None = None  # rows per forward/backward; gradients of the rollout's micro-batches accumulate

    @property
    def micro_batches(self) -> int:
        rows = self.micro_batch or self.rollout_size
        if self.rollout_size % rows:
            raise ValueError(f"micro_batch={rows} must divide the rollout's {self.rollout_size} rows")
        return self.rollout_size // rows

    @property
    def rollout_size(self) -> int:
        return self.prompts * self.group_size


# ------------------------------------------------------------------ prompts
def lit_datamodule(s: Settings, cls=None):
    from lit_grpo.data.grpo import OnPolicyDataModule
    from lit_grpo.data.specs import HeldOutSpec, SourceSpec
    from lit_grpo.generation.rollout import SamplingSpec
    from lit_grpo.rewards import Accuracy

    sampling = SamplingSpec(
        group_size=s.group_size, temperature=s.temperature, max_new_tokens=s.max_new_tokens, ignore_eos=s.fixed_length
    )
    return (cls or OnPolicyDataModule)(
        source=SourceSpec("arithmetic", task_args={"digits": 2, "ops": "+"}, train_size=max(64, s.prompts * s.steps)),
        held_out=HeldOutSpec(size=1),
        prompts_per_epoch=s.prompts,
        batch_size=s.rollout_size // s.micro_batches,
        sampling=sampling,
        rewards=[Accuracy()],
        seed=s.seed,
    )


def trl_dataset(s: Settings):
    """The rows lit_grpo's DataModule draws, in its order, chat-formatted as lit_grpo formats them."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from lit_grpo.data.prompts import chat_prompts
    from lit_grpo.model.sources import embedded_model_dir

    data = lit_datamodule(s)
    data.setup("fit")
    rows = data.next_prompts(s.prompts * s.steps)
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    texts = chat_prompts(tokenizer, [row["prompt"] for row in rows], data.prompt.system_prompt, data.prompt.template)
    return Dataset.from_list([{"prompt": text, "answer": row["answer"]} for text, row in zip(texts, rows)])


# ----------------------------------------------------------------- lit_grpo
def run_lit(s: Settings) -> dict:
    """Train ``s.steps`` epochs (one rollout, one optimizer step each) with lit_grpo."""
    import lightning as L
    import torch

    from lit_grpo.algorithms.grpo import GRPOModule
    from lit_grpo.data.grpo import OnPolicyDataModule
    from lit_grpo.generation import GenerationSpec
    from lit_grpo.model.policy import LoraSpec, PolicySpec

    class RolloutTimed(OnPolicyDataModule):
        # Lightning's setup_data() already iterates the fresh loader, which runs the
        # rollout, before on_train_epoch_start: the step has to start here instead.
        def rollout_buffer(self):
            self.rollout_started = time.perf_counter(), time.process_time()
            return super().rollout_buffer()

    class StepTimer(L.Callback):
        def __init__(self):
            self.steps: list[dict] = []

        def on_train_epoch_end(self, trainer, module):
            data = trainer.datamodule
            wall, cpu = data.rollout_started
            phases = {k[len("time/") :]: v for k, v in data.last_stats.items() if k.startswith("time/")}
            phases.update(getattr(module, "phase_seconds", {}))
            self.steps.append(
                {
                    "seconds": time.perf_counter() - wall,
                    "cpu_seconds": time.process_time() - cpu,
                    "reward": data.last_stats["reward/total"],
                    "tokens": data.last_stats["completion/length_mean"] * s.rollout_size,
                    "phases": phases,
                    "perf": module.throughput.metrics(phases),
                }
            )

    policy = PolicySpec(
        name_or_path="embedded",
        dtype=s.lit_dtype,
        attn_implementation=s.lit_attn,
        lora=LoraSpec(r=s.lora_r, alpha=s.lora_alpha, dropout=0.0, target_modules="all-linear"),
    )
    module = GRPOModule(
        policy=policy,
        beta=s.beta,
        epsilon_low=s.epsilon,
        epsilon_high=s.epsilon,
        loss_type="grpo",
        optimizer=lambda params: torch.optim.AdamW(params, lr=s.lr, weight_decay=0.0),
        progress=False,
        log_samples=0,
        validate_before_training=False,
        generation=GenerationSpec(dtype=s.lit_generation_dtype),
        skip_zero_gradient_rows=s.lit_skip_zero_gradient_rows,
    )
    timer = StepTimer()
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            max_epochs=s.steps,
            reload_dataloaders_every_n_epochs=1,
            accumulate_grad_batches=s.micro_batches,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            gradient_clip_val=s.max_grad_norm,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root,
            callbacks=[timer],
        )
        trainer.fit(module, lit_datamodule(s, RolloutTimed))
    return {"steps": timer.steps, "version": _version("lit_grpo")}


# ---------------------------------------------------------------------- TRL
def run_trl(s: Settings) -> dict:
    """Train ``s.steps`` optimizer steps (one generation each) with TRL's GRPOTrainer."""
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from lit_grpo.model.sources import embedded_model_dir
    from lit_grpo.rewards import accuracy

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.seconds: list[tuple[float, float]] = []  # (wall, process CPU)
            self.logs: list[dict] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds.append((time.perf_counter() - self.start[0], time.process_time() - self.start[1]))

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.logs.append(dict(logs))

    timer = StepTimer()
    with tempfile.TemporaryDirectory() as root:
        config = GRPOConfig(
            output_dir=root,
            use_cpu=True,
            bf16=s.trl_bf16,
            seed=s.seed,
            per_device_train_batch_size=s.rollout_size // s.micro_batches,
            gradient_accumulation_steps=s.micro_batches,
            steps_per_generation=s.micro_batches,
            num_generations=s.group_size,
            max_completion_length=s.max_new_tokens,
            temperature=s.temperature,
            top_p=1.0,
            top_k=0,
            beta=s.beta,
            epsilon=s.epsilon,
            num_iterations=1,
            loss_type="grpo",
            scale_rewards="group",
            learning_rate=s.lr,
            lr_scheduler_type="constant",
            weight_decay=0.0,
            max_grad_norm=s.max_grad_norm,
            gradient_checkpointing=False,
            max_steps=s.steps,
            shuffle_dataset=False,
            save_strategy="no",
            logging_steps=1,
            report_to="none",
            disable_tqdm=True,
            generation_kwargs={"min_new_tokens": s.max_new_tokens} if s.fixed_length else None,
        )
        lora = LoraConfig(
            r=s.lora_r, lora_alpha=s.lora_alpha, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
        )
        trainer = GRPOTrainer(
            model=str(embedded_model_dir()),
            reward_funcs=[accuracy],
            args=config,
            train_dataset=trl_dataset(s),
            peft_config=lora,
            callbacks=[timer],
        )
        trainer.train()
    if len(timer.logs) != len(timer.seconds):
        raise RuntimeError(f"TRL logged {len(timer.logs)} steps but ran {len(timer.seconds)}.")
    steps = [
        {
            "seconds": wall,
            "cpu_seconds": cpu,
            "reward": log["reward"],
            "tokens": log["completions/mean_length"] * s.rollout_size,
        }
        for (wall, cpu), log in zip(timer.seconds, timer.logs)
    ]
    return {"steps": steps, "version": _version("trl")}


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


# ------------------------------------------------------------ orchestration
def run_child(system: str, s: Settings) -> dict:
    """Run one system in a fresh subprocess; return its steps and peak RSS."""
    command = [sys.executable, __file__, "--child", system, "--settings", json.dumps(asdict(s))]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen(command, stdout=out, stderr=err, env=env)
        _, status, usage = os.wait4(process.pid, 0)  # the child's own rusage, not all children's
        process.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        lines = [line for line in out.read().splitlines() if line.startswith("RESULT ")]
        if process.returncode != 0 or not lines:
            raise RuntimeError(
                f"{system} ({s.recipe}) failed with exit code {process.returncode}:\n{err.read()[-4000:]}"
            )
    result = json.loads(lines[-1][len("RESULT ") :])
    result["peak_rss_mib"] = usage.ru_maxrss / 1024  # Linux: KiB
    return result


def benchmark(s: Settings, rounds: int, systems: tuple[str, ...] = SYSTEMS) -> dict[str, dict]:
    """Alternate the systems for ``rounds`` rounds (A, B, A, B); pool their steps."""
    pooled = {system: {"steps": [], "peak_rss_mib": 0.0} for system in systems}
    for index in range(rounds):
        order = systems if index % 2 == 0 else systems[::-1]  # neither always goes first
        for system in order:
            start, load = time.perf_counter(), os.getloadavg()[0]
            result = run_child(system, s)
            pool = pooled[system]
            pool["steps"] += result["steps"]
            pool["peak_rss_mib"] = max(pool["peak_rss_mib"], result["peak_rss_mib"])
            pool["version"] = result["version"]
            step_times = ", ".join(f"{step['seconds']:.1f}" for step in result["steps"])
            print(
                f"  round {index + 1} {system:<8} steps [{step_times}] s, peak RSS "
                f"{result['peak_rss_mib']:.0f} MiB, process {time.perf_counter() - start:.0f} s, "
                f"load average {load:.1f} -> {os.getloadavg()[0]:.1f}",
                flush=True,
            )
    return pooled


def summarize(pool: dict) -> dict:
    steps = pool["steps"]
    return {
        "step_s": statistics.median(step["seconds"] for step in steps),
        "cpu_s": statistics.median(step["cpu_seconds"] for step in steps),
        "tokens_per_s": statistics.median(step["tokens"] / step["seconds"] for step in steps),
        "peak_rss_mib": pool["peak_rss_mib"],
        "reward": statistics.fmean(step["reward"] for step in steps),
        "steps": len(steps),
    }


def report(s: Settings, pooled: dict[str, dict]) -> None:
    rows = {system: summarize(pool) for system, pool in pooled.items()}
    steps = next(iter(rows.values()))["steps"]
    print(
        f"\nrecipe {s.recipe}: {s.prompts} prompt(s) x G={s.group_size} x {s.max_new_tokens} new tokens, "
        f"beta={s.beta}, {steps} steps each"
    )
    print("| system          | dtype    | median s/step | CPU s/step | gen tokens/s | peak RSS MiB | mean reward |")
    print("|-----------------|----------|---------------|------------|--------------|--------------|-------------|")
    dtypes = {"lit_grpo": s.lit_dtype, "trl": "bf16 amp" if s.trl_bf16 else "float32"}
    for system, r in rows.items():
        label = f"{system} {pooled[system]['version']}"
        print(
            f"| {label:<15} | {dtypes[system]:<8} | {r['step_s']:13.2f} | {r['cpu_s']:10.2f} | "
            f"{r['tokens_per_s']:12.1f} | "
            f"{r['peak_rss_mib']:12.0f} | {r['reward']:11.3f} |"
        )
    if len(rows) == 2:
        _print_ratios(rows["lit_grpo"], rows["trl"])
    phases = _median_phases(pooled["lit_grpo"]["steps"]) if "lit_grpo" in pooled else {}
    if phases:
        print("lit_grpo phases (median s): " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()))


def _print_ratios(lit: dict, trl: dict) -> None:
    print(
        f"lit_grpo/TRL: step time {lit['step_s'] / trl['step_s']:.2f}, CPU time {lit['cpu_s'] / trl['cpu_s']:.2f}, "
        f"tokens/s {lit['tokens_per_s'] / trl['tokens_per_s']:.2f}, "
        f"peak RSS {lit['peak_rss_mib'] / trl['peak_rss_mib']:.2f}"
    )


def _median_phases(steps: list[dict]) -> dict[str, float]:
    names = sorted({name for step in steps for name in step.get("phases", {})})
    return {name: statistics.median(step["phases"].get(name, 0.0) for step in steps) for name in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", choices=[*RECIPES, "all"], default="all")
    parser.add_argument("--steps", type=int, default=4, help="Optimizer steps per system per round.")
    parser.add_argument("--rounds", type=int, default=2, help="Alternating rounds (fresh processes each).")
    parser.add_argument("--max-new-tokens", type=int, help="Override the recipe's (for a quick check).")
    parser.add_argument("--lit-dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--trl-bf16", action="store_true", help="GRPOConfig(bf16=True): CPU autocast.")
    parser.add_argument("--beta", type=float, default=0.04, help="KL weight for both (0 skips the reference pass).")
    parser.add_argument("--lit-attn", help="lit_grpo's policy.attn_implementation (e.g. eager).")
    parser.add_argument(
        "--lit-generation-dtype", choices=["float32", "bfloat16"], help="lit_grpo's model.generation.dtype."
    )
    parser.add_argument(
        "--lit-keep-zero-gradient-rows",
        action="store_true",
        help="model.skip_zero_gradient_rows=False (a lever's 'before').",
    )
    parser.add_argument(
        "--systems",
        nargs="+",
        choices=SYSTEMS,
        default=list(SYSTEMS),
        help="Run only some systems (a lit_grpo lever before/after needs no TRL run).",
    )
    parser.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        settings = Settings(**json.loads(args.settings))
        result = (run_lit if args.child == "lit_grpo" else run_trl)(settings)
        print("RESULT " + json.dumps(result), flush=True)
        return
    print(
        "Same model (embedded SmolLM2-135M-Instruct), prompts, reward and settings; TRL defaults changed to ours: "
        "gradient_checkpointing=False (TRL default True), "
        f"bf16={args.trl_bf16} (TRL default True), temperature 0.8 (1.0), lr 1e-4 constant (1e-6, linear decay), "
        "loss_type='grpo' (dapo), shuffle_dataset=False; left at TRL's default: fused AdamW, unbiased group std."
    )
    for recipe in RECIPES if args.recipe == "all" else [args.recipe]:
        settings = Settings(
            recipe=recipe,
            steps=args.steps,
            lit_dtype=args.lit_dtype,
            trl_bf16=args.trl_bf16,
            beta=args.beta,
            lit_attn=args.lit_attn,
            lit_generation_dtype=args.lit_generation_dtype,
            lit_skip_zero_gradient_rows=not args.lit_keep_zero_gradient_rows,
            **RECIPES[recipe],
        )
        if args.max_new_tokens:
            settings = replace(settings, max_new_tokens=args.max_new_tokens)
        print(f"\n{recipe}: {args.rounds} round(s) x {args.steps} steps per system", flush=True)
        report(settings, benchmark(settings, args.rounds, tuple(args.systems)))


if __name__ == "__main__":
    main()
