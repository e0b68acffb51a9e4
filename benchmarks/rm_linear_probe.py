"""How much a linear head on the frozen SFT model can read: pairwise accuracy of a linear probe per layer.

    python benchmarks/rm_linear_probe.py [--init-adapter runs/sft_quickstart/adapter] [--pairs 512]
    python benchmarks/rm_linear_probe.py --rm-adapter runs/rm_quickstart/rm/adapter [...]

The reward model of configs/rm_quickstart.yaml is a linear head on the last
hidden state at the conversation's last token. This fits that head alone
(Bradley-Terry = logistic regression on ``h(chosen) - h(rejected)``, L2 1e-3,
LBFGS) on the frozen SFT model's hidden states, for every third layer and at
the last three positions (the ``\\n`` the reward model reads, ``<|im_end|>``,
the answer's last digit), on the config's pairs: trained on ``--pairs``, held
out on the config's 64. A probe well below the target says the adapter has to
build the feature, not just expose it. Beside it, what the same model knows as
a language model: the share of pairs whose chosen reply it gives the higher
log-likelihood (the pairs differ only in the result's digits).

``--rm-adapter`` asks the second question instead: does a trained reward
model's adapter (the ``adapter/`` that ``lit-grpo rm fit`` exports) keep that
knowledge? It prints the same log-likelihood share on the held-out pairs, by
slip, for the SFT model and with each adapter on.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from rm_learning_curve import slip

from lit_grpo.data.reward_pairs import RewardDataModule
from lit_grpo.data.tasks import arithmetic_preferences
from lit_grpo.model.policy import PolicySpec, build_policy, load_tokenizer
from lit_grpo.objectives import token_logprobs

HELD_OUT = 64  # configs/rm_quickstart.yaml's val_size: the first rows


def features(init_adapter: str, pairs: int) -> tuple[dict[tuple[int, int], torch.Tensor], torch.Tensor]:
    """``(position from the end, layer) -> [HELD_OUT + pairs, 2, H]`` hidden states of chosen and rejected,
    and ``[HELD_OUT + pairs]`` whether the model's log-likelihood of the chosen conversation is the higher."""
    spec = PolicySpec(init_adapter=init_adapter, lora=None)
    model, _ = build_policy(spec, need_reference=False)
    model.eval()
    tokenizer = load_tokenizer(spec)
    rows = arithmetic_preferences(HELD_OUT + pairs, 0, digits=2, ops="+")
    pairs_data = RewardDataModule(max_prompt_length=None)  # whole conversations, as training renders them
    out: dict[tuple[int, int], list[torch.Tensor]] = {}
    generative = []
    with torch.no_grad():
        for start in range(0, len(rows), 32):
            batch = rows[start : start + 32]
            encoded = pairs_data.encode_pairs(tokenizer, batch)
            ids, mask = encoded["input_ids"], encoded["attention_mask"]
            outputs = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
            hidden = outputs.hidden_states  # layers + 1 of [2B, T, H]
            last, n = mask.sum(-1) - 1, len(batch)
            generative.append(chosen_likelier(outputs.logits, ids, mask))
            for back in range(3):
                for layer, states in enumerate(hidden):
                    picked = states[torch.arange(2 * n), last - back]  # [2B, H]
                    out.setdefault((back, layer), []).append(torch.stack([picked[:n], picked[n:]], dim=1))
    return {key: torch.cat(parts) for key, parts in out.items()}, torch.cat(generative)


def chosen_likelier(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` whether each pair's chosen conversation (the first B of ``[2B, T]``) is the likelier."""
    token_logp = token_logprobs(logits[:, :-1], ids[:, 1:])  # [2B, T - 1]
    likelihood = (token_logp * mask[:, 1:]).sum(-1)  # [2B]
    return likelihood[: len(ids) // 2] > likelihood[len(ids) // 2 :]


def knowledge(init_adapter: str, rm_adapters: list[str]) -> None:
    """Print the held-out pairs' log-likelihood share by slip: the SFT model, then with each adapter on."""
    from peft import PeftModel

    spec = PolicySpec(init_adapter=init_adapter, lora=None)
    model, _ = build_policy(spec, need_reference=False)
    rows = arithmetic_preferences(HELD_OUT, 0, digits=2, ops="+")
    kinds = [slip(row) for row in rows]
    encoded = RewardDataModule(max_prompt_length=None).encode_pairs(load_tokenizer(spec), rows)
    print("| model | " + " | ".join(sorted(set(kinds))) + " | all |")
    print("|---|" + "---|" * (len(set(kinds)) + 1))
    for name in ["SFT model", *rm_adapters]:
        scored = model if name == "SFT model" else PeftModel.from_pretrained(model, name)
        scored.eval()
        with torch.no_grad():
            wins = chosen_likelier(
                scored(**encoded, use_cache=False).logits, encoded["input_ids"], encoded["attention_mask"]
            )
        shares = [float(wins[[k == kind for k in kinds]].float().mean()) for kind in sorted(set(kinds))]
        print(f"| {name} | " + " | ".join(f"{share:.3f}" for share in shares) + f" | {wins.float().mean():.3f} |")
        if scored is not model:
            model = scored.unload()  # the SFT model again, for the next adapter


def probe(states: torch.Tensor) -> tuple[float, float]:
    """(train, held-out) pairwise accuracy of a linear Bradley-Terry head fitted on the training pairs."""
    diff = states[:, 0] - states[:, 1]  # [N, H]
    diff = diff / diff[HELD_OUT:].std(0).clamp(min=1e-6)
    weight = torch.zeros(diff.shape[1], requires_grad=True)
    optimizer = torch.optim.LBFGS([weight], max_iter=200)
    train, held_out = diff[HELD_OUT:], diff[:HELD_OUT]

    def closure():
        optimizer.zero_grad()
        loss = F.softplus(-(train @ weight)).mean() + 1e-3 * weight.square().sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    with torch.no_grad():
        return float((train @ weight > 0).float().mean()), float((held_out @ weight > 0).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--init-adapter", default="runs/sft_quickstart/adapter")
    parser.add_argument("--pairs", type=int, default=512)
    parser.add_argument(
        "--rm-adapter",
        nargs="+",
        default=[],
        help="reward models' adapter/ folders: print what the model knows with each on, and stop",
    )
    args = parser.parse_args()
    if args.rm_adapter:
        return knowledge(args.init_adapter, args.rm_adapter)
    states, generative = features(args.init_adapter, args.pairs)
    print(
        f"log p(chosen) > log p(rejected): {generative[HELD_OUT:].float().mean():.2f} of the training pairs, "
        f"{generative[:HELD_OUT].float().mean():.2f} held out"
    )
    layers = sorted({layer for _, layer in states})
    shown = sorted(set(layers[::3]) | {layers[-1]})
    print("| position | " + " | ".join(f"layer {layer}" for layer in shown) + " |")
    print("|---|" + "---|" * len(shown))
    for back, name in enumerate(("last (\\n, scored)", "<|im_end|>", "last digit")):
        cells = [probe(states[(back, layer)]) for layer in shown]
        print(f"| {name} | " + " | ".join(f"{held:.2f} ({train:.2f})" for train, held in cells) + " |")


if __name__ == "__main__":
    main()
