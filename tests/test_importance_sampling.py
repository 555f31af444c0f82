"""vLLM's importance-sampling correction and selection (docs/fidelity/importance-sampling.md
correction").

TRL's default correction (``sequence_mask``, C_max = 3) weights each rollout's policy term by its sequence
ratio pi_trainer / pi_vLLM and zeroes the rollouts above the cap. Methods with ``zeroed_rollouts: excluded``
(every method that selects) choose their rollouts and tokens among the others and drop the zeroed ones from
every denominator; ``grpo`` and ``gspo`` (``trl``) keep TRL's: weight 0, still counted.

The trainer tests force the mismatch at the point TRL receives vLLM's log-probs: generation runs with
transformers, and the sampling log-probs handed to TRL are the policy's own, shifted on each rollout's first
token so that its sequence ratio is exactly exp(shift): 7.4 (above the cap) for the chosen rollouts, 0.67, 1
or 1.49 for the others.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from helpers import TINY_TRAINER_ARGS, make_trainer, serve_as_vllm

from d3s.rows import valid_tokens
from d3s.selection import corrected_loss_mask, max_variance_subset, select_samples, zeroed_rollouts

G = 8
ZEROED_SHIFT = 2.0  # exp(2) = 7.39 > C_max = 3: TRL's sequence_mask zeroes the rollout


# ---- the pure part -----------------------------------------------------------------------------------------


def test_zeroed_rollouts_and_the_corrected_loss_mask():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0], [1, 0, 0]])
    sequence_ratio = torch.tensor([[0.0], [1.3], [0.0], [2.9]])
    assert zeroed_rollouts(sequence_ratio, mask).tolist() == [
        True,
        False,
        False,
        False,
    ]  # no token: not zeroed
    assert corrected_loss_mask(sequence_ratio, mask).tolist() == [[0, 0, 0], [1, 1, 1], [0, 0, 0], [1, 0, 0]]
    token_ratio = torch.tensor([[0.0, 0.0, 5.0], [0.0, 1.0, 1.0], [1.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
    assert zeroed_rollouts(token_ratio, mask).tolist() == [True, False, False, True]  # padding does not count
    assert corrected_loss_mask(token_ratio, mask).tolist() == [[0, 0, 0], [0, 1, 1], [0, 0, 0], [0, 0, 0]]
    with pytest.raises(ValueError, match="must be \\(B, 1\\) or \\(B, T\\)"):
        zeroed_rollouts(torch.ones(4), mask)


def _best_variance(values: torch.Tensor, size: int) -> float:
    return max(
        values[list(c)].double().var(unbiased=False).item()
        for c in itertools.combinations(range(values.numel()), size)
    )


@pytest.mark.parametrize("rule", ["max_variance", "max_reward", "random"])
@pytest.mark.parametrize("scope", ["group", "batch"])
def test_selection_chooses_among_the_rollouts_the_correction_kept(rule, scope):
    gen = torch.Generator().manual_seed(3)
    rewards = torch.randint(0, 3, (4 * G,), generator=gen).float()
    grouped = rewards.view(-1, G)
    advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).flatten()
    zeroed = torch.zeros(4 * G, dtype=torch.bool)
    zeroed[0:7] = True  # group 0: one eligible rollout for two slots
    zeroed[8:16] = True  # group 1: none
    zeroed[[16, 17, 30]] = True
    keep = 2

    def pick(eligible, seed=7):
        return select_samples(
            advantages,
            rewards,
            G,
            keep,
            rule=rule,
            scope=scope,
            generator=torch.Generator().manual_seed(seed),
            eligible=eligible,
        )

    # every row eligible: exactly the selection without the argument (the random draw included)
    assert torch.equal(pick(torch.ones(4 * G, dtype=torch.bool)), pick(None))
    kept = pick(~zeroed)
    assert kept.tolist() == sorted(set(kept.tolist())) and kept.numel() == keep * 4
    eligible = (~zeroed).nonzero().squeeze(1)
    if scope == "batch":  # 21 eligible rollouts for 8 slots: none of the zeroed ones
        assert not zeroed[kept].any()
        pools = [(kept, eligible)]
    else:  # a group with fewer eligible rollouts than slots keeps them all, then its first zeroed ones
        assert kept[:2].tolist() == [0, 7] and kept[2:4].tolist() == [8, 9]
        assert not zeroed[kept[4:]].any()
        pools = [(kept[kept // G == g], eligible[eligible // G == g]) for g in (2, 3)]
    for chosen, candidates in pools:
        if rule == "max_variance":
            best = _best_variance(advantages[candidates], chosen.numel())
            assert advantages[chosen].double().var(unbiased=False).item() >= best - 1e-9
            local = max_variance_subset(advantages[candidates].unsqueeze(0), chosen.numel())[0]
            assert torch.equal(chosen, candidates[local])  # the rule's own tie-break, on the eligible rows
        elif rule == "max_reward":
            assert rewards[chosen].min() >= rewards[candidates[~torch.isin(candidates, chosen)]].max()


# ---- the trainer under a forced mismatch -------------------------------------------------------------------


def varied_reward(completions, **kwargs):
    """Length mod 3: most groups have spread, several have ties."""
    return [float(len(c) % 3) for c in completions]


def _shift(position: int, zeroed: set[int]) -> float:
    return ZEROED_SHIFT if position in zeroed else 0.4 * (position % 3 - 1)


# Generation-batch positions (4 prompts x 8) forced above the cap: group 0 keeps 1 of 8, group 1 loses 2.
FORCED = {0, 1, 2, 3, 4, 5, 6, 8, 9, 20}


def _force_mismatch(trainer):
    """Transformers generates; TRL receives the policy's log-probs of each completion as vLLM's, shifted by
    -shift on the first token: sequence ratio exp(shift)."""

    def engine_logprobs(position, prompt, completion, model):
        ids = torch.tensor([list(prompt) + list(completion)])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / trainer.temperature
        own = logits.log_softmax(-1).gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1)
        own[0] -= _shift(position, FORCED)
        return own.tolist()

    serve_as_vllm(trainer, engine_logprobs)
    trainer.vllm_importance_sampling_correction = trainer.args.vllm_importance_sampling_correction = True
    trainer.vllm_importance_sampling_mode = "sequence_mask"
    trainer.vllm_importance_sampling_clip_min = None
    trainer.vllm_importance_sampling_clip_max = 3.0


def _run(model_path, tmp_path, method, **overrides):
    import d3s.trainer as trainer_module
    from d3s.trainer import D3SConfig, D3STrainer

    record = {"kept": [], "rewards": [], "loss_calls": []}

    class Recording(D3STrainer):
        def _calculate_rewards(self, *args):
            rewards = super()._calculate_rewards(*args)
            record["rewards"].append(rewards.sum(1).clone())
            return rewards

        def _generate_and_score_completions(self, inputs):
            record["selected"] = super()._generate_and_score_completions(inputs)
            return record["selected"]

        def _compute_loss(self, model, inputs):
            loss = super()._compute_loss(model, inputs)
            record["loss_calls"].append((dict(inputs), loss.item()))
            return loss

    def recording_select(*args, **kwargs):
        kept = select_samples(*args, **kwargs)
        record["kept"].append(kept.tolist())
        return kept

    args = D3SConfig.for_method(
        method,
        output_dir=str(tmp_path / method),
        **(
            TINY_TRAINER_ARGS
            | dict(max_steps=1, gradient_accumulation_steps=2, metrics_log=None, lr_scheduler_type="constant")
            | overrides
        ),
    )
    trainer = make_trainer(model_path, args, reward_funcs=[varied_reward], trainer_cls=Recording)
    _force_mismatch(trainer)
    original = trainer_module.select_samples
    trainer_module.select_samples = recording_select
    try:
        trainer.train()
    finally:
        trainer_module.select_samples = original
    return trainer, record


CASES = [
    ("grpo", {}),  # TRL's: zeroed rollouts weigh 0 and count
    ("d1s", {}),  # per group: group 0 has one eligible rollout for two slots
    ("pods", {"loss_type": "grpo"}),  # as the PODS paper configs: a mean over rows, re-normalised advantages
    # cross-group samples and top-K% tokens; the saving keeps the old-policy pass, which gives the ratio
    ("d3s", {"defer_logprob_passes": True}),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "overrides"), CASES, ids=[m + "".join(f"-{k}" for k in o) for m, o in CASES]
)
def test_zeroed_rollouts_take_no_slot_and_leave_the_denominators(tmp_path, tiny_sft_model, method, overrides):
    trainer, record = _run(tiny_sft_model, tmp_path, method, **overrides)
    args = trainer.args
    excluded = args.zeroed_rollouts == "excluded"
    assert excluded == (method != "grpo")
    total = 4 * G
    rewards = record["rewards"][0]
    kept = record["kept"][0] if record["kept"] else list(range(total))
    selected = record["selected"]
    ratio = selected["importance_sampling_ratio"].squeeze(1)
    expected_ratio = [0.0 if i in FORCED else math.exp(_shift(i, FORCED)) for i in kept]
    torch.testing.assert_close(ratio, torch.tensor(expected_ratio), rtol=1e-4, atol=0.0)
    lengths = selected["completion_mask"].sum(1)

    # -- which rollouts hold the slots ---------------------------------------------------------------------
    forced_kept = [i for i in kept if i in FORCED]
    if not excluded:
        assert kept == list(range(total))
    elif args.sample_scope == "group":  # group 0: its one eligible rollout and one filler
        assert forced_kept == [0]
    else:
        assert forced_kept == []
    if excluded and args.sample_rule == "max_variance":
        grouped = rewards.double().view(-1, G)
        advantages = (
            (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)
        ).flatten()
        pools = (
            [range(total)] if args.sample_scope == "batch" else [range(g * G, g * G + G) for g in range(4)]
        )
        for pool in pools:
            eligible = [i for i in pool if i not in FORCED]
            chosen = [i for i in kept if i in eligible]
            slots = sum(1 for i in kept if i in pool)
            assert len(chosen) == min(slots, len(eligible))
            best = _best_variance(advantages[eligible], len(chosen)) if len(eligible) <= 12 else None
            if best is not None:
                assert advantages[chosen].var(unbiased=False).item() >= best - 1e-9
    if args.renormalize:  # PODS: over the kept members the correction did not zero; a filler gets 0
        for position, i in enumerate(kept):
            members = [j for j in kept if j // G == i // G and j not in FORCED]
            values = rewards.double()[members]
            spread = values.std() + 1e-4 if len(members) > 1 else None  # one member: no spread, A = 0
            expected = 0.0 if spread is None or i in FORCED else float((rewards[i] - values.mean()) / spread)
            assert selected["advantages"][position].item() == pytest.approx(expected, abs=1e-5)

    # -- the loss mask, the token slots and the denominators -----------------------------------------------
    live = torch.tensor([i not in FORCED for i in kept])
    assert "tool_mask" not in selected  # nothing passes through TRL's tool mask
    loss_mask = valid_tokens(excluded, selected)  # m, the tokens the selection loss may train
    assert torch.equal(loss_mask.sum(1), torch.where(live, lengths, 0) if excluded else lengths)
    counted = int(lengths[live].sum()) if excluded else int(lengths.sum())
    if "token_mask" in selected:
        token_mask = selected["token_mask"]
        assert not token_mask[~live].any()
        ratio_k = args.selection_schedule.token_keep_ratio(0.0)
        assert int(token_mask.sum()) == math.ceil(ratio_k * int(lengths[live].sum()) - 1e-9)
    if args.loss_type == "dapo":
        assert int(selected["num_items_in_batch"]) == counted

    # -- the loss of each of TRL's micro-batches: weights r_i, the denominators above -----------------------
    # step 0 is on-policy (pi / pi_old = 1), so each row's term is -r_i A_i per trained token. Packing (on)
    # ran TRL's micro-batches of the step as one, their rows in order, after an empty slot: its loss is the
    # sum of theirs, each with its own denominator
    assert len(record["loss_calls"]) == args.gradient_accumulation_steps
    calls = [(inputs, loss) for inputs, loss in record["loss_calls"] if "completion_ids" in inputs]
    rows = sum(len(inputs["advantages"]) for inputs, _ in calls)
    micro = args.per_device_train_batch_size
    assert len(calls) == min(args.gradient_accumulation_steps, math.ceil(rows / micro))
    micro_rows = rows // args.gradient_accumulation_steps

    def expected_loss(inputs: dict) -> torch.Tensor:
        r = inputs["importance_sampling_ratio"].squeeze(1).double()
        a = inputs["advantages"].double()
        trained = inputs["completion_mask"].double()
        if "token_mask" in inputs:
            trained = trained * inputs["token_mask"]
        rows_live = r != 0
        if args.loss_type == "dapo":
            return -(r * a * trained.sum(1)).sum() / counted
        # grpo: a mean over the micro-batch's rows, the zeroed ones left out under "excluded"
        rows = int(rows_live.sum()) if excluded else r.numel()
        return -(r * a).sum() / max(rows, 1) / args.gradient_accumulation_steps

    for inputs, loss in calls:
        parts = [
            {
                k: v[start : start + micro_rows]
                for k, v in inputs.items()
                if isinstance(v, torch.Tensor) and v.dim()
            }
            for start in range(0, len(inputs["advantages"]), micro_rows)
        ]
        assert loss == pytest.approx(sum(expected_loss(part) for part in parts).item(), rel=1e-4, abs=1e-6)

    logged = trainer.state.log_history[0]
    if excluded:
        assert logged["selection/zeroed_fraction_before"] == pytest.approx(len(FORCED) / total)
        assert logged["selection/zeroed_fraction"] == pytest.approx(len(forced_kept) / len(kept))
