"""Run by tests/test_packing.py under `accelerate launch --num_processes 2` (DDP, gloo on the CPU).

Trains d3s twice from the same weights, packed and unpacked, and writes per rank: the forward passes with
gradient and DDP's gradient all-reduces (a comm hook counts the buckets) of each optimizer step, the
gradient before each optimizer step and the final weights.
"""

from __future__ import annotations

import sys

import torch
from datasets import Dataset
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

from d3s.data.synthetic import arithmetic_problems
from d3s.rewards import accuracy_reward
from d3s.trainer import D3SConfig, D3STrainer


class Counts(TrainerCallback):
    def __init__(self, trainer: D3STrainer) -> None:
        self.trainer, self.forwards, self.all_reduces = trainer, 0, 0
        self.steps: list[dict] = []
        trainer.model.register_forward_hook(self._forward)

    def _forward(self, module, args, output) -> None:
        self.forwards += int(torch.is_grad_enabled())

    def _all_reduce(self, state, bucket):
        self.all_reduces += 1
        return allreduce_hook(state, bucket)

    def on_train_begin(self, args, state, control, **kwargs):
        wrapped = self.trainer.model_wrapped
        assert isinstance(wrapped, torch.nn.parallel.DistributedDataParallel), type(wrapped)
        wrapped.register_comm_hook(None, self._all_reduce)

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        grads = [p.grad.flatten() for p in model.parameters() if p.grad is not None]
        self.steps.append(
            {"forwards": self.forwards, "all_reduces": self.all_reduces, "grad": torch.cat(grads).tolist()}
        )
        self.forwards = self.all_reduces = 0


def main(model_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    rows = [
        {"prompt": p.prompt, "answer": p.answer} for p in arithmetic_problems(100, max_ops=1, max_operand=9)
    ]
    for packed in (True, False):
        # 4 prompts x 8 rollouts per generation batch over 2 ranks: 16 rows per rank in TRL's 4 micro-batches
        # of 4; N = 2 of 8 keeps 4 rows per rank: 4 micro-batches of 1 unpacked, 1 of 4 packed
        args = D3SConfig.for_method(
            "d3s",
            output_dir=f"{out_dir}/{packed}",
            per_device_train_batch_size=4,
            gradient_accumulation_steps=4,
            num_generations=8,
            schedule="constant",
            keep_per_prompt=2,
            max_completion_length=16,
            max_steps=2,
            use_cpu=True,
            report_to="none",
            save_strategy="no",
            bf16=False,
            gradient_checkpointing=False,
            learning_rate=1e-3,
            seed=0,
            pack_micro_batches=packed,
        )
        trainer = D3STrainer(
            model=AutoModelForCausalLM.from_pretrained(model_path),
            args=args,
            reward_funcs=[accuracy_reward],
            train_dataset=Dataset.from_list(rows),
            processing_class=AutoTokenizer.from_pretrained(model_path),
        )
        counts = Counts(trainer)
        trainer.add_callback(counts)
        trainer.train()
        rank = trainer.accelerator.process_index
        record = {
            "packs": trainer.packs_micro_batches,
            "steps": counts.steps,
            "weights": torch.cat([p.detach().flatten() for p in trainer.model.parameters()]).tolist(),
        }
        torch.save(record, f"{out_dir}/{'packed' if packed else 'unpacked'}_rank{rank}.pt")


if __name__ == "__main__":
    main(*sys.argv[1:3])
