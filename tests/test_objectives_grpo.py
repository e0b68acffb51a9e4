"""grpo_loss: hand-computed cases, clip/KL gradients, parity, invariances, errors."""

import math

import pytest
import torch

from lit_grpo.objectives import grpo_loss

LOSS_TYPES = ["grpo", "bnpo", "dapo", "dr_grpo"]
NORMS = {"num_items": 7, "max_completion_length": 5}


def ones_ratio_case():
    # ratio = 1 everywhere, beta = 0 -> per-token loss = -A.
    # row 0: A=+1, 2 real tokens -> (-1, -1); row 1: A=-3, 1 real token -> (3)
    logprobs = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    return logprobs, torch.tensor([1.0, -3.0]), mask


@pytest.mark.parametrize(
    "loss_type,expected",
    [
        ("grpo", 1.0),  # row means -1 and 3 -> (-1 + 3) / 2 = 1
        ("bnpo", 1 / 3),  # token sum -1 - 1 + 3 = 1 over 3 tokens
        ("dapo", 1 / 7),  # token sum 1 / num_items 7
        ("dr_grpo", 0.1),  # token sum 1 / (2 rows * max_completion_length 5)
    ],
)
def test_aggregation_hand_computed(loss_type, expected):
    logprobs, adv, mask = ones_ratio_case()
    out = grpo_loss(logprobs, logprobs.detach(), adv, mask, beta=0.0, loss_type=loss_type, **NORMS)
    torch.testing.assert_close(out.loss, torch.tensor(expected))


def test_clip_hand_computed_and_metrics():
    # One token per row, (ratio, A) -> -min(rho*A, clip(rho, 0.8, 1.2)*A):
    # (1.5, +1) -> -min(1.5, 1.2) = -1.2   (high clip binds)
    # (1.5, -1) -> -min(-1.5, -1.2) = 1.5
    # (0.5, -1) -> -min(-0.5, -0.8) = 0.8  (low clip binds)
    # (0.5, +1) -> -min(0.5, 0.8) = -0.5
    # bnpo mean: (-1.2 + 1.5 + 0.8 - 0.5) / 4 = 0.15
    ratio = torch.tensor([[1.5], [1.5], [0.5], [0.5]])
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0])
    logprobs = ratio.log()
    out = grpo_loss(logprobs, torch.zeros(4, 1), adv, torch.ones(4, 1), beta=0.0, loss_type="bnpo")
    torch.testing.assert_close(out.loss, torch.tensor(0.15))
    m = out.metrics
    assert m["clip_ratio/high"].item() == 0.25 and m["clip_ratio/low"].item() == 0.25
    assert m["clip_ratio/region"].item() == 0.5
    torch.testing.assert_close(m["ratio/mean"], torch.tensor(1.0))  # (1.5+1.5+0.5+0.5)/4
    assert "kl" not in m and all(not v.requires_grad and v.dim() == 0 for v in m.values())


def test_clip_higher():
    # ratio 1.25, A=+1: eps_high 0.2 -> -1.2; DAPO's eps_high 0.28 -> -1.25 (unclipped)
    logprobs, old, adv, mask = torch.tensor([[math.log(1.25)]]), torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1)
    default = grpo_loss(logprobs, old, adv, mask, beta=0.0).loss
    higher = grpo_loss(logprobs, old, adv, mask, beta=0.0, epsilon_high=0.28).loss
    torch.testing.assert_close(default, torch.tensor(-1.2))
    torch.testing.assert_close(higher, torch.tensor(-1.25))


def test_clip_gradient():
    # ratio 1.5 > 1.2. A=+1: the clipped term 1.2 is the min -> constant -> grad exactly 0.
    # A=-1: -(rho * -1) = rho is the max of the negated pair -> d/dlogp = rho = 1.5 (grpo, 1 row/1 token).
    for adv, expected in [(1.0, 0.0), (-1.0, 1.5)]:
        logprobs = torch.tensor([[math.log(1.5)]], requires_grad=True)
        grpo_loss(logprobs, torch.zeros(1, 1), torch.tensor([adv]), torch.ones(1, 1), beta=0.0).loss.backward()
        if expected == 0.0:
            assert logprobs.grad.item() == 0.0
        else:
            torch.testing.assert_close(logprobs.grad, torch.tensor([[expected]]))


