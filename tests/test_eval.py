"""``lit-grpo eval``: greedy accuracy and pass@k of a base model or base + exported adapter."""

from __future__ import annotations

import json

import pytest
import torch

from lit_grpo.algorithms.grpo import GRPOModule
from lit_grpo.data.sources import load_rows
from lit_grpo.evaluation.evaluate import main, pass_at_k
from lit_grpo.model.policy import LoraSpec, PolicySpec


def test_pass_at_k_by_hand():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)  # 1 right of 4, one draw
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 3, 2) == 1.0  # n - c < k: a right one is always drawn


def letter_share(prompts, completions, **columns):
    return [sum(ch.isalpha() for ch in text) / max(len(text), 1) for text in completions]


def eval_args(tiny: str, *extra: str) -> list[str]:
    # A random model never answers right; this validation reward still tells answers apart.
    reward = json.dumps(
        {"class_path": "lit_grpo.rewards.FromCallable", "init_args": {"function": "test_eval.letter_share"}}
    )
    return [
        "--trainer.accelerator=cpu",
        f"--model.policy.name_or_path={tiny}",
        "--model.progress=false",
        "--data.held_out.size=4",
        "--data.source.train_size=8",
        "--data.sampling.max_new_tokens=6",
        f"--data.held_out.reward={reward}",
        *extra,
    ]


def test_base_and_adapter_scores_and_json(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path.parent))
    monkeypatch.syspath_prepend(__import__("os").path.dirname(__file__))
    base = main(eval_args(tiny_model_dir, "--samples=4", "--pass_k=[1,4]", f"--out={tmp_path / 'base.json'}"))
    assert base["prompts"] == 4 and base["adapter"] is None
    assert 0 <= base["pass@1"] <= base["pass@4"] <= 1
    assert json.loads((tmp_path / "base.json").read_text()) == base

    # An adapter of another rank than LoraSpec's default, with weights that change the answers.
    module = GRPOModule(policy=PolicySpec(name_or_path=tiny_model_dir, lora=LoraSpec(r=4)), progress=False)
    module.configure_model()
    torch.manual_seed(1)
    for name, weight in module.policy.named_parameters():
        if "lora_B" in name:
            weight.data.normal_(0, 1.0)
    module.export_adapter(tmp_path / "adapter")
    tuned = main(eval_args(tiny_model_dir, f"--adapter={tmp_path / 'adapter'}"))
    assert tuned["adapter"] == str(tmp_path / "adapter")
    assert tuned["greedy_accuracy"] != base["greedy_accuracy"]  # the adapter's weights are in use


def test_pass_k_above_samples_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match=r"--pass_k=\[8\]; expected each k in 1..--samples=4"):
        main(eval_args(tiny_model_dir, "--samples=4", "--pass_k=[8]"))


def test_eval_runs_the_episodes_and_reports_tool_use(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(__import__("os").path.dirname(__file__))
    result = main(
        eval_args(
            tiny_model_dir,
            "--samples=2",
            "--pass_k=[1]",
            '--data.episodes.tools=["lit_grpo.environments.builtin.calculator"]',
            "--data.prompt.max_length=400",
        )
    )
    assert result["turns_mean"] == 1.0 and result["tool_calls"] == 0.0  # a random model never calls
    assert "tool_calls" in capsys.readouterr().out.splitlines()[0]


class SecretScore:
    """An environment that scores each episode by its row's secret: above 0 for secrets above 5."""

    def reset(self, **row) -> None:
        self.secret = row["secret"]

    def guess(self, number: int) -> str:
        """Guesses the secret.

        Args:
            number: The guess.
        """
        return "no"

    def get_reward(self) -> float:
        return float(self.secret - 5)


def test_eval_reports_what_the_environment_scored(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(__import__("os").path.dirname(__file__))
    result = main(
        eval_args(
            tiny_model_dir,
            "--data.source.dataset=guess_number",
            '--data.episodes.environment={"class_path": "test_eval.SecretScore"}',
            "--data.rewards=[]",
            "--data.prompt.max_length=400",
            f"--transcripts={tmp_path / 'games.jsonl'}",
        )
    )
    rows = load_rows("guess_number", "train", None, 0, 12)[:4]  # the val rows
    secrets = [row["secret"] for row in rows]
    assert len(set(s > 5 for s in secrets)) == 2  # both kinds, so the share is neither 0 nor 1
    assert result["env_reward"] == pytest.approx(sum(s - 5 for s in secrets) / 4)
    assert result["env_success"] == pytest.approx(sum(s > 5 for s in secrets) / 4)
    assert "env_success" in capsys.readouterr().out.splitlines()[0]
    games = [json.loads(line) for line in (tmp_path / "games.jsonl").read_text().splitlines()]
    assert [g["prompt"] for g in games] == [row["prompt"] for row in rows]
    assert [g["columns"]["secret"] for g in games] == secrets
    assert [g["env_reward"] for g in games] == [float(s - 5) for s in secrets]
    assert all(g["set"] == "validation" and g["turns"][0]["role"] == "assistant" for g in games)
    assert games[0]["completion"] == next(m["content"] for m in reversed(games[0]["turns"]) if m["role"] == "assistant")


class ShapedSecret(SecretScore):
    """Rewards every episode above 0 (a shaping reward) and says itself which ones it counts as solved."""

    def reset(self, **row) -> None:
        super().reset(**row)
        self.solved = self.secret > 5

    def get_reward(self) -> float:
        return 0.1 + float(self.solved)


def test_env_success_reads_the_environments_solved_not_its_shaped_reward(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(__import__("os").path.dirname(__file__))
    result = main(
        eval_args(
            tiny_model_dir,
            "--data.source.dataset=guess_number",
            '--data.episodes.environment={"class_path": "test_eval.ShapedSecret"}',
            "--data.rewards=[]",
            "--data.prompt.max_length=400",
        )
    )
    secrets = [row["secret"] for row in load_rows("guess_number", "train", None, 0, 12)[:4]]
    assert 0 < sum(s > 5 for s in secrets) < 4  # every reward is > 0, yet not every game is solved
    assert result["env_success"] == pytest.approx(sum(s > 5 for s in secrets) / 4)
