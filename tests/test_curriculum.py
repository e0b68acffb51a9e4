"""data.curriculum: training stages of a built-in task, trained in order, each shuffled within itself."""

from __future__ import annotations

import pytest

from lit_grpo.data.batches import EpochSampler
from lit_grpo.data.curriculum import Curriculum, Stage
from lit_grpo.data.preferences import PreferenceDataModule
from lit_grpo.data.reward_pairs import RewardDataModule
from lit_grpo.data.tasks import slip_kind

STAGES = [
    {"share": 0.4, "task_args": {"slips": ["off_by_1"]}},
    {"share": 0.4, "task_args": {"slips": ["off_by_10"]}},
    {},
]


def kinds(rows: list[dict]) -> set[str]:
    return {slip_kind(int(r["answer"]), int(r["rejected"].split("= ")[1])) for r in rows}


def data(cls=RewardDataModule, **kwargs):
    options = dict(source="arithmetic_preferences", task_args={"digits": 2, "ops": "+"}, train_size=40, val_size=8)
    module = cls(**{**options, **kwargs})
    module.setup("fit")
    return module


def test_each_stage_draws_its_own_slips_on_new_questions_and_the_held_out_pairs_stay():
    staged, plain = data(curriculum=STAGES), data()
    assert staged.curriculum.stages == [
        Stage(16, 16),
        Stage(16, 16),
        Stage(8, 8),
    ]  # the last takes the rest of train_size
    rows = staged.train_rows
    assert kinds(rows[:16]) == {"off_by_1"} and kinds(rows[16:32]) == {"off_by_10"}
    assert staged.val_rows == plain.val_rows  # held out as without a curriculum, every slip
    prompts = [r["prompt"] for r in rows + staged.val_rows]
    assert len(set(prompts)) == len(prompts) == 48  # no question twice, none held out


def test_an_epoch_goes_through_the_stages_in_order_and_resumes_inside_one():
    stages = [Stage(16, 16), Stage(16, 16), Stage(8, 8)]
    order = EpochSampler(range(40), 4, 1, 0, seed=0, start_batch=lambda epoch: 0, curriculum=Curriculum(stages))
    first = list(order)
    assert sorted(first[:16]) == list(range(16)) and sorted(first[16:32]) == list(range(16, 32))
    assert first[:16] != list(range(16))  # shuffled within the stage
    order.set_epoch(1)
    assert list(order) != first and sorted(list(order)[:16]) == list(range(16))  # a new shuffle each epoch
    order.set_epoch(0)
    resumed = EpochSampler(range(40), 4, 1, 0, seed=0, start_batch=lambda epoch: 3, curriculum=Curriculum(stages))
    assert list(resumed) == first[12:]  # 3 batches of 4 already trained
    ranks = [
        list(EpochSampler(range(40), 4, 2, rank, seed=0, start_batch=lambda e: 0, curriculum=Curriculum(stages)))
        for rank in (0, 1)
    ]
    assert sorted(ranks[0] + ranks[1]) == list(range(40))
    assert all(i < 16 for rank in ranks for i in rank[:8])  # both ranks train the first stage first


