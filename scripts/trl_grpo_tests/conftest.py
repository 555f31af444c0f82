"""Runs TRL's tests/test_grpo_trainer.py offline, against GRPOTrainer or against D3STrainer.

TRL_UNDER_TEST=grpo (default): TRL's GRPOTrainer and GRPOConfig, as the file imports them.
TRL_UNDER_TEST=d3s-grpo: GRPOTrainer and GRPOConfig in the test module's namespace are replaced by D3STrainer
    and a D3SConfig of method "grpo" built from the same keyword arguments.
TRL_UNDER_TEST=d3s-d3s: the same with method "d3s" (D3SConfig.for_method("d3s", ...)).

Both runs: hub ids resolve to ./trl-internal-testing/<name> (build_standins.py; pytest must run from this
directory), and, as there is no GPU, TrainingArguments gets use_cpu=True (TRL's default bf16=True is refused
on a GPU-less machine otherwise). Tests needing models or datasets that cannot be built offline are skipped.
"""

import inspect
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import transformers  # noqa: E402
import trl.trainer.utils  # noqa: E402

# The stored test file is newer than trl 1.16, which lacks this helper; only the GPU-only test_vlm_training
# (skipped here) calls it.
if not hasattr(trl.trainer.utils, "get_kbit_device_map"):
    trl.trainer.utils.get_kbit_device_map = lambda: None

UNDER_TEST = os.environ.get("TRL_UNDER_TEST", "grpo")
assert UNDER_TEST in ("grpo", "d3s-grpo", "d3s-d3s"), UNDER_TEST

if not torch.cuda.is_available():
    _post_init = transformers.TrainingArguments.__post_init__

    def _cpu_post_init(self):
        self.use_cpu = True
        if os.environ.get("TRL_TESTS_CPU_BF16") != "1":
            self.bf16 = False  # CPU bf16 matmuls over a 151,665-token vocabulary take seconds a step
        _post_init(self)

    transformers.TrainingArguments.__post_init__ = _cpu_post_init

# TRL_TESTS_MAX_STEPS=n: every run stops after n optimizer steps. Only for the quick census of what the
# method="d3s" variant refuses (refusals come at config or trainer construction); never for the comparison.
if os.environ.get("TRL_TESTS_MAX_STEPS"):
    _post_init_steps = transformers.TrainingArguments.__post_init__

    def _capped_post_init(self):
        self.max_steps = int(os.environ["TRL_TESTS_MAX_STEPS"])
        _post_init_steps(self)

    transformers.TrainingArguments.__post_init__ = _capped_post_init

# Not reproducible offline: real tokenizers' token ids (tool calls) or vision models and image datasets.
NOT_OFFLINE = ("test_training_with_tools", "test_tool_completion_idx_injection", "vlm")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(key in item.name for key in NOT_OFFLINE):
            item.add_marker(pytest.mark.skip(reason="not reproducible offline (hub model/tokenizer/dataset)"))


def _d3s_standins(method: str):
    from trl import GRPOConfig as TrlGRPOConfig
    from trl import GRPOTrainer as TrlGRPOTrainer
    from trl.trainer.utils import get_config_model_id

    from d3s.trainer import D3STrainer
    from d3s.trainer_config import D3SConfig

    def make_config(**kwargs):
        if method == "grpo":
            return D3SConfig(method="grpo", **kwargs)
        return D3SConfig.for_method(method, **kwargs)

    def convert(config):
        """A GRPOConfig handed to the trainer: its fields copied into a D3SConfig of the method."""
        import dataclasses

        values = {f.name: getattr(config, f.name) for f in dataclasses.fields(TrlGRPOConfig) if f.init}
        return make_config(**values)

    class GRPOTrainer(D3STrainer):
        def __init__(self, *args, **kwargs):
            call = inspect.signature(TrlGRPOTrainer.__init__).bind(self, *args, **kwargs)
            config = call.arguments.get("args")
            if config is None and method != "grpo":  # GRPOTrainer's default config, of this method
                model = call.arguments["model"]
                name = model if isinstance(model, str) else get_config_model_id(model.config)
                call.arguments["args"] = make_config(output_dir=f"{name.split('/')[-1]}-GRPO")
            elif config is not None and not isinstance(config, D3SConfig):
                call.arguments["args"] = convert(config)
            super().__init__(*call.args[1:], **call.kwargs)

    return make_config, GRPOTrainer


@pytest.fixture(autouse=True)
def _trainer_under_test(request, monkeypatch):
    if UNDER_TEST == "grpo" or request.module is None:
        yield
        return
    make_config, trainer = _d3s_standins(UNDER_TEST.split("-", 1)[1])
    if hasattr(request.module, "GRPOTrainer"):
        monkeypatch.setattr(request.module, "GRPOTrainer", trainer)
        monkeypatch.setattr(request.module, "GRPOConfig", make_config)
    yield
