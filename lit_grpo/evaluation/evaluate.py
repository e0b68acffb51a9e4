"""``lit-grpo eval``: how well a base model, or base + trained adapter, answers held-out prompts.

It reads the same config as ``lit-grpo fit`` (the model and the data sections;
``--data.*`` flags point it at another task, file or hub dataset), loads the
adapter a run exported, and scores with the run's own validation reward:

* greedy accuracy, exactly what training's ``val/accuracy`` measures;
* with ``--samples n``: ``n`` sampled answers per prompt (the config's
  temperature) and pass@k for each ``--pass_k`` k <= n, by the unbiased
  estimator of Chen et al. (2021): ``1 - C(n - c, k) / C(n, k)`` for a prompt
  with ``c`` correct answers out of ``n``, averaged over prompts.
* with tools or an environment (``data.episodes.tools``, ``data.episodes.environment``): the
  same episodes training runs, and beside the accuracy the greedy episodes'
  tool use (``tool_calls``, ``tool_errors`` per episode, ``turns_mean``), and
  with an environment that scores its episodes (``get_reward``) their mean
  reward (``env_reward``) and the share of episodes it counts as a success
  (``env_success``): its ``solved`` attribute where it has a boolean one (for
  :class:`~lit_grpo.environments.builtin.GuessNumber`, games won within
  ``max_guesses``, whatever a shaping reward adds to lost ones), else a reward
  above 0.

It prints a table row for the validation prompts and one per ``data.held_out.slices``
slice and, with ``--out``, writes the figures as JSON (the slices' under ``slices``).
With ``--transcripts FILE`` it also writes every greedy answer as a JSON line:
``set``, ``prompt``, the row's other ``columns``, ``completion``, ``score``, and
for an episode its ``turns`` (assistant and tool messages) and ``env_reward``.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.cli import LightningCLI
from tqdm.auto import tqdm

from lit_grpo.algorithms.answers import answer_batch
from lit_grpo.algorithms.grpo import GRPOModule
from lit_grpo.cli_checks import OneLineErrorParser, check_moved_keys, check_yaml_files
from lit_grpo.data.grpo import OnPolicyDataModule
from lit_grpo.environments.factory import environment_rewards
from lit_grpo.generation.episodes import episode_stats
from lit_grpo.model.policy import LoraSpec

# The greedy episodes' tool use, reported beside the accuracy.
EPISODE_COLUMNS = ("tool_calls", "tool_errors", "turns_mean")


def pass_at_k(n: int, correct: int, k: int) -> float:
    """Probability that at least one of ``k`` answers drawn from ``n`` (``correct`` right) is right."""
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def adapter_lora(folder: str | Path) -> LoraSpec:
    """The :class:`LoraSpec` an exported PEFT adapter folder was trained with.

    Raises:
        FileNotFoundError: ``folder`` holds no ``adapter_config.json``.
    """
    config_file = Path(folder) / "adapter_config.json"
    if not config_file.is_file():
        raise FileNotFoundError(
            f"--adapter={str(folder)!r}: no adapter_config.json there; expected a folder "
            "written by --export_adapter (or PeftModel.save_pretrained)."
        )
    config = json.loads(config_file.read_text())
    targets = config["target_modules"]
    return LoraSpec(
        r=config["r"],
        alpha=config["lora_alpha"],
        dropout=config.get("lora_dropout", 0.0),
        target_modules=sorted(targets) if isinstance(targets, list) else targets,
    )


def load_adapter(module: GRPOModule, folder: str | Path) -> None:
    """Copy an exported adapter's weights into the module's (same-shaped) LoRA adapter.

    Raises:
        ValueError: The adapter was trained on a base model of other shapes (checked before any
            weight is copied), or holds weights this model has no place for.
    """
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    file = Path(folder) / "adapter_model.safetensors"
    check_adapter_shapes(module, folder)
    try:
        result = set_peft_model_state_dict(module.policy, load_file(file))
    except RuntimeError as error:  # a mismatch the check above could not see (peft renamed the weights)
        if "size mismatch" not in str(error):
            raise
        detail = next((line.strip() for line in str(error).splitlines() if "size mismatch" in line), "")
        raise ValueError(f"{_does_not_fit(module, folder)}: {detail} {_retry(folder)}") from error
    if result.unexpected_keys:
        raise ValueError(
            f"--adapter={str(folder)!r} holds weights this model has no place for, e.g. "
            f"{result.unexpected_keys[0]!r}; was it trained on policy.name_or_path="
            f"{module.spec.name_or_path!r}?"
        )


def check_adapter_shapes(module: GRPOModule, folder: str | Path) -> None:
    """Refuse, before loading them, adapter weights whose shapes differ from the module's adapter: the
    shapes in the ``adapter_model.safetensors`` header against the weights ``save_pretrained`` would write.

    Raises:
        ValueError: Naming the adapter, the base it was trained on, this model and the first weight
            (in layer order) of another shape.
    """
    from peft import get_peft_model_state_dict
    from safetensors import safe_open

    with safe_open(Path(folder) / "adapter_model.safetensors", framework="pt") as f:
        saved = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    # save_embedding_layers=False: "auto" would look the base model up (on the hub, for a hub id).
    ours = {
        key: tuple(weight.shape)
        for key, weight in get_peft_model_state_dict(module.policy, save_embedding_layers=False).items()
    }
    mismatched = [key for key in ours if key in saved and saved[key] != ours[key]]
    if mismatched:
        key = mismatched[0]
        raise ValueError(
            f"{_does_not_fit(module, folder)}: {len(mismatched)} of its {len(saved)} weights have "
            f"another shape here, e.g. {key}: {saved[key]} in the adapter, {ours[key]} in this "
            f"model. {_retry(folder)}"
        )


def _does_not_fit(module: GRPOModule, folder: str | Path) -> str:
    return f"--adapter={str(folder)!r} does not fit model.policy.name_or_path={module.spec.name_or_path!r}"


def _retry(folder: str | Path) -> str:
    """Where the adapter came from (its ``adapter_config.json``) and what to do."""
    config = json.loads((Path(folder) / "adapter_config.json").read_text())
    return (
        f"The adapter was trained on base_model_name_or_path={config.get('base_model_name_or_path')!r} (its "
        "adapter_config.json); evaluate it on that base (model.policy.name_or_path), or pass an adapter "
        "trained on this one."
    )


@torch.no_grad()
def evaluate(
    module: GRPOModule,
    datamodule: OnPolicyDataModule,
    samples: int,
    pass_k: list[int],
    rows: list[dict] | None = None,
    progress: bool = True,
    transcripts: list[dict] | None = None,
) -> dict[str, float]:
    """Greedy accuracy and pass@k on ``rows`` (by default the validation prompts) of an attached
    module and DataModule; each greedy answer is appended to ``transcripts`` when given (see the
    module docstring)."""
    rows = datamodule.val_rows if rows is None else rows
    size = datamodule.held_out.batch_size
    greedy, passes, records, env_rewards, successes = [], {k: [] for k in pass_k}, [], [], []
    factory = datamodule.episodes.factory if datamodule.episodes is not None else None
    scored = factory is not None and factory.has_reward  # an environment that scores its episodes
    sampling = datamodule.sampling
    bar = tqdm(total=len(rows), desc="eval", unit="prompt", disable=not progress, dynamic_ncols=True)
    module.eval()
    with torch.random.fork_rng():  # the same draws each run; the caller's RNG state untouched
        torch.manual_seed(datamodule.hparams.seed)
        for start in range(0, len(rows), size):
            batch = datamodule.collate_val(rows[start : start + size])
            answers, scores = answer_batch(module, datamodule, batch)
            scores = scores.tolist()
            greedy += scores
            records += answers.episodes or []
            rewards = environment_rewards(batch["environments"]) if scored else []
            env_rewards += rewards
            successes += [_solved(env, reward) for env, reward in zip(batch.get("environments", ()), rewards)]
            if transcripts is not None:
                transcripts += _transcripts(datamodule, batch["rows"], answers, scores, rewards)
            if samples:
                episodes = None
                ids, mask, repeat, environments = batch["prompt_ids"], batch["prompt_mask"], samples, None
                if datamodule.episodes is not None:  # a fresh environment per sampled episode
                    ids, mask, episodes, environments = datamodule.episodes.start(datamodule, batch["rows"], samples)
                    repeat = episodes.repeat(ids.shape[0])
                texts = module.engine.generate(ids, mask, sampling, repeat=repeat, episodes=episodes).texts
                repeated = [row for row in batch["rows"] for _ in range(samples)]
                scores = datamodule.score_validation(repeated, texts, environments).view(-1, samples)  # [B, samples]
                for k in pass_k:
                    passes[k] += [pass_at_k(samples, int((row > 0.5).sum()), k) for row in scores]
            bar.update(len(batch["rows"]))
    bar.close()
    result = {"prompts": len(rows), "greedy_accuracy": sum(greedy) / len(greedy)}
    result.update({f"pass@{k}": sum(values) / len(values) for k, values in passes.items()})
    if records:
        stats = episode_stats(records)
        result.update({name: stats[f"episode/{name}"] for name in EPISODE_COLUMNS})
    if env_rewards:
        result.update(
            {"env_reward": sum(env_rewards) / len(env_rewards), "env_success": sum(successes) / len(successes)}
        )
    return result


def _solved(environment, reward: float) -> bool:
    """Whether an episode succeeded: the environment's boolean ``solved`` where it has one, else ``reward > 0``."""
    solved = getattr(environment, "solved", None)
    return solved if isinstance(solved, bool) else reward > 0


