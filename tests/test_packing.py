"""Packing (d3s/packing.py): an optimizer step's kept rows in ceil(rows / per_device_train_batch_size)
micro-batches, with the same gradient, weights and metrics as TRL's micro-batches.

The unpacked run is the oracle: the same trainer with ``pack_micro_batches: false`` trains on TRL's
``steps_per_generation`` micro-batches exactly as before packing existed (test_objectives.py proves that
run's gradient against the papers' equations)."""

from __future__ import annotations

import math
import zlib

import pytest
import torch
from helpers import TINY_TRAINER_ARGS, make_trainer
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import TrainerCallback

from d3s.objective import CLIPPED_LOSSES, Objective, loss_row_scale, selection_loss
from d3s.packing import (
    LOSS_ROW_SCALE,
    cut,
    is_empty,
    join,
    pack_generation_batch,
    pack_step,
    rows_of,
)
from d3s.trainer import D3SConfig


def _batch(rows: int, width: int = 5, start: int = 0) -> dict:
    return {
        "completion_ids": torch.arange(start * width, (start + rows) * width).view(rows, width),
        "advantages": torch.arange(start, start + rows, dtype=torch.float32),
        "num_items_in_batch": torch.tensor(17.0),
        "prompts": [f"p{start + i}" for i in range(rows)],
        "ref_per_token_logps": None,
    }


# ---- the pure packing --------------------------------------------------------------------------------------


@given(rows=st.integers(1, 40), parts=st.integers(1, 40))
def test_cut_then_join_is_the_batch(rows, parts):
    parts = min(parts, rows)
    batch = _batch(rows)
    pieces = cut(batch, parts)
    sizes = [rows_of(p) for p in pieces]
    assert sum(sizes) == rows and max(sizes) - min(sizes) <= 1  # near-equal, in order
    joined = join(pieces)
    assert torch.equal(joined["completion_ids"], batch["completion_ids"])
    assert joined["prompts"] == batch["prompts"]
    assert joined["num_items_in_batch"] is batch["num_items_in_batch"]  # a 0-dim value is taken once
    assert joined["ref_per_token_logps"] is None


@given(
    slot_rows=st.lists(st.integers(1, 9), min_size=1, max_size=8),
    rows_per_micro_batch=st.integers(1, 12),
)
def test_pack_step_puts_the_rows_in_order_in_the_last_slots(slot_rows, rows_per_micro_batch):
    slots, start = [], 0
    for rows in slot_rows:
        slots.append(_batch(rows, start=start))
        start += rows
    scale = [torch.full((rows,), float(i)) for i, rows in enumerate(slot_rows)]
    scale_of = {id(slot): rows_scale for slot, rows_scale in zip(slots, scale, strict=True)}
    packed = pack_step(slots, rows_per_micro_batch, lambda slot: scale_of[id(slot)])
    assert len(packed) == len(slots)
    wanted = math.ceil(sum(slot_rows) / rows_per_micro_batch)
    if wanted >= len(slots):  # packing would not save a micro-batch: TRL's slots, untouched
        assert packed == slots
        return
    empty = [is_empty(slot) for slot in packed]
    assert empty == [True] * (len(slots) - wanted) + [False] * wanted  # the last slot is a real one
    real = packed[len(slots) - wanted :]
    assert all(rows_of(slot) <= rows_per_micro_batch for slot in real)
    joined = join(real)
    assert torch.equal(joined["completion_ids"], join(slots)["completion_ids"])
    # every row keeps the normaliser of the micro-batch TRL put it in
    assert torch.equal(joined[LOSS_ROW_SCALE], torch.cat(scale))


def test_pack_generation_batch_never_moves_rows_between_optimizer_steps():
    slots = [_batch(2, start=2 * i) for i in range(8)]  # 2 optimizer steps of 4 micro-batches of 2 rows
    packed = pack_generation_batch(slots, 4, 8, lambda slot: torch.ones(rows_of(slot)))
    assert [is_empty(s) for s in packed] == [True, True, True, False] * 2
    assert packed[3]["completion_ids"].flatten().tolist() == list(range(0, 40))
    assert packed[7]["completion_ids"].flatten().tolist() == list(range(40, 80))
    with pytest.raises(ValueError, match="not whole optimizer steps of 3"):
        pack_generation_batch(slots, 3, 8, lambda slot: torch.ones(rows_of(slot)))


