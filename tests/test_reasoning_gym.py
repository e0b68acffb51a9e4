"""reasoning-gym as a data source and a reward: its generators' rows, scored by its own scorers."""

from __future__ import annotations

import pytest

pytest.importorskip("reasoning_gym", reason="needs the reasoning extra: pip install -e '.[reasoning]'")

from lit_grpo import LoraSpec, OnPolicyDataModule, PolicySpec, SamplingSpec  # noqa: E402
from lit_grpo.data.specs import HeldOutSpec, PromptSpec, SourceSpec
from lit_grpo.data.tasks import reasoning_gym  # noqa: E402
from lit_grpo.rewards import ReasoningGym  # noqa: E402
from lit_grpo.rewards.reasoning_gym import extract_answer  # noqa: E402

SUMS = {
    "name": "basic_arithmetic",
    "min_terms": 2,
    "max_terms": 2,
    "min_digits": 1,
    "max_digits": 2,
    "operators": ["+"],
    "allow_parentheses": False,
    "allow_negation": False,
}


def score(rows, completions):
    return ReasoningGym()(
        [r["prompt"] for r in rows],
        completions,
        answer=[r["answer"] for r in rows],
        metadata=[r["metadata"] for r in rows],
    )


def test_a_right_answer_scores_1_and_a_wrong_one_0_by_the_tasks_own_scorer():
    rows = reasoning_gym(4, seed=3, **SUMS) + reasoning_gym(2, seed=3, name="leg_counting")
    right = [f"<answer>{r['answer']}</answer>" for r in rows]
    wrong = [f"<answer>{int(r['answer']) + 1}</answer>" for r in rows]
    assert score(rows, right) == [1.0] * 6
    assert score(rows, wrong) == [0.0] * 6
    expression = rows[0]["metadata"]["expression"]
    assert rows[0]["prompt"].startswith("Calculate") and expression.count("+") == 1


def test_the_answer_is_read_from_closed_and_open_tags_or_the_last_line():
    assert extract_answer("think <answer>1</answer> then <answer> 12 </answer>") == "12"
    assert extract_answer("<answer>38\nThe answer is correct.") == "38"
    assert extract_answer("So it is\n38\n") == "38"
    assert extract_answer("<answer>5 + 33 = 38") == "38" and extract_answer("<answer>m = 62</answer>") == "62"


def test_an_unknown_task_names_the_close_ones_and_refused_options_name_ours():
    with pytest.raises(
        ValueError,
        match=r"data.source.task_args.name='chain_summ' is not a reasoning-gym task; close "
        r"ones: \['chain_sum', 'decimal_chain_sum'\]",
    ):
        reasoning_gym(4, seed=0, name="chain_summ")
    with pytest.raises(
        ValueError, match=r"data.source.task_args.size=9: reasoning-gym's size is data.source.train_size here"
    ):
        reasoning_gym(4, seed=0, name="chain_sum", size=9)
    with pytest.raises(ValueError, match=r"reasoning-gym refuses them"):
        reasoning_gym(4, seed=0, name="chain_sum", min_terms=5, max_terms=2)


def test_it_trains_with_held_out_slices_of_another_difficulty(tmp_path, tiny_model_dir):
    import lightning as L
    import torch

    from lit_grpo import GRPOModule

    data = OnPolicyDataModule(
        source=SourceSpec(dataset="reasoning_gym", task_args=SUMS, train_size=40),
        held_out=HeldOutSpec(size=4, slices={"3 digits": {"min_digits": 3, "max_digits": 3}}, reward=ReasoningGym()),
        prompts_per_epoch=2,
        batch_size=8,
        rewards=[ReasoningGym()],
        prompt=PromptSpec(completion_prefix="<answer>"),
        sampling=SamplingSpec(group_size=4, max_new_tokens=6),
    )
    module = GRPOModule(
        policy=PolicySpec(name_or_path=tiny_model_dir, lora=LoraSpec(r=4, alpha=8)),
        progress=False,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
    )
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        reload_dataloaders_every_n_epochs=1,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, data)
    assert {"val/accuracy", "val/3 digits/accuracy", "reward/reasoning_gym"} <= set(trainer.callback_metrics)
    assert all(len(str(int(r["answer"]))) >= 3 for r in data.val_slices["3 digits"])
