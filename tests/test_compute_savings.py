"""Dropped work is not paid for, and the result is unchanged.

1. Rollout selection runs before TRL's old-policy, reference and importance-sampling log-prob passes: a
   dropped rollout is never forwarded again (counted per rollout, with beta > 0 and num_iterations > 1), and
   the selected batch, its log-probs and the losses equal TRL's order (all rollouts, then indexing).
2. With K < 1, the gradient pass projects through the LM head only at the kept tokens: loss, token mask,
   logged metrics and every parameter gradient equal the straightforward masked computation.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from helpers import TINY_TRAINER_ARGS, make_trainer

from d3s.trainer import D3SConfig, D3STrainer

# ---- 1. selection before the log-prob passes ---------------------------------------------------------------


def _sequence(ids: torch.Tensor, mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(ids[mask.bool()].tolist())


class CountingTrainer(D3STrainer):
    """Records every rollout generated and kept, and every row forwarded by a log-prob pass."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.generated: Counter = Counter()
        self.kept: Counter = Counter()
        self.forwarded: Counter = Counter()
        self.selected_batches: list[dict] = []
        for model in (self.model, self.ref_model):
            if model is not None:
                model.register_forward_pre_hook(self._count_rows, with_kwargs=True)

    def _count_rows(self, module, args, kwargs):
        if "labels" in kwargs:  # log-prob passes pass labels; generation does not
            for ids, mask in zip(kwargs["input_ids"], kwargs["attention_mask"], strict=True):
                self.forwarded[_sequence(ids, mask)] += 1

    def _rows(self, output: dict) -> list[tuple[int, ...]]:
        return [
            _sequence(p, pm) + _sequence(c, cm)
            for p, pm, c, cm in zip(
                output["prompt_ids"],
                output["prompt_mask"],
                output["completion_ids"],
                output["completion_mask"],
                strict=True,
            )
        ]

    def _keep_rows(self, output, kept, kept_advantages):
        self.generated.update(self._rows(output))
        selected = super()._keep_rows(output, kept, kept_advantages)
        self.kept.update(self._rows(selected))
        return selected

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        self.selected_batches.append(
            {k: v.detach().clone() for k, v in output.items() if isinstance(v, torch.Tensor)}
        )
        return output


def _run(tmp_path, model_path, method, defer, steps=4, fake_vllm_mode=None, **overrides):
    args = D3SConfig.for_method(
        method,
        output_dir=str(tmp_path / f"{method}_{defer}"),
        **(
            TINY_TRAINER_ARGS
            | dict(max_steps=steps, defer_logprob_passes=defer, logging_steps=1, metrics_log=None)
            | overrides
        ),
    )
    trainer = make_trainer(model_path, args, trainer_cls=CountingTrainer)
    if fake_vllm_mode is not None:
        _fake_vllm_sampling(trainer, fake_vllm_mode)
    trainer.train()
    return trainer


def _fake_vllm_sampling(trainer, mode):
    """Stand in for vLLM (no GPU here): generate with transformers, report made-up sampling log-probs, so
    TRL's importance-sampling correction runs for real on them."""
    generate = trainer._generate

    def fake_generate(prompts):
        trainer.use_vllm = False  # transformers generation, no weight sync
        try:
            out = list(generate(prompts))
        finally:
            trainer.use_vllm = True
        out[4] = [[-0.5 - 0.05 * (j % 7) for j in range(len(ids))] for ids in out[1]]
        return tuple(out)

    # the config too: D3SConfig.excludes_zeroed reads it (TRL copies both into the trainer at its init)
    trainer.use_vllm = trainer.args.use_vllm = True
    trainer.vllm_importance_sampling_correction = trainer.args.vllm_importance_sampling_correction = True
    trainer.vllm_importance_sampling_mode = mode
    trainer.vllm_importance_sampling_clip_min = 0.5
    trainer.vllm_importance_sampling_clip_max = 2.0
    trainer._generate = fake_generate


