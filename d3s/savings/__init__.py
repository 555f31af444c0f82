"""The two opt-in, exact compute savings (same losses and gradients; docs/fidelity.md, "Compute savings"):
``DeferredLogprobPasses`` (``defer_logprob_passes``) and ``KeptTokenHead`` (``kept_token_logprobs``)."""

from d3s import trl_contract  # noqa: F401 - checks the TRL internals these mixins use, at import
from d3s.savings.deferred import DEFERRED_KEYS, DeferredLogprobPasses
from d3s.savings.kept_head import KeptTokenHead, add_kept_token_head, kept_token_head_unsupported

__all__ = [
    "DEFERRED_KEYS",
    "DeferredLogprobPasses",
    "KeptTokenHead",
    "add_kept_token_head",
    "kept_token_head_unsupported",
]
