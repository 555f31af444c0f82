"""Log-prob passes by length (d3s/length_buckets.py, ``length_bucket_rows``): the buckets' plan against
brute force, the reassembled pass against one pass over the padded batch (values and gradients), and a
trainer's step with buckets against TRL's passes."""

from __future__ import annotations

import pytest
import torch
from helpers import TINY_TRAINER_ARGS, make_trainer
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import TrainerCallback

from d3s.length_buckets import bucketed_pass, length_buckets, row_ends
from d3s.tiny_model import build_model, build_tokenizer
from d3s.trainer import D3SConfig


def _padded_batch(prompt_lengths: list[int], completion_lengths: list[int], prompt_width: int, width: int):
    """TRL's layout: prompts left-padded to ``prompt_width``, completions right-padded to ``width``."""
    rows = len(prompt_lengths)
    generator = torch.Generator().manual_seed(rows * 7919 + width)
    ids = torch.randint(3, 100, (rows, prompt_width + width), generator=generator)
    mask = torch.zeros_like(ids)
    for row, (prompt, completion) in enumerate(zip(prompt_lengths, completion_lengths, strict=True)):
        mask[row, prompt_width - prompt : prompt_width + completion] = 1
    return ids.masked_fill(mask == 0, 0), mask


lengths = st.integers(1, 12).flatmap(
    lambda rows: st.tuples(
        st.lists(st.integers(1, 6), min_size=rows, max_size=rows),
        st.lists(st.integers(0, 9), min_size=rows, max_size=rows),
    )
)


@given(lengths=lengths, bucket_rows=st.integers(1, 13))
def test_buckets_cover_every_row_once_sorted_and_cut_only_padding(lengths, bucket_rows):
    prompts, completions = lengths
    ids, mask = _padded_batch(prompts, completions, prompt_width=6, width=9)
    buckets = length_buckets(mask, bucket_rows, logits_to_keep=9)
    rows = torch.cat([bucket for bucket, _ in buckets])
    assert sorted(rows.tolist()) == list(range(len(prompts)))  # every row once
    ends = [6 + c for c in completions]  # brute force: one past each row's last real token
    assert row_ends(mask).tolist() == ends
    assert [ends[r] for r in rows.tolist()] == sorted(ends)  # sorted by end
    for bucket, width in buckets:
        assert len(bucket) <= bucket_rows
        assert width == max(
            max(ends[r] for r in bucket.tolist()), 7
        )  # the longest row; one completion column
        assert mask[bucket, width:].sum() == 0  # only padding is cut


def _trl_like_pass(model):
    """TRL's pass on a tiny model: log-probs and entropies of the completion tokens (fused LM head)."""
    from trl.trainer.utils import add_fused_lm_head

    add_fused_lm_head(model, temperature=1.0, cast_lm_head_to_fp32=False, outputs=("log_probs", "entropy"))

    def run(ids, mask, keep):
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, :-keep] = -100
        out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        return out.log_probs[:, -keep:], out.entropy[:, -keep:], None

    return run


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return build_model(build_tokenizer(), seed=0)


