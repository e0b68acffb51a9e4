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
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import subprocess
import sys
import time

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
    from lit_grpo.module import GRPOModule

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

    from lit_grpo.data import OnPolicyDataModule
    from lit_grpo.module import GRPOModule
    from lit_grpo.policy import LoraSpec, PolicySpec
    from lit_grpo.rewards import Accuracy
    from lit_grpo.rollout import SamplingSpec

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
        prompts_per_epoch=4, batch_size=32, val_size=1, task_args={"digits": 2, "ops": "+"},
        sampling=SamplingSpec(group_size=8, temperature=0.8, max_new_tokens=24), rewards=[Accuracy()],
    )
    trainer = L.Trainer(
        accelerator="gpu" if gpu else "cpu", devices=1, max_epochs=1, reload_dataloaders_every_n_epochs=1,
        limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    start = time.perf_counter()
    trainer.fit(module, data)
    seconds = time.perf_counter() - start
    if gpu:
        peak_mib = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    trainable = sum(p.numel() for p in module.trainable_parameters())
    return {"peak_mib": peak_mib, "seconds": seconds, "trainable": trainable, "gpu": gpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", choices=list(CONFIGS), help=argparse.SUPPRESS)
    parser.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one, args.checkpointing)))
        return
    rows = []
    for name in CONFIGS:
        for checkpointing in (False, True):
            command = [sys.executable, __file__, "--one", name] + (["--checkpointing"] if checkpointing else [])
            out = subprocess.run(command, capture_output=True, text=True)
            lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
            if out.returncode != 0 or not lines:
                print(f"{name} (checkpointing={checkpointing}) failed:\n{out.stderr[-2000:]}", file=sys.stderr)
                continue
            rows.append((name, checkpointing, json.loads(lines[-1][len("RESULT "):])))
    measure = "torch.cuda.max_memory_allocated" if rows and rows[0][2]["gpu"] else "peak RSS (ru_maxrss)"
    print(f"One GRPO step, embedded SmolLM2-135M, 4 prompts x G=8 x 24 new tokens; {measure}")
    print(f"| {'configuration':<26} | grad ckpt | peak MiB | trainable params | step s |")
    print(f"|{'-' * 28}|-----------|----------|------------------|--------|")
    for name, checkpointing, r in rows:
        print(f"| {name:<26} | {'yes' if checkpointing else 'no':<9} | {r['peak_mib']:8.0f} | "
              f"{r['trainable']:>16,} | {r['seconds']:6.1f} |")


if __name__ == "__main__":
    main()
