"""Reward model: the Bradley-Terry loss, training, the exports, RewardModel separate and on the shared base."""

from __future__ import annotations

import json
import math
import shutil

import lightning as L
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from lit_grpo.algorithms.grpo import GRPOModule
from lit_grpo.algorithms.reward_model import RewardModelModule, pair_loss, pair_scores, suffix_scores
from lit_grpo.data.preferences import PreferenceDataModule
from lit_grpo.data.reward_pairs import RewardDataModule
from lit_grpo.model.policy import LoraSpec, PolicySpec
from lit_grpo.objectives import bradley_terry_loss
from lit_grpo.rewards import Accuracy, RewardCombiner, RewardModel
from lit_grpo.rewards.reward_model import backbone_scores, encode_conversations, last_token_index


def trainer(**kwargs) -> L.Trainer:
    options = dict(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    return L.Trainer(**{**options, **kwargs})


# ------------------------------------------------------------------ the loss
def test_bradley_terry_against_a_naive_reference():
    generator = torch.Generator().manual_seed(0)
    chosen, rejected = torch.randn(7, generator=generator) * 3, torch.randn(7, generator=generator) * 3
    out = bradley_terry_loss(chosen, rejected)
    naive = sum(math.log(1 + math.exp(-(c - r))) for c, r in zip(chosen.tolist(), rejected.tolist())) / 7
    torch.testing.assert_close(out.loss, torch.tensor(naive))
    wins = sum(c > r for c, r in zip(chosen.tolist(), rejected.tolist())) / 7
    torch.testing.assert_close(out.metrics["accuracy"], torch.tensor(wins))
    torch.testing.assert_close(out.metrics["margin"], (chosen - rejected).mean())
    # equal scores: -log sigmoid(0) = ln 2, no pair won; a huge margin stays finite
    assert abs(float(bradley_terry_loss(torch.zeros(2), torch.zeros(2)).loss) - math.log(2)) < 1e-6
    assert torch.isfinite(bradley_terry_loss(torch.tensor([-1e4]), torch.tensor([1e4])).loss)


def test_last_token_index_is_transformers_rule():
    pad = 0
    ids = torch.tensor([[5, 6, 7, 0, 0], [0, 0, 5, 6, 7], [5, 0, 6, 0, 0]])  # right, left, pad inside
    assert last_token_index(ids, pad).tolist() == [2, 4, 2]
    assert last_token_index(ids, None).tolist() == [4, 4, 4]


PAIR_BATCHES = {
    # the batch shares the system prompt; each pair also the rest of its prompt and reply's start
    "prompts differ": [
        ("What is 12 + 30?", "12 + 30 = 42", "12 + 30 = 43"),
        ("What is 7 + 8?", "15", "155"),
        ("Hi there, how are you today?", "Fine, thanks.", "No"),
    ],
    # one prompt: the first pair shares no more than the whole batch does, the second a reply's start too
    "one prompt": [("What is 7 + 8?", "15", "fifteen"), ("What is 7 + 8?", "7 + 8 = 15", "7 + 8 = 16")],
    "one pair": [("What is 7 + 8?", "7 + 8 = 15", "7 + 8 = 16")],
}


def test_final_hidden_states_are_what_the_output_head_reads(tiny_model_dir):
    # Through the model's own forward (FSDP2's root hooks run), the decoder's final states: the
    # output head applied to them gives the model's logits, at every position.
    from transformers import AutoModelForCausalLM

    from lit_grpo.model.logprob_passes import final_hidden_states

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.randint(3, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    hidden = final_hidden_states(model, input_ids=ids, attention_mask=mask, use_cache=False)  # [2, 7, H]
    assert hidden.shape == (2, 7, model.config.hidden_size)
    expected = model(input_ids=ids, attention_mask=mask).logits  # [2, 7, V]
    torch.testing.assert_close(model.get_output_embeddings()(hidden), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("checkpointed", [False, True])
@pytest.mark.parametrize("batch", sorted(PAIR_BATCHES))
def test_pair_scores_equal_a_full_pass_per_row_with_their_gradients(tiny_model_dir, checkpointed, batch):
    # The shared-prefix pass the module trains with must score (and differentiate) exactly as the
    # one-pass rule the export and RewardModel use; replies of other lengths, one a prefix of the other.
    # A checkpointed model (whose layers would drop the prefix cache) takes the full pass.
    torch.manual_seed(0)
    module = RewardModelModule(
        policy=PolicySpec(name_or_path=tiny_model_dir, lora=LoraSpec(r=4, alpha=8), gradient_checkpointing=checkpointed)
    )
    module.configure_model()
    for p in module.trainable_parameters():  # a non-zero adapter, so that its gradients are not trivial
        p.data.normal_(0, 0.05)
    prompts, chosen, rejected = zip(*PAIR_BATCHES[batch])
    ids, mask = encode_conversations(module.tokenizer, list(prompts) * 2, [*chosen, *rejected], None, None)
    pad = module.tokenizer.pad_token_id
    results = []
    for scores in (pair_scores, backbone_scores):
        module.zero_grad()
        out = scores(module.policy, module.reward_head, ids, mask, pad)
        (out * torch.arange(1.0, len(ids) + 1.0)).sum().backward()
        results.append((out.detach(), [p.grad.clone() for p in module.trainable_parameters()]))
    (shared, shared_grads), (full, full_grads) = results
    torch.testing.assert_close(shared, full, atol=1e-5, rtol=1e-4)
    for a, b in zip(shared_grads, full_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("checkpointed", [False, True])
@pytest.mark.parametrize("batch", sorted(PAIR_BATCHES))
def test_suffix_scores_are_the_heads_scores_of_a_full_pass_from_each_pairs_first_difference(
    tiny_model_dir, checkpointed, batch
):
    torch.manual_seed(0)
    module = RewardModelModule(
        policy=PolicySpec(name_or_path=tiny_model_dir, lora=LoraSpec(r=4, alpha=8), gradient_checkpointing=checkpointed)
    )
    module.configure_model()
    for p in module.trainable_parameters():
        p.data.normal_(0, 0.05)
    prompts, chosen, rejected = zip(*PAIR_BATCHES[batch])
    ids, mask = encode_conversations(module.tokenizer, list(prompts) * 2, [*chosen, *rejected], None, None)
    with torch.no_grad():
        every, lengths = suffix_scores(module.policy, module.reward_head, ids, mask, module.tokenizer.pad_token_id)
        hidden = module.policy.get_base_model().get_decoder()(input_ids=ids, attention_mask=mask).last_hidden_state
        full = module.reward_head(hidden).squeeze(-1)  # [2B, T] the head at every token of one pass per row
    B, ends = len(chosen), mask.sum(-1).tolist()
    for i, (end, n) in enumerate(zip(ends, lengths.tolist())):
        start, pair = end - n, (i % B, i % B + B)
        # the suffix starts at the pair's first differing token (or the shorter row's last, when one is a prefix)
        assert ids[pair[0], :start].tolist() == ids[pair[1], :start].tolist()
        assert start == min(ends[pair[0]], ends[pair[1]]) - 1 or ids[pair[0], start] != ids[pair[1], start]
        torch.testing.assert_close(every[i, :n], full[i, start:end], atol=1e-5, rtol=1e-4)


def test_pair_loss_adds_the_loss_of_every_token_both_replies_have_against_a_naive_reference():
    generator = torch.Generator().manual_seed(0)
    every = torch.randn(4, 5, generator=generator) * 2  # B = 2 pairs, chosen rows first
    lengths = torch.tensor([3, 2, 5, 4])  # pair 0: 3 and 5 tokens from the first difference, pair 1: 2 and 4
    last = [every[i, n - 1].item() for i, n in enumerate(lengths.tolist())]
    pairs = [(every[0, k].item(), every[2, k].item()) for k in range(3)] + [
        (every[1, k].item(), every[3, k].item()) for k in range(2)
    ]
    naive_last = sum(math.log(1 + math.exp(-(c - r))) for c, r in zip(last[:2], last[2:])) / 2
    naive_tokens = sum(math.log(1 + math.exp(-(c - r))) for c, r in pairs) / len(pairs)
    torch.testing.assert_close(pair_loss(every, lengths).loss, torch.tensor(naive_last))
    out = pair_loss(every, lengths, suffix_weight=0.5)
    torch.testing.assert_close(out.loss, torch.tensor(naive_last + 0.5 * naive_tokens))
    torch.testing.assert_close(out.metrics["suffix_accuracy"], torch.tensor(sum(c > r for c, r in pairs) / len(pairs)))
    torch.testing.assert_close(
        out.metrics["accuracy"], torch.tensor(float(last[0] > last[2]) / 2 + float(last[1] > last[3]) / 2)
    )
    with pytest.raises(ValueError, match=r"model.suffix_weight=-1.0; expected a weight >= 0"):
        RewardModelModule(suffix_weight=-1.0)


def test_equal_chosen_and_rejected_is_named(tmp_path):
    rows = [{"prompt": f"q{i}", "chosen": "a", "rejected": "b"} for i in range(3)]
    rows.append({"prompt": "q", "chosen": "same", "rejected": [{"role": "assistant", "content": "same "}]})
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = PreferenceDataModule(source=str(tmp_path / "pairs.jsonl"), val_size=1)
    with pytest.raises(ValueError, match="row 3: chosen and rejected are the same reply"):
        data.setup("fit")


# ------------------------------------------------------- training and export
@pytest.fixture(scope="module")
def trained_rm(tmp_path_factory, tiny_model_dir):
    """A LoRA reward model trained a few steps on the tiny model and exported."""
    L.seed_everything(0)
    module = RewardModelModule(
        policy=PolicySpec(name_or_path=tiny_model_dir, lora=LoraSpec(r=4, alpha=8)),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
        progress=False,
    )
    data = RewardDataModule(train_size=8, val_size=8, batch_size=4, val_batch_size=8)
    trainer(max_epochs=2).fit(module, data)
    folder = tmp_path_factory.mktemp("rm") / "export"
    module.export_adapter(folder)
    return module, data, folder


def test_head_lr_is_a_parameter_group_of_its_own_that_a_scheduler_keeps_in_ratio(tiny_model_dir):
    module = RewardModelModule(
        policy=PolicySpec(name_or_path=tiny_model_dir, lora=LoraSpec(r=4, alpha=8)),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4),
        head_lr=1e-3,
        scheduler=lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=10),
    )
    module.configure_model()
    configured = module.configure_optimizers()
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    backbone, head = optimizer.param_groups
    assert head["params"] == [module.reward_head.weight] and backbone["lr"] == 1e-4 and head["lr"] == 1e-3
    assert len(backbone["params"]) + 1 == len(module.trainable_parameters())
    for _ in range(4):
        optimizer.step()
        scheduler.step()
    assert head["lr"] < 1e-3 and head["lr"] == pytest.approx(10 * backbone["lr"])
    plain = RewardModelModule(policy=PolicySpec(name_or_path=tiny_model_dir, lora=LoraSpec(r=4, alpha=8)))
    plain.configure_model()
    assert len(plain.configure_optimizers().param_groups) == 1  # without head_lr: one group, as before
    with pytest.raises(ValueError, match=r"model.head_lr=0.0; expected a learning rate > 0"):
        RewardModelModule(head_lr=0.0)


def test_full_fine_tuned_reward_model_learns_the_pairs(tiny_model_dir):
    # 8 pairs seen 30 times over, validated on the same 8: every pair must end up ranked right.
    L.seed_everything(0)
    module = RewardModelModule(
        policy=PolicySpec(name_or_path=tiny_model_dir, lora=None),
        progress=False,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
    )
    data = RewardDataModule(train_size=8, val_split="train", val_size=8, batch_size=4, val_batch_size=8)
    fit = trainer(max_epochs=30, check_val_every_n_epoch=100)
    (before,) = fit.validate(module, data, verbose=False)
    fit.fit(module, data)
    (after,) = fit.validate(module, data, verbose=False)
    assert after["val/accuracy"] == 1.0 and after["val/margin"] > before["val/margin"] + 1.0
    assert after["val/loss"] < 0.3 < before["val/loss"]


def test_export_is_a_sequence_classifier_scoring_as_trained(trained_rm):
    module, data, folder = trained_rm
    batch = data.collate(data.val_rows)
    with torch.no_grad():
        module.eval()
        ours = module.scores(batch["input_ids"], batch["attention_mask"])
        theirs = AutoModelForSequenceClassification.from_pretrained(folder)(**batch).logits[:, 0]
        separate = RewardModel(str(folder))
        separate.bind(module)
        prompts = [r["prompt"] for r in data.val_rows] * 2
        replies = [r["chosen"] for r in data.val_rows] + [r["rejected"] for r in data.val_rows]
        scored = torch.tensor(separate(prompts, replies))
    assert ours.abs().max() > 0 and (ours - ours.mean()).abs().max() > 1e-4  # not a constant
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(scored, ours, rtol=1e-5, atol=1e-5)
    assert (folder / "adapter" / "adapter_config.json").is_file() and (
        folder / "adapter" / "reward_head.safetensors"
    ).is_file()


def test_shared_base_scores_as_a_separate_copy_and_leaves_the_policy_alone(trained_rm, tiny_model_dir):
    _, data, folder = trained_rm
    module = GRPOModule(policy=PolicySpec(name_or_path=tiny_model_dir, lora=LoraSpec(r=4, alpha=8)))
    module.configure_model()
    with torch.no_grad():
        for name, p in module.policy.named_parameters():
            if "lora_B" in name:
                p.normal_()  # an actor adapter that is not a no-op
    module.policy.train()  # as during a rollout inside fit
    before = {k: v.clone() for k, v in module.policy.state_dict().items()}
    flags = {n: p.requires_grad for n, p in module.policy.named_parameters()}
    shared, separate = RewardModel(str(folder), shared_base=True), RewardModel(str(folder))
    shared.bind(module)
    separate.bind(module)
    prompts = [r["prompt"] for r in data.val_rows]
    replies = [r["chosen"] for r in data.val_rows]
    torch.testing.assert_close(
        torch.tensor(shared(prompts, replies)), torch.tensor(separate(prompts, replies)), rtol=1e-5, atol=1e-5
    )
    after = module.policy.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items())  # base and actor adapter untouched
    assert {n: p.requires_grad for n, p in module.policy.named_parameters() if n in flags} == flags
    assert module.policy.active_adapter == "default" and module.policy.training
    assert not any(p.requires_grad for n, p in module.policy.named_parameters() if ".rm_reward_model." in n)
    # checkpoints hold the actor adapter only: the frozen reward adapter is reloaded from its folder
    assert set(module.state_dict()) == {f"policy.{k}" for k in before if "lora_" in k and ".default." in k}


def test_two_reward_models_on_one_shared_base_each_score_as_their_own_copy(trained_rm, tiny_model_dir, tmp_path):
    # a second reward model: the first one's adapter and head, changed
    _, data, folder = trained_rm
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    adapter = other / "adapter" / "adapter_model.safetensors"
    save_file({k: -2 * v for k, v in load_file(adapter).items()}, adapter)
    head = other / "adapter" / "reward_head.safetensors"
    save_file({"weight": load_file(head)["weight"].flip(1).contiguous()}, head)

    def policy() -> GRPOModule:
        module = GRPOModule(policy=PolicySpec(name_or_path=tiny_model_dir, lora=LoraSpec(r=4, alpha=8)))
        module.configure_model()
        return module

    prompts, replies = [r["prompt"] for r in data.val_rows], [r["chosen"] for r in data.val_rows]
    module = policy()
    both = [
        RewardModel(str(folder), shared_base=True, name="first"),
        RewardModel(str(other), shared_base=True, name="second"),
    ]
    RewardCombiner(both).bind(module)
    assert {"rm_first", "rm_second"} <= set(module.policy.peft_config)
    scores = []
    for rm in both:
        alone = RewardModel(rm.name_or_path, shared_base=True)
        alone.bind(policy())
        scores.append(torch.tensor(rm(prompts, replies)))
        torch.testing.assert_close(scores[-1], torch.tensor(alone(prompts, replies)), rtol=1e-5, atol=1e-5)
    assert (scores[0] - scores[1]).abs().max() > 1e-3  # each with its own adapter and head


def test_reward_model_beside_a_rule_reward_with_weights(trained_rm):
    module, data, folder = trained_rm
    rm = RewardModel(str(folder), weight=0.5, normalize=True)
    combiner = RewardCombiner([rm, Accuracy(weight=2.0)])
    combiner.bind(module)
    rows = data.val_rows[:4]
    scores = combiner.score(
        [r["prompt"] for r in rows], [r["chosen"] for r in rows], {"answer": [r["answer"] for r in rows]}
    )
    normalised = scores.per_function["reward_model"]
    torch.testing.assert_close(normalised.mean(), torch.tensor(0.0), atol=1e-5, rtol=0)
    torch.testing.assert_close(scores.total, 0.5 * normalised + 2.0 * scores.per_function["accuracy"])


# --------------------------------------------------------------- bad input
def test_folder_that_is_not_a_sequence_classifier(tiny_model_dir):
    with pytest.raises(ValueError, match="is a \\['LlamaForCausalLM'\\], not a sequence-classification model"):
        RewardModel(tiny_model_dir)


def test_head_with_more_than_one_output(tmp_path, trained_rm):
    model = AutoModelForSequenceClassification.from_pretrained(
        trained_rm[2], num_labels=2, ignore_mismatched_sizes=True
    )
    model.save_pretrained(tmp_path / "two")
    with pytest.raises(ValueError, match="head with 2 outputs"):
        RewardModel(str(tmp_path / "two"))


def test_tokenizer_without_chat_template(tmp_path, trained_rm):
    folder = tmp_path / "no_template"
    shutil.copytree(trained_rm[2], folder)
    (folder / "chat_template.jinja").unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="has no chat template"):
        RewardModel(str(folder))


def test_shared_base_needs_the_policy_vocabulary_and_base(tmp_path, trained_rm, tiny_model_dir):
    folder = tmp_path / "other_vocab"
    shutil.copytree(trained_rm[2], folder)
    tokenizer = AutoTokenizer.from_pretrained(folder / "adapter")
    tokenizer.add_tokens(["<extra-token>"])
    tokenizer.save_pretrained(folder / "adapter")
    module = GRPOModule(policy=PolicySpec(name_or_path=tiny_model_dir, lora=LoraSpec(r=4, alpha=8)))
    module.configure_model()
    with pytest.raises(ValueError, match="another vocabulary"):
        RewardModel(str(folder), shared_base=True).bind(module)
    other_base = GRPOModule(
        policy=PolicySpec(
            name_or_path=tiny_model_dir, lora=LoraSpec(r=4, alpha=8), init_adapter=str(trained_rm[2] / "adapter")
        )
    )
    other_base.configure_model()
    with pytest.raises(ValueError, match="was trained on policy.init_adapter=None"):
        RewardModel(str(trained_rm[2]), shared_base=True).bind(other_base)
    with pytest.raises(FileNotFoundError, match="shared_base=true has no adapter_config.json"):
        RewardModel(tiny_model_dir, shared_base=True)
