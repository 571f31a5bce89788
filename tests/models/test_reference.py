"""Reference models: frozen copies, adapter-disabled PEFT references, and the update schedule."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from tests.helpers import make_tiny_model
from tether.models import (
    REFERENCE_UPDATES,
    AdapterDisabledReference,
    ReferenceUpdater,
    adapter_disabled,
    frozen_copy,
)

IDS = torch.tensor([[257, 72, 105, 258, 10, 65, 66], [257, 200, 3, 4, 5, 6, 258]])


def lora(model: nn.Module):
    # init_lora_weights=False draws B at random too, so the adapter changes the output.
    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=ids).logits


def storages(model: nn.Module) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


# --- frozen_copy ---------------------------------------------------------------------


def test_frozen_copy_is_frozen_independent_and_equal():
    model = make_tiny_model().train()
    ref = frozen_copy(model)
    assert torch.equal(logits(ref), logits(model))
    assert not ref.training and all(not m.training for m in ref.modules())
    assert model.training, "the original keeps its mode"
    assert all(not p.requires_grad for p in ref.parameters())
    assert all(p.requires_grad for p in model.parameters()), "the original keeps its gradients"
    assert storages(ref).isdisjoint(storages(model))
    before = logits(ref)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.add_(1.0)
    assert not torch.allclose(logits(model), before, atol=1e-3)
    assert torch.equal(logits(ref), before)


def test_frozen_copy_own_dtype_and_device():
    model = make_tiny_model()
    ref = frozen_copy(model, dtype=torch.float64)
    assert {p.dtype for p in ref.parameters()} == {torch.float64}
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    torch.testing.assert_close(logits(ref).float(), logits(model), atol=1e-4, rtol=1e-4)
    meta = frozen_copy(model, device="meta")
    assert {p.device.type for p in meta.parameters()} == {"meta"}
    assert {p.device.type for p in model.parameters()} == {"cpu"}


def test_frozen_copy_keeps_tied_weights_tied():
    ref = frozen_copy(make_tiny_model(tie=True))
    assert ref.lm_head.weight is ref.model.embed_tokens.weight


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [({"dtype": torch.int64}, "floating torch.dtype, got torch.int64"), ({"dtype": "float16"}, "dtype must be")],
)
def test_frozen_copy_rejects_bad_dtype(kwargs, pattern):
    with pytest.raises(TypeError, match=pattern):
        frozen_copy(make_tiny_model(), **kwargs)


def test_frozen_copy_rejects_non_module():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got dict"):
        frozen_copy({"w": torch.zeros(2)})


# --- adapter_disabled -----------------------------------------------------------------


def test_adapter_disabled_reference_is_the_base_model_without_copy():
    base = make_tiny_model(seed=0)
    policy = lora(make_tiny_model(seed=0))
    ref = adapter_disabled(policy)
    assert isinstance(ref, AdapterDisabledReference)
    adapted = logits(policy)
    assert (adapted - logits(base)).abs().max() > 1e-2, "the adapter must matter"
    assert torch.equal(ref(input_ids=IDS).logits, logits(base))
    # Same parameter objects, so no weight was copied.
    assert [id(p) for p in ref.parameters()] == [id(p) for p in policy.parameters()]
    assert storages(ref) == storages(policy)
    # The adapter is back on afterwards.
    assert torch.equal(logits(policy), adapted)


def test_adapter_disabled_runs_in_eval_without_grad_and_restores_modes():
    policy = lora(make_tiny_model(seed=0)).train()
    seen = []
    layer = policy.get_base_model().model.layers[0]
    layer.register_forward_hook(lambda module, args, out: seen.append(module.training))
    out = adapter_disabled(policy)(input_ids=IDS)
    assert seen == [False] and not out.logits.requires_grad
    assert all(m.training for m in policy.modules())
    policy(input_ids=IDS)
    assert seen == [False, True]


def test_adapter_disabled_context_for_other_calls():
    base = make_tiny_model(seed=0)
    policy = lora(make_tiny_model(seed=0))
    with adapter_disabled(policy).disabled() as model:
        inside = logits(model)
    assert torch.equal(inside, logits(base))
    assert adapter_disabled(policy).config is policy.config


def test_score_tokens_scores_an_adapter_disabled_reference_as_the_base_model():
    """The reference is its own scorer kind (``scoring_view``): score_tokens gives exactly the
    base model's log-probs, with no graph even under grad mode, and leaves the adapter on."""
    from tether.models.scoring import score_tokens

    base = make_tiny_model(seed=0)
    policy = lora(make_tiny_model(seed=0)).train()
    mask = torch.ones_like(IDS, dtype=torch.bool)
    with torch.no_grad():
        expected = score_tokens(base, IDS, mask).log_probs
    got = score_tokens(adapter_disabled(policy), IDS, mask).log_probs
    assert torch.equal(got, expected) and not got.requires_grad
    assert all(m.training for m in policy.modules())
    assert score_tokens(policy, IDS, mask).log_probs.requires_grad  # the adapter is back on


