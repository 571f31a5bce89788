"""The KL panel draws the band the controller acts on: the budget's no-move band
``[1 - kl_band, 1 + kl_band / 2] x kl_target`` (from 0 without the push) and the most a move keeps,
``(1 + kl_band) x kl_target``; a beta controller's +-25 % band around its target."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tether.train.plots import _draw_kl_guides  # noqa: E402


def _guides(config: dict) -> tuple[list[tuple[float, float]], dict[str, float]]:
    fig, ax = plt.subplots()
    _draw_kl_guides(ax, config, {})
    spans = []
    for patch in ax.patches:
        ys = patch.get_patch_transform().transform(patch.get_path().vertices)[:, 1] if hasattr(
            patch, "get_patch_transform") else patch.get_xy()[:, 1]
        spans.append((float(np.min(ys)), float(np.max(ys))))
    lines = {line.get_label(): float(line.get_ydata()[0]) for line in ax.lines}
    plt.close(fig)
    return spans, lines


@pytest.mark.parametrize("push, low", [(True, 2.25), (False, 0.0)])
def test_the_budget_band_is_the_one_it_acts_on(push, low):
    """kl_target 3, kl_band 0.25: no move within [2.25, 3.375] (from 0 without the push); a move keeps
    at most 3.75; the ceiling kl_bound 4 is drawn too."""
    spans, lines = _guides({"kl_controller": "budget", "kl_target": 3.0, "kl_band": 0.25, "kl_push": push,
                            "kl_bound": 4.0})
    assert spans == [pytest.approx((low, 3.375))]
    assert lines == {"kl_bound": 4.0, "budget: most kept": pytest.approx(3.75)}


def test_a_beta_controller_gets_the_scoring_band():
    spans, _ = _guides({"kl_controller": "target", "kl_target": 2.0, "kl_bound": 4.0})
    assert spans == [pytest.approx((1.5, 2.5))]