# ---- the loss: each row's unpacked normaliser makes the packed loss the unpacked sum -----------------------


@settings(max_examples=60, deadline=None)
@given(
    loss_type=st.sampled_from(CLIPPED_LOSSES),
    sequence_level=st.booleans(),
    beta=st.sampled_from([0.0, 0.04]),
    kept_tokens_normalise=st.booleans(),
    with_is_weight=st.booleans(),
    chunk_rows=st.lists(st.integers(1, 5), min_size=1, max_size=5),
    seed=st.integers(0, 10_000),
)
def test_packed_loss_and_gradient_equal_the_micro_batches_summed(
    loss_type, sequence_level, beta, kept_tokens_normalise, with_is_weight, chunk_rows, seed
):
    generator = torch.Generator().manual_seed(seed)
    rows, width = sum(chunk_rows), 6
    objective = Objective(
        loss_type=loss_type,
        sequence_level=sequence_level,
        epsilon_low=0.2,
        epsilon_high=0.28,
        delta=None,
        beta=beta,
        kl_on_kept_tokens=True,
        kl_bias_correction=True,
        kept_tokens_normalise=kept_tokens_normalise or sequence_level,
        max_completion_length=width,
    )
    logps = torch.randn(rows, width, generator=generator) * 0.3 - 1
    old = logps + torch.randn(rows, width, generator=generator) * 0.2  # clipped on some tokens
    ref = logps + torch.randn(rows, width, generator=generator) * 0.1
    advantages = torch.randn(rows, generator=generator)
    valid = (torch.rand(rows, width, generator=generator) > 0.2).float()
    kept = valid * (torch.rand(rows, width, generator=generator) > 0.5).float()
    is_weight = torch.rand(rows, 1, generator=generator) * 2 if with_is_weight else None
    counted = torch.rand(rows, generator=generator) > 0.2  # a zeroed rollout leaves the mean over rows
    accumulation, dapo = len(chunk_rows), torch.tensor(float(valid.sum()))

    def loss_of(part: slice, row_scale=None):
        weights = None if is_weight is None else is_weight[part]
        return selection_loss(
            objective,
            leaf[part],
            old[part],
            ref[part],
            advantages[part],
            valid[part],
            kept[part],
            weights,
            rows_counted=counted[part],
            accumulation=accumulation,
            dapo_denominator=dapo,
            row_scale=row_scale,
        ).loss

    bounds = [0, *torch.tensor(chunk_rows).cumsum(0).tolist()]
    parts = [slice(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
    leaf = logps.clone().requires_grad_(True)
    unpacked = sum(loss_of(part) for part in parts)
    unpacked.backward()
    unpacked_grad, leaf.grad = leaf.grad.clone(), None
    scales = [
        loss_row_scale(objective, objective.loss_mask(valid[p], kept[p]), counted[p], accumulation, dapo)
        for p in parts
    ]
    packed = loss_of(slice(0, rows), torch.cat(scales))
    packed.backward()
    torch.testing.assert_close(packed, unpacked, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(leaf.grad, unpacked_grad, rtol=1e-5, atol=1e-7)


# ---- the trainer: packed and unpacked training, step for step ---------------------------------------------

# 4 prompts x 8 rollouts per generation batch, TRL's micro-batches of 8 rows, accumulation 4. With N = 2 of 8
# the 8 kept rows are 4 micro-batches of 2 unpacked, 1 of 8 packed.
PACKING_GEOMETRY = dict(per_device_train_batch_size=8, gradient_accumulation_steps=4, max_steps=2)
CONSTANT_N2 = {"schedule": "constant", "keep_per_prompt": 2}
# Every method that selects rollouts or tokens: (method, overrides). Sample selection at N = 2 of 8 packs 4
# micro-batches into 1; the token level alone (entropy_8020) keeps every row, so packing saves nothing there
# and must change nothing.
GSPO_MINIBATCHES = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2}
# Every method that selects rollouts or tokens: (method, overrides, forward passes with gradient per optimizer
# step packed, unpacked). Sample selection at N = 2 of 8 packs 4 micro-batches into 1; the token level alone
# (entropy_8020) keeps every row, so packing saves nothing there and must change nothing.
SELECTING_METHODS = [
    ("pods", CONSTANT_N2, [1, 1], [4, 4]),
    ("pods_random", CONSTANT_N2, [1, 1], [4, 4]),
    ("pods_max_reward", CONSTANT_N2, [1, 1], [4, 4]),
    ("d1s", CONSTANT_N2, [1, 1], [4, 4]),
    ("d1s_cross", CONSTANT_N2, [1, 1], [4, 4]),
    ("d2s", CONSTANT_N2, [1, 1], [4, 4]),
    ("d3s", CONSTANT_N2, [1, 1], [4, 4]),
    ("d3s_i", CONSTANT_N2, [1, 1], [4, 4]),
    ("d3s_adaptive", CONSTANT_N2, [1, 1], [4, 4]),
    # GSPO's 4 optimizer steps per generation batch (steps_per_generation 8, accumulation 2, 4-row
    # micro-batches): 8 kept rows, 1 per TRL micro-batch; each step's 2 packed into 1; off-policy after step 1
    ("gspo_d3s", CONSTANT_N2 | GSPO_MINIBATCHES, [1, 1], [2, 2]),
    ("entropy_8020", {}, [4, 4], [4, 4]),
    ("d3s", CONSTANT_N2 | {"loss_type": "bnpo"}, [1, 1], [4, 4]),
    ("d3s", CONSTANT_N2 | {"loss_type": "dr_grpo"}, [1, 1], [4, 4]),
    ("d3s", CONSTANT_N2 | {"loss_type": "dapo", "beta": 0.04}, [1, 1], [4, 4]),
    # linear N = 6 at p = 0, 4 at p = 1/2: 24 rows in 3 micro-batches, then 16 in 2
    ("d3s", {"keep_per_prompt": 6, "keep_per_prompt_final": 2}, [3, 2], [4, 4]),
]


def spread_reward(completions, **kwargs):
    """Rewards that tie only where texts are equal: PODS's max-reward rule keeps the 2 best of 8, which under
    a 0/1 reward mostly tie, leaving every kept advantage 0 (as in test_objectives.py)."""
    return [float(len(c) % 3) + (zlib.crc32(c.encode()) % 1000) / 1000 for c in completions]


REWARDS = {"pods_max_reward": [spread_reward]}  # every other method: math-verify's 0/1 reward


class StepRecorder(TrainerCallback):
    """Each optimizer step's gradient (before clipping) and forward passes with gradient."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []
        self.forwards: list[int] = []
        self._forwards = 0
        model.register_forward_hook(self._count)

    def _count(self, module, args, output) -> None:
        self._forwards += int(torch.is_grad_enabled())

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        self.forwards.append(self._forwards)
        self._forwards = 0


def train(model_path, out, method: str, overrides: dict, packed: bool):
    args = D3SConfig.for_method(
        method,
        output_dir=str(out / ("packed" if packed else "unpacked")),
        **(TINY_TRAINER_ARGS | PACKING_GEOMETRY | {"pack_micro_batches": packed} | overrides),
    )
    trainer = make_trainer(model_path, args, REWARDS.get(method))
    recorder = StepRecorder(trainer.model)
    trainer.add_callback(recorder)
    trainer.train()
    logs = [record for record in trainer.state.log_history if "loss" in record]
    return trainer, recorder, logs


@pytest.mark.slow
@pytest.mark.parametrize("method, overrides, packed_forwards, unpacked_forwards", SELECTING_METHODS)
def test_packed_training_equals_unpacked(
    tmp_path, tiny_sft_model, method, overrides, packed_forwards, unpacked_forwards
):
    packed, packed_steps, packed_logs = train(tiny_sft_model, tmp_path, method, overrides, True)
    unpacked, unpacked_steps, unpacked_logs = train(tiny_sft_model, tmp_path, method, overrides, False)
    assert packed.packs_micro_batches and not unpacked.packs_micro_batches
    assert packed_steps.forwards == packed_forwards
    assert unpacked_steps.forwards == unpacked_forwards
    moved = [any(g.abs().sum() > 0 for g in step.values()) for step in unpacked_steps.grads]
    assert any(moved), "no step carried a gradient: the comparison checks nothing"
    for grads, reference in zip(packed_steps.grads, unpacked_steps.grads, strict=True):
        assert grads.keys() == reference.keys() and grads
        for name in reference:
            torch.testing.assert_close(grads[name], reference[name], rtol=1e-4, atol=1e-7, msg=name)
    # AdamW divides each gradient by its own root mean square: a weight whose gradient is float noise moves by
    # up to a step either way, so the weights agree to 1 % of a step (lr 1e-3), not to the gradients' 1e-7
    for name, weight in unpacked.model.state_dict().items():
        torch.testing.assert_close(packed.model.state_dict()[name], weight, rtol=1e-4, atol=1e-5, msg=name)
    assert len(packed_logs) == len(unpacked_logs) == 2
    for record, reference in zip(packed_logs, unpacked_logs, strict=True):
        assert record.keys() == reference.keys()
        for key, value in reference.items():
            if isinstance(value, float) and key not in ("step_time", "train_runtime"):
                assert record[key] == pytest.approx(value, rel=1e-4, abs=1e-6, nan_ok=True), key


@pytest.mark.slow
def test_packing_under_ddp_all_reduces_in_a_real_backward(tmp_path, tiny_sft_model):
    """2 ranks (accelerate's DDP, the workflow's config): packed, each rank runs 1 forward with gradient per
    step instead of 4, the last one DDP's synchronising backward; gradients and weights equal unpacked."""
    import os
    import subprocess

    from helpers import ACCELERATE_DIR, REPO_ROOT

    from d3s.orchestration.commands import accelerate_command
    from d3s.ports import free_port

    cmd = accelerate_command(
        [str(REPO_ROOT / "tests" / "packing_worker.py"), str(tiny_sft_model), str(tmp_path)],
        num_processes=2,
        config_file=ACCELERATE_DIR / "ddp.yaml",
        main_process_port=free_port(),
        threads_per_process=1,
        cpu=True,
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    runs = {
        name: [torch.load(tmp_path / f"{name}_rank{rank}.pt") for rank in range(2)]
        for name in ("packed", "unpacked")
    }
    assert [r["packs"] for r in runs["packed"]] == [True, True]
    assert [r["packs"] for r in runs["unpacked"]] == [False, False]
    for rank in range(2):
        packed, unpacked = runs["packed"][rank], runs["unpacked"][rank]
        assert [s["forwards"] for s in packed["steps"]] == [1, 1]
        assert [s["forwards"] for s in unpacked["steps"]] == [4, 4]
        # one synchronising backward per step, packed or not: the same buckets all-reduced
        buckets = [s["all_reduces"] for s in unpacked["steps"]]
        assert buckets[0] > 0 and [s["all_reduces"] for s in packed["steps"]] == buckets
        for step, reference in zip(packed["steps"], unpacked["steps"], strict=True):
            torch.testing.assert_close(
                torch.tensor(step["grad"]), torch.tensor(reference["grad"]), rtol=1e-4, atol=1e-7
            )
        torch.testing.assert_close(
            torch.tensor(packed["weights"]), torch.tensor(unpacked["weights"]), rtol=1e-4, atol=1e-5
        )
    # the all-reduce made the ranks' gradients and weights one (each rank trained on other rows)
    for name in ("packed", "unpacked"):
        first, second = runs[name]
        assert first["steps"][0]["grad"] == second["steps"][0]["grad"]
        assert first["weights"] == second["weights"]
