"""``PromptBatch``: the prompts a rollout starts from, with an optional reference completion.

Layout (TorchRL's summarisation layout, right-padded): row ``b`` holds its prompt at
positions ``[0, prompt_rindex[b])``. In the TL;DR setting the dataset row continues with
the human-written reference summary, so positions ``[prompt_rindex[b], n_b)`` may hold that
completion (``attention_mask`` True up to ``n_b``); padding follows. ``labels`` can give the
reference completion explicitly instead, in the Hugging Face convention (token ids on the
completion's positions, ``-100`` everywhere else); it then takes precedence over whatever
``input_ids`` holds after the prompt. TorchRL's ``PromptData`` carries ``labels ==
input_ids`` (the whole row); a row whose first label is not ``-100`` is read that way: its
prompt labels must equal ``input_ids`` and its completion is ``labels[prompt_rindex:n_b]``.

Departure from TorchRL's ``PromptData``: the batch is validated (typed errors naming the
field), and the prompt end comes only from ``prompt_rindex``, never from searching for a pad
or eos id, so prompts may contain the eos token (chat templates do).
"""

from __future__ import annotations

import torch
from tensordict import tensorclass
from torch import Tensor

from tether.ops.checks import whole_number

__all__ = ["LABEL_IGNORE_INDEX", "PromptBatch"]

# Hugging Face's ignore index: a label position that is not part of the reference completion.
LABEL_IGNORE_INDEX = -100


def _is_int_tensor(x: object) -> bool:
    return isinstance(x, Tensor) and not x.is_floating_point() and not x.is_complex() and x.dtype != torch.bool


def _check_ids(name: str, x: object, shape: tuple[int, ...] | None) -> None:
    if not _is_int_tensor(x) or x.dim() != 2:
        got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
        raise TypeError(f"{name}: expected an integer tensor [B, L], got {got}. Pass token ids as .long().")
    if shape is not None and tuple(x.shape) != shape:
        raise ValueError(
            f"{name}: expected the shape of input_ids {shape}, got {tuple(x.shape)}. "
            "Pad every field of the batch to the same [B, L]."
        )


def _as_bool_mask(mask: object, shape: tuple[int, ...]) -> Tensor:
    if not isinstance(mask, Tensor) or tuple(mask.shape) != shape:
        got = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(f"attention_mask: expected a tensor of the shape of input_ids {shape}, got {got}.")
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point() or not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError(
            f"attention_mask: expected bool or 0/1 integer values, got dtype {mask.dtype} with other "
            "values. Pass the tokenizer's attention mask."
        )
    return mask.bool()


def _checked_fields(input_ids: object, attention_mask: object, rindex: object, labels: object) -> Tensor:
    """Validates the fields of a batch; returns the attention mask as bool."""
    _check_ids("input_ids", input_ids, None)
    shape = tuple(input_ids.shape)
    mask = _as_bool_mask(attention_mask, shape)
    if not _is_int_tensor(rindex):
        got = rindex.dtype if isinstance(rindex, Tensor) else type(rindex).__name__
        raise TypeError(f"prompt_rindex: expected an integer tensor [B], got {got}. Pass a .long() tensor.")
    if tuple(rindex.shape) != shape[:1]:
        raise ValueError(
            f"prompt_rindex: expected an integer tensor of shape [{shape[0]}], got {tuple(rindex.shape)}."
        )
    lengths = mask.sum(-1)
    bad = ((rindex < 1) | (rindex > lengths)).nonzero().flatten().tolist()
    if bad:
        raise ValueError(
            f"prompt_rindex: expected 1 <= prompt_rindex <= number of valid tokens in every row; "
            f"rows {bad[:8]} have prompt_rindex {rindex[bad[:8]].tolist()} and "
            f"{lengths[bad[:8]].tolist()} valid tokens. Point prompt_rindex at the first label position."
        )
    positions = torch.arange(shape[1], device=mask.device)
    holes = (mask != (positions < lengths[:, None])).any(-1).nonzero().flatten().tolist()
    if holes:
        raise ValueError(
            f"attention_mask: expected right padding (valid tokens from position 0, then padding), "
            f"rows {holes[:8]} are not. Right-pad the prompts (tokenizer padding_side='right')."
        )
    if labels is not None:
        _check_ids("labels", labels, shape)
        completion_positions(input_ids, mask, rindex, labels)
    return mask


