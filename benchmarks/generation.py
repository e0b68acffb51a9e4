"""Rollout engines side by side: native decode loop vs vLLM vs Hugging Face ``generate``.

Part 1, sampling alone (``--part sampling``): each engine completes the same
prompts (``prompts x group`` rows, up to ``new_tokens`` each, EOS allowed so
answers vary in length) on the embedded SmolLM2-135M-Instruct with a LoRA
adapter, through the same :class:`~lit_grpo.generation.Engine` call a rollout
makes (vLLM after its weights were pushed). Variants run alternately so
machine drift hits all of them; the table shows the median tokens/s and
rollout seconds.

Part 2, a full GRPO step (``--part step``): ``lit_grpo`` trains the same
setting for 2 epochs (one optimizer step per epoch) with each engine; the
table shows the second epoch (the first pays for vLLM's start): rollout
seconds, training seconds and the whole step. The policy trains in float32;
the bf16 engines sample from a bf16 copy of it (``generation.dtype``), which
pays only where the CPU or GPU has bf16 matrix units (part 1 shows it).

    python benchmarks/generation.py --part sampling --shapes 4x8x64 8x8x256 --repeats 2
    python benchmarks/generation.py --part step --shapes 1x8x256 8x8x256
    python benchmarks/generation.py --part sampling --shapes 8x8x256 --engines "native fp32" "vllm fp32"

vLLM needs the extra (docs/engines.md, "The vLLM engine"); without it its rows are
left out. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

import torch

from lit_grpo.algorithms.grpo import GRPOModule
from lit_grpo.data.grpo import OnPolicyDataModule
from lit_grpo.data.prompts import chat_prompts
from lit_grpo.data.specs import HeldOutSpec, PromptSpec, SourceSpec
from lit_grpo.data.word_problems import word_problems
from lit_grpo.generation import GenerationSpec
from lit_grpo.generation.rollout import SamplingSpec, encode_prompts, eos_ids
from lit_grpo.model.policy import LoraSpec, PolicySpec
from lit_grpo.rewards import Accuracy

SYSTEM = "Think step by step, then give the final number after ####."


def engines(vllm: bool, chosen: list[str] | None = None) -> dict[str, GenerationSpec]:
    variants = {"native fp32": GenerationSpec(), "native bf16": GenerationSpec(dtype="bfloat16")}
    if vllm:
        variants.update(
            {"vllm fp32": GenerationSpec(backend="vllm"), "vllm bf16": GenerationSpec(backend="vllm", dtype="bfloat16")}
        )
    return {name: spec for name, spec in variants.items() if not chosen or name in chosen}


def module_with(spec: GenerationSpec) -> GRPOModule:
    module = GRPOModule(policy=PolicySpec(dtype="float32", lora=LoraSpec()), generation=spec, progress=False)
    module.configure_model()
    return module


def hf_generate(module, ids, mask, sampling):
    model = module.policy.get_base_model()
    start = time.perf_counter()
    out = model.generate(
        input_ids=ids.repeat_interleave(sampling.group_size, 0),
        attention_mask=mask.repeat_interleave(sampling.group_size, 0),
        do_sample=True,
        temperature=sampling.temperature,
        top_k=None,
        top_p=None,
        max_new_tokens=sampling.max_new_tokens,
        eos_token_id=eos_ids(module.tokenizer, model),
        pad_token_id=module.tokenizer.pad_token_id,
    )
    seconds = time.perf_counter() - start
    completion = out[:, ids.shape[1] :]
    ended = (completion == module.tokenizer.pad_token_id).any(-1)  # pad = eos here: its first one is the EOS
    return int((completion != module.tokenizer.pad_token_id).sum() + ended.sum()), seconds


def sampling_part(shapes: list[tuple[int, int, int]], repeats: int, vllm: bool, chosen: list[str]) -> None:
    print("| prompts x G x max tokens | engine | tokens/s | rollout s | mean length |")
    print("|---|---|---|---|---|")
    for prompts, group, new_tokens in shapes:
        sampling = SamplingSpec(group_size=group, max_new_tokens=new_tokens, temperature=0.8)
        modules = {name: module_with(spec) for name, spec in engines(vllm, chosen).items()}
        compare_hf = not chosen or "hf generate fp32" in chosen
        tokenizer = next(iter(modules.values())).tokenizer
        texts = chat_prompts(tokenizer, [r["prompt"] for r in word_problems(prompts, seed=1)], SYSTEM, "{prompt}")
        ids, mask = encode_prompts(tokenizer, texts, None)
        for module in modules.values():  # warm-up: vLLM starts and receives the weights here
            torch.manual_seed(0)
            module.engine.generate(ids, mask, SamplingSpec(group_size=1, max_new_tokens=new_tokens))
        results: dict[str, list[tuple[int, float]]] = {name: [] for name in modules}
        if compare_hf:
            results["hf generate fp32"] = []
        for repeat in range(repeats):
            for name, module in modules.items():
                torch.manual_seed(repeat)
                rollout = module.engine.generate(ids, mask, sampling)
                results[name].append((int(rollout.lengths.sum()), rollout.seconds))
            if compare_hf:
                torch.manual_seed(repeat)
                results["hf generate fp32"].append(hf_generate(next(iter(modules.values())), ids, mask, sampling))
        for name, runs in results.items():
            rate = statistics.median(tokens / seconds for tokens, seconds in runs)
            seconds = statistics.median(s for _, s in runs)
            length = statistics.mean(tokens for tokens, _ in runs) / (prompts * group)
            print(
                f"| {prompts}x{group}x{new_tokens} | {name} | {rate:.0f} | {seconds:.1f} | {length:.0f} |", flush=True
            )
        for module in modules.values():
            module.engine.close()


class EpochClock:
    """Seconds of each training epoch, from the rollout's start to the optimizer step's end."""

    def __init__(self):
        import lightning as L

        outer = self

        class Clock(L.Callback):
            def on_train_epoch_end(self, trainer, module):
                stats = trainer.datamodule.last_stats
                outer.epochs.append({"rollout": stats["time/generate"], "total": time.perf_counter() - outer.start})
                outer.start = time.perf_counter()

            def on_train_start(self, trainer, module):
                outer.start = time.perf_counter()

        self.epochs: list[dict] = []
        self.start = 0.0
        self.callback = Clock()


def step_part(shapes: list[tuple[int, int, int]], vllm: bool, chosen: list[str]) -> None:
    import lightning as L

    print("| prompts x G x max tokens | engine | rollout s | rest of the step s | step s |")
    print("|---|---|---|---|---|")
    for prompts, group, new_tokens in shapes:
        for name, spec in engines(vllm, chosen).items():
            module = GRPOModule(
                policy=PolicySpec(dtype="float32", lora=LoraSpec()),
                generation=spec,
                progress=False,
                validate_before_training=False,
                log_samples=0,
            )
            data = OnPolicyDataModule(
                source=SourceSpec("word_problems"),
                prompt=PromptSpec(system_prompt=SYSTEM),
                prompts_per_epoch=prompts,
                batch_size=8,
                held_out=HeldOutSpec(size=1),
                rewards=[Accuracy()],
                sampling=SamplingSpec(group_size=group, max_new_tokens=new_tokens),
            )
            clock = EpochClock()
            trainer = L.Trainer(
                max_epochs=2,
                reload_dataloaders_every_n_epochs=1,
                accelerator="cpu",
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                num_sanity_val_steps=0,
                limit_val_batches=0,
                callbacks=[clock.callback],
                accumulate_grad_batches=prompts * group // 8,
            )
            torch.manual_seed(0)
            trainer.fit(module, data)
            last = clock.epochs[-1]
            print(
                f"| {prompts}x{group}x{new_tokens} | {name} | {last['rollout']:.1f} | "
                f"{last['total'] - last['rollout']:.1f} | {last['total']:.1f} |",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["sampling", "step"], default="sampling")
    parser.add_argument(
        "--shapes", nargs="+", default=["4x8x64", "8x8x256"], help="prompts x group size x max new tokens"
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--engines",
        nargs="*",
        default=[],
        help="a subset of: native fp32, native bf16, vllm fp32, vllm bf16, hf generate fp32 (default: all)",
    )
    args = parser.parse_args()
    shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.shapes]
    vllm = importlib.util.find_spec("vllm") is not None
    if args.part == "sampling":
        sampling_part(shapes, args.repeats, vllm, args.engines)
    else:
        step_part(shapes, vllm, args.engines)


if __name__ == "__main__":
    main()
