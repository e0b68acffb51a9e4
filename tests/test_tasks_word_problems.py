"""The word_problems task, and the GSM8K path it mirrors.

Answers are recomputed twice, each time with the test's own arithmetic:
from the recorded chain (``start``, ``steps``), and from the question text
itself (each sentence matched to its phrasing, the numbers read back out).
The GSM8K path runs on a small parquet file with GSM8K's schema, loaded as
``configs/gsm8k_qlora.yaml`` loads the real one.
"""

from __future__ import annotations

import operator
import re
import string
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from lit_grpo.data import word_problems as wp
from lit_grpo.data.grpo import OnPolicyDataModule
from lit_grpo.data.specs import HeldOutSpec, PromptSpec, SourceSpec
from lit_grpo.data.tasks import TASKS
from lit_grpo.rewards import Accuracy

CONFIGS = Path(__file__).parent.parent / "configs"
KNOBS = [
    {},
    {"min_steps": 3, "max_steps": 3, "max_value": 50, "ops": "+-"},
    {"min_steps": 2, "max_steps": 5, "max_value": 200, "ops": "*/", "max_factor": 3},
    {"min_steps": 12, "max_steps": 20, "max_value": 1000},  # more people than names
]
# The test's own arithmetic: division must be exact, so it is checked, not floored.
ARITHMETIC = {"+": operator.add, "-": operator.sub, "*": operator.mul}
WORDS = {
    "twice": 2,
    "three times": 3,
    "four times": 4,
    "half": 2,
    "a third": 3,
    "a quarter": 4,
    "a fifth": 5,
    "a sixth": 6,
    "a seventh": 7,
    "an eighth": 8,
    "a ninth": 9,
    "a tenth": 10,
}
PERSON, OBJECT = f"(?:{'|'.join(wp.NAMES)})", f"(?:{'|'.join(wp.ITEMS)})"
TIMES = "|".join([*(w for w in WORDS if w.endswith(("twice", "times"))), r"\d+ times"])
FRACTION = "|".join([*(w for w in WORDS if not w.endswith(("twice", "times"))), r"1/\d+"])
FIELDS = {
    "n": r"(?P<n>\d+)",
    "start": r"(?P<start>\d+)",
    "times": f"(?P<times>{TIMES})",
    "fraction": f"(?P<fraction>{FRACTION})",
    "name": PERSON,
    "new": PERSON,
    "friend": PERSON,
    "items": OBJECT,
}


def settings(knobs: dict) -> dict:
    return {"min_steps": 2, "max_steps": 4, "max_value": 100, "ops": "+-*/", "max_factor": 5, **knobs}


def apply(op: str, value: int, operand: int) -> int:
    if op == "/":
        assert value % operand == 0, f"{value} / {operand} is not an integer"
        return value // operand
    return ARITHMETIC[op](value, operand)


def final_answer(row: dict) -> int:
    last = row["answer"].splitlines()[-1]
    assert re.fullmatch(r"#### \d+", last), last  # GSM8K's answer line, a non-negative integer
    assert row["answer"].count("####") == 1
    return int(last[5:])


def pattern(template: str) -> re.Pattern:
    """A template as a regex: numbers captured, names and objects from the generator's lists."""
    parts = [
        re.escape(literal) + (FIELDS[field] if field else "")
        for literal, field, _, _ in string.Formatter().parse(template)
    ]
    return re.compile("".join(parts))


def number(match: re.Match) -> int:
    fields = match.groupdict()
    if fields.get("n"):
        return int(fields["n"])
    word = fields.get("times") or fields.get("fraction")
    return WORDS.get(word) or int(re.fullmatch(r"(?:1/)?(\d+)(?: times)?", word).group(1))


def only_match(sentence: str, templates: dict[tuple[str, str], re.Pattern]) -> tuple[tuple[str, str], re.Match]:
    found = [(key, m) for key, p in templates.items() if (m := p.fullmatch(sentence))]
    assert len(found) == 1, f"{sentence!r} matches {[key for key, _ in found]}"
    return found[0]


STARTS = {("start", t): pattern(t) for t in (*wp.STARTS, wp.GROUPS)}
STEPS = {(op, t): pattern(t) for op, templates in wp.TEMPLATES.items() for t in templates}
QUESTIONS = {("question", t): pattern(t) for t in wp.QUESTIONS}


def read_text(prompt: str) -> tuple[list[tuple[str, str]], int, list[tuple[str, int]]]:
    """The templates a question used, its start value and its steps, read back from the words alone."""
    sentences = re.split(r"(?<=[.?]) ", prompt)
    (_, first), start = only_match(sentences[0], STARTS)
    steps = []
    if first == wp.GROUPS:  # "3 bags with 4 in each": start 3, then * 4
        steps.append(("*", int(start["n"])))
        start_value = int(start["start"])
    else:
        start_value = int(start["n"])
    used = [("start", first)]
    for sentence in sentences[1:-1]:
        (op, template), match = only_match(sentence, STEPS)
        used.append((op, template))
        steps.append((op, number(match)))
    used.append(only_match(sentences[-1], QUESTIONS)[0])
    return used, start_value, steps


