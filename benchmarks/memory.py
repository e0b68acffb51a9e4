"""Peak memory of one GRPO step (rollout + training) on the embedded SmolLM2-135M.

    python benchmarks/memory.py

Runs every configuration in a fresh subprocess (so one run's allocations never
count towards the next) with the quickstart recipe: 4 prompts x G=8 samples x
24 new tokens, one optimizer step over the 32 completions, beta=0.04 (so the
reference policy is scored too). Peak memory is the process's peak RSS
(``ru_maxrss``) on CPU, including the Python/torch baseline and the loaded
model, and ``torch.cuda.max_memory_allocated`` on a GPU.

Rows:

* ``full + ref copy``: full fine-tuning; a frozen copy of the model is the
  reference.
* ``LoRA``: the reference is the same base with the adapter disabled.
* ``QLoRA``: as LoRA, on a 4-bit NF4 base (bitsandbytes).
* ``full + ref copy + critic``: what PPO adds on top of the first row, a
  critic of the policy's size (a second trainable copy with a value head)
  trained in the same step; it measures the "no critic" saving GRPO claims.

each with and without gradient checkpointing.

Completion length (needs TRL: ``pip install -e .[bench]``)::

    python benchmarks/memory.py --lengths 64 256 1024
    python benchmarks/memory.py --lengths 256 1024 4096 --dtype bfloat16 --lit-checkpointing yes \
        --release-host-memory --cap-gib 20 --steps 1 --plot growth.png

One table of peak memory and seconds per step against completion length:
lit_grpo's LoRA without and with gradient checkpointing beside TRL's
``GRPOTrainer`` (trl>=1.16) with its gradient checkpointing on, as its users
run it. Each row is a fresh process running ``--steps`` steps (default 2) of
1 prompt x G=8 completions sampled to exactly the given length (lit_grpo:
``SamplingSpec(ignore_eos=True)``; TRL: ``generation_kwargs={"min_new_tokens":
length}``), so every step trains 8 x length completion tokens. Both sides: the
embedded SmolLM2-135M-Instruct in fp32 (``--dtype bfloat16``: bf16 weights, and TRL's bf16
autocast), a LoRA adapter (r=16, alpha=32, no
dropout, all linear layers but the head), the built-in ``arithmetic`` prompts
(lit_grpo's order, chat-formatted by lit_grpo), the accuracy reward,
beta=0.04 (the reference, adapter disabled, is scored too), clip 0.2, the
per-sequence mean loss, AdamW at lr 1e-4, gradient norm clipped at 1.0,
temperature 0.8. A step is timed from the start of its rollout to the end of
its optimizer step; seconds per step is the median over the steps after the
first (warm-up). Peak memory is measured as for the first table (the child's
peak RSS, model loading included, on CPU; allocated CUDA memory on a GPU),
and completions that are not exactly the given length fail the row. Then
the exponent k each row grows with (value ~ N^k) between consecutive lengths,
and with ``--plot`` both on log-log axes. A smoke
run on a tiny random model::

    python -c "import torch; from lit_grpo.model.random_models import save_random_model; \\
        save_random_model('tiny', '/tmp/tiny-llama', torch.float32)"
    python benchmarks/memory.py --lengths 16 --steps 1 --model /tmp/tiny-llama
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

CONFIGS = {
    "full + ref copy": {"lora": False},
    "full + ref copy + critic": {"lora": False, "critic": True},
    "LoRA": {"lora": True},
    "QLoRA": {"lora": True, "load_in_4bit": True},
}


def _critic_module():
    """GRPOModule plus a PPO-style critic: a trainable copy of the model with a value head."""
    from lit_grpo.algorithms.grpo import GRPOModule

    class WithCritic(GRPOModule):
        def configure_model(self) -> None:
            super().configure_model()
            if not hasattr(self, "critic"):
                self.critic = copy.deepcopy(self.reference).requires_grad_(True).train()
                if self.spec.gradient_checkpointing:
                    self.critic.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
                self.value_head = nn.Linear(self.critic.config.hidden_size, 1)

        def trainable_parameters(self):
            return super().trainable_parameters() + list(self.critic.parameters()) + list(self.value_head.parameters())

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            width = batch["completion_ids"].shape[1]
            hidden = self.critic.model(
                input_ids=torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
                attention_mask=torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1),
            ).last_hidden_state[:, -width:]  # [n, C, H]
            values = self.value_head(hidden).squeeze(-1)  # [n, C]
            mask = batch["completion_mask"]
            # PPO regresses values on returns; the advantages stand in for them here:
            # what is measured is the critic's memory, not its accuracy.
            value_loss = ((values - batch["advantages"][:, None]) ** 2 * mask).sum() / mask.sum()
            return loss + value_loss

    return WithCritic


def run_one(name: str, checkpointing: bool) -> dict:
    """One GRPO step in this process; returns peak memory and seconds."""
    import lightning as L

    from lit_grpo.algorithms.grpo import GRPOModule
    from lit_grpo.data.grpo import OnPolicyDataModule
    from lit_grpo.data.specs import HeldOutSpec, SourceSpec
    from lit_grpo.generation.rollout import SamplingSpec
    from lit_grpo.model.policy import LoraSpec, PolicySpec
    from lit_grpo.rewards import Accuracy

    config = CONFIGS[name]
    gpu = torch.cuda.is_available()
    spec = PolicySpec(
        name_or_path="embedded",
        lora=LoraSpec() if config["lora"] else None,
        load_in_4bit=config.get("load_in_4bit", False),
        gradient_checkpointing=checkpointing,
    )
    module_class = _critic_module() if config.get("critic") else GRPOModule
    module = module_class(policy=spec, beta=0.04, progress=False, log_samples=0)
    data = OnPolicyDataModule(
        prompts_per_epoch=4,
        batch_size=32,
        held_out=HeldOutSpec(size=1),
        source=SourceSpec(task_args={"digits": 2, "ops": "+"}),
        sampling=SamplingSpec(group_size=8, temperature=0.8, max_new_tokens=24),
        rewards=[Accuracy()],
    )
    trainer = L.Trainer(
        accelerator="gpu" if gpu else "cpu",
        devices=1,
        max_epochs=1,
        reload_dataloaders_every_n_epochs=1,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    start = time.perf_counter()
    trainer.fit(module, data)
    seconds = time.perf_counter() - start
    trainable = sum(p.numel() for p in module.trainable_parameters())
    return {"peak_mib": _peak_mib(gpu), "seconds": seconds, "trainable": trainable, "gpu": gpu}


def _peak_mib(gpu: bool) -> float:
    """This process's peak memory so far: allocated CUDA memory on a GPU, else peak RSS."""
    if gpu:
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