def test_dpo_batches_follow_the_stages_too():
    module = data(PreferenceDataModule, curriculum=STAGES)
    sampler = module.train_dataloader().sampler
    assert isinstance(sampler, EpochSampler) and [stage.rows for stage in sampler.curriculum.stages] == [16, 16, 8]
    first = list(sampler)
    sampler.set_epoch(1)
    second = list(sampler)
    assert first != second and all(sorted(o[:16]) == list(range(16)) for o in (first, second))
    assert data(PreferenceDataModule).train_dataloader().sampler.curriculum is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"source": "pairs.jsonl", "task_args": None}, "data.curriculum needs a built-in task"),
        (
            {"curriculum": [{"share": 0.8}, {"share": 0.4}, {}]},
            r"data.curriculum\[1\]=.* gets 16 of data.train_size=40",
        ),
        ({"curriculum": [{"share": 0.5}, {"share": 0.5}, {}]}, r"data.curriculum\[2\]=\{\} gets 0 of"),
        ({"curriculum": [{"task_args": {}}, {}]}, r"data.curriculum\[0\]=\{'task_args': \{\}\}; expected"),
        ({"curriculum": [{"share": 1.5}, {}]}, r"data.curriculum\[0\]=.*0 < share < 1"),
        ({"curriculum": [{"share": 0.5}, {"share": 0.5}]}, r"data.curriculum\[1\]=.*no share on the last stage"),
        ({"curriculum": [{"share": 0.5, "slips": ["off_by_1"]}, {}]}, r"data.curriculum\[0\]=.*expected"),
        (
            {"curriculum": [{"share": 0.2, "task_args": {"slips": ["off_by_2"]}}, {}]},
            r"data.curriculum\[0\]: arithmetic_preferences with .* slips=\['off_by_2'\]",
        ),
        ({"task_args": [{"digits": 2}, {"digits": 3}]}, "task_args as a mix"),
        (
            {"curriculum": [{"share": 0.5, "until": {"accuracy": 1.5, "pairs": 8}}, {}]},
            r"data.curriculum\[0\].until=\{'accuracy': 1.5, 'pairs': 8\}; expected \{accuracy: a, pairs: n\}",
        ),
        ({"curriculum": [{"share": 0.5, "until": {"accuracy": 0.9}}, {}]}, r"data.curriculum\[0\].until=.*expected"),
        (
            {"curriculum": [{"share": 0.5}, {"until": {"accuracy": 0.9, "pairs": 8}}]},
            r"data.curriculum\[1\].until=.*on a stage that has one after it",
        ),
    ],
)
def test_a_malformed_curriculum_is_refused_naming_the_stage(tmp_path, kwargs, message):
    if kwargs.get("source") == "pairs.jsonl":
        kwargs["source"] = str(tmp_path / "pairs.jsonl")
        (tmp_path / "pairs.jsonl").write_text('{"prompt": "q", "chosen": "a", "rejected": "b"}\n' * 60)
    with pytest.raises(ValueError, match=message):
        data(**{"curriculum": STAGES, **kwargs})


def test_a_stage_past_the_tasks_questions_goes_round_them_again_with_new_slips_never_the_held_out_ones():
    # 1-digit sums: 100 questions, 8 held out; 150 pairs in stage 0 and 50 in stage 1.
    module = data(task_args={"digits": 1, "ops": "+"}, train_size=200, curriculum=[{"share": 0.75}, {}])
    first, second = module.train_rows[:150], module.train_rows[150:]
    held_out = {r["prompt"] for r in module.val_rows}
    assert len(first) == 150 and len(second) == 50
    assert not held_out & {r["prompt"] for r in module.train_rows}
    assert len({r["prompt"] for r in first[:92]}) == 92  # every question once, then again
    assert {r["prompt"] for r in first[92:]} <= {r["prompt"] for r in first[:92]}
    again = {r["prompt"]: r["rejected"] for r in first[92:]}
    assert any(again[r["prompt"]] != r["rejected"] for r in first[:92] if r["prompt"] in again)  # new slips drawn


