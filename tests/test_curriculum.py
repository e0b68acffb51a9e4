"""data.curriculum: training stages of a built-in task, trained in order, each shuffled within itself."""

from __future__ import annotations

import pytest

from lit_grpo.data.batches import EpochSampler
from lit_grpo.data.preferences import PreferenceDataModule
from lit_grpo.data.reward_pairs import RewardDataModule
from lit_grpo.data.tasks import slip_kind

STAGES = [{"share": 0.4, "task_args": {"slips": ["off_by_1"]}}, {"share": 0.4, "task_args": {"slips": ["off_by_10"]}},
          {}]


def kinds(rows: list[dict]) -> set[str]:
    return {slip_kind(int(r["answer"]), int(r["rejected"].split("= ")[1])) for r in rows}


def data(cls=RewardDataModule, **kwargs):
    options = dict(source="arithmetic_preferences", task_args={"digits": 2, "ops": "+"}, train_size=40, val_size=8)
    module = cls(**{**options, **kwargs})
    module.setup("fit")
    return module


def test_each_stage_draws_its_own_slips_on_new_questions_and_the_held_out_pairs_stay():
    staged, plain = data(curriculum=STAGES), data()
    assert staged.stage_sizes == [16, 16, 8]  # the last stage takes the rest of train_size
    rows = staged.train_rows
    assert kinds(rows[:16]) == {"off_by_1"} and kinds(rows[16:32]) == {"off_by_10"}
    assert staged.val_rows == plain.val_rows  # held out as without a curriculum, every slip
    prompts = [r["prompt"] for r in rows + staged.val_rows]
    assert len(set(prompts)) == len(prompts) == 48  # no question twice, none held out


def test_an_epoch_goes_through_the_stages_in_order_and_resumes_inside_one():
    stages = [16, 16, 8]
    order = EpochSampler(range(40), 4, 1, 0, seed=0, start_batch=lambda epoch: 0, stages=stages)
    first = list(order)
    assert sorted(first[:16]) == list(range(16)) and sorted(first[16:32]) == list(range(16, 32))
    assert first[:16] != list(range(16))  # shuffled within the stage
    order.set_epoch(1)
    assert list(order) != first and sorted(list(order)[:16]) == list(range(16))  # a new shuffle each epoch
    order.set_epoch(0)
    resumed = EpochSampler(range(40), 4, 1, 0, seed=0, start_batch=lambda epoch: 3, stages=stages)
    assert list(resumed) == first[12:]  # 3 batches of 4 already trained
    ranks = [list(EpochSampler(range(40), 4, 2, rank, seed=0, start_batch=lambda e: 0, stages=stages))
             for rank in (0, 1)]
    assert sorted(ranks[0] + ranks[1]) == list(range(40))
    assert all(i < 16 for rank in ranks for i in rank[:8])  # both ranks train the first stage first


def test_dpo_batches_follow_the_stages_too():
    module = data(PreferenceDataModule, curriculum=STAGES)
    sampler = module.train_dataloader().sampler
    assert isinstance(sampler, EpochSampler) and sampler.stages == [16, 16, 8]
    first = list(sampler)
    sampler.set_epoch(1)
    second = list(sampler)
    assert first != second and all(sorted(o[:16]) == list(range(16)) for o in (first, second))
    assert data(PreferenceDataModule).train_dataloader().sampler.stages is None


@pytest.mark.parametrize("kwargs, message", [
    ({"source": "pairs.jsonl", "task_args": None}, "data.curriculum needs a built-in task"),
    ({"curriculum": [{"share": 0.8}, {"share": 0.4}, {}]}, r"data.curriculum\[1\]=.* gets 16 of data.train_size=40"),
    ({"curriculum": [{"share": 0.5}, {"share": 0.5}, {}]}, r"data.curriculum\[2\]=\{\} gets 0 of"),
    ({"curriculum": [{"task_args": {}}, {}]}, r"data.curriculum\[0\]=\{'task_args': \{\}\}; expected"),
    ({"curriculum": [{"share": 1.5}, {}]}, r"data.curriculum\[0\]=.*0 < share < 1"),
    ({"curriculum": [{"share": 0.5}, {"share": 0.5}]}, r"data.curriculum\[1\]=.*no share on the last stage"),
    ({"curriculum": [{"share": 0.5, "slips": ["off_by_1"]}, {}]}, r"data.curriculum\[0\]=.*expected"),
    ({"curriculum": [{"share": 0.2, "task_args": {"slips": ["off_by_2"]}}, {}]},
     r"data.curriculum\[0\]: arithmetic_preferences with .* slips=\['off_by_2'\]"),
    ({"task_args": [{"digits": 2}, {"digits": 3}]}, "task_args as a mix"),
])
def test_a_malformed_curriculum_is_refused_naming_the_stage(tmp_path, kwargs, message):
    if kwargs.get("source") == "pairs.jsonl":
        kwargs["source"] = str(tmp_path / "pairs.jsonl")
        (tmp_path / "pairs.jsonl").write_text('{"prompt": "q", "chosen": "a", "rejected": "b"}\n' * 60)
    with pytest.raises(ValueError, match=message):
        data(**{"curriculum": STAGES, **kwargs})
