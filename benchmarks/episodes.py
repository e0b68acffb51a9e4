"""What episodes cost on the native engine (docs/agents.md, "Cost").

Part 1 (``overhead``): the same prompts (no tool described, so none is called)
sampled as single-turn completions and as episodes with the calculator
configured; the outputs must be equal and the time within a few percent.

Part 2 (``turns``): episodes that do call the calculator (configs/tools.yaml's
start: its system prompt and reply prefix), run by the engine as it ships, which
continues from its KV cache after each turn's tool tokens; then the same
trajectories re-read the way an engine without a persistent cache must: the
first turn as the shipped engine runs it (each prompt prefilled once for its
group), every later turn prefilling each row's prompt and whole trajectory so
far, then decoding as many steps as that turn took. Seconds per turn for each.

    python benchmarks/episodes.py --prompts 4 --group 8 --repeats 3

Run it alone on the machine (``flock /tmp/heavy.lock``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from lit_grpo.data.tasks import arithmetic
from lit_grpo.environments import Toolbox, call_format
from lit_grpo.environments.builtin import calculator
from lit_grpo.generation.episodes import EpisodeSpec
from lit_grpo.generation.rollout import SamplingSpec, encode_prompts, generate
from lit_grpo.model.sources import embedded_model_dir

START = yaml.safe_load(open("configs/tools.yaml"))["data"]["prompt"]


def prompts(tokenizer, rows, fmt, toolbox, prefix, system=None):
    texts = []
    for row in rows:
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": row["prompt"]})
        if toolbox is not None:
            messages = fmt.system_prompt(tokenizer, messages, toolbox.schemas)
        texts.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + prefix)
    return encode_prompts(tokenizer, texts, None)


def overhead(model, tokenizer, rows, group, repeats, new_tokens):
    fmt, toolbox = call_format(tokenizer), Toolbox([calculator])
    ids, mask = prompts(tokenizer, rows, fmt, None, "")
    sampling = SamplingSpec(group_size=group, max_new_tokens=new_tokens)
    spec = EpisodeSpec([toolbox] * (len(rows) * group), fmt, 3, 2 * new_tokens)
    times = {"single-turn": [], "episodes, never called": []}
    for _ in range(repeats):  # alternately, so machine drift hits both
        torch.manual_seed(0)
        single = generate(model, tokenizer, ids, mask, sampling)
        times["single-turn"].append(single.seconds)
        torch.manual_seed(0)
        episode = generate(model, tokenizer, ids, mask, sampling, episodes=spec)
        times["episodes, never called"].append(episode.seconds)
        width = single.completion_ids.shape[1]
        assert torch.equal(single.completion_ids, episode.completion_ids[:, :width]), "outputs differ"
    base = statistics.median(times["single-turn"])
    print(f"| rollout ({len(rows)}x{group} rows, <= {new_tokens} tokens) | median s | vs single-turn |")
    print("|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.2f} | {statistics.median(values) / base - 1:+.1%} |")


def turns(model, tokenizer, rows, group, repeats, new_tokens):
    fmt, toolbox = call_format(tokenizer), Toolbox([calculator])
    prefix = START["completion_prefix"]
    ids, mask = prompts(tokenizer, rows, fmt, toolbox, prefix, START["system_prompt"])
    sampling = SamplingSpec(group_size=group, max_new_tokens=new_tokens)
    spec = EpisodeSpec([toolbox] * (len(rows) * group), fmt, 2, 2 * new_tokens, prefix)
    kv, reread, counted = [], [], []
    for _ in range(repeats):
        torch.manual_seed(0)
        episode = generate(model, tokenizer, ids, mask, sampling, episodes=spec)
        n_turns = max(r.turns for r in episode.episodes)
        kv.append(episode.seconds / n_turns)
        reread.append(_reread_seconds(model, tokenizer, ids, mask, group, episode) / n_turns)
        counted.append((n_turns, sum(r.tool_calls for r in episode.episodes)))
    print(f"| {len(rows)}x{group} episodes, {counted[0][1]} calls, {counted[0][0]} turns | s per turn |")
    print("|---|---|")
    print(f"| KV-cache continuation (shipped) | {statistics.median(kv):.2f} |")
    print(f"| re-reading prompt + trajectory each turn | {statistics.median(reread):.2f} |")


def _reread_seconds(model, tokenizer, ids, mask, group, episode) -> float:
    """The first turn from the grouped prompts, then prefill prompt + trajectory before each later
    turn; each turn decodes as many steps as it took (greedy, EOS ignored)."""
    model_mask, attention = episode.completion_mask, episode.completion_attention
    # where each row's turns start: after the prompt, and after every run of tool tokens
    starts = [
        [0] + [t for t in range(1, int(a.sum())) if m[t] == 1 and m[t - 1] == 0] for m, a in zip(model_mask, attention)
    ]
    steps = max(int(m.cumprod(0).sum()) for m in model_mask)
    start = time.perf_counter()
    generate(model, tokenizer, ids, mask, SamplingSpec(group_size=group, max_new_tokens=steps, ignore_eos=True))
    seconds = time.perf_counter() - start
    ids, mask = ids.repeat_interleave(group, 0), mask.repeat_interleave(group, 0)
    for turn in range(1, max(len(s) for s in starts)):
        rows = [i for i, s in enumerate(starts) if len(s) > turn]
        texts = [torch.cat([ids[i, mask[i].bool()], episode.completion_ids[i, : starts[i][turn]]]) for i in rows]
        width = max(len(t) for t in texts)
        context = torch.stack(
            [torch.nn.functional.pad(t, (width - len(t), 0), value=tokenizer.pad_token_id) for t in texts]
        )
        context_mask = torch.stack([torch.nn.functional.pad(torch.ones_like(t), (width - len(t), 0)) for t in texts])
        steps = max(int(model_mask[i, starts[i][turn] :].cumprod(0).sum()) for i in rows)
        start = time.perf_counter()
        generate(
            model,
            tokenizer,
            context,
            context_mask,
            SamplingSpec(max_new_tokens=steps, ignore_eos=True),
            greedy=True,
            repeat=1,
        )
        seconds += time.perf_counter() - start
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["overhead", "turns", "both"], default="both")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new_tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    folder = embedded_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    rows = arithmetic(args.prompts, 11, digits=[4, 4], ops="+")
    print(f"torch threads: {torch.get_num_threads()}")
    if args.part in ("overhead", "both"):
        overhead(model, tokenizer, rows, args.group, args.repeats, args.new_tokens)
    if args.part in ("turns", "both"):
        turns(model, tokenizer, rows, args.group, args.repeats, args.new_tokens)


if __name__ == "__main__":
    main()