# ------------------------------------------------------- completion length
GROUP_SIZE = 8
LENGTH_ROWS = (("lit_grpo", False), ("lit_grpo", True), ("trl", True))  # (system, gradient checkpointing)


def _length_data(length: int, cls=None, group_size: int = GROUP_SIZE):
    """lit_grpo's DataModule for the length table: 1 prompt x G rows of exactly ``length`` tokens."""
    from lit_grpo.data.grpo import OnPolicyDataModule
    from lit_grpo.data.specs import HeldOutSpec, SourceSpec
    from lit_grpo.generation.rollout import SamplingSpec
    from lit_grpo.rewards import Accuracy

    sampling = SamplingSpec(group_size=group_size, temperature=0.8, max_new_tokens=length, ignore_eos=True)
    return (cls or OnPolicyDataModule)(
        source=SourceSpec("arithmetic", task_args={"digits": 2, "ops": "+"}, train_size=64),
        held_out=HeldOutSpec(size=1),
        prompts_per_epoch=1,
        batch_size=group_size,
        sampling=sampling,
        rewards=[Accuracy()],
        seed=0,
    )


def run_length_lit(
    model: str,
    length: int,
    checkpointing: bool,
    steps: int,
    release: bool,
    group_size: int = GROUP_SIZE,
    dtype: str = "float32",
    load_in_4bit: bool = False,
) -> dict:
    """``steps`` GRPO steps (one rollout and one optimizer step each) with lit_grpo.

    Returns:
        ``seconds``: each step's; ``phases``: each step's seconds per phase (``time/*``); ``saved_mib``: the
        largest micro-batch's activations saved for backward; ``prompt_tokens``: the prompts' padded width.
    """
    import lightning as L

    from lit_grpo.algorithms.grpo import GRPOModule
    from lit_grpo.data.grpo import OnPolicyDataModule
    from lit_grpo.model.policy import LoraSpec, PolicySpec
    from lit_grpo.training.host_memory import ReleaseHostMemory

    seconds: list[float] = []
    phases: list[dict[str, float]] = []

    class Timed(OnPolicyDataModule):
        def rollout_buffer(self):  # Lightning runs the rollout here, before on_train_epoch_start
            self.started = time.perf_counter()
            return super().rollout_buffer()

    class StepTimer(L.Callback):
        def on_train_epoch_end(self, trainer, module):
            seconds.append(time.perf_counter() - trainer.datamodule.started)
            logged = trainer.callback_metrics
            phases.append({k.removeprefix("time/"): float(v) for k, v in logged.items() if k.startswith("time/")})
            _check_length(trainer.datamodule.last_stats["completion/length_mean"], length)

    class SavedForBackward(L.Callback):
        """The bytes autograd keeps from a micro-batch's forward for its backward (the largest micro-batch).

        Each storage counted once, the model's parameters left out, independent of the
        allocator (peak RSS on a CPU also holds what glibc keeps), so it carries over to a
        GPU. Under gradient checkpointing a checkpointed layer saves nothing but keeps its
        input, counted from the decoder layers' inputs; the one layer recomputed at a time
        in backward comes on top.
        """

        largest_mib = 0.0

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self.prompt_tokens = batch["prompt_ids"].shape[1]
            params = {p.untyped_storage().data_ptr() for p in module.parameters()}
            self.seen = {}

            def count(tensor):
                storage = tensor.untyped_storage()
                if storage.data_ptr() not in params:
                    self.seen[storage.data_ptr()] = storage.nbytes()
                return tensor

            def layer_input(layer, args, kwargs):
                hidden = args[0] if args else kwargs.get("hidden_states")
                if torch.is_grad_enabled() and isinstance(hidden, torch.Tensor):
                    count(hidden)

            layers = [m for m in module.modules() if type(m).__name__.endswith("DecoderLayer")]
            self.handles = [layer.register_forward_pre_hook(layer_input, with_kwargs=True) for layer in layers]
            self.hooks = torch.autograd.graph.saved_tensors_hooks(count, lambda tensor: tensor)
            self.hooks.__enter__()

        def on_before_backward(self, trainer, module, loss):
            self.hooks.__exit__(None, None, None)
            for handle in self.handles:
                handle.remove()
            self.largest_mib = max(self.largest_mib, sum(self.seen.values()) / 2**20)

    saved = SavedForBackward()

    spec = PolicySpec(
        name_or_path=model,
        lora=LoraSpec(r=16, alpha=32, dropout=0.0, target_modules="all-linear"),
        gradient_checkpointing=checkpointing,
        dtype=dtype,
        load_in_4bit=load_in_4bit,
    )
    module = GRPOModule(
        policy=spec,
        beta=0.04,
        epsilon_low=0.2,
        epsilon_high=0.2,
        loss_type="grpo",
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0),
        progress=False,
        log_samples=0,
        validate_before_training=False,
    )
    trainer = L.Trainer(
        accelerator="gpu" if torch.cuda.is_available() else "cpu",
        devices=1,
        max_epochs=steps,
        reload_dataloaders_every_n_epochs=1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[StepTimer(), saved] + ([ReleaseHostMemory()] if release else []),
    )
    trainer.fit(module, _length_data(length, Timed, group_size))
    return {
        "seconds": seconds,
        "phases": phases,
        "saved_mib": saved.largest_mib,
        "prompt_tokens": saved.prompt_tokens,
    }