def completion_positions(input_ids: Tensor, mask: Tensor, rindex: Tensor, labels: Tensor) -> Tensor:
    """``bool [B, L]``: where ``labels`` holds the reference completion; raises on other layouts.

    Hugging Face rows (first label ``-100``): the non-ignored run, which must start at
    ``prompt_rindex``. Full-sequence rows (TorchRL's ``labels == input_ids``): positions
    ``[prompt_rindex, n_b)``, the prompt labels being the prompt ids.
    """
    positions = torch.arange(labels.shape[-1], device=labels.device)
    used = labels != LABEL_IGNORE_INDEX
    full_row = used[:, :1]
    count = used.sum(-1)
    run = (positions >= rindex[:, None]) & (positions < (rindex + count)[:, None])
    bad = (~full_row[:, 0] & (used != run).any(-1)).nonzero().flatten().tolist()
    if bad:
        raise ValueError(
            f"labels: expected each row's label ids on one run starting at prompt_rindex and "
            f"{LABEL_IGNORE_INDEX} elsewhere (or labels equal to input_ids on the prompt, as in TorchRL's "
            f"PromptData); rows {bad[:8]} are neither. Set the prompt and padding positions of labels "
            f"to {LABEL_IGNORE_INDEX}."
        )
    prompt = positions < rindex[:, None]
    mismatched = (full_row[:, 0] & ((labels != input_ids) & prompt).any(-1)).nonzero().flatten().tolist()
    if mismatched:
        raise ValueError(
            f"labels: rows {mismatched[:8]} carry label ids on the prompt (the full-sequence layout "
            f"of TorchRL's PromptData) that differ from input_ids there. Pass labels equal to "
            f"input_ids, or {LABEL_IGNORE_INDEX} on the prompt positions."
        )
    return torch.where(full_row, mask & ~prompt, run)


@tensorclass
class PromptBatch:
    """Right-padded prompts (optionally followed by a reference completion).

    Attributes:
        input_ids: ``long [B, L]``; the prompt at ``[0, prompt_rindex)``, then optionally the
            reference completion, then padding.
        attention_mask: ``bool [B, L]`` (0/1 integers accepted); one run of True from
            position 0 covering at least the prompt.
        prompt_rindex: ``long [B]``, where each prompt ends (the first label position),
            in ``[1, L]``.
        labels: optional ``long [B, L]``, the reference completion's ids on positions
            ``[prompt_rindex, prompt_rindex + m)`` and ``-100`` elsewhere, or the whole
            row as in TorchRL's ``PromptData`` (``labels == input_ids``).

    Build it with ``PromptBatch.from_tensors(...)`` (infers the batch size and validates)
    or the tensorclass constructor followed by ``validate()``.
    """

    input_ids: Tensor
    attention_mask: Tensor
    prompt_rindex: Tensor
    labels: Tensor | None = None

    @classmethod
    def from_tensors(
        cls,
        input_ids: Tensor,
        attention_mask: Tensor,
        prompt_rindex: Tensor,
        labels: Tensor | None = None,
    ) -> PromptBatch:
        """Builds a validated batch of size ``[B]`` from the tensors described above."""
        mask = _checked_fields(input_ids, attention_mask, prompt_rindex, labels)
        return cls(
            input_ids=input_ids,
            attention_mask=mask,
            prompt_rindex=prompt_rindex,
            labels=labels,
            batch_size=[input_ids.shape[0]],
        )

    def validate(self) -> PromptBatch:
        """Checks dtypes, shapes and the right-padded layout; returns ``self`` or raises."""
        _checked_fields(self.input_ids, self.attention_mask, self.prompt_rindex, self.labels)
        if tuple(self.batch_size) != tuple(self.input_ids.shape[:1]):
            raise ValueError(
                f"batch_size: expected [B] = [{self.input_ids.shape[0]}] for input_ids of shape "
                f"{tuple(self.input_ids.shape)}, got {list(self.batch_size)}. Build the batch "
                "with PromptBatch.from_tensors(...)."
            )
        return self

    def mask_label(self, pad_token_id: int) -> PromptBatch:
        """The prompt-only view: everything from ``prompt_rindex`` on becomes padding.

        Args:
            pad_token_id: id written on the masked positions.

        Returns:
            A ``PromptBatch`` of the same shape with ``attention_mask`` True exactly on the
            prompt and ``labels`` None.
        """
        whole_number("pad_token_id", pad_token_id, low=0)
        positions = torch.arange(self.input_ids.shape[-1], device=self.input_ids.device)
        prompt = positions < self.prompt_rindex[..., None]
        return type(self)(
            input_ids=torch.where(prompt, self.input_ids, pad_token_id),
            attention_mask=prompt,
            prompt_rindex=self.prompt_rindex,
            labels=None,
            batch_size=self.batch_size,
        )

    def reference_view(self) -> PromptBatch:
        """Prompt followed by the reference completion, the sequence whose score is the baseline.

        With ``labels``: the prompt then the label ids (``attention_mask`` on exactly those
        positions). Without: the row as given (TorchRL's behaviour, which in the TL;DR
        layout already holds prompt + reference summary).
        """
        if self.labels is None:
            return self
        positions = torch.arange(self.input_ids.shape[-1], device=self.input_ids.device)
        used = completion_positions(self.input_ids, self.attention_mask.bool(), self.prompt_rindex, self.labels)
        keep = (positions < self.prompt_rindex[..., None]) | used
        return type(self)(
            input_ids=torch.where(used, self.labels, self.input_ids),
            attention_mask=keep,
            prompt_rindex=self.prompt_rindex,
            labels=None,
            batch_size=self.batch_size,
        )
