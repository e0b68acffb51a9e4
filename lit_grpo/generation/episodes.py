"""Episodes: the turn loop every engine runs when tools or an environment are configured.

An episode is the prompt followed by alternating segments: what the policy
sampled (an assistant turn), then what its tools returned, for up to
``max_turns`` assistant turns. A turn ends at EOS, or at the call format's
``stop`` text (``</tool_call>``); the turn's calls are parsed and run, their
results are rendered by the chat template (:meth:`CallFormat.results_text`:
tool messages, then the next assistant header, then ``turn_prefix``) and
appended as tokens the policy did not sample, and the model goes on. The
episode ends on a turn without a call, at ``max_turns``, when the policy has sampled
``sampling.max_new_tokens`` tokens (the model-token budget), when the
trajectory reaches ``max_episode_tokens`` (every token after the prompt), or
when a call leaves the episode's environment ``done`` (a game won or lost:
its results join the messages, and no token follows them, since no turn
would read them).

:class:`Episodes` holds each row's state and is what both engines drive:

* the native engine feeds one token per row per decoding step, sampled or
  the next queued tool token, so it continues from its KV cache: a turn's
  tool tokens are prefilled once, never re-read (:func:`lit_grpo.generation.rollout.generate`);
  rows whose turns end at the same step run their calls together;
* the vLLM engines (in process, or a server) submit each row's prompt +
  trajectory once per turn (the prefix cache keeps what was read before), all
  rows' calls together (:func:`play_turns`).

The rollout is every token after the prompt: ``completion_mask`` is the
model-token mask (1 only where the policy sampled), ``completion_attention``
covers every real token, and the sampler's log-prob is 0 at tool tokens.
An episode whose first turn calls nothing is exactly a single-turn rollout:
the same tokens, mask and log-probs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lit_grpo.environments import CallFormat, Toolbox, ToolCall, ToolResult, run_concurrently
from lit_grpo.generation.samples import Rollout

# Why a turn ended: EOS, the call format's stop text, or a budget (the policy's or the trajectory's).
EOS, CALL, BUDGET = "eos", "call", "budget"


@dataclass
class EpisodePlan:
    """What turns each completion into an episode.

    Args:
        toolboxes: One per completion row (``B * repeat`` rows, the rows of
            one prompt contiguous): the tools that episode may call (an
            environment's bound methods, or the configured tools).
        call_format: How calls are written and results shown (:func:`lit_grpo.environments.call_format`).
        max_turns: Most assistant turns per episode.
        max_episode_tokens: Most tokens after the prompt, the policy's and the tools'.
        prefix: Text the reply starts with, already in the prompt
            (``data.prompt.completion_prefix``): the first turn's text begins with it.
        turn_prefix: Text every later turn starts with (``data.episodes.turn_prefix``):
            queued after the tool results, tokenized with them, as tokens the
            policy reads but did not sample (masked out of the loss like the
            results); the turn's text begins with it.
        environments: Each row's environment, where one is configured (else
            empty): an episode ends after the turn whose calls leave its
            environment's ``done`` attribute ``True``.
    """

    toolboxes: list[Toolbox]
    call_format: CallFormat
    max_turns: int
    max_episode_tokens: int
    prefix: str = ""
    turn_prefix: str = ""
    environments: list = field(default_factory=list)

    def repeat(self, prompts: int) -> int:
        """Episodes per prompt row, for ``prompts`` rows of prompts: the group size when a group shares
        its prompt, 1 when each episode has its own (an environment's reset text varies)."""
        return len(self.toolboxes) // prompts


@dataclass
class EpisodeRecord:
    """One finished episode, as rewards, metrics and ``samples.jsonl`` read it.

    Attributes:
        messages: TRL's conversational completion: the assistant turns
            (``tool_calls`` where one was parsed) and ``tool`` messages.
        turns: Assistant turns.
        tool_calls: Calls run (a malformed call counts as an error, not a call).
        tool_errors: Results that are errors (malformed call, unknown tool, raised, timed out).
        tool_timeouts: Calls abandoned at their timeout.
        tool_seconds: Seconds spent in tools.
        budget_cut: Ended by the model-token budget or the trajectory cap.
    """

    messages: list[dict] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    tool_seconds: float = 0.0
    budget_cut: bool = False

    @property
    def answer(self) -> str:
        """The last assistant turn's text (the final answer built-in rewards score)."""
        return next((m["content"] for m in reversed(self.messages) if m["role"] == "assistant"), "")


class Episodes:
    """The state of ``n`` episodes, advanced one token at a time (see the module docstring).

    Args:
        spec: Toolboxes, call format and limits.
        tokenizer: Decodes turns and encodes tool results.
        max_new_tokens: The model-token budget per episode.
        eos: Token ids that end a turn (and its episode).
    """

    def __init__(self, spec: EpisodePlan, tokenizer, max_new_tokens: int, eos: list[int]) -> None:
        n = len(spec.toolboxes)
        self.spec, self.tokenizer, self.max_new_tokens, self.eos = spec, tokenizer, max_new_tokens, set(eos)
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.sampled: list[list[int]] = [[] for _ in range(n)]  # 1 where the policy sampled the token
        self.logprobs: list[list[float]] = [[] for _ in range(n)]
        self.queue: list[deque[int]] = [deque() for _ in range(n)]  # tool tokens still to feed
        self.turn_start = [0] * n  # where each row's current turn begins in its tokens
        self.done = [False] * n
        self.records = [EpisodeRecord() for _ in range(n)]
        self.stop_window = len(spec.call_format.stop) + 2  # tokens that hold a just-completed stop text

    @property
    def width(self) -> int:
        """Most completion tokens of any episode."""
        return self.spec.max_episode_tokens

    def room(self, row: int) -> int:
        """Tokens ``row`` may still sample this turn (model budget and trajectory cap)."""
        return min(self.max_new_tokens - sum(self.sampled[row]), self.width - len(self.tokens[row]))

    def sample(self, row: int, token: int, logprob: float | None) -> str | None:
        """Record a token the policy sampled; why the turn ended (``eos``/``call``/``budget``) or ``None``."""
        self._append(row, token, 1, logprob or 0.0)
        if token in self.eos:
            return EOS
        start = max(self.turn_start[row], len(self.tokens[row]) - self.stop_window)
        tail = self.tokenizer.decode(self.tokens[row][start:])
        if start == self.turn_start[row]:
            tail = self._prefix(row) + tail
        if self.spec.call_format.stop in tail:
            return CALL
        return BUDGET if self.room(row) <= 0 else None

    def force(self, row: int) -> int:
        """Feed ``row``'s next tool token (it has one queued); the episode ends if the cap is reached."""
        token = self.queue[row].popleft()
        self._append(row, token, 0, 0.0)
        if not self.queue[row]:
            self.turn_start[row] = len(self.tokens[row])
            if self.room(row) <= 0:  # no room left for the policy to answer
                self.done[row] = self.records[row].budget_cut = True
        return token

    def end_turns(self, ended: dict[int, str]) -> None:
        """Close the turns of the rows in ``ended`` (row -> reason): run the calls of those
        that called (concurrently), queue their results, end the others' episodes."""
        jobs: dict[int, list[ToolCall] | str] = {}
        for row, reason in ended.items():
            record, text = self.records[row], self._turn_text(row)
            record.turns += 1
            message = {"role": "assistant", "content": text}
            record.messages.append(message)
            calls = self.spec.call_format.parse(text) if reason == CALL else []
            if isinstance(calls, list) and calls:
                message["tool_calls"] = [
                    {"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls
                ]
            budget_left = sum(self.sampled[row]) < self.max_new_tokens
            if reason == CALL and calls and record.turns < self.spec.max_turns and budget_left:
                jobs[row] = calls
            else:
                self.done[row] = True
                record.budget_cut = reason == BUDGET
        rows = [row for row, calls in jobs.items() if isinstance(calls, list)]
        ran = dict(zip(rows, run_concurrently([(self.spec.toolboxes[row], jobs[row]) for row in rows])))
        for row, calls in jobs.items():
            results = ran[row] if row in ran else [ToolResult("error", calls, error=True)]
            self._record_results(row, results, calls_run=len(calls) if row in ran else 0)
            if self._environment_done(row):
                self.done[row] = True
            else:
                self._queue_results(row, results)

    def _record_results(self, row: int, results: list[ToolResult], calls_run: int) -> None:
        record = self.records[row]
        record.tool_calls += calls_run
        record.tool_errors += sum(r.error for r in results)
        record.tool_timeouts += sum(r.timed_out for r in results)
        record.tool_seconds += sum(r.seconds for r in results)
        record.messages += [{"role": "tool", "name": r.name, "content": r.content} for r in results]

    def _environment_done(self, row: int) -> bool:
        environments = self.spec.environments
        return bool(environments) and getattr(environments[row], "done", False) is True

    def _queue_results(self, row: int, results: list[ToolResult]) -> None:
        record = self.records[row]
        text = self.spec.call_format.results_text(self.tokenizer, results) + self.spec.turn_prefix
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        self.queue[row].extend(ids[: self.width - len(self.tokens[row])])
        if not self.queue[row]:
            self.done[row] = record.budget_cut = True

    def _append(self, row: int, token: int, sampled: int, logprob: float) -> None:
        self.tokens[row].append(token)
        self.sampled[row].append(sampled)
        self.logprobs[row].append(logprob)

    def _turn_text(self, row: int) -> str:
        start = self.turn_start[row]
        turn = [t for t, s in zip(self.tokens[row][start:], self.sampled[row][start:]) if s]
        return self._prefix(row) + self.tokenizer.decode(turn, skip_special_tokens=True)

    def _prefix(self, row: int) -> str:
        """The text ``row``'s current turn starts with, not sampled: the reply's or a later turn's prefix."""
        return self.spec.prefix if self.turn_start[row] == 0 else self.spec.turn_prefix

    def rollout(self, prompt_ids, prompt_mask, repeat: int, greedy: bool, seconds: float) -> Rollout:
        """The finished episodes as a :class:`Rollout` (``completion_attention`` and ``episodes`` set).

        ``texts`` are the final answers (:attr:`EpisodeRecord.answer`, the
        completion prefix in front when the first turn was the last).
        """
        n, pad = len(self.tokens), self.tokenizer.pad_token_id
        width = max(1, max(len(t) for t in self.tokens))
        ids = torch.full((n, width), pad, dtype=torch.long)  # [N, C]
        mask = torch.zeros(n, width, dtype=torch.long)  # [N, C] the policy's tokens
        attention = torch.zeros(n, width, dtype=torch.long)  # [N, C] every real token
        logprobs = torch.zeros(n, width)  # [N, C]
        for i, tokens in enumerate(self.tokens):
            ids[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            mask[i, : len(tokens)] = torch.tensor(self.sampled[i], dtype=torch.long)
            attention[i, : len(tokens)] = 1
            logprobs[i, : len(tokens)] = torch.tensor(self.logprobs[i])
        truncated = torch.tensor([r.budget_cut for r in self.records])
        return Rollout(
            prompt_ids.repeat_interleave(repeat, 0).cpu(),
            prompt_mask.repeat_interleave(repeat, 0).cpu(),
            ids,
            mask,
            truncated,
            [r.answer for r in self.records],
            seconds,
            None if greedy else logprobs,
            completion_attention=attention,
            episodes=self.records,
        )


# An engine that samples a whole turn per request: (rows, their contexts, their token budgets) -> each
# row's sampled token ids and their log-probs (``None`` when greedy).
TurnSampler = Callable[[list[int], list[list[int]], list[int]], list[tuple[list[int], list[float] | None]]]


def play_turns(state: Episodes, contexts: list[list[int]], sample_turns: TurnSampler) -> None:
    """Run ``state``'s episodes to their end with an engine that samples whole turns.

    Each turn sends every live row's context (its prompt, then its trajectory so far) with the
    tokens it may still sample; the engine stops a turn at EOS or the call format's stop text
    (it may sample past them: the tokens after the turn's end are dropped here, as the native
    engine would never have sampled them). The turns' calls then run together and their results
    are fed as tool tokens.

    Args:
        state: The episodes, as :class:`Episodes` built them.
        contexts: Each row's prompt token ids (``B * repeat`` rows).
        sample_turns: The engine's call, see :data:`TurnSampler`.
    """
    live = list(range(len(contexts)))
    while live:
        turns = sample_turns(
            live, [contexts[row] + state.tokens[row] for row in live], [state.room(row) for row in live]
        )
        ended = {}
        for row, (tokens, logprobs) in zip(live, turns):
            for token, logprob in zip(tokens, logprobs or [None] * len(tokens)):
                reason = state.sample(row, token, logprob)
                if reason is not None:
                    ended[row] = reason
                    break
            ended.setdefault(row, BUDGET)  # the engine stopped at the turn's budget
        state.end_turns(ended)
        for row in live:
            while state.queue[row]:
                state.force(row)
        live = [row for row in live if not state.done[row]]


def episode_stats(records: list[EpisodeRecord]) -> dict[str, float]:
    """Per-epoch means over episodes: ``episode/turns_mean``, ``episode/tool_calls`` (per episode), ..."""
    n = max(len(records), 1)
    return {
        "episode/turns_mean": sum(r.turns for r in records) / n,
        "episode/tool_calls": sum(r.tool_calls for r in records) / n,
        "episode/tool_errors": sum(r.tool_errors for r in records) / n,
        "episode/tool_timeouts": sum(r.tool_timeouts for r in records) / n,
        "episode/tool_seconds": sum(r.tool_seconds for r in records),
        "episode/budget_cut_fraction": sum(r.budget_cut for r in records) / n,
    }