def run_length_trl(
    model: str, length: int, steps: int, group_size: int = GROUP_SIZE, dtype: str = "float32"
) -> list[float]:
    """``steps`` GRPO steps with TRL's GRPOTrainer, its gradient checkpointing on; each one's seconds.

    ``dtype="bfloat16"`` loads the weights in bf16 and turns on TRL's ``bf16`` (autocast).
    """
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from lit_grpo.data.prompts import chat_prompts
    from lit_grpo.model.sources import embedded_model_dir
    from lit_grpo.rewards import accuracy

    path = str(embedded_model_dir()) if model == "embedded" else model
    data = _length_data(length, group_size=group_size)
    data.setup("fit")
    rows = data.next_prompts(steps)  # the prompts lit_grpo draws, in its order, formatted as it formats them
    texts = chat_prompts(
        AutoTokenizer.from_pretrained(path),
        [row["prompt"] for row in rows],
        data.prompt.system_prompt,
        data.prompt.template,
    )
    dataset = Dataset.from_list([{"prompt": text, "answer": row["answer"]} for text, row in zip(texts, rows)])
    seconds: list[float] = []

    class StepTimer(TrainerCallback):  # TRL samples inside the step
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            seconds.append(time.perf_counter() - self.start)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                _check_length(logs["completions/mean_length"], length)

    with tempfile.TemporaryDirectory() as root:
        config = GRPOConfig(
            output_dir=root,
            use_cpu=not torch.cuda.is_available(),
            bf16=dtype == "bfloat16",
            model_init_kwargs={"dtype": dtype},
            seed=0,
            per_device_train_batch_size=group_size,
            gradient_accumulation_steps=1,
            steps_per_generation=1,
            num_generations=group_size,
            max_completion_length=length,
            generation_kwargs={"min_new_tokens": length},
            temperature=0.8,
            top_p=1.0,
            top_k=0,
            beta=0.04,
            epsilon=0.2,
            num_iterations=1,
            loss_type="grpo",
            scale_rewards="group",
            learning_rate=1e-4,
            lr_scheduler_type="constant",
            weight_decay=0.0,
            max_grad_norm=1.0,
            gradient_checkpointing=True,
            max_steps=steps,
            shuffle_dataset=False,
            save_strategy="no",
            logging_steps=1,
            report_to="none",
            disable_tqdm=True,
        )
        lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
        GRPOTrainer(
            model=path,
            reward_funcs=[accuracy],
            args=config,
            train_dataset=dataset,
            peft_config=lora,
            callbacks=[StepTimer()],
        ).train()
    return seconds


