"""A dynamic tree's node count chosen every round from the heads' own confidence
(`mtp-tree#nodes=conf`), as EAGLE-2 grows its tree from the draft's confidence, but priced:
each node verified costs T(n + 1) - T(n), so a node is worth verifying only while the tokens
it is expected to add pay for the time it adds.

Under greedy verification a drafted node is accepted exactly when every token on its path is
the target's argmax; the heads' probability of the path estimates that chance. The heads'
probabilities are trained on other text than the one being written, so a per-sequence scale
at each depth (accepted drafts there over the heads' predicted ones, decayed per round)
calibrates them before they are used. The choice reads the drafts, the scales and the cost
model alone, never this round's target, so verification stays exact at any temperature.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specmtp.tree import Path


@dataclass
class NodeCalibration:
    """How far to trust the heads' path probabilities at each depth in this sequence:
    (accepted_d + s) / (predicted_d + s), where predicted_d sums the chances of the nodes
    verified at depth d and accepted_d counts the rounds that accepted a node there (at most
    one node per depth can be), both decayed by `decay` per round, so the scale follows the
    text as the adaptive schedule's acceptance estimates do. Starts at 1 (the heads taken at
    their word): deeper heads are less sure and less often right, each by its own measure."""

    strength: float = 2.0  # pseudo-rounds behind the neutral start
    decay: float = 0.95
    predicted: list[float] = field(default_factory=list)  # per depth
    accepted: list[float] = field(default_factory=list)
    tokens: float = 0.0  # tokens committed by the tree rounds (decayed)
    seconds: float = 0.0  # and their seconds under the cost model

    def scale(self, depth: int) -> float:
        """The factor for nodes at `depth` (1 = the first draft)."""
        if depth > len(self.predicted):
            return 1.0
        s = self.strength
        return (self.accepted[depth - 1] + s) / (self.predicted[depth - 1] + s)

    def record(self, predicted: Sequence[float], accepted: int) -> None:
        """One round: `predicted[d]` the summed chances of its nodes at depth d + 1, and the
        number of drafts it accepted."""
        while len(self.predicted) < len(predicted):
            self.predicted.append(0.0)
            self.accepted.append(0.0)
        for d, chance in enumerate(predicted):
            self.predicted[d] = self.decay * self.predicted[d] + chance
            self.accepted[d] = self.decay * self.accepted[d] + (accepted > d)

    def rate(self, plain_rate: float) -> float:
        """Tokens per second of this sequence's tree rounds under the cost model (not the
        clock: a seed must fix sampled output), starting from plain decoding's."""
        s = self.strength  # pseudo-rounds of one token at plain decoding's rate
        return (self.tokens + s) / (self.seconds + s / plain_rate)

    def record_round(self, tokens: int, seconds: float) -> None:
        """A round's tokens (accepted + 1) and its modelled seconds."""
        self.tokens = self.decay * self.tokens + tokens
        self.seconds = self.decay * self.seconds + seconds

    def calibrated(self, paths: Sequence[Path], chances: Sequence[float]) -> list[float]:
        """Each node's chance scaled by its depth's factor, at most 1 and at most its
        parent's (a path cannot be likelier than its prefix)."""
        out: dict[Path, float] = {(): 1.0}
        for path, chance in zip(paths, chances, strict=True):
            out[path] = min(out[path[:-1]], self.scale(len(path)) * chance)
        return [out[p] for p in paths]


def paying_node_count(
    chances: Sequence[float], round_s: Callable[[int], float], rate: float
) -> int:
    """The n in 1..len(chances) that gains the most over spending the round's time at
    `rate` tokens per second: the largest (1 + Σ_{i<=n} chances[i]) - rate · round_s(n).
    `chances` are the ranked nodes' calibrated path probabilities (likeliest first, each node
    after its parent, so every prefix is a tree), `round_s(n)` the seconds of a round
    verifying n nodes, `rate` the tokens per second the sequence is making.

    Not the round's own tokens per second: maximising that ratio round by round adds nodes
    while they beat the round's own rate, so an unsure round (a low rate) verifies many
    unlikely nodes and a sure one stops early, the opposite of what the sequence's rate
    needs (Dinkelbach: a node pays when its chance beats the sequence's rate times the time
    it adds). Measured: the ratio rule accepted more tokens and ran 5% slower."""
    if not chances:
        raise ValueError("a tree round needs at least one drafted node")
    best, best_gain, expected = 1, -math.inf, 1.0
    for n, chance in enumerate(chances, 1):
        expected += chance
        gain = expected - rate * round_s(n)
        if gain > best_gain:
            best, best_gain = n, gain
    return best