@pytest.mark.parametrize("knobs", KNOBS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()) or "defaults")
def test_answers_recompute_from_the_chain_and_from_the_text(knobs):
    s = settings(knobs)
    for seed in range(25):
        for row in wp.word_problems(40, seed=seed, **knobs):
            answer = final_answer(row)
            assert s["min_steps"] <= len(row["steps"]) <= s["max_steps"]
            value = row["start"]
            assert 1 <= value <= s["max_value"]
            for step in row["steps"]:
                op, operand = step.split(" ")
                assert op in s["ops"] and (op in "+-" or 2 <= int(operand) <= s["max_factor"])
                value = apply(op, value, int(operand))
                assert 1 <= value <= s["max_value"]
            assert value == answer, row
            _, start, steps = read_text(row["prompt"])
            assert (start, steps) == (row["start"], [(step[0], int(step[2:])) for step in row["steps"]])


def test_worked_lines_chain_to_the_answer():
    for row in wp.word_problems(300, seed=7):
        lines = row["answer"].splitlines()[:-1]
        value = row["start"]
        assert len(lines) == len(row["steps"])
        for line, step in zip(lines, row["steps"]):
            a, op, b, result = re.search(r"(\d+) ([-+*/]) (\d+) = (\d+) ", line).groups()
            # Each line starts from the previous result and states its own result right.
            assert (int(a), f"{op} {b}") == (value, step)
            value = apply(op, value, int(b))
            assert int(result) == value
        assert value == final_answer(row)


def test_the_same_seed_gives_the_same_rows():
    assert wp.word_problems(50, seed=3) == wp.word_problems(50, seed=3)
    assert wp.word_problems(50, seed=3, max_steps=3) == wp.word_problems(50, seed=3, max_steps=3)
    a, b = wp.word_problems(50, seed=3), wp.word_problems(50, seed=4)
    assert not {r["prompt"] for r in a} & {r["prompt"] for r in b}
    assert len({r["prompt"] for r in wp.word_problems(500, seed=0)}) == 500  # distinct rows


def test_the_phrasing_varies():
    rows = wp.word_problems(200, seed=0)
    used = Counter(key for row in rows for key in read_text(row["prompt"])[0])
    # Every phrasing, and every start and question, appears (16 step phrasings in all).
    every = {*STARTS, *STEPS, *QUESTIONS}
    assert set(used) == every, every - set(used)
    assert all(any(f" {item}" in r["prompt"] for r in rows) for item in wp.ITEMS)
    assert all(any(name in r["prompt"] for r in rows) for name in wp.NAMES)
    assert Counter(len(r["steps"]) for r in rows).keys() == {2, 3, 4}


def test_no_one_is_compared_with_or_gives_to_themselves():
    for row in wp.word_problems(100, seed=0, min_steps=40, max_steps=60, max_value=1000):  # names run out
        assert not re.search(rf"({PERSON}) has [^.]* (?:than|as) \1\.", row["prompt"]), row["prompt"]
        assert not re.search(rf"({PERSON}) gives \d+ \w+ to \1\.", row["prompt"]), row["prompt"]
        assert not re.search(rf"({PERSON}) gives \1 ", row["prompt"]), row["prompt"]


def test_it_is_a_built_in_task():
    assert TASKS["word_problems"] is wp.word_problems


