"""Installed dependencies lie in the tested ranges, and a release outside them is named clearly."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tether._compat import TESTED, version_problems

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_installed_releases_are_in_the_tested_ranges():
    problems = version_problems()
    assert not problems, "\n".join(problems)


def test_a_release_outside_the_range_names_package_range_and_fix():
    assert version_problems({"transformers": "6.0.1", "torch": "2.13.0+cpu", "ray": "2.8.0"}) == [
        "transformers 6.0.1 is outside the range tether is tested with (>=4.56,<5.24); install a release in "
        "that range (pip install 'transformers>=4.56,<5.24') or expect breakage in tether._compat, which "
        "holds every use of its internals.",
        "ray 2.8.0 is outside the range tether is tested with (>=2.9,<2.61); install a release in that range "
        "(pip install 'ray>=2.9,<2.61') or expect breakage in tether._compat, which holds every use of its "
        "internals.",
    ]
    assert version_problems({"tensordict": "0.15.3", "peft": "0.21.2rc1"}) == []


def test_pyproject_bounds_match_the_tested_ranges():
    text = PYPROJECT.read_text()
    for name, (low, high) in TESTED.items():
        assert re.search(rf'"{name}>={re.escape(low)},<{re.escape(high)}"', text), name


def test_peft_model_hides_only_transformers_deprecation_of_peft_s_own_call():
    """PEFT reads ``is_gradient_checkpointing``, which transformers 5 deprecates with a FutureWarning
    printed on every LoRA run; ``_compat.peft_model`` wraps the same model without it."""
    import warnings

    import peft

    from tether._compat import peft_model
    from tether.models.tiny import byte_tokenizer, tiny_causal_lm

    lora = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])

    def future_warnings(build) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            build(tiny_causal_lm(byte_tokenizer(), seed=0), lora)
        return [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]

    if not any("is_gradient_checkpointing" in m for m in future_warnings(peft.get_peft_model)):
        pytest.skip("this transformers/peft pair raises no such warning")
    assert future_warnings(peft_model) == []
