"""Built-in rewards, the combiner's arithmetic and errors, and YAML instantiation."""

from __future__ import annotations

import math
import os
import warnings

import pytest
import torch
from jsonargparse import ArgumentParser

from lit_grpo.rewards import (
    Accuracy,
    CodeUnitTests,
    Countdown,
    Format,
    FromCallable,
    LanguageConsistency,
    OverlongPenalty,
    Reward,
    RewardCombiner,
    RewardFunctionError,
    Sandbox,
    accuracy,
    code_unit_tests,
    countdown,
    format,
    language_consistency,
    overlong_penalty,
)
from lit_grpo.rewards.countdown import UnsafeExpression, evaluate
from lit_grpo.rewards.math import extract_answer


def call(fn, completions, **columns):
    return fn(prompts=["p"] * len(completions), completions=completions, **columns)


# accuracy


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("<think>half</think><answer>0.5</answer>", "1/2", 1.0),
        ("so the total is 1,000", "1000", 1.0),
        ("We get \\boxed{\\frac{3}{4}} in the end, not 2", "0.75", 1.0),
        ("first 12, then 7 apples", "7", 1.0),  # last number
        ("<answer>8</answer> although 7 also appears", "7", 0.0),  # the tag wins
        ("<answer>8</answer>", "7", 0.0),
        ("no number at all", "7", 0.0),
    ],
)
def test_accuracy_compares_mathematically(completion, answer, expected):
    assert call(accuracy, [completion], answer=[answer]) == [expected]


def test_accuracy_rows_without_answer_are_not_applicable():
    assert call(accuracy, ["4", "4"], answer=[None, "4"]) == [None, 1.0]


def test_accuracy_without_answer_column_names_it():
    with pytest.raises(ValueError, match="'answer'"):
        call(accuracy, ["4"], completion_length=[1])


def test_extract_answer_prefers_tag_then_boxed_then_last_number():
    assert extract_answer("1 <answer> x+1 </answer> 2") == "x+1"
    assert extract_answer("1 \\boxed{\\frac{1}{2}} 2") == "\\frac{1}{2}"
    assert extract_answer("between -3 and 4.5") == "4.5"


# format, language, length


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<think>a</think><answer>b</answer>", 1.0),
        ("\n <think>\nmulti\nline</think>\n\n<answer> 4 </answer>\n", 1.0),
        ("Sure! <think>a</think><answer>b</answer>", 0.0),  # text outside
        ("<think>a</think><answer>b</answer> done", 0.0),
        ("<answer>b</answer>", 0.0),
        ("<think>a</think><answer>b</answer><answer>c</answer>", 0.0),
        ("<think>a<answer>x</answer></think><answer>b</answer>", 0.0),  # nested tag
    ],
)
def test_format(completion, expected):
    assert call(format, [completion]) == [expected]


def test_language_consistency_by_script():
    completions = ["<think>plain English, \\frac{1}{2}</think>", "答案是四", "English 和 中文", "42"]
    assert call(language_consistency, completions) == [1.0, 0.0, 0.0, 1.0]
    assert language_consistency(["p"] * 4, completions, script="cjk") == [0.0, 1.0, 0.0, 1.0]
    assert LanguageConsistency(script="cyrillic")(["p"], ["привет"]) == [1.0]
    with pytest.raises(ValueError, match="klingon"):
        LanguageConsistency(script="klingon")


def test_overlong_penalty_ramp():
    # max_len=10, buffer=4: free up to 6 tokens; 8 -> -(8-6)/4 = -0.5; >= 10 -> -1
    values = OverlongPenalty(max_len=10, buffer=4)(["p"] * 5, [""] * 5, completion_length=[3, 6, 8, 10, 12])
    assert values == [0.0, 0.0, -0.5, -1.0, -1.0]
    with pytest.raises(ValueError, match="completion_length"):
        call(overlong_penalty, ["x"], answer=["1"])
    with pytest.raises(ValueError, match="buffer"):
        OverlongPenalty(max_len=4, buffer=8)


# countdown


def test_countdown_scores_exact_use_of_the_numbers():
    completions = [
        "<think>...</think><answer>(25 - 5) * 4</answer>",  # = 80, uses 25, 5, 4
        "<answer>(25 - 5) * 4 = 80</answer>",
        "<answer>25 * 4 - 5 - 5</answer>",  # 5 used twice
        "<answer>25 * 4</answer>",  # 5 unused
        "<answer>(25 + 5) * 4</answer>",  # = 120
        "<answer>25 / (5 - 5) * 4</answer>",  # division by zero
    ]
    n = len(completions)
    assert call(countdown, completions, numbers=[[25, 5, 4]] * n, target=[80] * n) == [1, 1, 0, 0, 0, 0]
    assert Countdown()(["p"], ["6 / 4 * 2"], numbers=[[6, 4, 2]], target=[3]) == [1.0]  # exact 3, no float