def _check_length(mean_length: float, length: int) -> None:
    if mean_length != length:
        raise RuntimeError(f"completions averaged {mean_length} tokens, not the fixed {length}")


def run_length(
    system: str,
    model: str,
    length: int,
    checkpointing: bool,
    steps: int,
    release: bool,
    group_size: int = GROUP_SIZE,
    dtype: str = "float32",
    load_in_4bit: bool = False,
) -> dict:
    """One row of the length table in this process: peak memory and the median warm step's seconds."""
    if system == "lit_grpo":
        result = run_length_lit(model, length, checkpointing, steps, release, group_size, dtype, load_in_4bit)
    else:
        result = {"seconds": run_length_trl(model, length, steps, group_size, dtype)}
    gpu = torch.cuda.is_available()
    seconds = result.pop("seconds")
    if "phases" in result:  # the warm steps' median of each phase, as step_s
        steps = result["phases"][1:] or result["phases"]
        result["phases"] = {k: statistics.median(step.get(k, 0.0) for step in steps) for k in steps[0]}
    return {"peak_mib": _peak_mib(gpu), "step_s": statistics.median(seconds[1:] or seconds), "gpu": gpu, **result}


def length_table(
    lengths: list[int],
    steps: int,
    model: str,
    systems: list[str],
    release: bool,
    dtype: str = "float32",
    lit_checkpointing: tuple[bool, ...] = (False, True),
    cap_gib: float | None = None,
    plot: str | None = None,
    from_log: Path | None = None,
) -> None:
    """Print the length table (the rows of ``systems``), each row from a fresh process, and how each row grows."""
    from importlib.metadata import version

    rows = {}
    wanted = [(s, c) for s, c in LENGTH_ROWS if s in systems and (s != "lit_grpo" or c in lit_checkpointing)]
    if from_log:  # the RESULT lines of an earlier run (one stopped part-way, too): its table and plot
        for line in from_log.read_text().splitlines():
            if line.startswith("RESULT "):
                fields = json.loads(line[len("RESULT ") :])
                if len(fields) == 4:  # the length table's (not scale.py's)
                    length, system, checkpointing, result = fields
                    rows[length, system, checkpointing] = result
    for length in [] if from_log else lengths:
        for system, checkpointing in wanted:
            command = [
                sys.executable,
                __file__,
                "--length-child",
                system,
                "--lengths",
                str(length),
                "--steps",
                str(steps),
                "--model",
                model,
                "--dtype",
                dtype,
            ] + (["--checkpointing"] if checkpointing else [])
            if release and system == "lit_grpo":
                command.append("--release-host-memory")
            result = run_child(command, f"{system} at {length} tokens (checkpointing={checkpointing})", cap_gib)
            if result is not None:
                rows[length, system, checkpointing] = result
                print(f"RESULT {json.dumps([length, system, checkpointing, result])}", flush=True)
    if not rows:
        return
    measure = "torch.cuda.max_memory_allocated" if next(iter(rows.values()))["gpu"] else "peak RSS (ru_maxrss)"
    timing = {1: "step 1, warm-up included", 2: "step 2"}.get(steps, f"median of steps 2-{steps}")
    print(
        f"GRPO steps, {model}, LoRA r=16, 1 prompt x G={GROUP_SIZE} completions of exactly N tokens, beta=0.04, "
        f"{dtype}; {measure}; step s: {timing}"
        + ("; lit_grpo with ReleaseHostMemory" if release else "")
        + (f"; each process capped at {cap_gib:g} GiB of address space" if cap_gib else "")
    )
    print("| N tokens | system         | grad ckpt | peak MiB | step s | peak / TRL | step / TRL |")
    print("|----------|----------------|-----------|----------|--------|------------|------------|")
    names = {"lit_grpo": "lit_grpo", "trl": "TRL"}
    labels = {system: f"{names[system]} {version(system)}" for system in {key[1] for key in rows}}
    for (length, system, checkpointing), r in rows.items():
        trl = rows.get((length, "trl", True))
        ratios = (
            f"{r['peak_mib'] / trl['peak_mib']:10.2f} | {r['step_s'] / trl['step_s']:10.2f}"
            if trl
            else f"{'-':>10} | {'-':>10}"
        )
        print(
            f"| {length:8d} | {labels[system]:<14} | {'yes' if checkpointing else 'no':<9} | "
            f"{r['peak_mib']:8.0f} | {r['step_s']:6.1f} | {ratios} |"
        )
    _growth(rows, labels, plot)