def test_a_stage_with_until_hands_the_rest_of_its_share_to_the_next_and_resumes_after_the_switch():
    stages = [Stage(16, 16, {"accuracy": 0.9, "pairs": 8}), Stage(24, 8)]  # stage 1 holds 16 rows in reserve
    staged = Curriculum(stages)
    sampler = EpochSampler(range(40), 4, 1, 0, seed=0, start_batch=lambda epoch: 0, curriculum=staged)
    assert len(sampler) == 24  # the budgets, not the reserve
    order = []
    for index in sampler:
        order.append(index)
        if len(order) == 8:  # two batches in, the stage ends: from the next batch built, stage 1
            staged.ends[0] = staged.built
    assert sorted(order[:8]) == sorted(set(order[:8])) and all(i < 16 for i in order[:8])
    assert all(i >= 16 for i in order[8:]) and len(order) == 24 and staged.batch_stages == [0, 0, 1, 1, 1, 1]
    straight = list(EpochSampler(range(40), 4, 1, 0, seed=0, start_batch=lambda e: 0, curriculum=Curriculum(stages)))
    assert straight[:8] == order[:8] and all(i < 16 for i in straight[:16])  # no end: the whole share
    resumed_stages = Curriculum(stages)
    resumed_stages.ends[0] = 2
    resumed = EpochSampler(range(40), 4, 1, 0, seed=0, start_batch=lambda e: 3, curriculum=resumed_stages)
    assert list(resumed) == order[12:]


def test_the_stage_ends_when_its_last_pairs_score_the_accuracy_asked():
    until = {"accuracy": 0.75, "pairs": 8}
    module = data(train_size=40, batch_size=4, curriculum=[{"share": 0.5, "until": until}, {}])
    assert module.curriculum.stages == [Stage(20, 20, until), Stage(40, 20)]
    loader = module.train_dataloader()
    accuracies, stages = iter([1.0, 0.25, 0.75, 1.0, 0.5, 0.5, 0.5]), []
    for _ in zip(loader.batch_sampler, range(7)):
        module.begin_batch()
        stages.append(module.batch_stage())
        module.end_batch(next(accuracies), 4)
    # batches 0-1 score 0.625, 1-2 0.5, 2-3 0.875: the stage ends after batch 3, the next batch built
    # (here batch 4: nothing is fetched ahead; Lightning's one batch ahead makes it batch 5) is stage 1's
    assert module.curriculum.ends == {0: 4} and stages == [0, 0, 0, 0, 1, 1, 1]
    state = module.state_dict()
    assert state["stage_ends"] == {0: 4} and state["trained"] == 7


def test_suffix_stages_trains_the_suffix_loss_in_those_stages_only(tiny_model_dir):
    import lightning as L
    import torch

    from lit_grpo.algorithms.reward_model import RewardModelModule
    from lit_grpo.model.policy import LoraSpec, PolicySpec

    L.seed_everything(0)
    module = RewardModelModule(
        policy=PolicySpec(name_or_path=tiny_model_dir, lora=LoraSpec(r=4, alpha=8)),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
        progress=False,
        suffix_weight=1.0,
        suffix_stages=[1],
    )
    pairs = data(train_size=16, batch_size=4, curriculum=[{"share": 0.5, "until": {"accuracy": 1.0, "pairs": 4}}, {}])
    weights = []
    original = module.suffix_weight

    def recorded() -> float:  # the weight of each training batch, beside its stage
        if module.training:
            weights.append((pairs.batch_stage(), original()))
        return original()

    module.suffix_weight = recorded
    L.Trainer(
        max_epochs=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    ).fit(module, pairs)
    assert [stage for stage, _ in weights] == pairs.curriculum.batch_stages and len(weights) == 4
    assert all(weight == (1.0 if stage == 1 else 0.0) for stage, weight in weights)
    assert 1 in pairs.curriculum.batch_stages and 0 in pairs.curriculum.batch_stages
    with pytest.raises(ValueError, match=r"model.suffix_stages=\[2\] names curriculum stages, and the data have 2"):
        bad = RewardModelModule(
            policy=PolicySpec(name_or_path=tiny_model_dir, lora=LoraSpec(r=4, alpha=8)),
            suffix_weight=1.0,
            suffix_stages=[2],
            progress=False,
        )
        L.Trainer(
            max_epochs=1,
            accelerator="cpu",
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        ).fit(bad, data(curriculum=STAGES[1:]))
    with pytest.raises(ValueError, match=r"model.suffix_stages=\[-1\]; expected a list"):
        RewardModelModule(suffix_stages=[-1])
