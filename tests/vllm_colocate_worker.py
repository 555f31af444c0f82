"""Run by tests/test_vllm_colocate.py in a process of its own (vLLM's CPU worker replaces
torch.set_num_threads for the whole process, so no engine is built inside pytest).

    python vllm_colocate_worker.py OUT MODEL_DIR METHOD[:STEPS] [METHOD[:STEPS] ...]

Trains each method in turn through TRL's colocate mode with a float32 engine, and writes OUT/<method>.json:
after each weight sync, the largest difference between vLLM's and the trainer's log-probs of a fixed token
sequence, before the LM head is re-packed (the plain layer-wise reload) and after (the whole sync); and the
per-step metrics. Under ``accelerate launch`` each rank writes OUT/<method>_rank<r>.json, without the fixed
sequence (the trainer's weights are sharded under ZeRO-3).

The methods share one engine per process (built for the first, reused by the next): each trainer's first
sync, before its first generation, loads its own weights, so sharing saves only the engine's start.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from helpers import TINY_TRAINER_ARGS, train_rows
from transformers import AutoModelForCausalLM, AutoTokenizer

import d3s.vllm_engine as vllm_engine
from d3s.rewards import accuracy_reward
from d3s.trainer import D3SConfig, D3STrainer

FIXED_SEQUENCE = "7 + 5 = \\boxed{12}"
STEP_METRICS = ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max", "loss")


def length_reward(completions, **kwargs):
    """Mixed rewards in every group, whatever the tiny model samples (selection always has work to do)."""
    return [float(len(c) % 5) for c in completions]


def vllm_logprobs(llm, token_ids: list[int]) -> torch.Tensor:
    """vLLM's log-probs of ``token_ids[1:]`` given the tokens before each (prompt log-probs)."""
    from vllm import SamplingParams

    llm.reset_prefix_cache()  # no KV cached under the previous weights
    (output,) = llm.generate(
        [{"prompt_token_ids": token_ids}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
    )
    steps = zip(output.prompt_logprobs[1:], token_ids[1:], strict=True)
    return torch.tensor([step[token].logprob for step, token in steps])


def trainer_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(token_ids[1:]).unsqueeze(1)).squeeze(1)


class SharedEngine:
    """TRL's engine class, built once per process and handed to every later trainer."""

    def __init__(self, llm_class) -> None:
        self.llm_class, self.llm = llm_class, None

    def __call__(self, **kwargs):
        if self.llm is None:
            # room for every method's generation batch (GSPO's is 4 micro-batches)
            self.llm = self.llm_class(**kwargs | {"max_num_seqs": 4 * kwargs["max_num_seqs"]})
        return self.llm


class MeasuredRefresh:
    """The sync's last stage (re-packing the LM head), with the fixed sequence's log-probs measured before it
    (what the plain layer-wise reload leaves) and after it (the whole sync), against the trainer's."""

    def __init__(self, refresh, sequence: list[int]) -> None:
        self.refresh, self.sequence = refresh, sequence
        self.trainer, self.syncs = None, []

    def __call__(self, model: torch.nn.Module) -> int:
        if self.trainer.accelerator.num_processes > 1:  # sharded weights: no single-process reference
            return self.refresh(model)
        llm = self.trainer.vllm_generation.llm
        reload_only = vllm_logprobs(llm, self.sequence)
        refreshed = self.refresh(model)
        synced = vllm_logprobs(llm, self.sequence)
        reference = trainer_logprobs(self.trainer.model, self.sequence)
        self.syncs.append(
            {
                "step": self.trainer.state.global_step,
                "reload_only": (reload_only - reference).abs().max().item(),
                "synced": (synced - reference).abs().max().item(),
            }
        )
        return refreshed


def main(out_dir: str, model_dir: str, *method_steps: str) -> None:
    from trl.generation import vllm_generation

    torch.set_num_threads(1)
    vllm_generation.LLM = SharedEngine(vllm_generation.LLM)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    sequence = tokenizer(FIXED_SEQUENCE, add_special_tokens=False)["input_ids"]
    real_refresh = vllm_engine.refresh_packed_lm_head
    for item in method_steps:
        method, _, steps = item.partition(":")
        measured = vllm_engine.refresh_packed_lm_head = MeasuredRefresh(real_refresh, sequence)
        args = D3SConfig.for_method(
            method,
            **TINY_TRAINER_ARGS
            | {
                "output_dir": f"{out_dir}/{method}",
                "max_steps": int(steps or 3),
                "max_completion_length": 16,
                "use_vllm": True,
                "vllm_mode": "colocate",
                "vllm_max_model_length": 128,
                "vllm_dtype": "float32",
            },
        )
        trainer = measured.trainer = D3STrainer(
            model=AutoModelForCausalLM.from_pretrained(model_dir),
            args=args,
            reward_funcs=[accuracy_reward, length_reward],
            train_dataset=train_rows(),
            processing_class=tokenizer,
        )
        trainer.train()
        record = {
            "engine_dtype": str(trainer.vllm_generation.llm.llm_engine.model_config.dtype),
            "syncs": measured.syncs,
            "steps": [
                {"step": e["step"], **{k: e[k] for k in STEP_METRICS if k in e}}
                for e in trainer.state.log_history
                if "loss" in e
            ],
        }
        rank, world = trainer.accelerator.process_index, trainer.accelerator.num_processes
        name = f"{method}_rank{rank}" if world > 1 else method
        Path(out_dir, f"{name}.json").write_text(json.dumps(record))
    vllm_engine.refresh_packed_lm_head = real_refresh


if __name__ == "__main__":
    main(*sys.argv[1:])
