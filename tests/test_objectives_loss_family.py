"""cispo, sapo, GDPO advantages, the entropy bonus and top_entropy_quantile against naive references.

Each reference is written from the paper's formula, token by token in plain
Python floats; the library's vectorised version must match it in value and in
the gradient autograd takes through it.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_bad_inputs import fit  # noqa: F401  (the fixture: lit-grpo fit on the tiny model, in-process)

from lit_grpo.objectives import decoupled_group_advantages, grpo_loss
from lit_grpo.objectives.grpo import high_entropy_mask


def case(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    old = -torch.rand(4, 5, generator=generator) * 2  # [N, T]
    logprobs = (old + torch.randn(4, 5, generator=generator) * 0.4).requires_grad_()  # ratios around 1
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]])
    advantages = torch.tensor([1.5, -0.7, 0.0, 0.9])
    return logprobs, old, advantages, mask


def naive_cispo(logprobs, old, advantages, mask, epsilon_high, num_items):
    total = 0.0
    for i in range(len(mask)):
        for t in range(mask.shape[1]):
            if mask[i, t]:
                ratio = math.exp(logprobs[i, t].item() - old[i, t].item())
                weight = min(ratio, 1 + epsilon_high)  # a constant: no gradient through it
                total = total - weight * advantages[i].item() * logprobs[i, t]
    return total / num_items


def naive_sapo(logprobs, old, advantages, mask, tau_pos, tau_neg):
    rows = []
    for i in range(len(mask)):
        tokens = []
        for t in range(mask.shape[1]):
            if mask[i, t]:
                ratio = torch.exp(logprobs[i, t] - old[i, t])
                tau = tau_pos if advantages[i] > 0 else tau_neg
                gate = 4 / tau / (1 + torch.exp(-tau * (ratio - 1)))
                tokens.append(-gate * advantages[i])
        rows.append(sum(tokens) / max(len(tokens), 1))
    return sum(rows) / len(rows)


def gradient(loss, logprobs):
    (grad,) = torch.autograd.grad(loss, logprobs, retain_graph=True)
    return grad


@pytest.mark.parametrize("epsilon_high", [0.2, 4.0])
def test_cispo_matches_its_naive_reference_in_value_and_gradient(epsilon_high):
    logprobs, old, advantages, mask = case()
    out = grpo_loss(
        logprobs, old, advantages, mask, beta=0.0, loss_type="cispo", epsilon_high=epsilon_high, num_items=11
    )
    reference = naive_cispo(logprobs, old, advantages, mask, epsilon_high, num_items=11)
    torch.testing.assert_close(out.loss, reference)
    torch.testing.assert_close(gradient(out.loss, logprobs), gradient(reference, logprobs))


def test_cispo_keeps_the_gradient_where_the_clip_would_drop_it():
    # ratio 1.5 > 1.2, A = +1: grpo's clipped term is constant (gradient 0); cispo's gradient is -1.2
    logprobs = torch.tensor([[math.log(1.5)]], requires_grad=True)
    args = (logprobs, torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1))
    assert gradient(grpo_loss(*args, beta=0.0).loss, logprobs).item() == 0.0
    cispo = grpo_loss(*args, beta=0.0, loss_type="cispo", num_items=1).loss
    torch.testing.assert_close(gradient(cispo, logprobs), torch.tensor([[-1.2]]))


def test_sapo_matches_its_naive_reference_and_is_the_policy_gradient_on_policy():
    logprobs, old, advantages, mask = case(1)
    out = grpo_loss(
        logprobs, old, advantages, mask, beta=0.0, loss_type="sapo", sapo_temperature_pos=1.0, sapo_temperature_neg=1.05
    )
    reference = naive_sapo(logprobs, old, advantages, mask, 1.0, 1.05)
    torch.testing.assert_close(out.loss, reference)
    torch.testing.assert_close(gradient(out.loss, logprobs), gradient(reference, logprobs))
    # at ratio 1 the gate's slope is 1: the same gradient as grpo's surrogate
    on_policy = logprobs.detach().clone().requires_grad_()
    sapo = grpo_loss(on_policy, on_policy.detach(), advantages, mask, beta=0.0, loss_type="sapo").loss
    grpo = grpo_loss(on_policy, on_policy.detach(), advantages, mask, beta=0.0, loss_type="grpo").loss
    torch.testing.assert_close(gradient(sapo, on_policy), gradient(grpo, on_policy))


def test_the_entropy_bonus_and_the_top_entropy_quantile_match_their_references():
    logprobs, old, advantages, mask = case(2)
    entropies = torch.rand(4, 5, generator=torch.Generator().manual_seed(3)).requires_grad_()
    out = grpo_loss(
        logprobs,
        old,
        advantages,
        mask,
        beta=0.0,
        loss_type="bnpo",
        entropies=entropies,
        entropy_coef=0.01,
        top_entropy_quantile=0.5,
    )
    real = [(i, t) for i in range(4) for t in range(5) if mask[i, t]]
    values = sorted(entropies[i, t].item() for i, t in real)
    threshold = torch.quantile(torch.tensor(values), 0.5).item()
    total = 0.0
    for i, t in real:
        ratio = torch.exp(logprobs[i, t] - old[i, t])
        surrogate = -torch.minimum(ratio * advantages[i], ratio.clamp(0.8, 1.2) * advantages[i])
        keep = 1.0 if entropies[i, t].item() >= threshold else 0.0
        total = total + keep * surrogate - 0.01 * entropies[i, t]
    reference = total / len(real)
    torch.testing.assert_close(out.loss, reference)
    for tensor in (logprobs, entropies):
        torch.testing.assert_close(gradient(out.loss, tensor), gradient(reference, tensor))
    assert out.metrics["entropy/trained_fraction"].item() == pytest.approx(
        sum(entropies[i, t].item() >= threshold for i, t in real) / len(real)
    )


def test_high_entropy_mask_keeps_the_top_fraction_of_real_tokens_only():
    entropies = torch.tensor([[0.1, 0.9, 0.5, 7.0], [0.3, 0.8, 0.2, 0.0]])
    real = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]).bool()  # 7.0 is padding: never kept, never counted
    kept = high_entropy_mask(entropies, real, 0.25)
    assert kept.tolist() == [[0, 1, 0, 0], [0, 1, 0, 0]]


def naive_gdpo(rewards, weights, group_size, eps=1e-4):
    n, k = len(rewards), len(weights)
    totals = []
    for start in range(0, n, group_size):
        group = rewards[start : start + group_size]
        normalised = [[0.0] * k for _ in group]
        for j in range(k):
            values = [row[j] for row in group if not math.isnan(row[j])]
            mean = sum(values) / len(values)
            std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
            for g, row in enumerate(group):
                if not math.isnan(row[j]) and std > 1e-6 * (1 + abs(mean)):
                    normalised[g][j] = (row[j] - mean) / (std + eps)
        totals += [sum(w * x for w, x in zip(weights, row)) for row in normalised]
    mean = sum(totals) / n
    std = math.sqrt(sum((t - mean) ** 2 for t in totals) / n)
    return [t / (std + eps) for t in totals]


def test_gdpo_advantages_match_their_naive_reference_and_weigh_rewards_apart():
    nan = float("nan")
    rewards = [
        [1.0, 10.0],
        [0.0, 30.0],
        [1.0, 20.0],
        [0.0, nan],  # group 0: both rewards vary
        [1.0, 5.0],
        [1.0, 5.0],
        [1.0, 5.0],
        [1.0, 5.0],
    ]  # group 1: both collapsed -> 0
    weights = [1.0, 0.5]
    out = decoupled_group_advantages(torch.tensor(rewards), torch.tensor(weights), group_size=4)
    torch.testing.assert_close(out.advantages, torch.tensor(naive_gdpo(rewards, weights, 4)), rtol=1e-5, atol=1e-6)
    assert out.advantages[4:].eq(0).all() and out.collapsed.tolist() == [False] * 4 + [True] * 4
    # summed first, reward 1's 0/1 would be drowned by reward 2's spread of 20; normalised apart, it is not
    assert out.advantages[0] > out.advantages[1]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_fused_heads_entropy_trains_like_autograds(temperature):
    from lit_grpo.objectives import head_logprobs

    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(6, 8, generator=generator, requires_grad=True)
    weight = torch.randn(11, 8, generator=generator, requires_grad=True)
    tokens = torch.randint(0, 11, (6,), generator=generator)
    coef = torch.rand(6, generator=generator)
    logprobs, entropy = head_logprobs(hidden, weight, tokens, temperature, with_entropy=True, chunk_size=4)
    fused = gradient_pair(logprobs.sum() + (coef * entropy).sum(), hidden, weight)
    logp = torch.log_softmax(hidden @ weight.T / temperature, dim=-1)
    reference = logp.gather(-1, tokens[:, None]).sum() + (coef * -(logp.exp() * logp).sum(-1)).sum()
    for got, expected in zip(fused, gradient_pair(reference, hidden, weight)):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def gradient_pair(loss, *tensors):
    return torch.autograd.grad(loss, tensors)


@pytest.mark.parametrize(
    "options",
    [
        ["--model.loss_type=cispo", "--model.epsilon_high=4.0"],
        ["--model.loss_type=sapo", "--model.sapo_temperature_neg=1.2"],
        ["--model.entropy_coef=0.01", "--model.top_entropy_quantile=0.5", "--model.beta=0"],
        [
            "--data.advantage.multi_objective_aggregation=normalize_then_sum",
            '--data.rewards=[{"class_path": "lit_grpo.rewards.Accuracy"}, {"class_path": "lit_grpo.rewards.Format"}]',
        ],
    ],
)
def test_each_is_selected_from_the_command_line_and_trains(fit, options):  # noqa: F811
    code, last = fit(*options, "--trainer.max_epochs=2", "--data.dynamic_sampling=false")
    assert code == 0, last


def test_a_wrong_choice_is_one_line(fit):  # noqa: F811
    code, last = fit("--model.top_entropy_quantile=0")
    assert code == 2 and last == (
        "lit-grpo: model.top_entropy_quantile=0.0; expected a fraction in (0, 1] (1.0 trains on every token)."
    )
    code, last = fit(
        "--data.advantage.multi_objective_aggregation=normalize_then_sum", "--data.advantage.estimator=rloo"
    )
    assert code == 2 and "use grpo." in last
