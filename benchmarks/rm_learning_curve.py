"""Does the reward model of configs/rm_quickstart.yaml learn? Its accuracy on fresh pairs, step by step.

    python benchmarks/rm_learning_curve.py --steps 200 --lr 1e-3 --head-init zero [--head-lr 1e-2]
        [--dtype bfloat16 --attn eager] [--warmup 10] [--sched cos|const]

The config's model (the SFT model, ``init_adapter``, a LoRA adapter of rank
``--r`` on all linear layers, a bias-free scalar head) trained in a plain loop
on ``--steps`` batches of ``--batch`` fresh ``arithmetic_preferences`` pairs
(2-digit sums, the config's data; the first 64 rows are held out as in the
config): AdamW without weight decay, the adapter at ``--lr`` and the head at
``--head-lr`` (default ``--lr``), linear warm-up over ``--warmup`` steps then
cosine to 0 (or constant), gradients clipped at norm 1, the shared-prefix
pass of training (:func:`lit_grpo.algorithms.reward_model.pair_scores`). Every
20 steps it prints the accuracy on the last 160 training pairs, each scored
*before* the step that trains on it (fresh pairs, so an estimate of held-out
accuracy with 2.5x the pairs of the config's validation), split by the kind
of slip (+-1, +-10, last two digits swapped), the mean |margin| and mean
score; at the start and the end the accuracy on the 64 held-out pairs.
``--lr 0`` trains the head alone; ``--r 0`` fine-tunes every weight of the
SFT model (no adapter) at ``--lr``. ``--per-question K`` fills each batch with
``--batch / K`` questions and K of each one's slips (the same chosen reply
against K rejected ones), so every step contrasts answers to the same questions.
``--kinds`` trains on those slips only (``--kinds off_by_1``: the last digit alone);
the held-out pairs keep every kind, and their accuracy is printed by kind.
``--curriculum off_by_1:350 off_by_10:350`` trains the first 350 steps on the +-1 slips
only, the next 350 on the +-10 slips, then on ``--kinds`` (one digit at a time).
A stage may weight several slips, ``off_by_1*3+off_by_10:300`` (each pair's kind drawn
3:1 among those its answer has, as ``arithmetic_preferences(slips={...})`` draws them).
``--suffix-weight W`` adds W times the loss at every token from each pair's first
difference (``RewardModelModule(suffix_weight=)``), from step ``--suffix-from`` on.
``--init-rm FOLDER`` starts from what ``lit-grpo rm fit --export_adapter FOLDER`` wrote
(its ``adapter/``: the LoRA weights and the head), trained on the same ``--init-adapter``,
so a stage can follow a finished run without repeating it.
``--distill-weight W`` adds W times the squared error between the score margins at every
token from each pair's first difference and ``--distill-scale`` times the SFT model's own
log-likelihood gap of the two replies up to that token (:func:`teacher_gaps`; the SFT
model ranks 0.94 of the held-out pairs by likelihood): the language model's knowledge of
the sums distilled into the head's scores.
``--seed S`` changes the initialisation, the order of the training pairs and the slips drawn
(the held-out pairs stay the same). Past the 8,036 training questions (1,004 steps of 8) the
questions come round again with new slips drawn, so from there the windows are of new pairs,
not of unseen questions; ``--held-out-every N`` prints the held-out accuracy every N steps.
"""

from __future__ import annotations

import argparse
import math
import random
import time

import torch
from peft import set_peft_model_state_dict
from safetensors.torch import load_file

from lit_grpo.algorithms.reward_model import RewardModelModule, last_scores, pair_loss, pair_scores, suffix_scores
from lit_grpo.data.reward_pairs import RewardDataModule
from lit_grpo.data.tasks import SLIPS, arithmetic_preferences, draw_near_miss, near_misses, slip_kind
from lit_grpo.model.logprob_passes import final_hidden_states
from lit_grpo.model.policy import LoraSpec, PolicySpec
from lit_grpo.objectives import token_logprobs
from lit_grpo.rewards.reward_model import ADAPTER_DIR, HEAD_FILE

