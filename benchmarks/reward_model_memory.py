"""Peak memory of one GRPO step scored by a rule, by a separate reward model, and by one on the shared base.

    python benchmarks/reward_model_memory.py --rm runs/rm_quickstart/rm

``--rm`` is what ``lit-grpo rm fit --export_adapter`` wrote (configs/rm_quickstart.yaml).
Each row runs in a fresh subprocess (so one run's allocations never count
towards the next): the embedded SmolLM2-135M-Instruct with a LoRA adapter
(r=16), on the base the reward model was trained on (its ``init_adapter``,
read from the export), one GRPO step as in ``benchmarks/memory.py``: 4
prompts x G=8 samples x 24 new tokens, one optimizer step over the 32
completions, beta=0.04 (the reference is scored too). Peak memory is the
process's peak RSS (``ru_maxrss``) on CPU, the Python/torch baseline and the
loaded models included, and ``torch.cuda.max_memory_allocated`` on a GPU.

Rows:

* ``rule reward``: the ``accuracy`` verifier only.
* ``separate RM``: :class:`~lit_grpo.rewards.RewardModel` as a
  sequence-classification model of its own (a second copy of the weights).
* ``RM on the shared base``: the same reward model as a second adapter + head
  on the policy's frozen base (``shared_base: true``).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

ROWS = {"rule reward": None, "separate RM": False, "RM on the shared base": True}  # name -> shared_base


def run_one(name: str, rm: str) -> dict:
    """One GRPO step in this process; returns peak memory and seconds."""
    import lightning as L

    from lit_grpo.algorithms.grpo import GRPOModule
    from lit_grpo.data.grpo import OnPolicyDataModule
    from lit_grpo.data.specs import HeldOutSpec, SourceSpec
    from lit_grpo.generation.rollout import SamplingSpec
    from lit_grpo.model.policy import LoraSpec, PolicySpec
    from lit_grpo.rewards import Accuracy, RewardModel
    from lit_grpo.rewards.reward_model import ADAPTER_DIR, BASE_FILE

    base = json.loads((Path(rm) / ADAPTER_DIR / BASE_FILE).read_text())
    shared = ROWS[name]
    rewards = [Accuracy()] if shared is None else [RewardModel(rm, shared_base=shared)]
    gpu = torch.cuda.is_available()
    spec = PolicySpec(name_or_path=base["name_or_path"], init_adapter=base["init_adapter"], lora=LoraSpec())
    module = GRPOModule(policy=spec, beta=0.04, progress=False, log_samples=0, validate_before_training=False)
    data = OnPolicyDataModule(
        prompts_per_epoch=4,
        batch_size=32,
        held_out=HeldOutSpec(size=1),
        source=SourceSpec(task_args={"digits": 2, "ops": "+"}),
        sampling=SamplingSpec(group_size=8, temperature=0.8, max_new_tokens=24),
        rewards=rewards,
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
    peak = (
        torch.cuda.max_memory_allocated() / 2**20 if gpu else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    )
    reward_seconds = data.last_stats.get("time/reward", float("nan"))
    return {"peak_mib": peak, "seconds": seconds, "reward_seconds": reward_seconds, "gpu": gpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rm", required=True, help="an rm fit export folder")
    parser.add_argument("--row", choices=list(ROWS), help=argparse.SUPPRESS)  # the child's one row
    args = parser.parse_args()
    if args.row:
        print(json.dumps(run_one(args.row, args.rm)))
        return
    print("| reward | peak memory (MiB) | step (s) | of which scoring (s) |\n|---|---|---|---|")
    for name in ROWS:
        done = subprocess.run(
            [sys.executable, __file__, "--rm", args.rm, "--row", name], capture_output=True, text=True, check=True
        )
        result = json.loads(done.stdout.strip().splitlines()[-1])
        print(
            f"| {name} | {result['peak_mib']:.0f} | {result['seconds']:.1f} | {result['reward_seconds']:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