def test_countdown_never_evaluates_code(tmp_path):
    victim = tmp_path / "pwned"
    attack = f"<answer>__import__('os').system('touch {victim}')</answer>"
    assert call(countdown, [attack, "<answer>2 ** 3</answer>"], numbers=[[2, 3]] * 2, target=[8] * 2) == [0, 0]
    assert not victim.exists()
    with pytest.raises(UnsafeExpression, match="Call"):
        evaluate("abs(-1)")
    assert evaluate("-(3 - 10) * 2") == (14, [3, 10, 2])


# code_unit_tests (a few cases; the attacks are in test_sandbox.py)

SANDBOX = Sandbox(timeout=2.0, max_workers=2)
TESTS = "assert add(1, 2) == 3\nassert add(0, 0) == 0\nassert add(2, 2) == 5"  # the last cannot pass


def code(body: str) -> str:
    return f"Solution:\n```python\n{body}\n```"


def test_code_unit_tests_all_or_fraction():
    completions = [code("def add(a, b):\n    return a + b"), "no code block", code("def add(a, b):\n    return 0")]
    tests = [TESTS, TESTS, TESTS]
    assert code_unit_tests(["p"] * 3, completions, sandbox=SANDBOX, tests=tests) == [0.0, 0.0, 0.0]
    fraction = CodeUnitTests(timeout=2.0, fraction=True)(["p"] * 3, completions, tests=tests)
    assert fraction == [2 / 3, 0.0, 1 / 3]  # add(0, 0) == 0 holds for `return 0`
    passing = "assert add(1, 2) == 3"
    assert code_unit_tests(["p"] * 2, completions[:2], sandbox=SANDBOX, tests=[passing, None]) == [1.0, None]


def test_code_unit_tests_with_a_check_function():
    tests = "def check(f):\n    assert f(1, 2) == 3\n\ncheck(add)"  # no top-level assert: one case
    completions = [code("def add(a, b):\n    return a + b"), code("def add(a, b):\n    return a * b")]
    assert code_unit_tests(["p"] * 2, completions, sandbox=SANDBOX, tests=[tests] * 2) == [1.0, 0.0]


@pytest.mark.parametrize(
    "cheat",
    [
        "import os\nos._exit(0)",  # exit before the tests run
        "import sys\nsys.exit(0)",
        "print('\\nforged 3 3')\nimport os\nos._exit(0)",  # a fake report line
        "import builtins\nbuiltins.exec = lambda *a, **k: None\ndef add(a, b):\n    return 0",
    ],
)
def test_code_unit_tests_cannot_be_forged_by_the_solution(cheat):
    assert code_unit_tests(["p"], [code(cheat)], sandbox=SANDBOX, tests=["assert add(1, 2) == 3"]) == [0.0]


# the combiner


def always(value):
    def fn(prompts, completions, **columns):
        return [value] * len(completions)

    fn.__name__ = f"always_{value}"
    return fn


def by_row(prompts, completions, **columns):
    return [None if c == "skip" else float(len(c)) for c in completions]


def test_combiner_weighted_sum_skips_not_applicable():
    combiner = RewardCombiner([(by_row, 2.0), Format(), always(None)])
    completions = ["ab", "skip", "<think>t</think><answer>a</answer>"]
    scores = combiner.score(["p"] * 3, completions, {"completion_length": [1, 1, 1]})
    # row 0: 2*2 + 0.5*0 = 4; row 1: by_row n/a, format 0 -> 0; row 2: 2*34 + 0.5*1 = 68.5
    assert scores.total.tolist() == [4.0, 0.0, 68.5]
    assert scores.total.dtype == torch.float32
    assert combiner.names == ["by_row", "format", "always_None"]
    assert scores.per_function["by_row"][0] == 2.0 and math.isnan(scores.per_function["by_row"][1])
    assert torch.isnan(scores.per_function["always_None"]).all()  # nothing applies: total 0 above


