"""Stand-in for TRL's tests/testing_utils.py: only the names tests/test_grpo_trainer.py imports, written here
(TRL's stored copy of the file is an older version without them). Same semantics: skip when the package or
hardware is missing."""

import importlib.util

import pytest
import torch
from transformers.utils import is_peft_available, is_vision_available


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _ampere_or_newer() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability(0) >= (8, 0)


require_peft = pytest.mark.skipif(not is_peft_available(), reason="test requires peft")
require_bitsandbytes = pytest.mark.skipif(not _has("bitsandbytes"), reason="test requires bitsandbytes")
require_jmespath = pytest.mark.skipif(not _has("jmespath"), reason="test requires jmespath")
require_kernels = pytest.mark.skipif(not _has("kernels"), reason="test requires kernels")
require_liger_kernel = pytest.mark.skipif(not _has("liger_kernel"), reason="test requires liger-kernel")
require_vision = pytest.mark.skipif(not is_vision_available(), reason="test requires vision")
require_vllm = pytest.mark.skipif(not _has("vllm"), reason="test requires vllm")
require_torch_accelerator = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="test requires an accelerator"
)
require_ampere_or_newer = pytest.mark.skipif(
    not _ampere_or_newer(), reason="test requires Ampere or newer GPU"
)


class TrlTestCase:
    @pytest.fixture(autouse=True)
    def set_tmp_dir(self, tmp_path):
        self.tmp_dir = str(tmp_path)
