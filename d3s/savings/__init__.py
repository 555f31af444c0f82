"""The two opt-in, exact compute savings (same losses and gradients; docs/fidelity/trainer.md, "Compute
savings"): ``DeferredLogprobPasses`` (``defer_logprob_passes``) and ``kept_token_logps``
(``kept_token_logprobs``)."""

from d3s import trl_contract  # noqa: F401 - checks the TRL internals these savings use, at import
from d3s.savings.deferred import DeferredLogprobPasses
from d3s.savings.kept_head import kept_token_logps

__all__ = ["DeferredLogprobPasses", "kept_token_logps"]