def test_adapter_disabled_with_transformers_integrated_adapter():
    base = make_tiny_model(seed=0)
    policy = make_tiny_model(seed=0)
    policy.add_adapter(LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    on = logits(policy)
    assert (on - logits(base)).abs().max() > 1e-2
    assert torch.equal(adapter_disabled(policy)(input_ids=IDS).logits, logits(base))
    assert torch.equal(logits(policy), on)


def test_adapter_disabled_refuses_plain_model():
    with pytest.raises(TypeError, match="carries no PEFT adapter.*use frozen_copy"):
        adapter_disabled(make_tiny_model())
    with pytest.raises(TypeError, match="policy must be a torch.nn.Module"):
        adapter_disabled("policy")


# --- ReferenceUpdater -----------------------------------------------------------------


class Pair(nn.Module):
    """Two float64 parameters: ``w`` trained, ``frozen`` not."""

    def __init__(self, w: float, frozen: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((2,), w, dtype=torch.float64))
        self.frozen = nn.Parameter(torch.full((2,), frozen, dtype=torch.float64), requires_grad=False)


def test_registry_names():
    assert sorted(REFERENCE_UPDATES) == ["ema", "fixed", "sync"]


def test_fixed_never_moves():
    policy, ref = Pair(4.0, 0.0), Pair(0.0, 0.0)
    updater = ReferenceUpdater(policy, ref, mode="fixed")
    assert updater.tracked == []
    assert [updater.step(k) for k in (1, 2, 3)] == [False, False, False]
    assert torch.equal(ref.w, torch.zeros(2, dtype=torch.float64))


def test_sync_every_two_steps_copies_trainable_weights_only():
    policy, ref = Pair(4.0, 7.0), Pair(0.0, -1.0)
    ref.requires_grad_(False)
    updater = ReferenceUpdater(policy, ref, mode="sync", every=2)
    assert updater.tracked == ["w"]
    assert updater.step(1) is False and ref.w.tolist() == [0.0, 0.0]
    assert updater.step(2) is True and ref.w.tolist() == [4.0, 4.0]
    assert ref.frozen.tolist() == [-1.0, -1.0], "frozen policy weights are not tracked"
    with torch.no_grad():
        policy.w.fill_(5.0)
    assert updater.step(3) is False and ref.w.tolist() == [4.0, 4.0]
    assert updater.step(4) is True and ref.w.tolist() == [5.0, 5.0]
    assert updater.num_updates == 2


def test_ema_matches_hand_derivation():
    """ref 0, policy 4, alpha 0.25: 0.75*0 + 0.25*4 = 1, then 0.75*1 + 0.25*4 = 1.75, then
    (every=1) 0.75*1.75 + 0.25*4 = 2.3125."""
    policy, ref = Pair(4.0, 0.0), Pair(0.0, 0.0)
    updater = ReferenceUpdater(policy, ref, mode="ema", alpha=0.25)
    values = []
    for k in (1, 2, 3):
        updater.step(k)
        values.append(ref.w[0].item())
    assert values == [1.0, 1.75, 2.3125]


def test_ema_into_lower_precision_reference():
    policy, ref = Pair(4.0, 0.0), Pair(0.0, 0.0).float()
    ReferenceUpdater(policy, ref, mode="ema", alpha=0.5).step(1)
    assert ref.w.dtype == torch.float32 and ref.w.tolist() == [2.0, 2.0]


def test_state_dict_round_trip_resumes_exactly():
    policy = Pair(4.0, 0.0)
    ref_a, ref_b = Pair(0.0, 0.0), Pair(0.0, 0.0)
    a = ReferenceUpdater(policy, ref_a, mode="ema", alpha=0.25)
    for k in (1, 2):
        a.step(k)
    b = ReferenceUpdater(policy, ref_b, mode="ema", alpha=0.25)
    b.load_state_dict(a.state_dict())
    assert torch.equal(ref_b.w, ref_a.w) and b.last_step == 2 and b.num_updates == 2
    a.step(3)
    b.step(3)
    assert torch.equal(ref_b.w, ref_a.w) and ref_b.w[0].item() == 2.3125
    with pytest.raises(ValueError, match="step_index must increase between calls: got 3 after 3"):
        b.step(3)


def test_state_dict_is_a_snapshot():
    policy, ref = Pair(4.0, 0.0), Pair(0.0, 0.0)
    updater = ReferenceUpdater(policy, ref, mode="sync")
    state = updater.state_dict()
    updater.step(1)
    assert state["reference"]["w"].tolist() == [0.0, 0.0]


def test_lora_sync_copies_adapter_and_reproduces_policy():
    policy = lora(make_tiny_model(seed=0))
    ref = frozen_copy(policy)
    updater = ReferenceUpdater(policy, ref, mode="sync")
    assert updater.tracked and all("lora_" in name for name in updater.tracked)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if p.requires_grad:
                p.add_(0.1)
    assert not torch.allclose(logits(ref), logits(policy), atol=1e-3)
    updater.step(1)
    assert torch.equal(logits(ref), logits(policy))


def test_lora_ema_is_refused():
    policy = lora(make_tiny_model(seed=0))
    with pytest.raises(ValueError, match="mode 'ema' is refused for a PEFT/LoRA policy.*mode='sync'"):
        ReferenceUpdater(policy, frozen_copy(policy), mode="ema", alpha=0.5)


def test_adapter_disabled_reference_only_fixed():
    policy = lora(make_tiny_model(seed=0))
    ReferenceUpdater(policy, adapter_disabled(policy), mode="fixed")
    with pytest.raises(ValueError, match="shares the policy's weights.*frozen_copy"):
        ReferenceUpdater(policy, adapter_disabled(policy), mode="sync")


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"mode": "hard"}, ValueError, r"mode: expected one of 'fixed', 'sync', 'ema', got 'hard'"),
        ({"mode": "sync", "every": 0}, ValueError, "every: expected an int >= 1, got 0"),
        ({"mode": "sync", "every": 1.5}, TypeError, "every: expected an int >= 1, got 1.5 of type float"),
        ({"mode": "sync", "every": True}, TypeError, "every: expected an int >= 1, got True of type bool"),
        ({"mode": "ema"}, TypeError, r"alpha: expected a finite number in \(0, 1\], got None.*mode 'ema' needs alpha"),
        ({"mode": "ema", "alpha": 0.0}, ValueError, r"alpha: expected a finite number in \(0, 1\], got 0.0"),
        ({"mode": "ema", "alpha": 1.5}, ValueError, r"alpha: expected a finite number in \(0, 1\], got 1.5"),
        ({"mode": "ema", "alpha": float("nan")}, ValueError, r"alpha: expected a finite number in \(0, 1\], got nan"),
        ({"mode": "sync", "alpha": 0.5}, ValueError, "alpha applies only to mode 'ema'"),
    ],
)
def test_bad_schedule_is_refused(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        ReferenceUpdater(Pair(1.0, 0.0), Pair(0.0, 0.0), **kwargs)


def test_mismatched_models_are_refused():
    policy = Pair(1.0, 0.0)
    with pytest.raises(KeyError, match="'w' has no counterpart"):
        ReferenceUpdater(policy, nn.Linear(2, 2), mode="sync")
    other = Pair(0.0, 0.0)
    other.w = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"policy shape \(2,\) != reference shape \(3,\)"):
        ReferenceUpdater(policy, other, mode="sync")
    with pytest.raises(ValueError, match="shares storage.*frozen_copy"):
        ReferenceUpdater(policy, policy, mode="sync")
    with pytest.raises(ValueError, match="no trainable parameters"):
        ReferenceUpdater(Pair(1.0, 0.0).requires_grad_(False), Pair(0.0, 0.0), mode="sync")


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-1, ValueError), (1.0, TypeError), (True, TypeError)])
def test_bad_step_index_is_refused(bad, error):
    updater = ReferenceUpdater(Pair(1.0, 0.0), Pair(0.0, 0.0), mode="sync")
    with pytest.raises(error, match=f"step_index: expected an int >= 1, got {bad!r}"):
        updater.step(bad)


def test_bad_state_is_refused():
    policy = Pair(1.0, 0.0)
    updater = ReferenceUpdater(policy, Pair(0.0, 0.0), mode="ema", alpha=0.5)
    state = updater.state_dict()
    with pytest.raises(ValueError, match=r"state\['alpha'\] = 0.5 but this updater has alpha=0.25"):
        ReferenceUpdater(policy, Pair(0.0, 0.0), mode="ema", alpha=0.25).load_state_dict(state)
    with pytest.raises(KeyError, match="state lacks 'every'"):
        updater.load_state_dict({"mode": "ema"})
    with pytest.raises(KeyError, match=r"\['w'\] of the reference this updater moves are missing .*another model"):
        updater.load_state_dict({**state, "reference": {}})
    with pytest.raises(ValueError, match=r"other shapes than its parameters \(w: \[3\] for \[2\]\)"):  # load_named's check
        updater.load_state_dict({**state, "reference": {**state["reference"], "w": torch.zeros(3)}})
