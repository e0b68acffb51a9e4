"""The public names import from the top of the package, and lazily."""

from __future__ import annotations

import subprocess
import sys

import lit_grpo


def test_public_classes_import_from_the_package():
    from lit_grpo import (  # noqa: F401
        DPOModule,
        GRPOModule,
        LoraSpec,
        OnPolicyDataModule,
        PolicySpec,
        PreferenceDataModule,
        SamplingSpec,
    )
    from lit_grpo.algorithms.grpo import GRPOModule as defined

    assert GRPOModule is defined
    assert set(lit_grpo.__all__) <= set(dir(lit_grpo))


def test_the_math_and_the_rewards_import_without_lightning_or_transformers():
    code = (
        "import sys, lit_grpo, lit_grpo.objectives, lit_grpo.rewards; "
        "print(sorted(m for m in ('lightning', 'transformers', 'peft') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_an_unknown_name_is_an_attribute_error():
    try:
        lit_grpo.GRPOModul  # noqa: B018
    except AttributeError as error:
        assert "GRPOModul" in str(error)
    else:
        raise AssertionError("expected an AttributeError")


def test_importing_the_modules_prints_no_third_party_warning_a_run_cannot_act_on():
    code = "import lit_grpo; lit_grpo.GRPOModule; import bitsandbytes"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "gemm_4bit_forward" not in result.stderr, result.stderr
