"""The two opt-in, exact compute savings (same losses and gradients; docs/fidelity.md, "Compute savings"):
``DeferredLogprobPasses`` (``defer_logprob_passes``) and ``KeptTokenHead`` (``kept_token_logprobs``)."""

from d3s import trl_contract  # noqa: F401 - checks the TRL internals these mixins use, at import
from d3s.savings.deferred import DeferredLogprobPasses
from d3s.savings.kept_head import KeptTokenHead

__all__ = ["DeferredLogprobPasses", "KeptTokenHead"]