HELD_OUT, WINDOW, KINDS, QUESTIONS = 64, 160, SLIPS, 90 * 90  # every 2-digit sum


def slip(row: dict) -> str:
    """Which slip the rejected reply is."""
    return slip_kind(int(row["chosen"].split("= ")[1]), int(row["rejected"].split("= ")[1]))


def rejecting(row: dict, wrong: int) -> dict:
    """The row with ``wrong`` as the result of its rejected reply."""
    return {**row, "rejected": f"{row['chosen'].rsplit('= ', 1)[0]}= {wrong}"}


def slips(row: dict) -> list[dict]:
    """The row with each of its answer's :func:`~lit_grpo.data.tasks.near_misses` as its rejected reply."""
    return [rejecting(row, wrong) for wrong in near_misses(int(row["answer"]))]


def stage_weights(text: str) -> dict[str, float] | None:
    """``off_by_1*3+off_by_10`` as ``{"off_by_1": 3.0, "off_by_10": 1.0}``; None if it does not parse."""
    weights = {}
    for part in text.split("+"):
        kind, _, weight = part.partition("*")
        try:
            weights[kind] = float(weight or 1)
        except ValueError:
            return None
        if kind not in KINDS or not weights[kind] > 0:
            return None
    return weights


def load_rm(module: RewardModelModule, folder: str) -> None:
    """Put the adapter and head an ``rm fit`` export wrote into ``module`` (built with the same policy spec)."""
    adapter = f"{folder}/{ADAPTER_DIR}"
    result = set_peft_model_state_dict(module.policy, load_file(f"{adapter}/adapter_model.safetensors"))
    if result.unexpected_keys:
        raise ValueError(f"--init-rm {folder!r}: adapter weights this model lacks, e.g. {result.unexpected_keys[0]}")
    with torch.no_grad():
        module.reward_head.weight.copy_(load_file(f"{adapter}/{HEAD_FILE}")["weight"])


PAIRS = RewardDataModule(max_prompt_length=128, max_completion_length=32)  # the config's rendering


