"""The two compute savings, opt-in and exact (same losses and gradients as without them):

- ``DeferredLogprobPasses`` (``D3SConfig.defer_logprob_passes``, d3s/savings/deferred.py): TRL's old-policy,
  reference and importance-sampling log-prob passes run after rollout selection, on the kept rollouts only;
- ``KeptTokenHead`` (``D3SConfig.kept_token_logprobs``, d3s/savings/kept_head.py): with K < 1 the gradient
  pass projects through the LM head only at the kept tokens.

Both rely on TRL internals, listed and checked in d3s/trl_contract.py.
"""

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