@settings(deadline=None, max_examples=10)
@given(lengths=lengths, bucket_rows=st.integers(1, 13))
def test_bucketed_pass_equals_one_padded_pass(tiny_model, lengths, bucket_rows):
    prompts, completions = lengths
    ids, mask = _padded_batch(prompts, completions, prompt_width=6, width=9)
    run = _trl_like_pass(tiny_model)
    with torch.no_grad():
        logps, entropies, _ = run(ids, mask, 9)
        bucketed_logps, bucketed_entropies, aux = bucketed_pass(run, ids, mask, 9, bucket_rows)
    assert aux is None and bucketed_logps.shape == logps.shape == bucketed_entropies.shape
    valid = mask[:, 6:].bool()
    torch.testing.assert_close(bucketed_logps[valid], logps[valid], rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(bucketed_entropies[valid], entropies[valid], rtol=1e-5, atol=2e-5)
    # a cut column is padding of every row in its bucket, and comes back as 0
    cut = (bucketed_logps == 0) & (logps != 0)
    assert not (cut & valid).any()


def test_one_bucket_over_the_whole_width_is_bit_for_bit(tiny_model):
    """Nothing to cut, one bucket: the very same call (no rounding difference to excuse)."""
    ids, mask = _padded_batch([3, 6, 2], [9, 4, 9], prompt_width=6, width=9)
    run = _trl_like_pass(tiny_model)
    with torch.no_grad():
        logps, _, _ = run(ids, mask, 9)
        bucketed, _, _ = bucketed_pass(run, ids, mask, 9, bucket_rows=3)
    assert torch.equal(bucketed, logps)


def test_gradient_through_the_buckets_equals_the_padded_pass(tiny_model):
    ids, mask = _padded_batch([3, 6, 2, 5, 4, 1], [9, 4, 1, 7, 0, 3], prompt_width=6, width=9)
    run = _trl_like_pass(tiny_model)
    valid = mask[:, 6:].float()
    weights = torch.linspace(-1.0, 2.0, valid.numel()).view_as(valid)

    def gradient(bucket_rows: int | None) -> dict[str, torch.Tensor]:
        tiny_model.zero_grad()
        logps, entropies, _ = (
            run(ids, mask, 9) if bucket_rows is None else bucketed_pass(run, ids, mask, 9, bucket_rows)
        )
        ((logps * weights * valid).sum() + (entropies * valid).sum()).backward()
        return {n: p.grad.clone() for n, p in tiny_model.named_parameters() if p.grad is not None}

    reference = gradient(None)
    assert reference and any(g.abs().sum() > 0 for g in reference.values())
    for bucket_rows in (1, 2, 4):
        grads = gradient(bucket_rows)
        assert grads.keys() == reference.keys()
        for name, grad in reference.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_length_bucket_rows_is_checked():
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="length_bucket_rows must be an integer >= 0"):
            D3SConfig.for_method("grpo", output_dir="unused", length_bucket_rows=bad, **TINY_TRAINER_ARGS)


@pytest.mark.parametrize("method", ["grpo", "d3s"])
def test_a_training_step_with_buckets_equals_trls_passes(tmp_path, tiny_sft_model, method):
    """Two steps of the trainer, with buckets of 4 rows and with TRL's passes (which the rest of the suite
    proves against GRPOTrainer and the papers' equations): the same gradient before each optimizer step and
    the same logged loss, up to float rounding."""
    runs = {}
    for bucket_rows in (0, 4):
        args = D3SConfig.for_method(
            method,
            output_dir=str(tmp_path / str(bucket_rows)),
            **(TINY_TRAINER_ARGS | {"max_steps": 2, "logging_steps": 1, "length_bucket_rows": bucket_rows}),
        )
        trainer = make_trainer(tiny_sft_model, args)
        rows: list[int] = []  # rows of each model call inside a log-prob pass
        inside = [False]
        original = trainer._logprob_pass

        def counting(*args, _original=original, _inside=inside, **kwargs):
            _inside[0] = True
            try:
                return _original(*args, **kwargs)
            finally:
                _inside[0] = False

        def record_rows(module, args, kwargs, output, _rows=rows, _inside=inside):
            if _inside[0]:
                _rows.append(kwargs["input_ids"].size(0))

        trainer._logprob_pass = counting
        trainer.model.register_forward_hook(record_rows, with_kwargs=True)
        grads = GradientRecorder()
        trainer.add_callback(grads)
        trainer.train()
        logs = [r for r in trainer.state.log_history if "loss" in r]
        runs[bucket_rows] = (grads.grads, logs, rows)
    grads, logs, rows = runs[4]
    reference_grads, reference_logs, reference_rows = runs[0]
    assert reference_rows and sum(rows) == sum(reference_rows)  # every row, once a pass
    assert max(rows) <= 4 < max(reference_rows)  # the buckets really ran
    assert len(grads) == len(reference_grads) == 2
    # the first step from the same weights: the same gradient; the second from weights that AdamW moved by
    # float noise (it divides each gradient by its own RMS), so to 1e-3
    for step, tolerance in ((0, 1e-4), (1, 1e-3)):
        assert any(g.abs().sum() > 0 for g in reference_grads[step].values())
        for name, grad in reference_grads[step].items():
            torch.testing.assert_close(grads[step][name], grad, rtol=tolerance, atol=1e-6, msg=name)
    for record, reference in zip(logs, reference_logs, strict=True):
        for key in ("loss", "grad_norm", "entropy", "reward"):
            if key in reference:
                assert record[key] == pytest.approx(reference[key], rel=1e-3, abs=1e-6), key


class GradientRecorder(TrainerCallback):
    """Each optimizer step's gradient, before clipping."""

    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
