"""token_logprobs / token_entropy: parity with the naive full log-softmax."""

import pytest
import torch

from lit_grpo.objectives import head_logprobs, token_entropy, token_logprobs


def naive_logprobs(logits, tokens, temperature=1.0):
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)  # [N, T, V]
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [N, T]


def make(n=3, t=5, v=11, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(n, t, v, generator=gen)).to(dtype)
    tokens = torch.randint(v, (n, t), generator=gen)
    return logits, tokens


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
@pytest.mark.parametrize("chunk_size", [1, 4, 7, 15, 1000])
def test_matches_naive_fp32(temperature, chunk_size):
    # chunk 4 and 7 do not divide N*T=15; 1000 takes all rows at once.
    logits, tokens = make()
    out = token_logprobs(logits, tokens, temperature, chunk_size=chunk_size)
    assert out.dtype == torch.float32 and out.shape == (3, 5)
    torch.testing.assert_close(out.double(), naive_logprobs(logits, tokens, temperature), rtol=0, atol=1e-5)


def test_hand_computed():
    # logits (0, ln 3) at T=1: p = (1/4, 3/4). At T=0.5: logits (0, 2 ln 3) -> p = (1/10, 9/10).
    logits = torch.tensor([[[0.0, torch.log(torch.tensor(3.0))]]])
    tokens = torch.tensor([[1]])
    torch.testing.assert_close(token_logprobs(logits, tokens), torch.log(torch.tensor([[0.75]])))
    torch.testing.assert_close(token_logprobs(logits, tokens, 0.5), torch.log(torch.tensor([[0.9]])))


def test_non_contiguous_logits():
    # logits[:, :-1] cannot be flattened without a copy; chunks must still line up.
    logits, tokens = make(t=6)
    sliced = logits[:, :-1]
    out = token_logprobs(sliced, tokens[:, :5], 0.8, chunk_size=2)
    torch.testing.assert_close(out.double(), naive_logprobs(sliced, tokens[:, :5], 0.8), rtol=0, atol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_bf16(temperature):
    # Stated tolerance: bf16 values are upcast exactly, so against the naive
    # result on the same (upcast) values we keep fp32 accuracy, 1e-5. Against
    # the fp32 logits before rounding to bf16, the bf16 rounding (2^-9 relative
    # on |logits| ~ 9) moves log-probs by up to ~0.1: tolerance 0.15.
    logits32, tokens = make()
    logits = logits32.bfloat16()
    out = token_logprobs(logits, tokens, temperature, chunk_size=4)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), naive_logprobs(logits, tokens, temperature), rtol=0, atol=1e-5)
    torch.testing.assert_close(out.double(), naive_logprobs(logits32, tokens, temperature), rtol=0, atol=0.15)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gradient_matches_naive(dtype, atol, temperature):
    logits, tokens = make(t=6, dtype=dtype)
    weights = torch.randn(3, 5)  # an arbitrary upstream gradient
    chunked_in = logits[:, :-1].detach().requires_grad_()
    (token_logprobs(chunked_in, tokens[:, :5], temperature, chunk_size=4) * weights).sum().backward()
    naive_in = logits[:, :-1].detach().float().requires_grad_()
    (naive_logprobs(naive_in, tokens[:, :5], temperature).float() * weights).sum().backward()
    assert chunked_in.grad.dtype == dtype
    torch.testing.assert_close(chunked_in.grad.float(), naive_in.grad, rtol=0, atol=atol)


def test_gradcheck_float64():
    logits, tokens = make(n=2, t=3, v=5)
    logits = logits.double().requires_grad_()
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, tokens, 0.9, chunk_size=2), (logits,))


def test_autograd_saves_no_vocab_sized_copies():
    # A plain chunked loop would let autograd keep every chunk's fp32
    # log-softmax, i.e. a full [N, T, V] copy in total. Only the logits
    # themselves (and the small token ids) may be saved.
    logits, tokens = make(n=4, t=8, v=64)
    logits.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
        token_logprobs(logits, tokens, 0.7, chunk_size=4)
    big = [x for x in saved if x.numel() >= logits.shape[-1]]
    assert all(x.data_ptr() == logits.data_ptr() for x in big), [x.shape for x in big]


def test_no_grad_input_gives_plain_tensor():
    logits, tokens = make()
    assert token_logprobs(logits, tokens).grad_fn is None


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_entropy_matches_naive(temperature):
    logits, _ = make()
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    expected = -(logp.exp() * logp).sum(-1)
    out = token_entropy(logits, temperature, chunk_size=4)
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-5)


def test_entropy_hand_computed_and_masked_vocab():
    # uniform over 4 -> ln 4; with two -inf logits, uniform over 2 -> ln 2 (no NaN from 0 * -inf)
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, -float("inf"), -float("inf")]]])
    torch.testing.assert_close(token_entropy(logits), torch.log(torch.tensor([[4.0, 2.0]])))


def test_errors_name_shapes():
    logits, tokens = make()
    with pytest.raises(ValueError, match=r"tokens shape \(3, 4\).*logits shape \(3, 5, 11\)"):
        token_logprobs(logits, tokens[:, :4])
    with pytest.raises(ValueError, match="temperature must be > 0"):
        token_logprobs(logits, tokens, temperature=0.0)
    with pytest.raises(ValueError, match=r"\[N, T, V\]"):
        token_entropy(logits[0])


# ------------------------------------------------------------ head_logprobs
def make_head(m=6, h=8, v=13, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, m // 2, h, generator=gen).to(dtype)
    weight = torch.randn(v, h, generator=gen).to(dtype)
    tokens = torch.randint(v, (2, m // 2), generator=gen)
    return hidden, weight, tokens


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [1, 4, 1000])
def test_head_logprobs_match_the_logits_path(temperature, chunk_size):
    hidden, weight, tokens = make_head()
    logprobs, entropy = head_logprobs(hidden, weight, tokens, temperature, with_entropy=True, chunk_size=chunk_size)
    logits = hidden @ weight.T  # [2, 3, V]
    torch.testing.assert_close(logprobs, naive_logprobs(logits, tokens, temperature).float(), rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy, token_entropy(logits, temperature), rtol=0, atol=1e-5)
    assert head_logprobs(hidden, weight, tokens, temperature)[1] is None


def test_head_logprobs_gradcheck_float64_hidden_and_weight():
    hidden, weight, tokens = make_head(dtype=torch.float64)
    hidden.requires_grad_(), weight.requires_grad_()
    assert torch.autograd.gradcheck(lambda h, w: head_logprobs(h, w, tokens, 0.9, chunk_size=4)[0], (hidden, weight))


def test_head_logprobs_save_no_logits():
    hidden, weight, tokens = make_head(m=8, h=4, v=64)
    hidden.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
        head_logprobs(hidden, weight, tokens, 0.7, chunk_size=2)
    assert all(x.shape[-1] != weight.shape[0] or x is weight or x.data_ptr() == weight.data_ptr() for x in saved)
    assert sum(x.numel() for x in saved) <= hidden.numel() + weight.numel() + tokens.numel()
