"""Prompt text: the chat template around each prompt, and rows as reward columns."""

from __future__ import annotations


def chat_prompts(tokenizer, prompts: list[str], system_prompt: str | None, prompt_template: str) -> list[str]:
    """Wrap each prompt in ``prompt_template`` and the tokenizer's chat template.

    Raises:
        ValueError: The tokenizer has no chat template.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the tokenizer has no chat template, which the prompts need; use an instruct/chat "
            "model or set tokenizer.chat_template."
        )
    texts = []
    for prompt in prompts:
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": prompt_template.format(prompt=prompt)})
        texts.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    return texts


def columns_of(rows: list[dict]) -> dict[str, list]:
    """Rows -> columns (``{name: [value per row]}``)."""
    return {key: [row.get(key) for row in rows] for key in rows[0]}


def check_prompt_lengths(data) -> None:
    """Chat-format and tokenize the training and validation prompts of an
    :class:`OnPolicyDataModule` once, at set-up, so that a prompt that is too long
    (or a tokenizer without a chat template) fails before any sampling, not in the
    epoch that first draws it. Too long is longer than max_prompt_length, or than
    the model's context less what may follow the prompt (sampling.max_new_tokens,
    or with tools data.episodes.max_episode_tokens, the tools' tokens included): past its
    context a model samples for minutes, then garbage. (``val_slices`` are
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
    hp, rows, n_train = data.hparams, data.train_rows + data.val_rows, len(data.train_rows)
    for start in range(0, len(rows), 512):
        lengths = data.encode(rows[start : start + 512])[1].sum(1).tolist()  # prompt tokens per row
        over = [start + i for i, n in enumerate(lengths) if budget is not None and n > budget]
        if over:
            i, n = over[0], lengths[over[0] - start]
            # Where the row is in the user's data: the held-out rows come first in `split`.
            split = hp.split if i < n_train or hp.val_split is None else hp.val_split
            row = (i + (hp.val_size if hp.val_split is None else 0)) if i < n_train else i - n_train
            raise ValueError(
                f"data.source={hp.source!r} split {split!r} row {row}: the prompt has {n} tokens "
                f"(chat template included), {n + after} with {field}={after}, more than the model's "
                f"context of {context} (policy.name_or_path={spec.name_or_path!r}); shorten or drop the "
                f"row, lower {field}, or set data.max_prompt_length={max(budget, 1)} "
                "with data.prompt_overflow='truncate'."
            )

