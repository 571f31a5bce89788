"""The KL budget on the project's toy plant, and what to do with Adam's moments after a move.

``../shared/research/kl_control_toy.py`` (beside the repository) is a 200-arm softmax bandit
trained by REINFORCE with a k1 penalty and Adam for 16 steps: 4 settings (reward scale x
target), beta started 30x above and 30x below the one that holds the target, 6 seeds. This
script drives it with tether's own ``BudgetKLController`` (exact KL readings) and three
choices for Adam after a move: keep the moments, scale the first moment by the kept scale,
or reset both. Printed per learning rate and choice: the share of steps 5-16 within +-25 % of
the target (mean and worst run), the final expected reward over the reward scale, and the
largest KL over the target seen at any step.

    python benchmarks/leash_toy.py [--toy PATH]        # about a minute on one core
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from tether.control import BudgetKLController

ARMS, STEPS, WARM = 200, 16, 4
SETTINGS = [(0.3, 0.5), (1.0, 0.5), (3.0, 0.5), (1.0, 2.0)]  # (reward scale, target), as the toy's grid


def load_toy(path: Path) -> dict:
    if not path.is_file():
        raise SystemExit(f"--toy: {path} does not exist; pass the path of kl_control_toy.py (shared/research).")
    namespace: dict = {}
    exec(path.read_text().split("res={}")[0], namespace)  # its plant and helpers, not its grid
    return namespace


def one_run(toy: dict, moments: str, beta0: float, ref, reward, target: float, seed: int, lr: float):
    rng = np.random.default_rng(seed)
    log_ref = np.log(ref)
    theta, adam = log_ref.copy(), toy["Adam"](ARMS)
    ctl = BudgetKLController(init_kl_coef=min(max(beta0, 1e-4), 1e3), target=target)
    kls = []
    for _ in range(STEPS):
        grad, _ = toy["grad"](theta, log_ref, reward, ctl.kl_coef, rng)
        updated = theta + adam.step(grad, lr)
        now = {"theta": updated}

        def move(scale: float) -> None:
            now["theta"] = log_ref + scale * (updated - log_ref)

        kept = ctl.hold(move, lambda: toy["kl"](toy["softmax"](now["theta"]), ref)).scale
        theta = now["theta"]
        if kept != 1.0 and moments == "scale first":
            adam.m *= kept
        elif kept != 1.0 and moments == "reset":
            adam.m[:], adam.v[:], adam.t = 0.0, 0.0, 0
        kls.append(toy["kl"](toy["softmax"](theta), ref))
    after = np.array(kls[WARM:]) / target
    return float(np.mean(np.abs(after - 1) <= 0.25)), float(toy["softmax"](theta) @ reward), max(kls) / target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--toy", type=Path, default=Path(__file__).parents[2] / "shared/research/kl_control_toy.py")
    toy = load_toy(parser.parse_args().toy)
    print("| lr | Adam after a move | steps 5-16 in band (worst run) | final reward / scale | peak KL / target |")
    print("|---|---|---|---|---|")
    for lr in (0.5, 1.0):
        for moments in ("keep", "scale first", "reset"):
            band, gain, peak = [], [], []
            for index, (scale, target) in enumerate(SETTINGS):
                draw = np.random.default_rng(100 + index)
                ref, reward = toy["softmax"](draw.normal(0, 2, ARMS)), scale * draw.normal(0, 1, ARMS)
                best = toy["gibbs_beta"](ref, reward, target)
                for wrong in (30, 1 / 30):
                    for seed in range(6):
                        f, r, p = one_run(toy, moments, best * wrong, ref, reward, target, seed, lr)
                        band.append(f), gain.append(r / scale), peak.append(p)
            print(f"| {lr} | {moments} | {np.mean(band):.0%} ({np.min(band):.0%}) | {np.mean(gain):.3f} | "
                  f"{np.max(peak):.2f} |", flush=True)


if __name__ == "__main__":
    main()