def test_kl_hand_computed():
    # ref - logp = ln 2 -> k3 = 2 - ln 2 - 1 = 0.30685; A=0, ratio 1 -> loss = 0.04 * 0.30685
    logprobs = torch.zeros(1, 1)
    ref = torch.full((1, 1), math.log(2.0))
    out = grpo_loss(logprobs, logprobs, torch.zeros(1), torch.ones(1, 1), ref_logprobs=ref)
    torch.testing.assert_close(out.loss, torch.tensor(0.04 * (1 - math.log(2.0))))
    torch.testing.assert_close(out.metrics["kl"], torch.tensor(1 - math.log(2.0)))


def test_kl_nonnegative_zero_at_ref_and_analytic_gradient():
    gen = torch.Generator().manual_seed(0)
    logprobs = torch.randn(4, 6, generator=gen).requires_grad_()
    ref = torch.randn(4, 6, generator=gen)
    mask = torch.ones(4, 6)
    # A = 0 removes the surrogate; bnpo over 24 tokens, beta = 1 -> loss = mean k3.
    out = grpo_loss(logprobs, logprobs.detach(), torch.zeros(4), mask, ref_logprobs=ref, beta=1.0, loss_type="bnpo")
    out.loss.backward()
    assert out.metrics["kl"] >= 0
    # d/dlogp [exp(ref - logp) - (ref - logp) - 1] = 1 - exp(ref - logp), / 24 tokens
    torch.testing.assert_close(logprobs.grad, (1 - torch.exp(ref - logprobs.detach())) / 24)
    same = grpo_loss(ref, ref, torch.zeros(4), mask, ref_logprobs=ref, beta=1.0)
    assert same.metrics["kl"].item() == 0.0 and same.loss.item() == 0.0


@pytest.mark.parametrize("importance_level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_empty_rows_contribute_nothing(loss_type, importance_level):
    # Row 1 is all padding, and its padded values are garbage (inf, -inf, 50):
    # no NaN, zero gradient, and the other rows' loss is unchanged except that
    # grpo and dr_grpo count every row in their denominators (2 rows vs 1).
    gen = torch.Generator().manual_seed(1)
    logprobs = torch.randn(2, 4, generator=gen)
    logprobs[1] = 50.0
    logprobs.requires_grad_()
    old = logprobs.detach() + 0.1 * torch.randn(2, 4, generator=gen)
    old[1], old[0, 3] = float("inf"), -float("inf")
    ref = old.clone()
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0]])
    kwargs = dict(ref_logprobs=ref, loss_type=loss_type, importance_level=importance_level, **NORMS)
    out = grpo_loss(logprobs, old, torch.tensor([1.0, -1.0]), mask, **kwargs)
    out.loss.backward()
    assert torch.isfinite(out.loss) and all(torch.isfinite(v) for v in out.metrics.values())
    assert torch.equal(logprobs.grad[1], torch.zeros(4)) and logprobs.grad[0, 3] == 0.0
    alone = grpo_loss(logprobs[:1], old[:1], torch.tensor([1.0]), mask[:1], **{**kwargs, "ref_logprobs": ref[:1]})
    rows_factor = 0.5 if loss_type in ("grpo", "dr_grpo") else 1.0
    torch.testing.assert_close(out.loss, alone.loss * rows_factor)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_all_padding_batch_is_zero(loss_type):
    logprobs = torch.zeros(2, 3, requires_grad=True)
    out = grpo_loss(
        logprobs,
        logprobs.detach(),
        torch.ones(2),
        torch.zeros(2, 3),
        ref_logprobs=torch.zeros(2, 3),
        loss_type=loss_type,
        **NORMS,
    )
    out.loss.backward()
    assert out.loss.item() == 0.0 and not logprobs.grad.isnan().any()


def reference_loss(logprobs, old, adv, mask, ref, beta, eps_low, eps_high, loss_type, level, max_len, num_items):
    """Naive per-row, per-token loop straight from docs/design.md, "The objective", 3-6."""
    n_rows, n_positions = logprobs.shape
    row_sums, row_counts = [], []
    for i in range(n_rows):
        real = [t for t in range(n_positions) if mask[i, t]]
        seq_log_ratio = sum((logprobs[i, t] - old[i, t] for t in real), torch.tensor(0.0)) / max(len(real), 1)
        total = torch.tensor(0.0)
        for t in real:
            rho = torch.exp(seq_log_ratio if level == "sequence" else logprobs[i, t] - old[i, t])
            term = -torch.min(rho * adv[i], torch.clamp(rho, 1 - eps_low, 1 + eps_high) * adv[i])
            if beta:
                d = ref[i, t] - logprobs[i, t]
                term = term + beta * (torch.exp(d) - d - 1)
            total = total + term
        row_sums.append(total)
        row_counts.append(len(real))
    if loss_type == "grpo":
        return sum(s / max(c, 1) for s, c in zip(row_sums, row_counts)) / n_rows
    if loss_type == "bnpo":
        return sum(row_sums) / max(sum(row_counts), 1)
    if loss_type == "dapo":
        return sum(row_sums) / num_items
    return sum(row_sums) / (n_rows * max_len)