def _exponent(n0: int, v0: float, n1: int, v1: float) -> float:
    """The k of ``v ~ N^k`` through ``(n0, v0)`` and ``(n1, v1)``; nan where a value is 0."""
    return math.log(v1 / v0) / math.log(n1 / n0) if v0 and v1 else float("nan")


def _phase_growth(label: str, checkpointing: bool, points: list[tuple[int, dict[str, float]]]) -> None:
    """Where a row's step goes at each length (seconds per phase), and the exponent each phase grows with."""
    if not points:
        return
    names = [k for k, v in points[0][1].items() if v > 0.01]
    print(f"\n{label}, checkpointing {'on' if checkpointing else 'off'}: seconds per phase (time/*), and N^k")
    print("| N | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for n, phases in points:
        print(f"| {n} | " + " | ".join(f"{phases.get(k, 0.0):.1f}" for k in names) + " |")
    for (n0, p0), (n1, p1) in zip(points, points[1:]):
        ks = [_exponent(n0, p0.get(k, 0.0), n1, p1.get(k, 0.0)) for k in names]
        print(f"| k, {n0} -> {n1} | " + " | ".join(f"{k:.2f}" for k in ks) + " |")


def _growth(rows: dict, labels: dict[str, str], plot: str | None) -> None:
    """The exponent k of each row's growth (value ~ N^k) between consecutive lengths; a log-log plot."""
    series: dict[tuple[str, bool], list[tuple[int, dict]]] = {}
    for (length, system, checkpointing), r in sorted(rows.items()):
        series.setdefault((system, checkpointing), []).append((length, r))
    print("\n| system | grad ckpt | from N | to N | step s grows as N^ | peak MiB grows as N^ |")
    print("|---|---|---|---|---|---|")
    for (system, checkpointing), points in series.items():
        for (n0, r0), (n1, r1) in zip(points, points[1:]):
            k_step = _exponent(n0, r0["step_s"], n1, r1["step_s"])
            k_peak = _exponent(n0, r0["peak_mib"], n1, r1["peak_mib"])
            ckpt = "yes" if checkpointing else "no"
            print(f"| {labels[system]} | {ckpt} | {n0} | {n1} | {k_step:.2f} | {k_peak:.2f} |")
    for (system, checkpointing), points in series.items():
        _phase_growth(labels[system], checkpointing, [(n, r["phases"]) for n, r in points if r.get("phases")])
    if plot:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot as plt

        figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
        for (system, checkpointing), points in series.items():
            label = f"{labels[system]}, checkpointing {'on' if checkpointing else 'off'}"
            lengths = [n for n, _ in points]
            left.plot(lengths, [r["step_s"] for _, r in points], marker="o", label=label)
            right.plot(lengths, [r["peak_mib"] / 1024 for _, r in points], marker="o", label=label)
        from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

        lengths = sorted({n for points in series.values() for n, _ in points})
        for axis, name in ((left, "seconds per step"), (right, "peak memory, GiB")):
            axis.set(xscale="log", yscale="log", xlabel="completion tokens (1 prompt x 8)", ylabel=name)
            axis.set_xticks(lengths)
            axis.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            for scale in (axis.xaxis, axis.yaxis):
                scale.set_major_formatter(ScalarFormatter())
                scale.set_minor_formatter(NullFormatter())
            axis.grid(True, which="both", alpha=0.3)
        left.legend(fontsize=8)
        figure.tight_layout()
        figure.savefig(plot, dpi=110)
        print(f"plot: {plot}")


def run_child(command: list[str], label: str, cap_gib: float | None = None) -> dict | None:
    """Run ``command`` (this script in a child role); its ``RESULT`` line, or ``None`` after reporting a failure.

    ``cap_gib`` limits the child's virtual address space (``RLIMIT_AS``: mapped files and
    thread stacks count too), so a row that would not fit fails alone (an allocation error)
    instead of waking the kernel's OOM killer. CUDA reserves far more address space than it
    uses, so on a GPU the cap is left off.
    """
    if cap_gib and torch.cuda.is_available():
        print("--cap-gib is left off on a GPU (CUDA reserves address space it does not use)", file=sys.stderr)
        cap_gib = None

    def cap() -> None:
        limit = int(cap_gib * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    out = subprocess.run(command, capture_output=True, text=True, preexec_fn=cap if cap_gib else None)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        print(f"{label} failed:\n{out.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--lengths", type=int, nargs="+", help="Completion lengths: print the length table (lit_grpo vs TRL) instead."
    )
    parser.add_argument("--steps", type=int, default=2, help="Steps per row of the length table.")
    parser.add_argument("--model", default="embedded", help="policy.name_or_path of the length table.")
    parser.add_argument(
        "--systems",
        nargs="+",
        choices=["lit_grpo", "trl"],
        default=["lit_grpo", "trl"],
        help="Rows of the length table to run (without trl, the ratio columns stay empty).",
    )
    parser.add_argument(
        "--release-host-memory",
        action="store_true",
        help="lit_grpo's rows run with the ReleaseHostMemory callback (less peak RSS, slower).",
    )
    parser.add_argument("--one", choices=list(CONFIGS), help=argparse.SUPPRESS)
    parser.add_argument("--length-child", choices=["lit_grpo", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--group-size", type=int, default=GROUP_SIZE, help=argparse.SUPPRESS)
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="Weights of the length table's rows (TRL's bfloat16 also turns on its bf16 autocast).",
    )
    parser.add_argument(
        "--lit-checkpointing",
        nargs="+",
        choices=["no", "yes"],
        default=["no", "yes"],
        help="lit_grpo's rows of the length table: without and/or with gradient checkpointing.",
    )
    parser.add_argument("--cap-gib", type=float, help="Virtual address-space cap of each row's process (GiB, CPU).")
    parser.add_argument("--plot", help="Write the length table's log-log plot to this PNG.")
    parser.add_argument(
        "--from-log",
        type=Path,
        help="The length table from an earlier run's output; run none (give the run's --dtype etc. for the header).",
    )
    parser.add_argument("--load-in-4bit", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one, args.checkpointing)))
        return
    if args.length_child:
        result = run_length(
            args.length_child,
            args.model,
            args.lengths[0],
            args.checkpointing,
            args.steps,
            args.release_host_memory,
            args.group_size,
            args.dtype,
            args.load_in_4bit,
        )
        print("RESULT " + json.dumps(result))
        return
    if args.lengths or args.from_log:
        length_table(
            args.lengths,
            args.steps,
            args.model,
            args.systems,
            args.release_host_memory,
            args.dtype,
            tuple(c == "yes" for c in args.lit_checkpointing),
            args.cap_gib,
            args.plot,
            args.from_log,
        )
        return
    rows = []
    for name in CONFIGS:
        for checkpointing in (False, True):
            command = [sys.executable, __file__, "--one", name] + (["--checkpointing"] if checkpointing else [])
            result = run_child(command, f"{name} (checkpointing={checkpointing})")
            if result is not None:
                rows.append((name, checkpointing, result))
    measure = "torch.cuda.max_memory_allocated" if rows and rows[0][2]["gpu"] else "peak RSS (ru_maxrss)"
    print(f"One GRPO step, embedded SmolLM2-135M, 4 prompts x G=8 x 24 new tokens; {measure}")
    print(f"| {'configuration':<26} | grad ckpt | peak MiB | trainable params | step s |")
    print(f"|{'-' * 28}|-----------|----------|------------------|--------|")
    for name, checkpointing, r in rows:
        print(
            f"| {name:<26} | {'yes' if checkpointing else 'no':<9} | {r['peak_mib']:8.0f} | "
            f"{r['trainable']:>16,} | {r['seconds']:6.1f} |"
        )


if __name__ == "__main__":
    main()
