"""tether's LLM KL transforms inside TorchRL's ``ChatEnv`` (TorchRL in its own environment: ``make torchrl-env``).

``as_chat_env_transform(t)`` wraps a ``tether.llm.KLRewardTransform`` or ``tether.llm.RetrieveKL``
as a TorchRL ``Transform`` for ``TransformedEnv(ChatEnv(...), ...)``. At every step it turns
the TorchRL data into a tether batch, runs ``t`` on it, and writes one number per
conversation to ``"next"``: the KL of the turn just taken (``kl_key``, summed over its
assistant tokens) and, when ``t`` adds to the reward, ``reward - coef * kl`` over the env's
reward (declared unbounded, shape ``(*batch, 1)``).

Which tokens: when the policy wrote TorchRL's padded ``("tokens", "prompt" | "response")``,
``("masks", "all_attention_mask")`` and ``("log_probs", "response")`` (TorchRL's
``TransformersWrapper`` with ``pad_output=True``), those exact ids are scored and the
sampling log-probs are reused (``KLRewardTransform`` needs them). Otherwise the ids come
from ``("history", "full")`` rendered by the reference's tokenizer (so ``RetrieveKL`` must
then score the policy itself, ``gen_model=...``). Either way only the newest assistant turn
counts: earlier turns were charged at their own step.

TorchRL is imported only when ``as_chat_env_transform`` is called.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from tether.integrations.torchrl import _INSTALL_HINT
from tether.models import tokenize_chats
from tether.models.batch_io import write_objects
from tether.models.chat import render_chat_ids
from tether.ops.masks import pad_rows

__all__ = ["as_chat_env_transform", "history_to_chats"]


def history_to_chats(history: Any) -> list[list[dict[str, str]]]:
    """TorchRL ``History`` ``[B, n]`` as tether chats (lists of ``{"role", "content"}`` dicts)."""
    roles, contents = history.role, history.content
    roles = roles.tolist() if hasattr(roles, "tolist") else roles
    contents = contents.tolist() if hasattr(contents, "tolist") else contents
    return [[{"role": r, "content": c} for r, c in zip(row_r, row_c)] for row_r, row_c in zip(roles, contents)]


def _from_policy_tokens(td: TensorDictBase, batch: TensorDictBase) -> bool:
    """Copy TorchRL's padded prompt/response ids and response log-probs into tether's layout."""
    keys = td.keys(include_nested=True)
    needed = [("tokens", "prompt"), ("tokens", "response"), ("log_probs", "response"), ("masks", "all_attention_mask")]
    if not all(k in keys for k in needed) or any(td.get(k) is None for k in needed):
        return False
    prompt, response, lp = td.get(("tokens", "prompt")), td.get(("tokens", "response")), td.get(("log_probs", "response"))
    if prompt.is_nested or response.is_nested:
        raise ValueError("TorchRL policy outputs are nested; build its TransformersWrapper with pad_output=True.")
    attention = td.get(("masks", "all_attention_mask")).bool()
    width = prompt.shape[-1]
    assistant = torch.cat([torch.zeros_like(attention[:, :width]), attention[:, width:]], dim=-1)
    batch.set(("tokens", "full"), torch.cat([prompt, response], dim=-1))
    batch.set(("masks", "all_attention_mask"), attention)
    batch.set(("masks", "all_assistant_mask"), assistant)
    batch.set(("log_probs", "full"), torch.cat([torch.zeros(prompt.shape, dtype=lp.dtype), lp], dim=-1) * assistant)
    return True


def _from_history(td: TensorDictBase, batch: TensorDictBase, tokenizer: Any) -> None:
    """Render the full chats; keep the assistant mask on the newest turn only."""
    full = history_to_chats(td.get(("history", "full")))
    prompts = history_to_chats(td.get(("history", "prompt")))
    enc = tokenize_chats(tokenizer, full)
    starts = [len(render_chat_ids(tokenizer, p, add_generation_prompt=True)) for p in prompts]
    rows = pad_rows(enc.input_ids)
    assistant = pad_rows(enc.assistant_mask, padding_value=False).values
    newest = torch.arange(rows.values.shape[-1])[None] >= torch.tensor(starts)[:, None]
    batch.set(("tokens", "full"), rows.values)
    batch.set(("masks", "all_attention_mask"), rows.mask)
    batch.set(("masks", "all_assistant_mask"), assistant & newest)
    write_objects(batch, ("history", "full"), full)


@functools.lru_cache(maxsize=1)
def _chat_transform_class() -> type:
    try:
        from torchrl.data.tensor_specs import Unbounded
        from torchrl.envs.transforms.transforms import Transform
    except ImportError as err:
        raise ImportError(_INSTALL_HINT) from err

    class ChatKLTransform(Transform):
        """TorchRL ``Transform`` running a tether LLM KL transform on each ``ChatEnv`` step."""

        def __init__(self, kl_transform: Any, reward_key: Any, kl_key: Any, kl_out: Any) -> None:
            super().__init__(in_keys=[("history", "full")], out_keys=[kl_key])
            self.kl_transform = kl_transform
            self.adds = kl_transform.kl_computation.add_to_reward
            self.reward_key, self.kl_key, self._kl_out = reward_key, kl_key, kl_out

        def _batch(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
            batch = TensorDict({}, batch_size=tensordict.batch_size[:1])
            if not _from_policy_tokens(tensordict, batch):
                _from_history(tensordict, batch, self.kl_transform.ref_log_prob.model.tokenizer)
            if self.adds:
                reward = next_tensordict.get(self.reward_key, None)
                if reward is None:
                    raise KeyError(
                        f"{self.reward_key!r}: the tether transform adds the KL to the reward, but the "
                        "step has none. Append a reward transform before this one, or build the tether "
                        "transform with add_to_reward=False."
                    )
                batch.set(("next", self.kl_transform.kl_computation.reward_key), reward.reshape(-1, 1).float())
            return batch

        def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
            batch = self.kl_transform(self._batch(tensordict, next_tensordict))
            scope = batch.get("next") if "next" in batch.keys() else batch
            kl = scope.get(self._kl_out)
            mask = batch.get(("masks", "all_assistant_mask"))
            per_turn = (kl * mask).sum(-1, keepdim=True)
            next_tensordict.set(self.kl_key, per_turn)
            if self.adds:
                reward = next_tensordict.get(self.reward_key)
                adjusted = reward.reshape(-1, 1) - self.kl_transform.kl_coef * per_turn
                next_tensordict.set(self.reward_key, adjusted.reshape(reward.shape).to(reward.dtype))
            return next_tensordict

        def _reset(self, tensordict: TensorDictBase, tensordict_reset: TensorDictBase) -> TensorDictBase:
            if tensordict_reset.get(self.kl_key, None) is None:
                tensordict_reset.set(self.kl_key, torch.zeros(*tensordict_reset.batch_size, 1))
            return tensordict_reset

        def transform_output_spec(self, output_spec):
            batch = output_spec.shape
            output_spec["full_observation_spec"][self.kl_key] = Unbounded(shape=(*batch, 1))
            if self.adds:
                output_spec["full_reward_spec"][self.reward_key] = Unbounded(shape=(*batch, 1))
            return output_spec

    return ChatKLTransform


def as_chat_env_transform(transform: Any, *, reward_key: Any = "reward", kl_key: Any = "kl_penalty") -> Any:
    """Wrap a ``tether.llm.KLRewardTransform`` or ``tether.llm.RetrieveKL`` for a TorchRL ``ChatEnv``.

    Example::

        env = TransformedEnv(ChatEnv(batch_size=(2,), tokenizer=tok), as_chat_env_transform(
            RetrieveKL(policy_scorer, ref_scorer, add_to_reward=False)))

    Raises:
        ImportError: if TorchRL is not installed.
        TypeError: if ``transform`` is neither of the two.
    """
    from tether.llm import KLRewardTransform, RetrieveKL

    if not isinstance(transform, (KLRewardTransform, RetrieveKL)):
        raise TypeError(
            f"transform: expected a tether.llm.KLRewardTransform or tether.llm.RetrieveKL, got "
            f"{type(transform).__name__}. (For tether.transforms.KLRewardTransform use "
            "tether.integrations.torchrl.as_env_transform.)"
        )
    kl_out = transform.kl_computation.kl_key
    return _chat_transform_class()(transform, reward_key, kl_key, kl_out)