def encode(module: RewardModelModule, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """``[2B, T]`` ids and mask of the chosen then the rejected replies, as the config's data module renders them."""
    batch = PAIRS.encode_pairs(module.tokenizer, rows)
    return batch["input_ids"], batch["attention_mask"]


@torch.no_grad()
def held_out_accuracy(module: RewardModelModule, rows: list[dict]) -> str:
    """Pairwise accuracy on ``rows``, over all and by kind of slip."""
    module.eval()
    wins = []
    for start in range(0, len(rows), 16):
        chosen, rejected = pair_scores(
            module.policy, module.reward_head, *encode(module, rows[start : start + 16]), module.tokenizer.pad_token_id
        ).chunk(2)
        wins += (chosen > rejected).tolist()
    module.train()
    by_kind = {k: [won for row, won in zip(rows, wins) if slip(row) == k] for k in KINDS}
    return (
        f"{sum(wins) / len(wins):.4f} ("
        + ", ".join(f"{k} {sum(v) / max(len(v), 1):.2f} of {len(v)}" for k, v in by_kind.items())
        + ")"
    )


@torch.no_grad()
def teacher_gaps(
    module: RewardModelModule, ids: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The SFT model's log-likelihood of each chosen reply minus its rejected one's, summed up to each
    token from the pair's first difference: ``([B, S] gaps, [B, S] the offsets both replies have)``.

    The SFT model is the policy with its adapter disabled; ``lengths`` are :func:`suffix_scores`'.
    The output head runs at the positions that predict suffix tokens only.
    """
    with module.policy.disable_adapter():
        hidden = final_hidden_states(module.policy, input_ids=ids, attention_mask=mask, use_cache=False)
    offsets = torch.arange(int(lengths.max()), device=ids.device)  # [S]
    first = mask.sum(-1) - lengths  # [2B] the position of each row's first suffix token
    position = (first[:, None] + offsets).clamp(max=ids.shape[1] - 1)  # [2B, S]
    before = hidden.gather(1, (position - 1)[..., None].expand(-1, -1, hidden.shape[-1]))  # [2B, S, H]
    head = module.policy.get_output_embeddings()
    logits = head(before.to(head.weight.dtype))  # [2B, S, V]
    token = token_logprobs(logits, ids.gather(1, position))  # [2B, S]
    total = (token * (offsets < lengths[:, None])).cumsum(-1)  # [2B, S]
    (chosen, rejected), (chosen_lengths, rejected_lengths) = total.chunk(2), lengths.chunk(2)
    return chosen - rejected, offsets < torch.minimum(chosen_lengths, rejected_lengths)[:, None]


def report(step: int, history: list[tuple[str, bool, float]], mean_score: float, seconds: float) -> None:
    window = history[-WINDOW:]
    by_kind = {k: [won for kind, won, _ in window if kind == k] for k in KINDS}
    print(
        f"step {step}: accuracy (last {len(window)} pairs, before their step) "
        f"{sum(won for _, won, _ in window) / len(window):.3f} | "
        + " ".join(f"{k} {sum(v) / max(len(v), 1):.2f}" for k, v in by_kind.items())
        + f" | |margin| {sum(abs(m) for *_, m in window) / len(window):.3f} | mean score {mean_score:.2f}"
        f" | {seconds:.2f} s/step",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--head-lr", type=float, default=None)
    parser.add_argument("--head-init", choices=("default", "zero"), default="default")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--sched", choices=("cos", "const"), default="cos")
    parser.add_argument("--r", type=int, default=16, help="LoRA rank; 0: full fine-tuning (every base weight trained)")
    parser.add_argument("--alpha", type=int, default=32)
    parser.add_argument("--per-question", type=int, default=1, help="slips of each question per batch (1-4)")
    parser.add_argument(
        "--kinds",
        nargs="+",
        choices=KINDS,
        default=list(KINDS),
        help="the slips trained on (the held-out pairs keep every kind)",
    )
    parser.add_argument(
        "--curriculum",
        nargs="+",
        default=[],
        metavar="KIND:STEPS",
        help="stages trained on one slip each before --kinds, e.g. off_by_1:350 off_by_10:350",
    )
    parser.add_argument(
        "--suffix-weight",
        type=float,
        default=0.0,
        help="weight of a Bradley-Terry loss at every token from the pair's first differing one",
    )
    parser.add_argument("--suffix-from", type=int, default=0, help="the step --suffix-weight starts at")
    parser.add_argument(
        "--distill-weight",
        type=float,
        default=0.0,
        help="weight of the squared error to the SFT model's log-likelihood gaps (0: none)",
    )
    parser.add_argument("--distill-scale", type=float, default=0.3, help="the gaps' scale in that loss")
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the adapter's and head's initialisation, the training pairs' order and slips drawn",
    )
    parser.add_argument("--held-out-every", type=int, default=0, help="also score the held-out pairs every N steps")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--attn", default=None)
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--init-adapter", default="runs/sft_quickstart/adapter", help='"": none')
    parser.add_argument("--init-rm", default=None, help="an rm fit export to start from (its adapter and head)")
    args = parser.parse_args()
    print(vars(args), flush=True)
    torch.manual_seed(args.seed)
    spec = PolicySpec(
        name_or_path=args.model,
        init_adapter=args.init_adapter or None,
        dtype=args.dtype,
        attn_implementation=args.attn,
        lora=LoraSpec(r=args.r, alpha=args.alpha) if args.r else None,
    )
    module = RewardModelModule(policy=spec)
    module.configure_model()
    if args.head_init == "zero":
        torch.nn.init.zeros_(module.reward_head.weight)
    if args.init_rm:
        load_rm(module, args.init_rm)
    head, adapter = list(module.reward_head.parameters()), [p for p in module.policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [{"params": adapter, "lr": args.lr}, {"params": head, "lr": args.head_lr or args.lr}], weight_decay=0.0
    )
    peaks = [group["lr"] for group in optimizer.param_groups]
    stages, end = [], 0  # (kinds, the step the stage ends at)
    for stage in args.curriculum:
        kinds, _, steps = stage.rpartition(":")
        weights = stage_weights(kinds)
        if weights is None or not steps.isdigit():
            parser.error(
                f"--curriculum {stage!r}: expected KIND[*WEIGHT][+KIND[*WEIGHT]...]:STEPS with KIND one of {KINDS}"
            )
        end += int(steps)
        stages.append((weights, end))
    if args.per_question > 1 and any(len(set(weights.values())) > 1 for weights, _ in stages):
        parser.error(
            f"--per-question={args.per_question} with a weighted --curriculum stage: a weighted stage "
            "draws one slip per question; use --per-question 1"
        )
    questions = args.batch // args.per_question
    if not 1 <= args.per_question <= 4 or questions * args.per_question != args.batch:
        parser.error(f"--per-question={args.per_question}: expected 1 to 4 dividing --batch={args.batch}")
    rows = arithmetic_preferences(min(HELD_OUT + args.steps * questions, QUESTIONS), 0, 2, "+")
    pick = random.Random(args.seed)
    held_out, train = rows[:HELD_OUT], rows[HELD_OUT:]
    if args.seed:  # the same held-out pairs; another initialisation, order and draw of slips
        pick.shuffle(train)
    laps = -(-args.steps * questions // len(train))  # past the last question, again with new slips drawn
    train += [rejecting(row, draw_near_miss(pick, int(row["answer"]))) for _ in range(laps - 1) for row in train]
    start = time.time()
    print(f"held-out accuracy before: {held_out_accuracy(module, held_out)}", flush=True)
    history: list[tuple[str, bool, float]] = []
    for step in range(args.steps):
        done = (step - args.warmup) / max(args.steps - args.warmup, 1)
        scale = (
            (step + 1) / args.warmup
            if step < args.warmup
            else (1.0 if args.sched == "const" else 0.5 * (1 + math.cos(math.pi * done)))
        )
        for group, peak in zip(optimizer.param_groups, peaks):
            group["lr"] = peak * max(scale, 1e-3)
        batch = train[step * questions : (step + 1) * questions]
        kinds = next((stage for stage, end in stages if step < end), dict.fromkeys(args.kinds, 1.0))
        weighted = len(set(kinds.values())) > 1
        if args.per_question > 1:
            batch = [
                pair
                for row in batch
                for pair in pick.sample([s for s in slips(row) if slip(s) in kinds], args.per_question)
            ]
        elif weighted or set(kinds) != set(KINDS):
            batch = [
                rejecting(row, draw_near_miss(pick, int(row["answer"]), kinds if weighted else list(kinds)))
                for row in batch
            ]
        ids, mask = encode(module, batch)
        every, lengths = suffix_scores(module.policy, module.reward_head, ids, mask, module.tokenizer.pad_token_id)
        chosen, rejected = last_scores(every, lengths).chunk(2)
        margin = chosen - rejected
        optimizer.zero_grad()
        loss = pair_loss(every, lengths, args.suffix_weight if step >= args.suffix_from else 0.0).loss
        if args.distill_weight:
            gap, both = teacher_gaps(module, ids, mask, lengths)
            chosen_every, rejected_every = every.chunk(2)
            margins = (chosen_every - rejected_every)[both]
            loss = loss + args.distill_weight * ((margins - args.distill_scale * gap[both]) ** 2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(adapter + head, 1.0)
        optimizer.step()
        history += [(slip(row), m > 0, m) for row, m in zip(batch, margin.tolist())]
        if (step + 1) % 20 == 0:
            mean_score = float((chosen + rejected).mean().detach()) / 2
            report(step + 1, history, mean_score, (time.time() - start) / (step + 1))
        if args.held_out_every and (step + 1) % args.held_out_every == 0 and step + 1 < args.steps:
            print(f"step {step + 1}: held-out accuracy {held_out_accuracy(module, held_out)}", flush=True)
    after = held_out_accuracy(module, held_out)
    print(f"held-out accuracy after: {after}, {time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