def _transcripts(datamodule, rows: list[dict], answers, scores: list[float], rewards: list) -> list[dict]:
    texts = datamodule.full_completions(answers.texts)
    lines = []
    for i, (row, text, score) in enumerate(zip(rows, texts, scores)):
        line = {
            "prompt": row["prompt"],
            "completion": text,
            "score": score,
            "columns": {k: v for k, v in row.items() if k != "prompt"},
        }
        if answers.episodes:
            line["turns"] = answers.episodes[i].messages
        if rewards:
            line["env_reward"] = rewards[i]
        lines.append(line)
    return lines


class EvalCli(LightningCLI):
    """The ``lit-grpo eval`` parser: the fit config's model and data, plus what to score."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument(
            "--adapter",
            type=str | None,
            default=None,
            help="A trained adapter folder (--export_adapter of a fit); none scores the base model.",
        )
        parser.add_argument(
            "--samples", type=int, default=0, help="Sampled answers per prompt for pass@k (0: greedy accuracy only)."
        )
        parser.add_argument("--pass_k", type=list[int], default=[1], help="The k of pass@k, each at most --samples.")
        parser.add_argument("--out", type=str | None, default=None, help="Also write the figures to this JSON file.")
        parser.add_argument(
            "--transcripts",
            type=str | None,
            default=None,
            help="Also write every greedy answer (an episode's turns too) to this JSONL file.",
        )
        for name in ("export_adapter", "collective_timeout", "preemption_grace"):  # fit-only keys a fit config may hold
            parser.add_argument(f"--{name}", default=None, help="Read from a fit config and ignored here.")

    def instantiate_trainer(self, **kwargs) -> L.Trainer:
        # Only the accelerator matters: no logger, no checkpoints, one device.
        accelerator = self._get(self.config_init, "trainer", default={}).get("accelerator", "auto")
        return L.Trainer(
            accelerator=accelerator,
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
        )


def main(argv: list[str]) -> dict[str, float]:
    """``lit-grpo eval [--config FIT.yaml] [--adapter DIR] [--samples N --pass_k K ...] [--out FILE]
    [--transcripts FILE]``."""
    check_yaml_files(argv)
    check_moved_keys(argv)
    cli = EvalCli(
        GRPOModule,
        OnPolicyDataModule,
        run=False,
        args=argv,
        save_config_callback=None,
        parser_class=OneLineErrorParser,
        parser_kwargs={
            "prog": "lit-grpo eval",
            "description": "Score a base model or base + adapter on held-out prompts.",
        },
    )
    config = cli.config
    samples, pass_k = config["samples"], config["pass_k"]
    if samples and any(not 1 <= k <= samples for k in pass_k):
        raise ValueError(f"--pass_k={pass_k}; expected each k in 1..--samples={samples}.")
    module, datamodule = cli.model, cli.datamodule
    if config["adapter"]:
        module.spec = replace(module.spec, lora=adapter_lora(config["adapter"]))
    cli.trainer.validate(module, datamodule, verbose=False)  # attaches both, loads the model and the prompts
    if config["adapter"]:
        load_adapter(module, config["adapter"])
        module.engine.weights_changed()
    transcripts = {name: [] for name in ("validation", *datamodule.val_slices)} if config["transcripts"] else {}
    result = {
        "model": module.spec.name_or_path,
        "adapter": config["adapter"],
        **evaluate(module, datamodule, samples, pass_k if samples else [], transcripts=transcripts.get("validation")),
    }
    slices = {
        name: evaluate(module, datamodule, samples, pass_k if samples else [], rows, transcripts=transcripts.get(name))
        for name, rows in datamodule.val_slices.items()
    }
    if slices:
        result["slices"] = slices
    print(table(result))
    if config["out"]:
        Path(config["out"]).parent.mkdir(parents=True, exist_ok=True)
        Path(config["out"]).write_text(json.dumps(result, indent=2) + "\n")
        print(f"written to {config['out']}")
    if transcripts:
        path = Path(config["transcripts"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            "".join(json.dumps({"set": name, **line}) + "\n" for name, lines in transcripts.items() for line in lines)
        )
        print(f"transcripts written to {path}")
    return result


def table(result: dict) -> str:
    """The figures as a Markdown table: the validation prompts' row, then one per ``data.held_out.slices`` slice."""
    sets = {"validation": result, **result.get("slices", {})}
    columns = [
        "prompts",
        "greedy_accuracy",
        *[k for k in result if k.startswith("pass@")],
        *[k for k in (*EPISODE_COLUMNS, "env_reward", "env_success") if k in result],
    ]
    header = ["model", "adapter", "set", *columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, figures in sets.items():
        cells = [
            str(result["model"]),
            str(result["adapter"] or "-"),
            name,
            *[f"{figures[c]:.3f}" if isinstance(figures[c], float) else str(figures[c]) for c in columns],
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