@pytest.mark.parametrize("importance_level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_parity_with_reference_loop(loss_type, importance_level, beta):
    gen = torch.Generator().manual_seed(2)
    logprobs = (-torch.rand(5, 6, generator=gen) * 3).requires_grad_()
    old = logprobs.detach() + 0.4 * torch.randn(5, 6, generator=gen)  # ratios well outside [0.8, 1.28]
    ref = logprobs.detach() + 0.5 * torch.randn(5, 6, generator=gen)
    adv = torch.randn(5, generator=gen)
    lengths = torch.tensor([6, 3, 0, 1, 5])  # includes an empty row
    mask = (torch.arange(6) < lengths[:, None]).float()
    args = (beta, 0.2, 0.28, loss_type, importance_level, 5, 13)
    expected = reference_loss(logprobs, old, adv, mask, ref, *args)
    (expected_grad,) = torch.autograd.grad(expected, logprobs)
    out = grpo_loss(
        logprobs,
        old,
        adv,
        mask,
        ref_logprobs=ref,
        beta=beta,
        epsilon_high=0.28,
        loss_type=loss_type,
        importance_level=importance_level,
        max_completion_length=5,
        num_items=13,
    )
    out.loss.backward()
    torch.testing.assert_close(out.loss, expected)
    torch.testing.assert_close(logprobs.grad, expected_grad)


def test_sequence_level_hand_computed():
    # log-ratios (ln 2, 0) -> mean ln2/2 -> rho = sqrt 2 = 1.414 for both tokens.
    # A=-1: -min(-1.414, -1.2) = 1.414 per token; grpo row mean 1.414.
    # Masking the 2nd token (value 100 ignored): rho = 2 -> loss 2.
    logprobs = torch.tensor([[math.log(2.0), 100.0]])
    adv = torch.tensor([-1.0])
    out = grpo_loss(
        logprobs, torch.tensor([[0.0, 100.0]]), adv, torch.ones(1, 2), beta=0.0, importance_level="sequence"
    )
    torch.testing.assert_close(out.loss, torch.tensor(math.sqrt(2.0)))
    masked = grpo_loss(logprobs, torch.zeros(1, 2), adv, torch.tensor([[1, 0]]), beta=0.0, importance_level="sequence")
    torch.testing.assert_close(masked.loss, torch.tensor(2.0))


@pytest.mark.parametrize("importance_level", ["token", "sequence"])
def test_dapo_split_into_micro_batches_gives_the_same_gradient(importance_level):
    gen = torch.Generator().manual_seed(3)
    logprobs = torch.randn(6, 5, generator=gen).requires_grad_()
    old = logprobs.detach() + 0.3 * torch.randn(6, 5, generator=gen)
    ref = logprobs.detach() + 0.3 * torch.randn(6, 5, generator=gen)
    adv = torch.randn(6, generator=gen)
    mask = (torch.arange(5) < torch.tensor([5, 1, 3, 4, 2, 5])[:, None]).float()
    num_items = int(mask.sum())  # 20 tokens in the whole rollout batch

    def loss(rows, loss_type="dapo"):
        return grpo_loss(
            logprobs[rows],
            old[rows],
            adv[rows],
            mask[rows],
            ref_logprobs=ref[rows],
            loss_type=loss_type,
            importance_level=importance_level,
            num_items=num_items,
        ).loss

    (whole,) = torch.autograd.grad(loss(slice(0, 6)), logprobs)
    # Unequal micro-batches (2 rows with 6 tokens, 4 rows with 14) summed, as gradient accumulation does.
    (split,) = torch.autograd.grad(loss(slice(0, 2)) + loss(slice(2, 6)), logprobs)
    torch.testing.assert_close(split, whole)
    # The same split under bnpo weighs tokens 1/6 vs 1/14, so the test can tell.
    (bnpo_whole,) = torch.autograd.grad(loss(slice(0, 6), "bnpo"), logprobs)
    (bnpo_split,) = torch.autograd.grad(loss(slice(0, 2), "bnpo") + loss(slice(2, 6), "bnpo"), logprobs)
    assert not torch.allclose(bnpo_split, bnpo_whole)


class Untouchable:
    def __getattr__(self, name):
        raise AssertionError(f"ref_logprobs.{name} was accessed with beta=0")


def test_beta_zero_never_touches_ref():
    logprobs = torch.zeros(2, 3)
    out = grpo_loss(logprobs, logprobs, torch.ones(2), torch.ones(2, 3), ref_logprobs=Untouchable(), beta=0.0)
    assert "kl" not in out.metrics


def test_errors():
    lp, mask, adv = torch.zeros(2, 3), torch.ones(2, 3), torch.ones(2)
    with pytest.raises(
        ValueError, match=r"loss_type must be one of \['bnpo', 'cispo', 'dapo', 'dr_grpo', 'grpo', 'sapo'\], got 'ppo'"
    ):
        grpo_loss(lp, lp, adv, mask, beta=0.0, loss_type="ppo")
    with pytest.raises(ValueError, match=r"importance_level must be one of \['sequence', 'token'\]"):
        grpo_loss(lp, lp, adv, mask, beta=0.0, importance_level="row")
    with pytest.raises(ValueError, match="'dapo' needs num_items"):
        grpo_loss(lp, lp, adv, mask, beta=0.0, loss_type="dapo")
    with pytest.raises(ValueError, match="'dr_grpo' needs max_completion_length"):
        grpo_loss(lp, lp, adv, mask, beta=0.0, loss_type="dr_grpo")
    with pytest.raises(ValueError, match="num_items must be > 0"):
        grpo_loss(lp, lp, adv, mask, beta=0.0, loss_type="dapo", num_items=0)
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        grpo_loss(lp, lp, adv, mask)
    with pytest.raises(ValueError, match=r"old_logprobs shape \(2, 4\) does not match logprobs shape \(2, 3\)"):
        grpo_loss(lp, torch.zeros(2, 4), adv, mask, beta=0.0)
    with pytest.raises(ValueError, match=r"ref_logprobs shape \(3, 3\) does not match logprobs shape \(2, 3\)"):
        grpo_loss(lp, lp, adv, mask, ref_logprobs=torch.zeros(3, 3))
    with pytest.raises(ValueError, match=r"completion_mask shape \(2,\) does not match"):
        grpo_loss(lp, lp, adv, torch.ones(2), beta=0.0)
    with pytest.raises(ValueError, match=r"advantages shape \(2, 1\) does not match logprobs shape \(2, 3\)"):
        grpo_loss(lp, lp, torch.ones(2, 1), mask, beta=0.0)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_bf16_inputs_are_computed_in_fp32_and_match_the_reference_loop(loss_type):
    # bf16 log-probs (what a bf16 model's logits give without the fused head) are upcast first:
    # the loss equals the fp32 reference on the same (rounded) values, not a bf16 computation of it.
    gen = torch.Generator().manual_seed(3)
    logprobs = (-torch.rand(5, 6, generator=gen) * 3).bfloat16().requires_grad_()
    old = (logprobs.detach().float() + 0.4 * torch.randn(5, 6, generator=gen)).bfloat16()
    ref = (logprobs.detach().float() + 0.5 * torch.randn(5, 6, generator=gen)).bfloat16()
    adv = torch.randn(5, generator=gen).bfloat16()
    mask = (torch.arange(6) < torch.tensor([6, 3, 0, 1, 5])[:, None]).float()
    upcast = logprobs.detach().float().requires_grad_()
    expected = reference_loss(
        upcast, old.float(), adv.float(), mask, ref.float(), 0.04, 0.2, 0.28, loss_type, "token", 5, 13
    )
    (expected_grad,) = torch.autograd.grad(expected, upcast)
    out = grpo_loss(
        logprobs,
        old,
        adv,
        mask,
        ref_logprobs=ref,
        beta=0.04,
        epsilon_high=0.28,
        loss_type=loss_type,
        max_completion_length=5,
        num_items=13,
    )
    out.loss.backward()
    assert out.loss.dtype == torch.float32 and out.metrics["kl"].dtype == torch.float32
    torch.testing.assert_close(out.loss, expected)
    assert logprobs.grad.dtype == torch.bfloat16
    torch.testing.assert_close(logprobs.grad.float(), expected_grad, atol=2e-3, rtol=8e-3)  # bf16 rounding
