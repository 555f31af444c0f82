"""Checkpoints of a D3S run: the run's counters (in trainer_state.json), the mark of a complete checkpoint
(d3s_state.json, which records each file's size and checksum) and, with ``full_state_checkpoints: latest``,
older checkpoints cut to their weights."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from accelerate import PartialState
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from d3s.provenance.integrity import CHECKSUM, record_files, reporting_full_disk
from d3s.provenance.manifest import atomic_write_text

D3S_STATE_FILE = "d3s_state.json"
# Marks a checkpoint cut to its weights (full_state_checkpoints: latest); written before anything is removed.
WEIGHTS_ONLY_FILE = "d3s_weights_only.txt"
FULL_STATE_CHECKPOINTS = ("all", "latest")
# What a checkpoint holds only for resuming, beside the weights (transformers 5.17 Trainer._save_checkpoint:
# optimizer, scheduler, grad scaler, RNG per rank; DeepSpeed's engine.save_checkpoint: global_step<N>/ with
# the sharded fp32 master weights and optimizer states, `latest`, zero_to_fp32.py and zero_to_torch.py).
RESUME_STATE_PATTERNS = (
    "optimizer.pt",
    "optimizer.bin",
    "scheduler.pt",
    "scaler.pt",
    "rng_state*.pth",
    "global_step*",
    "latest",
    "zero_to_fp32.py",
    "zero_to_torch.py",
)
# Weight files of a checkpoint (save_model); without one, the weights live only in DeepSpeed's global_step*/.
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "adapter_model.safetensors",
)
# Files of a checkpoint that describe the checkpoint itself, not the model that save_model wrote into it.
CHECKPOINT_ONLY_FILES = ("trainer_state.json", D3S_STATE_FILE, WEIGHTS_ONLY_FILE)


def has_training_state(checkpoint: str | os.PathLike[str]) -> bool:
    """True when the checkpoint holds optimizer state: optimizer.pt/.bin (an ``optimizer*`` folder under
    FSDP) or DeepSpeed's global_step*. save_only_model: true writes neither: such a checkpoint cannot resume.
    """
    return any(path.name.startswith(("optimizer", "global_step")) for path in Path(checkpoint).iterdir())


def strip_to_weights(checkpoint: str | os.PathLike[str], reason: str) -> list[str]:
    """Remove what ``checkpoint`` holds only for resuming (RESUME_STATE_PATTERNS), keeping its weights,
    tokenizer, trainer state and logs; returns the names removed. A checkpoint without weight files keeps
    everything (its weights live only in DeepSpeed's global_step*: ZeRO-3 without zero3_save_16bit_model).

    WEIGHTS_ONLY_FILE is written first, so a crash midway never leaves a checkpoint that looks resumable.
    """
    checkpoint = Path(checkpoint)
    if not any((checkpoint / name).is_file() for name in WEIGHT_FILES):
        return []
    state = sorted({path for pattern in RESUME_STATE_PATTERNS for path in checkpoint.glob(pattern)})
    if not state:
        return []
    atomic_write_text(
        checkpoint / WEIGHTS_ONLY_FILE,
        f"Weights only: {reason}. Removed (needed only to resume): {', '.join(p.name for p in state)}\n",
    )
    for path in state:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    return [path.name for path in state]


class D3SCheckpointState(TrainerCallback, ExportableState):
    """The run's counters, saved with each checkpoint and restored on resume; the mark of a complete one."""

    def __init__(self, update_tokens_total: int = 0) -> None:
        self.update_tokens_total = update_tokens_total  # tokens that reached the policy gradient, all ranks

    def state(self) -> dict:
        return {"args": {}, "attributes": {"update_tokens_total": self.update_tokens_total}}

    def on_train_begin(self, args, state, control, **kwargs):
        # On resume, Trainer loaded the checkpoint's trainer_state.json, ours included; it restores callbacks
        # itself only under restore_callback_states_from_checkpoint (off by default), so read ours here.
        name = type(self).__name__
        saved = state.stateful_callbacks.get(name)
        if saved and state.global_step > 0:
            self.update_tokens_total = saved["attributes"]["update_tokens_total"]
        elif state.global_step > 0:  # a checkpoint written before the counter moved to trainer_state.json
            legacy = Path(args.output_dir) / f"checkpoint-{state.global_step}" / D3S_STATE_FILE
            if legacy.is_file():
                counters = json.loads(legacy.read_text(encoding="utf-8"))
                self.update_tokens_total = counters["update_tokens_total"]
            state.stateful_callbacks[name] = self.state()  # Trainer's next save updates this entry

    def on_save(self, args, state, control, **kwargs):
        # Every rank has written its part (DeepSpeed shards, rng_state_<rank>.pth) before the checkpoint is
        # marked complete: d3s.runs.resume.latest_checkpoint resumes only from ones with D3S_STATE_FILE.
        PartialState().wait_for_everyone()
        if not args.should_save:
            return
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        with reporting_full_disk(folder, folder.name):
            # what the checkpoint holds, verified before it is resumed or promoted (d3s.runs.resume)
            files = record_files(folder, exclude=(D3S_STATE_FILE, WEIGHTS_ONLY_FILE))
            mark = {"update_tokens_total": self.update_tokens_total, "checksum": CHECKSUM, "files": files}
            atomic_write_text(folder / D3S_STATE_FILE, json.dumps(mark, indent=1))
        if args.full_state_checkpoints == "latest":
            _strip_older_checkpoints(Path(args.output_dir), state.global_step)


def _strip_older_checkpoints(run_dir: Path, step: int) -> None:
    """Cut every checkpoint older than the complete checkpoint-<step> to its weights."""
    for path in run_dir.glob("checkpoint-*"):
        number = path.name.split("-")[-1]
        if number.isdigit() and int(number) < step and not (path / WEIGHTS_ONLY_FILE).exists():
            removed = strip_to_weights(path, f"checkpoint-{step} holds the full state")
            if removed:
                print(f"{path.name} cut to its weights (removed {', '.join(removed)})", flush=True)


class CheckpointSaveErrors:
    """Mixin for D3STrainer: a checkpoint save that runs out of disk space ends in one line naming the
    checkpoint's path and the space left there (DiskFullError), not torch's "basic_ios::clear"."""

    def _save_checkpoint(self, model, trial):
        folder = Path(self._get_output_dir(trial=trial)) / f"checkpoint-{self.state.global_step}"
        with reporting_full_disk(folder, folder.name):
            super()._save_checkpoint(model, trial)
