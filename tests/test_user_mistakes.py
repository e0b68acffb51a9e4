"""User mistakes met through the ``lit-grpo`` command: one ``lit-grpo: <message>`` line and exit code 2.

Each test runs the real CLI in this process (``lit_grpo.cli.main``) and reads
the last line of stderr, as a user would.
"""

from __future__ import annotations

import json

import pytest
from conftest import build_tiny_model
from test_eval import eval_args


@pytest.fixture
def lit_grpo(capsys, monkeypatch):
    """Run ``lit-grpo ARGUMENTS`` in this process: ``(exit code, last line of stderr)`` (0 for a run that ends well)."""
    from lit_grpo import cli

    # main() ends its process's children on failure; here they would be pytest's.
    monkeypatch.setattr(cli, "end_child_processes", lambda: None)

    def run(*arguments: str) -> tuple[int, str]:
        code = 0
        try:
            cli.main(list(arguments))
        except SystemExit as exit_:
            code = exit_.code
        lines = capsys.readouterr().err.strip().splitlines()
        return code, lines[-1] if lines else ""

    return run


# ---------------------------------------------------------------------- eval
@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory, tiny_model_dir) -> str:
    """A tiny random Llama like ``tiny_model_dir`` but 64 wide instead of 32."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("wide-llama")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = build_tiny_model(tokenizer).config
    config.update({"hidden_size": 64, "intermediate_size": 128, "head_dim": 16})
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_eval_of_an_adapter_trained_on_another_base(lit_grpo, tiny_model_dir, wide_model_dir, tmp_path, monkeypatch):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    monkeypatch.syspath_prepend(__import__("os").path.dirname(__file__))  # test_eval.letter_share
    adapter = tmp_path / "adapter"
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)  # 32 wide
    get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])).save_pretrained(adapter)
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == tiny_model_dir

    code, last = lit_grpo("eval", *eval_args(wide_model_dir, f"--adapter={adapter}"))
    assert code == 2
    assert last == (
        f"lit-grpo: --adapter='{adapter}' does not fit model.policy.name_or_path='{wide_model_dir}': 8 of its 8 "
        "weights have another shape here, e.g. base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight: "
        f"(4, 32) in the adapter, (4, 64) in this model. The adapter was trained on base_model_name_or_path="
        f"'{tiny_model_dir}' (its adapter_config.json); evaluate it on that base (model.policy.name_or_path), "
        "or pass an adapter trained on this one."
    )


# ---------------------------------------------------------------------- reward model
def fit_args(tiny_model_dir: str, tmp_path, *extra: str) -> list[str]:
    return [
        "fit",
        "--trainer.accelerator=cpu",
        "--trainer.max_epochs=1",
        "--trainer.logger=false",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        f"--trainer.default_root_dir={tmp_path / 'run'}",
        f"--model.policy.name_or_path={tiny_model_dir}",
        "--model.policy.lora.r=4",
        "--model.progress=false",
        "--data.source.train_size=20",
        "--data.held_out.size=2",
        "--data.prompts_per_epoch=2",
        "--data.batch_size=4",
        "--data.sampling.group_size=4",
        "--data.sampling.max_new_tokens=4",
        *extra,
    ]


def reward_model(name_or_path: str, shared_base: bool) -> str:
    return "--data.rewards=" + json.dumps(
        [
            {
                "class_path": "lit_grpo.rewards.RewardModel",
                "init_args": {"name_or_path": name_or_path, "shared_base": shared_base},
            }
        ]
    )


EXPECTED = (
    "expected a folder written by lit-grpo rm fit --export_adapter or, with shared_base=false, a "
    "sequence-classification model folder or hub id (org/name)."
)


@pytest.mark.parametrize("shared_base", [False, True])
@pytest.mark.parametrize("kind", ["missing folder", "bare name", "empty folder"])
def test_reward_model_that_is_no_model_folder(lit_grpo, tiny_model_dir, tmp_path, monkeypatch, kind, shared_base):
    import huggingface_hub

    def no_hub(*args, **kwargs):
        raise AssertionError("the hub was asked")

    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", no_hub)
    monkeypatch.setattr("lit_grpo.model.sources._hub_answers", no_hub)
    monkeypatch.chdir(tmp_path)
    path, problem = {
        "missing folder": (str(tmp_path / "runs" / "rm"), ": no such folder"),
        "bare name": ("my_reward_model", ": no such folder"),
        "empty folder": (
            str(tmp_path / "empty"),
            " is not a model folder: it has no config.json and "
            "no weights (model.safetensors or pytorch_model.bin, or their shards), and no "
            "adapter_config.json",
        ),
    }[kind]
    (tmp_path / "empty").mkdir()
    code, last = lit_grpo(*fit_args(tiny_model_dir, tmp_path, reward_model(path, shared_base)))
    assert code == 2
    assert last == f"lit-grpo: RewardModel name_or_path='{path}'{problem}; {EXPECTED}"


# ---------------------------------------------------------------------- plot
def test_plot_out_that_is_a_file(lit_grpo, tmp_path):
    (tmp_path / "metrics.csv").write_text("epoch,step,train/kl\n0,0,0.0\n1,1,0.01\n")
    (tmp_path / "curves.png").write_bytes(b"an older figure")
    code, last = lit_grpo("plot", str(tmp_path), "--out", str(tmp_path / "curves.png"))
    assert code == 2
    assert last == (
        f"lit-grpo: --out='{tmp_path / 'curves.png'}' is a file; expected a folder to write the PNGs "
        f"into (curves.png, and curves/ with --each), e.g. --out {tmp_path}."
    )
    assert (tmp_path / "curves.png").read_bytes() == b"an older figure"


def test_plot_without_metrics_is_one_line(lit_grpo, tmp_path):
    code, last = lit_grpo("plot", str(tmp_path))
    assert code == 2
    assert last.startswith(f"lit-grpo: no metrics.csv under {tmp_path}; plots need a run logged with a CSVLogger")