def _losses(trainer):
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["d3s", "pods"])
def test_dropped_rollouts_are_never_forwarded_again(tmp_path, tiny_sft_model, method):
    iterations = 2
    settings = dict(beta=0.04, num_iterations=iterations)
    deferred = _run(tmp_path, tiny_sft_model, method, defer=True, **settings)
    eager = _run(tmp_path, tiny_sft_model, method, defer=False, **settings)
    assert deferred.ref_model is not None and sum(deferred.generated.values()) > sum(deferred.kept.values())

    # Deferred: each kept rollout is forwarded once by the old-policy pass, once by the reference pass and
    # once per iteration by the loss; a dropped one never.
    per_kept = 2 + iterations
    assert deferred.forwarded == Counter({seq: per_kept * n for seq, n in deferred.kept.items()})
    # TRL's order forwards every rollout twice more (old and reference), kept or not.
    assert eager.forwarded == Counter(
        {seq: 2 * eager.generated[seq] + iterations * eager.kept.get(seq, 0) for seq in eager.generated}
    )
    # ... and the two orders give the same batches, log-probs and losses.
    assert deferred.generated == eager.generated and deferred.kept == eager.kept
    for lazy, full in zip(deferred.selected_batches, eager.selected_batches, strict=True):
        assert lazy.keys() == full.keys()
        for key in lazy:
            torch.testing.assert_close(lazy[key], full[key], rtol=1e-5, atol=1e-6, msg=key)
    torch.testing.assert_close(_losses(deferred), _losses(eager), rtol=1e-5, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_deferred_importance_sampling_equals_trl(tmp_path, tiny_sft_model, mode):
    deferred = _run(tmp_path, tiny_sft_model, "d3s", defer=True, steps=3, fake_vllm_mode=mode)
    eager = _run(tmp_path, tiny_sft_model, "d3s", defer=False, steps=3, fake_vllm_mode=mode)
    # Without vLLM TRL would skip the old-policy pass here (one iteration); the IS correction forces it.
    # Under a *_mask mode it runs on every rollout, deferred or not: its ratio decides which ones selection
    # may keep.
    masked = mode.endswith("_mask")
    forwarded_deferred, forwarded_eager = sum(deferred.forwarded.values()), sum(eager.forwarded.values())
    assert forwarded_deferred == forwarded_eager if masked else forwarded_deferred < forwarded_eager
    for lazy, full in zip(deferred.selected_batches, eager.selected_batches, strict=True):
        assert {"old_per_token_logps", "importance_sampling_ratio", "sampling_per_token_logps"} <= lazy.keys()
        ratio = lazy["importance_sampling_ratio"]
        assert not torch.all(ratio == 1.0)  # the correction did something
        for key in lazy:
            torch.testing.assert_close(lazy[key], full[key], rtol=1e-5, atol=1e-6, msg=key)
    torch.testing.assert_close(_losses(deferred), _losses(eager), rtol=1e-5, atol=1e-7)
    # the logged ratio statistics are those of the kept rollouts, not of TRL's placeholder pass (masked: TRL's
    # own over every rollout, from its real pass)
    logged = [e["sampling/importance_sampling_ratio/mean"] for e in deferred.state.log_history if "loss" in e]
    if masked:
        assert logged == [
            e["sampling/importance_sampling_ratio/mean"] for e in eager.state.log_history if "loss" in e
        ]
        assert deferred.state.log_history[0]["selection/zeroed_fraction_before"] > 0  # the mask acted
        return
    expected = []
    for batch in deferred.selected_batches:
        ratio = batch["importance_sampling_ratio"]
        expected.append(
            ratio.flatten() if mode.startswith("sequence") else ratio[batch["completion_mask"].bool()]
        )
    assert logged == pytest.approx([r.mean().item() for r in expected], rel=1e-6)


# ---- 2. the LM head only at the kept tokens ----------------------------------------------------------------


def _batch(vocab: int, rows: int = 16, prompt_len: int = 6, completion_len: int = 20, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    prompt_mask = torch.ones(rows, prompt_len, dtype=torch.long)
    prompt_mask[::3, :2] = 0  # left padding
    lengths = torch.randint(1, completion_len + 1, (rows,), generator=gen)
    completion_mask = (torch.arange(completion_len) < lengths[:, None]).long()
    completion_mask[0] = 0  # an empty completion (truncated and masked)
    completion_mask[1, :] = 1
    return {
        "prompt_ids": torch.randint(3, vocab, (rows, prompt_len), generator=gen),
        "prompt_mask": prompt_mask,
        "completion_ids": torch.randint(3, vocab, (rows, completion_len), generator=gen),
        "completion_mask": completion_mask,
        "advantages": torch.randn(rows, generator=gen),
        "num_items_in_batch": completion_mask.sum(),
        "ref_per_token_logps": -2.0
        + 0.5 * torch.randn(rows, completion_len, generator=gen),  # read if beta != 0
    }


def _loss_and_grads(trainer, inputs):
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop
    trainer.model.zero_grad()
    trainer._metrics["train"].clear()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    trainer._close_step_metrics()  # as the training loop closes a step after its last backward
    grads = {
        name: p.grad.detach().clone() for name, p in trainer.model.named_parameters() if p.grad is not None
    }
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return loss.detach(), grads, inputs["token_mask"].clone(), metrics


@pytest.mark.parametrize(
    "method, overrides",
    [
        ("d3s", {}),
        ("d3s", {"token_scope": "sequence", "token_keep_ratio": 0.2}),
        ("d2s", {"loss_type": "grpo"}),
        ("entropy_8020", {"loss_type": "bnpo"}),
        ("d3s", {"beta": 0.04}),  # the KL on the selected tokens only (kl_tokens: selected)
        ("d3s", {"token_norm": "selected"}),
        ("gspo_d3s", {}),  # the sequence ratio over the kept tokens
    ],
)
def test_kept_token_head_equals_the_masked_computation(
    tmp_path, tiny_sft_model, method, overrides, monkeypatch
):
    import d3s.savings.kept_head as kept_head_module

    results = {}
    for kept in (True, False):
        args = D3SConfig.for_method(
            method,
            output_dir=str(tmp_path / str(kept)),
            **(TINY_TRAINER_ARGS | dict(kept_token_logprobs=kept, metrics_log=None) | overrides),
        )
        trainer = make_trainer(tiny_sft_model, args)
        assert trainer.kept_token_head is kept
        inputs = _batch(vocab=trainer.model.config.vocab_size)
        trainer.model.train()
        inputs["token_mask"] = trainer._select_tokens(
            inputs
        )  # chosen once per generation batch, before the loss
        projected = []
        apply = kept_head_module.ChunkedLogProbFunction.apply

        def spy(hidden, *rest, _apply=apply, _projected=projected):
            _projected.append((hidden.shape[0], torch.is_grad_enabled()))
            return _apply(hidden, *rest)

        monkeypatch.setattr(kept_head_module.ChunkedLogProbFunction, "apply", spy)
        results[kept] = _loss_and_grads(trainer, inputs)
        monkeypatch.undo()
        if kept:  # no-gradient scoring of every valid token, then the gradient pass on the kept ones only
            # (before them, TRL's fused head in the backbone's pass, with no label to score)
            keep = results[kept][2]
            valid, kept_count = int(inputs["completion_mask"].sum()), int(keep.sum())
            assert projected[-2:] == [(valid, False), (kept_count, True)]
            assert keep.sum() < inputs["completion_mask"].sum()

    (loss, grads, keep, metrics), (ref_loss, ref_grads, ref_keep, ref_metrics) = results[True], results[False]
    assert torch.equal(keep, ref_keep)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-7)
    assert grads.keys() == ref_grads.keys() and len(grads) > 0
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-7, msg=name)
    assert metrics.keys() == ref_metrics.keys()
    for name in metrics:
        assert metrics[name] == pytest.approx(ref_metrics[name], rel=1e-5, abs=1e-7), name


