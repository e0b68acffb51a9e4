"""Prompt text: the chat template around each prompt, and rows as reward columns."""

from __future__ import annotations


def chat_prompts(tokenizer, prompts: list, system_prompt: str | None, prompt_template: str) -> list[str]:
    """Each prompt as the tokenizer's chat template renders it (:func:`prompt_messages`).

    Raises:
        ValueError: The tokenizer has no chat template, or a prompt is neither text nor a conversation.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the tokenizer has no chat template, which the prompts need; use an instruct/chat "
            "model or set tokenizer.chat_template."
        )
    return [
        tokenizer.apply_chat_template(
            prompt_messages(prompt, system_prompt, prompt_template), tokenize=False, add_generation_prompt=True
        )
        for prompt in prompts
    ]


def prompt_messages(prompt, system_prompt: str | None, prompt_template: str, extra: str | None = None) -> list[dict]:
    """A prompt as chat messages: text becomes one user message (wrapped in ``prompt_template``), a
    conversation (TRL's conversational ``prompt``: a list of ``{role, content}``) is kept as it is;
    ``system_prompt`` goes first unless the conversation has a system message; ``extra`` (an
    environment's reset text) is appended to the last user message.

    Raises:
        ValueError: The prompt is neither a str nor a list of ``{role, content}`` messages.
    """
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt_template.format(prompt=prompt)}]
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in prompt)
    ):
        messages = [dict(m) for m in prompt]
    else:
        raise ValueError(
            f"a prompt is {str(prompt)[:80]!r} ({type(prompt).__name__}); expected text, or a "
            "conversation: a list of {'role': ..., 'content': ...} messages (the source's column map "
            "can name another column as 'prompt')."
        )
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    if extra:
        last = (
            max(i for i, m in enumerate(messages) if m["role"] == "user")
            if any(m["role"] == "user" for m in messages)
            else len(messages) - 1
        )
        messages[last] = {**messages[last], "content": f"{messages[last]['content']}\n\n{extra}"}
    return messages


def columns_of(rows: list[dict]) -> dict[str, list]:
    """Rows -> columns (``{name: [value per row]}``)."""
    return {key: [row.get(key) for row in rows] for key in rows[0]}


def check_prompt_lengths(data) -> None:
    """Chat-format and tokenize the training and validation prompts of an
    :class:`OnPolicyDataModule` once, at set-up, so that a prompt that is too long
    (or a tokenizer without a chat template) fails before any sampling, not in the
    epoch that first draws it. Too long is longer than data.prompt.max_length, or than
    the model's context less what may follow the prompt (sampling.max_new_tokens,
    or with tools data.episodes.max_episode_tokens, the tools' tokens included): past its
    context a model samples for minutes, then garbage. (``data.held_out.slices`` are
    built-in tasks' short questions, of the training prompts' form.)"""
    from lit_grpo.model.policy import PolicySpec, context_length

    module = data.trainer.lightning_module if data.trainer else None
    if getattr(module, "tokenizer", None) is None:
        return
    spec = getattr(module, "spec", None)
    context = context_length(spec) if isinstance(spec, PolicySpec) else None
    after, field = data.sampling.max_new_tokens, "sampling.max_new_tokens"
    if data.episodes is not None:  # an episode's tokens after the prompt, the tools' included
        after, field = data.episodes.max_episode_tokens, "data.episodes.max_episode_tokens"
    budget = None if context is None else context - after
    source, held_out = data.source, data.held_out
    rows, n_train = data.train_rows + data.val_rows, len(data.train_rows)
    for start in range(0, len(rows), 512):
        lengths = data.encode(rows[start : start + 512])[1].sum(1).tolist()  # prompt tokens per row
        over = [start + i for i, n in enumerate(lengths) if budget is not None and n > budget]
        if over:
            i, n = over[0], lengths[over[0] - start]
            # Where the row is in the user's data: the held-out rows come first in `split`.
            split = source.split if i < n_train or held_out.split is None else held_out.split
            row = (i + (held_out.size if held_out.split is None else 0)) if i < n_train else i - n_train
            raise ValueError(
                f"data.source.dataset={source.label!r} split {split!r} row {row}: the prompt has {n} tokens "
                f"(chat template included), {n + after} with {field}={after}, more than the model's "
                f"context of {context} (policy.name_or_path={spec.name_or_path!r}); shorten or drop the "
                f"row, lower {field}, or set data.prompt.max_length={max(budget, 1)} "
                "with data.prompt.overflow='truncate'."
            )
