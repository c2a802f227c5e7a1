"""Coverage and error rates of the group-sequential speed rounds, simulated through the real loop.

Crafted timers give each variant log-normal per-round ratios with a known true ratio against the baseline
(`flows.speed_rounds.sequential_rounds` + `gates.judging.speed_verdicts`, no engines): per true ratio, the
share of stopped CIs that cover it, how often the point passes / fails / ends uninformative, and the mean
rounds it took. Run: `.venv/bin/python benchmarks/speed_sequential.py [--draws 4000] [--sd 0.08]`."""

from __future__ import annotations

import argparse
import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flows.speed_rounds import sequential_rounds  # noqa: E402
from gates.judging.speed_verdicts import FAIL, PASS, SequentialDesign  # noqa: E402

TRUE_RATIOS = (0.85, 0.95, 0.98, 1.0, 1.02, 1.05, 1.15)


def simulate(true_ratios: tuple[float, ...], draws: int, sd: float, design: SequentialDesign,
             minimum: float = 1.0, seed: int = 0) -> dict[float, dict[str, float]]:
    """Per true ratio: coverage of the stopped CI, pass / fail / uninformative rates, mean rounds."""
    rng = random.Random(seed)
    names = ["baseline"] + [f"v{i}" for i in range(len(true_ratios))]
    tally = {r: {"cover": 0, PASS: 0, FAIL: 0, "uninformative": 0, "rounds": 0} for r in true_ratios}
    noise: dict[tuple[str, int], float] = {}  # this draw's log-ratio noise per (variant, round)

    def timer(name: str, point: str, round_: int) -> float:
        if name == "baseline" or round_ < 0:
            return 100.0
        if (name, round_) not in noise:  # the variant's log ratio this round: N(log true, sd)
            noise[(name, round_)] = rng.gauss(0.0, sd)
        return 100.0 * true_ratios[int(name[1:])] * math.exp(noise[(name, round_)])

    for _ in range(draws):
        noise.clear()
        _, looks = sequential_rounds(names, {"decode_b1": names[1:]}, timer, design, {"decode_b1": minimum},
                                     warmup=0)
        for i, true in enumerate(true_ratios):
            look = looks[(f"v{i}", "decode_b1")]
            t = tally[true]
            t["cover"] += look.ci.low <= true <= look.ci.high
            t[look.decision] += 1
            t["rounds"] += look.ci.n
    return {r: {k: v / draws for k, v in t.items()} for r, t in tally.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=4000)
    parser.add_argument("--sd", type=float, default=0.08, help="sd of a round's log ratio")
    parser.add_argument("--spending", default="pocock")
    parser.add_argument("--look-every", type=int, default=5)
    parser.add_argument("--max-rounds", type=int, default=20)
    args = parser.parse_args()
    design = SequentialDesign(args.look_every, args.max_rounds, 0.05, args.spending)
    print(f"{args.draws} draws, sd {args.sd}, {design}")
    print("| true ratio | stopped CI covers | pass | fail | uninformative | mean rounds |")
    print("| --- | --- | --- | --- | --- | --- |")
    for true, row in simulate(TRUE_RATIOS, args.draws, args.sd, design).items():
        print(f"| {true} | {row['cover']:.3f} | {row[PASS]:.3f} | {row[FAIL]:.3f} | {row['uninformative']:.3f} "
              f"| {row['rounds']:.1f} |")


if __name__ == "__main__":
    main()
