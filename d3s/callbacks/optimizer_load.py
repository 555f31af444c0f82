"""Resuming a multi-process CPU run's optimizer, which transformers 5.17's Trainer cannot load."""

from __future__ import annotations

import os

import torch
from transformers import Trainer


class CpuRanksOptimizerLoad(Trainer):
    """transformers.Trainer's ``_load_optimizer_and_scheduler`` with multi-process CPU runs loaded on the CPU.

    Trainer maps the optimizer state to args.device when world_size > 1, which on CPU processes is
    "cpu:<rank>", a location torch.load cannot restore. D3STrainer lists this class after GRPOTrainer, so it
    sits between GRPOTrainer and Trainer in the MRO: it replaces Trainer's load only, and GRPOTrainer's own
    ``_load_optimizer_and_scheduler``, which calls it and then restores TRL's state (the adaptive-entropy
    controller's ``entropy_ctrl_state.json``), runs unchanged. It stays an override: no callback runs
    between Trainer's load and the first step. A module of its own: importing transformers' Trainer costs
    seconds, which the light importers of d3s/callbacks/checkpoints.py (d3s.runs.resume) do not pay.
    """

    def _load_optimizer_and_scheduler(self, checkpoint):
        optimizer = os.path.join(checkpoint or "", "optimizer.pt")
        scheduler = os.path.join(checkpoint or "", "scheduler.pt")
        cpu_ranks = self.args.world_size > 1 and self.args.device.type == "cpu"
        plain = not (self.is_deepspeed_enabled or self.is_fsdp_enabled)
        if cpu_ranks and plain and os.path.isfile(optimizer) and os.path.isfile(scheduler):
            self.optimizer.load_state_dict(torch.load(optimizer, map_location="cpu", weights_only=True))
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
        else:
            super()._load_optimizer_and_scheduler(checkpoint)