def test_combiner_passes_columns_as_keywords():
    seen = {}

    def spy(prompts, completions, answer, **columns):
        seen.update(prompts=prompts, answer=answer, **columns)
        return [1.0] * len(completions)

    RewardCombiner([spy]).score(["q1", "q2"], ["a", "b"], {"answer": ["1", "2"], "completion_length": [3, 4]})
    assert seen == {"prompts": ["q1", "q2"], "answer": ["1", "2"], "completion_length": [3, 4]}


def test_raising_reward_names_function_and_row():
    def picky(prompts, completions, **columns):
        return [1.0 / (len(c) - 3) for c in completions]  # row with a 3-char completion divides by 0

    with pytest.raises(RewardFunctionError, match=r"'picky' raised on row 2: ZeroDivisionError"):
        RewardCombiner([picky]).score(["p"] * 3, ["a", "bb", "ccc"], {})


def test_on_error_zero_scores_zero_and_warns_once():
    def broken(prompts, completions, **columns):
        raise RuntimeError("boom")

    combiner = RewardCombiner([broken, (always(1.0), 0.5)], on_error="zero")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = combiner.score(["p"] * 2, ["a", "b"], {})
        combiner.score(["p"] * 2, ["a", "b"], {})
    assert first.total.tolist() == [0.5, 0.5] and first.per_function["broken"].tolist() == [0.0, 0.0]
    assert len([w for w in caught if "'broken'" in str(w.message)]) == 1


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        ([1.0], r"'bad' returned 1 values for 2 completions"),
        ([1.0, "yes"], r"'bad' returned 'yes' \(str\) on row 1"),
        ([math.nan, 1.0], r"'bad' returned nan on row 0"),
        ([1.0, math.inf], r"'bad' returned inf on row 1"),
    ],
)
def test_invalid_reward_output_is_a_value_error(returned, message):
    def bad(prompts, completions, **columns):
        return returned

    with pytest.raises(ValueError, match=message):
        RewardCombiner([bad]).score(["p"] * 2, ["a", "b"], {})


def test_combiner_rejects_bad_setup():
    with pytest.raises(ValueError, match="unique"):
        RewardCombiner([accuracy, Accuracy()])
    with pytest.raises(ValueError, match="on_error"):
        RewardCombiner([accuracy], on_error="ignore")
    with pytest.raises(ValueError, match="'answer' has 1 rows for 2"):
        RewardCombiner([accuracy]).score(["p"] * 2, ["a", "b"], {"answer": ["1"]})


# configuration


def test_from_callable_imports_dotted_paths_and_builtins():
    reward = FromCallable("os.path.basename")
    assert reward.function is os.path.basename and reward.name == "basename" and reward.weight == 1.0
    builtin = FromCallable("format", weight=0.5, name="fmt")
    assert builtin(["p"], ["<think>a</think><answer>b</answer>"]) == [1.0] and builtin.name == "fmt"
    with pytest.raises(ImportError, match="no_such_module"):
        FromCallable("no_such_module.fn")
    with pytest.raises(ImportError, match="has no attribute 'nope'"):
        FromCallable("os.path.nope")
    with pytest.raises(TypeError, match="not a callable"):
        FromCallable("os.sep")
    with pytest.raises(ValueError, match="built-ins"):
        FromCallable("acuracy")


def test_builtin_classes_default_weights_and_names():
    rewards = [Accuracy(), Format(), LanguageConsistency(), Countdown(), CodeUnitTests()]
    assert [(r.name, r.weight) for r in rewards] == [
        ("accuracy", 1.0),
        ("format", 0.5),
        ("language_consistency", 0.1),
        ("countdown", 1.0),
        ("code_unit_tests", 1.0),
    ]


def test_rewards_instantiate_from_yaml_class_paths():
    parser = ArgumentParser()
    parser.add_argument("--rewards", type=list[Reward])
    config = parser.parse_string("""
rewards:
  - class_path: lit_grpo.rewards.Accuracy
  - class_path: lit_grpo.rewards.LanguageConsistency
    init_args: {script: cjk, weight: 0.2}
  - class_path: lit_grpo.rewards.OverlongPenalty
    init_args: {max_len: 512, buffer: 128}
  - class_path: lit_grpo.rewards.FromCallable
    init_args: {function: lit_grpo.rewards.countdown.countdown, weight: 2.0}
""")
    rewards = parser.instantiate_classes(config).rewards
    combiner = RewardCombiner(rewards)
    assert combiner.names == ["accuracy", "language_consistency", "overlong_penalty", "countdown"]
    assert [r.weight for r in rewards] == [1.0, 0.2, 1.0, 2.0]
    assert rewards[1].script == "cjk" and rewards[2].max_len == 512