@pytest.mark.parametrize(
    "method, overrides, reason",
    [
        ("d3s", {"beta": 0.04, "kl_tokens": "all"}, "KL term trains every token"),
        ("d3s", {"token_scope": "micro_batch"}, "inside the loss"),
    ],
)
def test_kept_token_head_steps_aside_when_other_tokens_need_gradients(
    tmp_path, tiny_sft_model, caplog, method, overrides, reason
):
    args = D3SConfig.for_method(
        method,
        output_dir=str(tmp_path / method),
        **(TINY_TRAINER_ARGS | {"kept_token_logprobs": True} | overrides),
    )
    with caplog.at_level("WARNING"):
        trainer = make_trainer(tiny_sft_model, args)
    assert trainer.kept_token_head is False
    assert reason in caplog.text


@pytest.mark.parametrize(
    "overrides, named",
    [
        ({"loss_type": "vespo"}, "loss_type"),
        ({"top_entropy_quantile": 0.2}, "top_entropy_quantile 1.0 .* token_rule entropy"),
    ],
)
def test_the_selection_loss_refuses_what_it_does_not_compute(tmp_path, overrides, named):
    with pytest.raises(ValueError, match=f"selection loss .* needs {named}"):
        D3SConfig.for_method("d3s", output_dir=str(tmp_path), **(TINY_TRAINER_ARGS | overrides))
    D3SConfig.for_method("grpo", output_dir=str(tmp_path), **(TINY_TRAINER_ARGS | overrides))  # TRL's loss
