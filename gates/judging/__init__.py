"""gates/judging/: the gates judged: the policy, verdicts with their CIs, power, sensitivity, speed and fidelity gates."""
