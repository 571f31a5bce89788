"""The KL budget on the project's toy plant, and what to do with Adam's moments after a move.

``../shared/research/kl_control_toy.py`` (beside the repository) is a 200-arm softmax bandit
trained by REINFORCE with a k1 penalty and Adam for 16 steps: 4 settings (reward scale x
target), beta started 30x above and 30x below the one that holds the target, 6 seeds. This
script drives it with tether's own ``BudgetKLController`` (exact KL readings; a rejected
update restores the step's start and Adam's state) with and without the push, and three
choices for Adam after a move: keep the moments, scale the first moment by the kept scale,
or reset both. Per learning rate and choice: the share of steps 5-16 within +-25 % of the
target (mean and worst run), the final expected reward over the reward scale, the largest KL
over the target at any step, and the rejected steps; one record per row goes to
``benchmarks/results/leash_toy.jsonl``.

    python benchmarks/leash_toy.py [--toy PATH]        # a few minutes on one core
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

import _results
from tether.control import BudgetKLController

ARMS, STEPS, WARM = 200, 16, 4
SETTINGS = [(0.3, 0.5), (1.0, 0.5), (3.0, 0.5), (1.0, 2.0)]  # (reward scale, target), as the toy's grid


def load_toy(path: Path) -> dict:
    if not path.is_file():
        raise SystemExit(f"--toy: {path} does not exist; pass the path of kl_control_toy.py (shared/research).")
    namespace: dict = {}
    exec(path.read_text().split("res={}")[0], namespace)  # its plant and helpers, not its grid
    return namespace


def exact_kl(p, q) -> float:
    """KL(p || q) with 0 log 0 = 0 (the toy's own ``kl`` reads NaN once a push drives an arm's p to 0)."""
    inside = p > 0
    return float(np.sum(p[inside] * (np.log(p[inside]) - np.log(q[inside]))))


class ToyLine:
    """The toy's logits on the line from the reference's, with the step's start kept for a rejection."""

    def __init__(self, log_ref, start, adam, updated) -> None:
        self.log_ref, self.adam, self.theta, self.candidate = log_ref, adam, updated, updated
        self.start = (start, adam.m.copy(), adam.v.copy(), adam.t)

    def capture(self) -> None:
        self.candidate = self.theta

    def place(self, scale: float) -> None:
        self.theta = self.log_ref + scale * (self.candidate - self.log_ref)

    def reject(self) -> None:
        self.theta, self.adam.m, self.adam.v, self.adam.t = self.start
        self.candidate = self.theta


def one_run(toy: dict, moments: str, push: bool, beta0: float, ref, reward, target: float, seed: int, lr: float):
    rng = np.random.default_rng(seed)
    log_ref = np.log(ref)
    theta, adam = log_ref.copy(), toy["Adam"](ARMS)
    ctl = BudgetKLController(init_kl_coef=min(max(beta0, 1e-4), 1e3), target=target, push=push)
    kls, rejected = [], 0
    for _ in range(STEPS):
        grad, _ = toy["grad"](theta, log_ref, reward, ctl.kl_coef, rng)
        line = ToyLine(log_ref, theta, adam, theta + adam.step(grad, lr))
        move = ctl.hold(line, lambda full=False: exact_kl(toy["softmax"](line.theta), ref))
        theta, rejected = line.theta, rejected + move.rejected
        if move.scale != 1.0 and moments == "scale first":
            adam.m *= move.scale
        elif move.scale != 1.0 and moments == "reset":
            adam.m[:], adam.v[:], adam.t = 0.0, 0.0, 0
        kls.append(exact_kl(toy["softmax"](theta), ref))
    after = np.array(kls[WARM:]) / target
    return float(np.mean(np.abs(after - 1) <= 0.25)), float(toy["softmax"](theta) @ reward), max(kls) / target, rejected


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--toy", type=Path, default=Path(__file__).parents[2] / "shared/research/kl_control_toy.py")
    toy = load_toy(parser.parse_args().toy)
    print("| lr | push | Adam after a move | steps 5-16 in band (worst run) | final reward / scale | peak KL / target "
          "| rejected |")
    print("|---|---|---|---|---|---|---|")
    for lr in (0.5, 1.0):
        for push, moments in ((True, "keep"), (True, "scale first"), (True, "reset"), (False, "keep")):
            band, gain, peak, rejected = [], [], [], 0
            for index, (scale, target) in enumerate(SETTINGS):
                draw = np.random.default_rng(100 + index)
                ref, reward = toy["softmax"](draw.normal(0, 2, ARMS)), scale * draw.normal(0, 1, ARMS)
                best = toy["gibbs_beta"](ref, reward, target)
                for wrong in (30, 1 / 30):
                    for seed in range(6):
                        f, r, p, n = one_run(toy, moments, push, best * wrong, ref, reward, target, seed, lr)
                        band.append(f), gain.append(r / scale), peak.append(p)
                        rejected += n
            row = {"lr": lr, "push": push, "moments": moments, "in_band_mean": float(np.mean(band)),
                   "in_band_worst": float(np.min(band)), "reward_over_scale": float(np.mean(gain)),
                   "peak_over_target": float(np.max(peak)), "rejected": rejected, "runs": len(band),
                   **_results.stamp()}
            _results.write("leash_toy", row, key=("lr", "push", "moments"))
            print(f"| {lr} | {'on' if push else 'off'} | {moments} | {np.mean(band):.0%} ({np.min(band):.0%}) | "
                  f"{np.mean(gain):.3f} | {np.max(peak):.2f} | {rejected} |", flush=True)


if __name__ == "__main__":
    main()
