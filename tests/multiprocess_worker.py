"""Run by tests/test_multiprocess.py under `accelerate launch --num_processes 2` or `torchrun
--nproc_per_node 2` (gloo on CPU).

Trains a few steps and writes, per rank, the kept rows decided at each generation, the local row and
token counts, and TRL's num_items_in_batch, so the test can compare ranks.
"""

from __future__ import annotations

import json
import sys

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

import d3s.trainer as trainer_module
from d3s.data.synthetic import arithmetic_problems
from d3s.rewards import accuracy_reward


def length_reward(completions, **kwargs):
    return [float(len(c) % 5) for c in completions]


def main(model_path: str, method: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    decisions: list[list[int]] = []
    batches: list[dict] = []
    real_select = trainer_module.select_samples

    def recording_select(advantages, rewards, **kwargs):
        kept = real_select(advantages, rewards, **kwargs)
        settings = {k: v for k, v in kwargs.items() if k != "generator"}
        decisions.append(
            {
                "kept": kept.tolist(),
                "advantages": advantages.tolist(),
                "rewards": rewards.tolist(),
                **settings,
            }
        )
        return kept

    trainer_module.select_samples = recording_select
    token_decisions: list[dict] = []
    real_token_mask = trainer_module.token_keep_mask

    def recording_token_mask(scores, valid, token_keep_ratio, scope):
        keep = real_token_mask(scores, valid, token_keep_ratio, scope)
        token_decisions.append(
            {
                "scores": scores.tolist(),
                "valid": valid.tolist(),
                "ratio": token_keep_ratio,
                "scope": scope,
                "keep": keep.tolist(),
            }
        )
        return keep

    trainer_module.token_keep_mask = recording_token_mask

    class Recording(trainer_module.D3STrainer):
        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            batches.append(
                {
                    "rows": output["completion_ids"].shape[0],
                    "num_items_in_batch": output["num_items_in_batch"].item(),
                    "local_tokens": output["completion_mask"].sum().item(),
                }
            )
            return output

    args = trainer_module.D3SConfig.for_method(
        method,
        output_dir=f"{out_dir}/{method}",
        per_device_train_batch_size=16,
        num_generations=8,
        max_completion_length=16,
        max_steps=3,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        bf16=False,
        gradient_checkpointing=False,
        learning_rate=1e-3,
        seed=0,
        logging_steps=1,  # every step's loss is compared
    )
    rows = [
        {"prompt": p.prompt, "answer": p.answer} for p in arithmetic_problems(100, max_ops=1, max_operand=9)
    ]
    trainer = Recording(
        model=AutoModelForCausalLM.from_pretrained(model_path),
        args=args,
        reward_funcs=[accuracy_reward, length_reward],
        train_dataset=Dataset.from_list(rows),
        processing_class=AutoTokenizer.from_pretrained(model_path),
    )
    trainer.train()
    rank = trainer.accelerator.process_index
    record = {
        "world_size": trainer.accelerator.num_processes,
        "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
        "zero_stage": trainer.accelerator.state.deepspeed_plugin.zero_stage
        if trainer.is_deepspeed_enabled
        else None,
        "packs": trainer.packs_micro_batches,
        "decisions": decisions,
        "token_decisions": token_decisions,
        "batches": batches,
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
    }
    with open(f"{out_dir}/{method}_rank{rank}.json", "w") as fh:
        json.dump(record, fh)


if __name__ == "__main__":
    main(*sys.argv[1:4])