@pytest.mark.parametrize(
    "knobs, field",
    [
        ({"min_steps": 0}, "min_steps=0"),
        ({"min_steps": 3, "max_steps": 2}, "min_steps=3, max_steps=2"),
        ({"ops": "+%"}, "ops='+%'"),
        ({"ops": ""}, "ops=''"),
        ({"max_factor": 1}, "max_factor=1"),
        ({"max_value": 5}, "max_value=5"),
    ],
)
def test_bad_knobs_name_the_field(knobs, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        wp.word_problems(5, seed=0, **knobs)


def test_knobs_no_problem_satisfies_are_an_error_not_a_hang():
    # Four halvings need a start divisible by 16, and no start is above 10.
    with pytest.raises(ValueError, match=r"found only 0 of n=5 distinct problems with min_steps=4"):
        wp.word_problems(5, seed=0, min_steps=4, max_steps=4, max_value=10, ops="/", max_factor=2)


def score(rows: list[dict], answers: list) -> list[float | None]:
    completions = [f"<think>Step by step.</think><answer>{a}</answer>" for a in answers]
    return Accuracy()([r["prompt"] for r in rows], completions, answer=[r["answer"] for r in rows])


def test_word_problems_load_and_score_through_the_data_module():
    datamodule = OnPolicyDataModule(
        source=SourceSpec(dataset="word_problems", task_args={"max_steps": 3}, train_size=20),
        held_out=HeldOutSpec(size=4),
        rewards=[Accuracy()],
    )
    datamodule.setup("fit")
    rows = datamodule.train_rows[:10]
    assert len(datamodule.train_rows) == 20 and len(datamodule.val_rows) == 4
    assert {r["prompt"] for r in datamodule.train_rows}.isdisjoint(r["prompt"] for r in datamodule.val_rows)
    assert all(len(r["steps"]) <= 3 for r in datamodule.train_rows)
    answers = [final_answer(r) for r in rows]
    assert score(rows, answers) == [1.0] * 10
    assert score(rows, [a + 1 for a in answers]) == [0.0] * 10
    # A bare number, as a model without the tags may answer, is also read.
    bare = Accuracy()([rows[0]["prompt"]], [f"So the answer is {answers[0]}."], answer=[rows[0]["answer"]])
    assert bare == [1.0]


# GSM8K's schema and answer style: worked lines with <<calculator>> notes and $ amounts, then "#### N".
GSM8K_ROWS = [
    {
        "question": "Tom picks 12 apples and buys 3 bags of 5 more. How many apples does he have?",
        "answer": "The bags hold 3 * 5 = <<3*5=15>>15 apples.\nHe has 12 + 15 = <<12+15=27>>27 apples.\n#### 27",
    },
    {
        "question": "A pen costs $4. Mia buys 6 pens and pays with $50. How much change does she get?",
        "answer": "The pens cost 6 * $4 = $<<6*4=24>>24.\nHer change is $50 - $24 = $<<50-24=26>>26.\n#### 26",
    },
    {
        "question": "A farm has 1,200 hens and sells half. How many hens are left?",
        "answer": "It sells 1,200 / 2 = <<1200/2=600>>600 hens.\nLeft: 1,200 - 600 = <<1200-600=600>>600.\n#### 600",
    },
    {
        "question": "Sam reads 15 pages a day for 4 days, then 10 more. How many pages in all?",
        "answer": "15 * 4 = <<15*4=60>>60 pages in 4 days.\n60 + 10 = <<60+10=70>>70.\n#### 70",
    },
    {
        "question": "Lena has 3 boxes of 8 crayons and gives away 5. How many crayons remain?",
        "answer": "She has 3 * 8 = <<3*8=24>>24 crayons.\n24 - 5 = <<24-5=19>>19 remain.\n#### 19",
    },
]


def test_a_gsm8k_schema_parquet_loads_and_scores(tmp_path):
    path = tmp_path / "gsm8k_train.parquet"
    pq.write_table(pa.Table.from_pylist(GSM8K_ROWS), path)
    data = yaml.safe_load((CONFIGS / "gsm8k_qlora.yaml").read_text())["data"]
    source = data["source"]
    assert source["dataset"] == "openai/gsm8k:main" and source["columns"] == {"prompt": "question", "answer": "answer"}
    datamodule = OnPolicyDataModule(
        source=SourceSpec(dataset=str(path), columns=source["columns"], train_size=4),
        held_out=HeldOutSpec(size=1),
        prompt=PromptSpec(**data["prompt"]),
        rewards=[Accuracy()],
    )
    datamodule.setup("fit")
    rows = datamodule.val_rows + datamodule.train_rows
    assert [(r["prompt"], r["answer"]) for r in rows] == [(r["question"], r["answer"]) for r in GSM8K_ROWS]
    answers = [int(r["answer"].rsplit("#### ", 1)[1]) for r in GSM8K_ROWS]
    # The gold is the "#### N" number, not one of the worked lines' numbers before it.
    assert score(rows, answers) == [1.0] * 5
    assert score(rows, [a + 1 for a in answers]) == [0.0] * 5
    assert score(rows, [15, 24, 1200, 60, 24]) == [0.0] * 5


def test_the_reasoning_config_scores_a_worked_answer():
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(OnPolicyDataModule, "data")
    config = yaml.safe_load((CONFIGS / "reasoning.yaml").read_text())
    datamodule = parser.instantiate_classes(parser.parse_object({"data": config["data"]})).data
    datamodule.setup("fit")
    rows = datamodule.train_rows[:2]
    assert datamodule.hparams.dynamic_sampling and datamodule.sampling.max_new_tokens == 256
    assert [fn.max_len for _, fn, _ in datamodule.rewards.entries if hasattr(fn, "max_len")] == [256]
    worked = [f"<think>{r['answer'].rsplit(chr(10), 1)[0]}</think>\n<answer>{final_answer(r)}</answer>" for r in rows]
    columns = {"answer": [r["answer"] for r in rows] * 2, "completion_length": [40, 40, 256, 256]}
    scores = datamodule.rewards.score([r["prompt"] for r in rows] * 2, worked + ["The answer is 0."] * 2, columns)
    # accuracy 1 + format 0.5 + latin 0.1 + no length penalty; then 0 + 0 + 0.1 - 1 at the length limit
    assert scores.total.tolist() == pytest.approx([1.6, 1.6, -0.9, -0.9])
