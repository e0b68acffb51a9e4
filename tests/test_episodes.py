"""Episodes on a tiny random Llama: the two masks, the turn loop and its KV-cache continuation.

A random model never writes a real tool call, so the calls here are scripted
by a call format whose ``stop`` is a token the model does emit; everything
else (the decode loop, the tools, the log-prob passes, the objective) is the
real code.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from lit_grpo.data.buffer import _trim
from lit_grpo.environments import Toolbox, ToolCall, ToolResult
from lit_grpo.generation.episodes import EpisodePlan
from lit_grpo.generation.rollout import SamplingSpec, encode_prompts, generate
from lit_grpo.model.logprob_passes import completion_logprobs
from lit_grpo.objectives import grpo_loss


def echo(text: str) -> str:
    """Repeats the text.

    Args:
        text: What to repeat.
    """
    return f"echo {text}"


class Scripted:
    """A call format whose turns end at ``stop`` (a text the model writes) and always call ``echo``."""

    def __init__(self, stop: str, result: str = " [tool says: hi] ") -> None:
        self.stop, self.result = stop, result

    def parse(self, text: str):
        return [ToolCall("echo", {"text": "hi"})] if self.stop in text else []

    def system_prompt(self, tokenizer, messages, tools):
        return list(messages)

    def results_text(self, tokenizer, results: list[ToolResult]) -> str:
        return self.result + " ".join(r.content for r in results)


@pytest.fixture()
def tiny(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    return model, tokenizer


def prompts(tokenizer):
    return encode_prompts(tokenizer, ["What is 3 + 4?", "Reach 24 with 2, 3 and 4, each used once."], None)


def spec(fmt, rows, max_turns=3, cap=40):
    return EpisodePlan([Toolbox([echo])] * rows, fmt, max_turns, cap)


def lora(model):
    torch.manual_seed(0)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))


@pytest.mark.parametrize("greedy", [True, False])
def test_an_episode_without_a_call_is_the_single_turn_rollout_token_for_token(tiny, greedy):
    model, tokenizer = tiny
    ids, mask = prompts(tokenizer)
    sampling = SamplingSpec(group_size=3, max_new_tokens=12)
    torch.manual_seed(1)
    single = generate(model, tokenizer, ids, mask, sampling, greedy=greedy)
    torch.manual_seed(1)
    rows = len(single.texts)
    episode = generate(
        model, tokenizer, ids, mask, sampling, greedy=greedy, episodes=spec(Scripted("\x00never written\x00"), rows)
    )
    width = single.completion_ids.shape[1]
    assert torch.equal(episode.completion_ids[:, :width], single.completion_ids)
    assert torch.equal(episode.completion_mask[:, :width], single.completion_mask)
    assert torch.equal(episode.completion_attention, episode.completion_mask)  # no tool token anywhere
    assert torch.equal(episode.truncated, single.truncated)
    assert episode.texts == single.texts
    if not greedy:
        assert torch.equal(episode.logprobs[:, :width], single.logprobs)
    assert all(r.turns == 1 and r.tool_calls == 0 for r in episode.episodes)


@pytest.mark.parametrize("adapter", [False, True], ids=["lean-step", "model-forward"])
def test_tool_tokens_are_attended_not_sampled_and_the_cache_continues_as_a_re_read_would(tiny, adapter):
    model, tokenizer = tiny
    model = lora(model).eval() if adapter else model
    ids, mask = prompts(tokenizer)
    sampling = SamplingSpec(max_new_tokens=16)
    first = generate(model, tokenizer, ids, mask, sampling, greedy=True)
    stop = tokenizer.decode(first.completion_ids[0, 2:3])  # a text the model writes early in row 0
    fmt = Scripted(stop)
    episode = generate(model, tokenizer, ids, mask, sampling, greedy=True, episodes=spec(fmt, 2, max_turns=2))
    record = episode.episodes[0]
    assert record.tool_calls == 1 and record.turns == 2
    assert [m["role"] for m in record.messages] == ["assistant", "tool", "assistant"]
    assert record.messages[1]["content"] == "echo hi"
    tool = tokenizer(fmt.results_text(tokenizer, [ToolResult("echo", "echo hi")]), add_special_tokens=False)[
        "input_ids"
    ]
    model_mask, attention = episode.completion_mask[0], episode.completion_attention[0]
    start = int(torch.nonzero(model_mask == 0)[0])  # the first tool token
    assert torch.equal(episode.completion_ids[0, start : start + len(tool)], torch.tensor(tool))
    assert model_mask[start : start + len(tool)].sum() == 0
    assert attention[: start + len(tool)].all()
    # Re-reading prompt + trajectory continues exactly as the cache did.
    context = torch.cat([ids[:1, mask[0].bool()], episode.completion_ids[:1, : start + len(tool)]], dim=1)
    reread = generate(model, tokenizer, context, torch.ones_like(context), SamplingSpec(max_new_tokens=4), greedy=True)
    after = episode.completion_ids[0, start + len(tool) : start + len(tool) + 4]
    n = int(attention[start + len(tool) :].sum().clamp(max=4))
    assert n > 0 and torch.equal(after[:n], reread.completion_ids[0, :n])


def test_max_turns_and_the_trajectory_cap_end_runaway_episodes(tiny):
    model, tokenizer = tiny
    ids, mask = prompts(tokenizer)
    first = generate(model, tokenizer, ids, mask, SamplingSpec(max_new_tokens=8), greedy=True)
    fmt = Scripted(tokenizer.decode(first.completion_ids[0, 0:1]), result=" ok ")
    episode = generate(
        model,
        tokenizer,
        ids,
        mask,
        SamplingSpec(max_new_tokens=30),
        greedy=True,
        episodes=spec(fmt, 2, max_turns=2, cap=60),
    )
    assert episode.episodes[0].turns <= 2
    short = generate(
        model,
        tokenizer,
        ids,
        mask,
        SamplingSpec(max_new_tokens=30),
        greedy=True,
        episodes=spec(fmt, 2, max_turns=50, cap=12),
    )
    assert short.completion_attention.sum(-1).max() <= 12
    assert short.episodes[0].budget_cut and bool(short.truncated[0])


class Game:
    """An environment whose game is over after its first call."""

    def __init__(self) -> None:
        self.done = False

    def echo(self, text: str) -> str:
        """Repeats the text, which ends the game.

        Args:
            text: What to repeat.
        """
        self.done = True
        return f"echo {text}"


def test_an_environment_that_is_done_ends_its_episode_after_that_turn(tiny):
    model, tokenizer = tiny
    ids, mask = prompts(tokenizer)
    first = generate(model, tokenizer, ids, mask, SamplingSpec(max_new_tokens=16), greedy=True)
    fmt = Scripted(tokenizer.decode(first.completion_ids[0, 2:3]))  # row 0 calls within its first 3 tokens

    def play(ends: bool):
        games = [Game() for _ in range(2)]
        episodes = EpisodePlan(
            [Toolbox([game.echo]) for game in games],
            fmt,
            max_turns=3,
            max_episode_tokens=40,
            environments=games if ends else [],
        )
        return generate(model, tokenizer, ids, mask, SamplingSpec(max_new_tokens=16), greedy=True, episodes=episodes)

    over, going_on = play(ends=True), play(ends=False)
    record, sampled = over.episodes[0], int(over.completion_mask[0].sum())
    assert record.turns == 1 and record.tool_calls == 1 and not record.budget_cut and not bool(over.truncated[0])
    assert [m["role"] for m in record.messages] == ["assistant", "tool"]  # the result is recorded ...
    assert torch.equal(over.completion_attention[0], over.completion_mask[0])  # ... and no token of it fed
    assert 1 <= sampled <= 3 and torch.equal(over.completion_ids[0, :sampled], first.completion_ids[0, :sampled])
    assert going_on.episodes[0].turns > 1  # without the environment's word the episode goes on


TURN_PREFIX = "<next>call("


def test_a_turn_prefix_follows_each_tool_result_read_by_the_policy_and_never_trained_on(tiny):
    model, tokenizer = tiny
    policy = lora(model).eval()
    ids, mask = prompts(tokenizer)
    fmt = Scripted(" ")  # about half the random model's tokens hold a space: most turns call
    episodes = EpisodePlan([Toolbox([echo])] * 2, fmt, max_turns=3, max_episode_tokens=90, turn_prefix=TURN_PREFIX)
    episode = generate(policy, tokenizer, ids, mask, SamplingSpec(max_new_tokens=24), greedy=True, episodes=episodes)
    record = episode.episodes[0]
    assert record.tool_calls >= 2, record.tool_calls  # at least two later turns
    # Each tool result is followed by the prefix, tokenized with it, as tokens the policy did not sample.
    queued = tokenizer(
        fmt.results_text(tokenizer, [ToolResult("echo", "echo hi")]) + TURN_PREFIX, add_special_tokens=False
    )["input_ids"]
    model_mask, attention = episode.completion_mask[0], episode.completion_attention[0]
    real = int(attention.sum())
    flips = torch.nonzero(model_mask[1:real] != model_mask[: real - 1]).flatten() + 1
    starts = [int(i) for i in flips if model_mask[i] == 0]  # where each run of tool tokens starts
    assert len(starts) == record.tool_calls
    for start in starts:
        assert episode.completion_ids[0, start : start + len(queued)].tolist() == queued
        assert model_mask[start : start + len(queued)].sum() == 0 and bool(model_mask[start + len(queued)])
    # Each later turn's text (what calls are parsed from, what rewards read) starts with it, the first does not.
    turns = [m["content"] for m in record.messages if m["role"] == "assistant"]
    assert not turns[0].startswith(TURN_PREFIX) and all(t.startswith(TURN_PREFIX) for t in turns[1:])
    assert len(turns) == record.tool_calls + 1
    # The passes attend to the prefix (the log-probs equal a re-read of the whole row); its gradient is exactly zero.
    policy.train()
    logprobs, _ = completion_logprobs(
        policy,
        episode.prompt_ids,
        episode.prompt_mask,
        episode.completion_ids,
        episode.completion_mask,
        1.0,
        completion_attention=episode.completion_attention,
    )
    with torch.no_grad():
        expected = reference_logprobs(
            policy, episode.prompt_ids, episode.prompt_mask, episode.completion_ids, episode.completion_attention
        )
    attended = episode.completion_attention.bool()
    assert torch.allclose(logprobs[attended], expected[attended], atol=1e-5)
    logprobs.retain_grad()
    grpo_loss(logprobs, logprobs.detach(), torch.tensor([1.0, -1.0]), episode.completion_mask, beta=0.0).loss.backward()
    assert torch.all(logprobs.grad[0, starts[0] : starts[0] + len(queued)] == 0)
    assert torch.all(logprobs.grad[episode.completion_mask == 1] != 0)


def trajectory(tokenizer):
    """Two rows of one prompt (a group) and a third prompt: model, tool, model tokens, then padding."""
    ids, mask = encode_prompts(tokenizer, ["What is 3 + 4?", "What is 3 + 4?", "Name a colour."], None)
    torch.manual_seed(3)
    completion = torch.randint(5, 1000, (3, 10))
    model_mask = torch.tensor(
        [
            [1, 1, 1, 0, 0, 0, 1, 1, 0, 0],
            [1, 1, 0, 0, 0, 0, 0, 0, 0, 0],  # a call, its result, then the cap
            [1, 1, 1, 1, 1, 1, 1, 0, 0, 0],
        ]
    )
    attention = torch.tensor(
        [[1, 1, 1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 0, 0, 0]]
    )
    return ids, mask, completion, model_mask, attention


def reference_logprobs(model, ids, mask, completion, attention):
    """Naive: one full forward per row over prompt + trajectory, log-softmax, gather."""
    rows = []
    for i in range(len(ids)):
        tokens = torch.cat([ids[i, mask[i].bool()], completion[i, attention[i].bool()]])[None]
        logits = model(input_ids=tokens).logits[0, -int(attention[i].sum()) - 1 : -1]  # [c, V]
        lp = logits.log_softmax(-1).gather(-1, tokens[0, -int(attention[i].sum()) :, None]).squeeze(-1)
        rows.append(torch.nn.functional.pad(lp, (0, completion.shape[1] - len(lp))))
    return torch.stack(rows)  # [N, C]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_passes_attend_to_tool_tokens_which_get_exactly_zero_gradient(tiny, checkpointing):
    model, tokenizer = tiny
    policy = lora(model).train()
    if checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        policy.enable_input_require_grads()
    ids, mask, completion, model_mask, attention = trajectory(tokenizer)
    logprobs, _ = completion_logprobs(
        policy, ids, mask, completion, model_mask, 1.0, completion_attention=attention
    )  # rows 0, 1 share a prompt
    with torch.no_grad():
        expected = reference_logprobs(policy, ids, mask, completion, attention)
    real = attention.bool()
    assert torch.allclose(logprobs[real], expected[real], atol=1e-5)
    advantages = torch.tensor([1.0, -0.5, 0.25])
    logprobs.retain_grad()
    result = grpo_loss(logprobs, logprobs.detach(), advantages, model_mask, beta=0.0)
    result.loss.backward()
    assert torch.all(logprobs.grad[model_mask == 0] == 0)  # no loss weight on a tool token
    assert torch.all(logprobs.grad[model_mask == 1] != 0)


def test_each_loss_type_counts_model_tokens_only():
    torch.manual_seed(0)
    model_mask = torch.tensor([[1, 1, 1, 0, 0, 0, 1, 1], [1, 1, 0, 0, 0, 0, 0, 0]])
    logprobs = torch.randn(2, 8)
    old = logprobs - 0.05 * torch.randn(2, 8)
    advantages = torch.tensor([1.0, -2.0])
    ratio = (logprobs - old).exp().clamp(0.8, 1.2)
    loss_tokens = -torch.minimum((logprobs - old).exp() * advantages[:, None], ratio * advantages[:, None])
    m = model_mask.float()
    # hand-built: model tokens only (5 in row 0, 2 in row 1), whatever the tools wrote in between
    expected = {
        "grpo": ((loss_tokens * m).sum(1) / m.sum(1)).mean(),
        "bnpo": (loss_tokens * m).sum() / 7,
        "dapo": (loss_tokens * m).sum() / 7,
        "dr_grpo": (loss_tokens * m).sum() / (2 * 8),
    }
    noise = torch.where(model_mask.bool(), 0.0, 100.0)  # tool positions' values must not matter
    for loss_type, value in expected.items():
        result = grpo_loss(
            logprobs + noise,
            old + noise / 2,
            advantages,
            model_mask,
            beta=0.0,
            loss_type=loss_type,
            max_completion_length=8,
            num_items=torch.tensor(7.0),
        )
        assert torch.allclose(result.loss, value, atol=1e-6), loss_type


def test_a_micro_batch_is_trimmed_to_its_attention_not_its_model_tokens(tiny):
    _, tokenizer = tiny
    ids, mask, completion, model_mask, attention = trajectory(tokenizer)
    batch = _trim(
        {
            "prompt_ids": ids[1:2],
            "prompt_mask": mask[1:2],
            "completion_ids": completion[1:2],
            "completion_mask": model_mask[1:2],
            "completion_attention": attention[1:2],
        }
    )
    assert batch["completion_ids"].shape[1] == 6  # the tool tokens after the last model token stay
