"""The paper's regime, estimated: the update tokens per step (prompts x G x mean completion tokens x the
fraction of the rollouts' tokens a method trains on over its schedule) at which the D3S paper trained, for the
regime sweep's figure and report to place the sweep's points against (docs/workflow/regime-sweep.md). Every
input is a choice of config/paper/ or an assumption: the paper gives none of them."""

from __future__ import annotations

import math
from dataclasses import dataclass

from d3s.methods import METHODS, Method


@dataclass(frozen=True)
class PaperRegime:
    """The paper's update tokens per step, estimated: prompts x G x mean completion tokens x the fraction of
    the rollouts' tokens a method trains on, averaged over the schedule (d3s.methods). Every input is a
    choice of config/paper/qwen2.5-math-7b.yaml or an assumption: the D3S paper gives none of them."""

    prompts_per_step: int = 32  # config/paper/*.yaml [choice]: the paper is silent (paper-notes §8)
    num_generations: int = 32  # G, DESIGN.md [choice]; N runs G/4 -> G (8 -> 32), K 5 % -> 20 % [paper, [S]]
    completion_tokens: tuple[float, float] = (500.0, 1500.0)  # mean completion length: an assumption
    max_completion_length: int = 3000  # config/paper: the cap, the upper bound of the mean

    @property
    def central_completion_tokens(self) -> float:
        low, high = self.completion_tokens
        return math.sqrt(low * high)

    def update_tokens(self, method: str) -> tuple[float, float, float]:
        """(low, central, high) update tokens per step of ``method`` in the paper's regime."""
        rollouts = self.prompts_per_step * self.num_generations * token_fraction(METHODS[method])
        low, high = self.completion_tokens
        return rollouts * low, rollouts * self.central_completion_tokens, rollouts * high

    def inputs(self) -> str:
        low, high = self.completion_tokens
        return (
            f"{self.prompts_per_step} prompts x G = {self.num_generations} rollouts per step "
            "(config/paper/qwen2.5-math-7b.yaml; the paper gives neither), mean completion length "
            f"{low:,.0f}-{high:,.0f} tokens (assumed; the configs cap it at {self.max_completion_length:,}), "
            "the trained fraction of those tokens averaged over the schedule (d3s.methods: D3S N = G/4 -> G "
            "and K = 5 -> 20 % linear, mean 8.75 %; PODS G/4 rollouts, all tokens, 25 %)"
        )


PAPER = PaperRegime()


def token_fraction(method: Method) -> float:
    """The mean fraction of the generated tokens a method trains on over a linear (or constant) schedule:
    the mean over p in [0, 1] of N(p)/G x K(p), rounding of N ignored."""
    n0, n1 = method.keep_per_prompt_fraction_init, method.keep_per_prompt_fraction_final
    k0, k1 = method.token_keep_ratio_init, method.token_keep_ratio_final
    if method.schedule != "linear":
        return n0 * k0
    return n0 * k0 + (n0 * (k1 - k0) + k0 * (n1 - n0)) / 2 + (n1 - n0) * (k1 - k0) / 3
