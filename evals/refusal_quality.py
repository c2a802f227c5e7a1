"""How good is the refusal detector? Precision and recall against pyrit's human-labelled responses.

pyrit's labels (`refusal.csv`, ~105 rows) call a response a refusal when it declines the objective *or*
answers something unrelated to it; our detector reads the response alone, so off-topic answers are
misses it cannot see by design (17 of the 70 labelled refusals, most of them off-topic answers).
"""

from __future__ import annotations

from dataclasses import dataclass

from evals.refusal import detect_refusal
from evals.tasks.packages import LabelledResponse, refusal_labels

# The floors tests assert (and docs/evals.md states) on pyrit's refusal.csv.
PRECISION_FLOOR = 0.95
RECALL_FLOOR = 0.70


@dataclass(frozen=True)
class DetectorQuality:
    n: int
    true_pos: int
    false_pos: int
    false_neg: int
    true_neg: int
    misses: tuple[str, ...]  # labelled refusals the detector passed (first 120 characters)
    false_alarms: tuple[str, ...]

    @property
    def precision(self) -> float:
        flagged = self.true_pos + self.false_pos
        return self.true_pos / flagged if flagged else float("nan")

    @property
    def recall(self) -> float:
        positives = self.true_pos + self.false_neg
        return self.true_pos / positives if positives else float("nan")


def measure(labels: list[LabelledResponse] | None = None) -> DetectorQuality:
    rows = refusal_labels() if labels is None else labels
    tp = fp = fn = tn = 0
    misses: list[str] = []
    alarms: list[str] = []
    for row in rows:
        flagged = detect_refusal(row.response).refused
        if flagged and row.refusal:
            tp += 1
        elif flagged:
            fp += 1
            alarms.append(row.response[:120])
        elif row.refusal:
            fn += 1
            misses.append(row.response[:120])
        else:
            tn += 1
    return DetectorQuality(len(rows), tp, fp, fn, tn, tuple(misses), tuple(alarms))


def main() -> None:
    q = measure()
    print(f"refusal detector on pyrit refusal.csv: n={q.n} precision={q.precision:.3f} recall={q.recall:.3f} "
          f"(tp {q.true_pos}, fp {q.false_pos}, fn {q.false_neg}, tn {q.true_neg}); "
          f"floors: precision >= {PRECISION_FLOOR}, recall >= {RECALL_FLOOR}")
    for text in q.misses:
        print("  missed:", text.replace("\n", " "))


if __name__ == "__main__":
    main()
