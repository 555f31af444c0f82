"""D3SConfig validation and D3STrainer on the tiny model: real generation, real math-verify rewards."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import TINY_TRAINER_ARGS, make_trainer

from d3s.methods import METHODS, get_method
from d3s.selection import variance_tie_tolerance
from d3s.trainer import D3SConfig


def config(tmp_path, method="grpo", **overrides) -> D3SConfig:
    return D3SConfig.for_method(method, output_dir=str(tmp_path / method), **(TINY_TRAINER_ARGS | overrides))


# ---- registry and config validation (fast) -----------------------------------------------------------------

EXPECTED_METHODS = {
    "grpo",
    "pods",
    "d1s",
    "d1s_cross",
    "d2s",
    "d3s",
    "d3s_i",
    "entropy_8020",
    "gspo",
    "gspo_d3s",
}


def test_registry_covers_the_paper_and_documents_rows():
    assert set(METHODS) >= EXPECTED_METHODS
    for name, method in METHODS.items():
        assert len(method.reproduces) > 20, f"{name} must say which paper row it reproduces"
    with pytest.raises(ValueError, match="unknown method 'd4s'; valid methods: .*d3s, d3s_adaptive, d3s_i"):
        get_method("d4s")


def test_method_defaults_resolve_against_num_generations(tmp_path):
    d3s = config(tmp_path, "d3s")
    assert (d3s.sample_rule, d3s.sample_scope, d3s.renormalize) == ("max_variance", "batch", False)
    assert (d3s.keep_per_prompt, d3s.keep_per_prompt_final) == (2, 8)  # 0.25 G -> G
    assert (d3s.token_rule, d3s.token_keep_ratio, d3s.token_keep_ratio_final) == ("adv_entropy", 0.05, 0.2)
    assert d3s.schedule == "linear"
    pods = config(tmp_path, "pods")
    assert (pods.sample_scope, pods.renormalize, pods.keep_per_prompt, pods.token_rule) == (
        "group",
        True,
        2,
        "none",
    )
    assert config(tmp_path, "d3s_i").sample_scope == "group"
    grpo = config(tmp_path, "grpo")
    assert (grpo.sample_rule, grpo.keep_per_prompt, grpo.token_rule) == ("none", 8, "none")
    gspo = config(tmp_path, "gspo_d3s")
    assert (gspo.importance_sampling_level, gspo.epsilon, gspo.epsilon_high) == ("sequence", 3e-4, 4e-4)
    explicit = config(tmp_path, "d3s", keep_per_prompt=4, token_keep_ratio=0.1, schedule="constant")
    assert (explicit.keep_per_prompt_final, explicit.token_keep_ratio_final) == (4, 0.1)


@pytest.mark.parametrize(
    ("method", "overrides", "message"),
    [
        (
            "d1s",
            {"keep_per_prompt": 9},
            "keep_per_prompt must be an integer between 1 and num_generations = 8",
        ),
        ("d3s", {"keep_per_prompt_final": 12}, "keep_per_prompt_final must be an integer between 1"),
        ("d2s", {"token_keep_ratio": 0.0}, r"token_keep_ratio must be in \(0, 1\]"),
        ("d2s", {"token_keep_ratio": 1.5}, r"token_keep_ratio must be in \(0, 1\]"),
        ("d1s", {"sample_rule": "best"}, "sample_rule must be one of max_variance, random, max_reward, none"),
        ("d1s", {"sample_scope": "global"}, "sample_scope must be one of group, batch"),
        ("d2s", {"token_scope": "token"}, "token_scope must be one of batch, micro_batch, sequence"),
        ("d3s", {"schedule": "exponential"}, "schedule must be one of constant, linear, two_phase, cosine"),
        # 3 x 12 / 8 = 4.5 kept rows per micro-batch: TRL's split would drop rows
        (
            "d1s",
            {"keep_per_prompt": 3, "per_device_train_batch_size": 12, "steps_per_generation": 2},
            "not a whole number: TRL would drop rows",
        ),
        # the schedule 2 -> 8 passes N = 3, and 3 x 4 / 8 is not whole
        (
            "d3s",
            {"per_device_train_batch_size": 4, "steps_per_generation": 4},
            r"keep_per_prompt = 3 \(reached by the schedule\)",
        ),
        ("pods", {"multi_objective_aggregation": "normalize_then_sum"}, "renormalize=True"),
        ("d3s", {"kept_token_logprobs": "yes"}, "kept_token_logprobs must be true or false"),
        ("d3s", {"defer_logprob_passes": 1}, "defer_logprob_passes must be true or false"),
        ("d3s", {"pack_micro_batches": "no"}, "pack_micro_batches must be true or false"),
        (
            "d3s",
            {"pack_micro_batches": True, "token_scope": "micro_batch"},
            "pack_micro_batches: true changes which tokens token_scope micro_batch ranks together",
        ),
    ],
)
def test_config_rejects_bad_values_with_a_fix(tmp_path, method, overrides, message):
    with pytest.raises(ValueError, match=message):
        config(tmp_path, method, **overrides)


def test_packing_is_on_where_it_is_exact(tmp_path):
    assert config(tmp_path, "d3s").pack_micro_batches is True
    assert config(tmp_path, "d3s", pack_micro_batches=False).pack_micro_batches is False
    # the token level ranking each micro-batch: packing would change the ranking, so it stays off
    assert config(tmp_path, "d3s", token_scope="micro_batch").pack_micro_batches is False


def test_gspo_needs_its_trl_settings(tmp_path):
    with pytest.raises(
        ValueError, match=r"method 'gspo' needs importance_sampling_level='sequence'.*for_method"
    ):
        D3SConfig(method="gspo", output_dir=str(tmp_path), **TINY_TRAINER_ARGS)
    with pytest.raises(ValueError, match="unknown method"):
        D3SConfig(method="nope", output_dir=str(tmp_path), **TINY_TRAINER_ARGS)


@pytest.mark.parametrize(
    ("module", "name", "named"),
    [
        ("trl", "GRPOTrainer._compute_loss", "GRPOTrainer._compute_loss"),
        ("trl.kernels", "ChunkedLogProbFunction", "trl.kernels.ChunkedLogProbFunction"),
        (
            "trl.generation.vllm_generation",
            "VLLMGeneration._iter_named_params",
            "VLLMGeneration._iter_named_params",
        ),
    ],
)
def test_another_trl_fails_at_import_naming_the_pin_and_the_missing_name(monkeypatch, module, name, named):
    import importlib

    from d3s import trl_contract

    owner = importlib.import_module(module)
    *path, attribute = name.split(".")
    for part in path:
        owner = getattr(owner, part)
    monkeypatch.delattr(owner, attribute)
    with pytest.raises(ImportError, match=rf"relies on {named} of TRL 1\.16\.0 .* Install trl==1\.16\.0"):
        trl_contract.check_trl_contract()


# ---- training on the tiny model (slow) ---------------------------------------------------------------------


def length_reward(completions, **kwargs):
    """A deterministic, real reward with spread in every group, so selection always has work to do."""
    return [float(len(c) % 5) for c in completions]


def step_logs(trainer):
    return [entry for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_trains_on_the_tiny_model(tmp_path, tiny_sft_model, method):
    from d3s.rewards import accuracy_reward

    minibatches = get_method(method).minibatches_per_generation  # GSPO: 4 updates per generation batch
    max_steps = 2 * minibatches
    args = config(tmp_path, method, max_steps=max_steps)
    trainer = make_trainer(tiny_sft_model, args, [accuracy_reward, length_reward])
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    logs = step_logs(trainer)
    assert len(logs) == max_steps
    schedule = args.selection_schedule
    for step, entry in enumerate(logs):
        assert math.isfinite(entry["loss"]) and math.isfinite(entry["grad_norm"])
        assert "selection/update_tokens_cumulative" in entry and "entropy" in entry
        if args.token_rule != "none":
            assert 0 <= entry["selection/token_keep_fraction"] < 1  # a mini-batch may hold none of K
        if step % minibatches:  # a later mini-batch of the same generation batch: nothing newly selected
            assert "schedule/keep_per_prompt" not in entry
            continue
        keep = schedule.keep_per_prompt(step / max_steps)
        assert entry["schedule/keep_per_prompt"] == keep
        assert entry["selection/sample_keep_fraction"] == pytest.approx(keep / 8)
        # K(p) written out (DESIGN.md, "schedule"): p = the global step at generation / max_steps
        p, k_init, k_final = step / max_steps, args.token_keep_ratio, args.token_keep_ratio_final
        ratio = (1 - p) * k_init + p * k_final if args.schedule == "linear" else k_init
        assert entry["schedule/token_keep_ratio"] == pytest.approx(ratio)
        if args.token_rule == "none":
            assert entry["selection/token_keep_fraction"] == 1.0
        elif minibatches == 1:  # ceil(K x tokens) of the generation batch by rank, no forced token
            assert ratio <= entry["selection/token_keep_fraction"] < ratio + 0.05
        for key in (
            "selection/adv_var_before",
            "selection/adv_var_after",
            "selection/useful_fraction",
            "selection/entropy_selected",
            "reward",
        ):
            assert key in entry, key
    if minibatches > 1:  # the updates after the first are off-policy, and GSPO's tiny clip range acts
        assert any(entry["clip_ratio/region_mean"] > 0 for entry in logs)
    cumulative = [entry["selection/update_tokens_cumulative"] for entry in logs]
    assert cumulative == sorted(cumulative) and cumulative[-1] > 0
    changed = any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    assert changed, "the length reward gives every group spread, so the policy must move"
    lines = (tmp_path / method / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines if "loss" in json.loads(line)] == list(
        range(1, max_steps + 1)
    )


@pytest.mark.slow
def test_grpo_reproduces_trl_grpo_trainer_exactly(tmp_path, tiny_sft_model):
    """Selection off: same losses every step and bitwise-identical weights after 3 steps."""
    from trl import GRPOConfig, GRPOTrainer

    from d3s.rewards import accuracy_reward

    fields = TINY_TRAINER_ARGS | {"max_steps": 3, "logging_steps": 1}
    reference = make_trainer(
        tiny_sft_model,
        GRPOConfig(output_dir=str(tmp_path / "trl"), **fields),
        [accuracy_reward, length_reward],
        trainer_cls=GRPOTrainer,
    )
    reference.train()
    ours = make_trainer(
        tiny_sft_model, config(tmp_path, "grpo", max_steps=3), [accuracy_reward, length_reward]
    )
    ours.train()
    ref_logs, our_logs = step_logs(reference), step_logs(ours)
    assert [e["loss"] for e in our_logs] == [e["loss"] for e in ref_logs]
    assert [e["reward"] for e in our_logs] == [e["reward"] for e in ref_logs]
    assert any(e["loss"] != 0 for e in ref_logs)
    ref_state = reference.model.state_dict()
    for name, value in ours.model.state_dict().items():
        assert torch.equal(value, ref_state[name]), name


def best_subset_variance(values: torch.Tensor, k: int) -> float:
    """The largest population variance of any k of ``values``: the best of the k + 1 splits "i largest plus
    k - i smallest" (PODS Lemma 3.1, checked against every subset in test_selection.py), one split at a time
    in float64, independently of the prefix sums in d3s.selection."""
    ordered = values.double().sort(descending=True).values
    n = ordered.numel()
    return max(
        torch.cat([ordered[:i], ordered[n - (k - i) :]]).var(unbiased=False).item() for i in range(k + 1)
    )


class RecordingTrainerMixin:
    """Records what selection produced each generation (the kept rows and their token mask)."""

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        self.recorded_batches.append({k: v for k, v in output.items()})
        return output


@pytest.mark.slow
@pytest.mark.parametrize("method", ["pods", "d1s_cross", "d3s", "d3s_i"])
def test_kept_rows_masks_and_schedule(tmp_path, tiny_sft_model, method, monkeypatch):
    import d3s.trainer as trainer_module
    from d3s.rewards import accuracy_reward

    calls = []
    real_select = trainer_module.select_samples

    def recording_select(advantages, rewards, **kwargs):
        kept = real_select(advantages, rewards, **kwargs)
        calls.append((advantages.clone(), rewards.clone(), kwargs, kept))
        return kept

    monkeypatch.setattr(trainer_module, "select_samples", recording_select)
    trainer_cls = type("Recording", (RecordingTrainerMixin, trainer_module.D3STrainer), {})
    args = config(tmp_path, method, max_steps=4)
    trainer = make_trainer(tiny_sft_model, args, [accuracy_reward, length_reward], trainer_cls=trainer_cls)
    trainer.recorded_batches = []
    trainer.train()

    expected_keep = [args.selection_schedule.keep_per_prompt(step / 4) for step in range(4)]
    if method in ("d3s", "d3s_i"):
        assert expected_keep == [2, 4, 5, 7]  # linear 2 -> 8 over 4 steps, halves rounded up
    assert [c[2]["keep_per_prompt"] for c in calls] == expected_keep
    for (advantages, _rewards, _kwargs, kept), batch, keep in zip(
        calls, trainer.recorded_batches, expected_keep, strict=True
    ):
        prompts = advantages.numel() // 8
        assert kept.numel() == keep * prompts == batch["completion_ids"].shape[0]
        if args.sample_scope == "group":
            assert torch.bincount(kept // 8, minlength=prompts).tolist() == [keep] * prompts
        if args.renormalize:  # PODS: zero mean within each kept group
            for group in range(prompts):
                members = (kept // 8) == group
                assert batch["advantages"][members].sum().abs() < 1e-4
        else:  # D-family: the advantages computed over all G, unchanged
            assert torch.equal(batch["advantages"], advantages[kept])
        assert batch["num_items_in_batch"] == batch["completion_mask"].sum()
        if args.sample_rule == "max_variance":  # a best subset of the pool: the batch, or each group
            if args.sample_scope == "batch":
                pools = [(advantages, kept)]
            else:
                pools = [
                    (advantages[8 * group : 8 * (group + 1)], kept[kept // 8 == group] - 8 * group)
                    for group in range(prompts)
                ]
            for values, chosen in pools:
                best = best_subset_variance(values, chosen.numel())
                # the documented tie rule may pick a split within the tie tolerance of the best one
                tolerance = variance_tie_tolerance(
                    (values.max() - values.min()).item(),
                    values.abs().max().item(),
                    chosen.numel(),
                    values.dtype,
                )
                assert values[chosen].double().var(unbiased=False) >= best - tolerance - 1e-12
    if args.token_rule != "none":  # one mask per generation batch: exactly ceil(K x its valid tokens)
        for step, batch in enumerate(trainer.recorded_batches):
            valid, keep_mask = batch["completion_mask"].bool(), batch["token_mask"]
            ratio = args.selection_schedule.token_keep_ratio(step / 4)
            assert not (keep_mask & ~valid).any()
            assert keep_mask.sum() == math.ceil(ratio * valid.sum().item() - 1e-9)
    else:
        assert all("token_mask" not in batch for batch in trainer.recorded_batches)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["d3s", "grpo"])
def test_anatomy_log_records_what_selection_did(tmp_path, tiny_sft_model, method):
    from d3s.rewards import accuracy_reward

    args = config(tmp_path, method, max_steps=2, anatomy_every=1, anatomy_examples=3)
    trainer = make_trainer(tiny_sft_model, args, [accuracy_reward, length_reward])
    trainer.train()
    records = [json.loads(line) for line in (tmp_path / method / "anatomy.jsonl").read_text().splitlines()]
    samples = [r for r in records if r["kind"] == "samples"]
    tokens = [r for r in records if r["kind"] == "tokens"]
    assert [r["step"] for r in samples] == [0, 1]
    for record in samples:
        keep = record["keep_per_prompt"]
        assert keep == args.selection_schedule.keep_per_prompt(record["step"] / 2)
        groups = record["groups"]
        assert len(groups) == 2 and all(len(g["advantages"]) == 8 for g in groups)  # 16 rollouts / 8
        assert sum(sum(g["kept"]) for g in groups) == keep * len(groups)
    if args.token_rule == "none":
        assert tokens == []
        return
    assert [r["step"] for r in tokens] == [0, 1]
    # rollouts that show the token level (A != 0, a token selected) come first (issue 47), for the figure
    shows = [[e["advantage"] != 0 and any(e["selected"]) for e in r["examples"]] for r in tokens]
    assert any(map(any, shows)) and all(flags == sorted(flags, reverse=True) for flags in shows)
    for record in tokens:
        assert len(record["examples"]) == 3
        for example in record["examples"]:
            n = len(example["tokens"])
            assert n == len(example["entropy"]) == len(example["score"]) == len(example["selected"]) > 0
            expected = [abs(example["advantage"]) * h for h in example["entropy"]]
            assert example["score"] == pytest.approx(expected, rel=1e-5, abs=1e-6)
            kept = [sc for sc, chosen in zip(example["score"], example["selected"], strict=True) if chosen]
            dropped = [
                sc for sc, chosen in zip(example["score"], example["selected"], strict=True) if not chosen
            ]
            if (
                kept and dropped
            ):  # top-K of the batch: within a completion, no dropped token outranks a kept one
                assert min(kept) >= max(dropped)


# ---- the scoring seam: which of TRL's log-prob passes gives the token level's entropies -----------------


@torch.no_grad()
def completion_entropies(model, batch: dict, temperature: float) -> torch.Tensor:
    """The entropy (nats) of each completion token's sampling distribution under ``model``: a plain forward,
    independent of TRL's log-prob pass."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    size = batch["completion_ids"].size(1)
    logits = model(input_ids=ids, attention_mask=attention).logits[:, -size - 1 : -1] / temperature
    return torch.distributions.Categorical(logits=logits.float()).entropy()


class EntropyRecordingMixin:
    """Records, at each token selection of a generation batch, the entropies it ranks by, and the policy's and
    the reference model's entropies of the same rows, computed afresh."""

    def _select_tokens(self, batch, entropies=None):
        policy = completion_entropies(self.model, batch, self.temperature)
        reference = completion_entropies(self.ref_model, batch, self.temperature)
        self.recorded_entropies.append((entropies, policy, reference, batch["completion_mask"].bool()))
        return super()._select_tokens(batch, entropies)


@pytest.mark.slow
@pytest.mark.parametrize("defer", [False, True])
def test_the_token_level_ranks_by_the_old_policy_pass_not_the_reference_pass(tmp_path, tiny_sft_model, defer):
    """TRL runs its old-policy pass (num_iterations 2), then its reference pass (beta > 0), both without
    gradient: the entropies selection ranks by are the policy's, never the reference model's, which here
    differs from the policy. A seam that names TRL's passes wrongly fails this."""
    from d3s.rewards import accuracy_reward
    from d3s.trainer import D3STrainer

    args = config(
        tmp_path,
        "d3s",
        max_steps=1,
        beta=0.04,
        num_iterations=2,
        defer_logprob_passes=defer,
        metrics_log=None,
    )
    trainer_cls = type("Recording", (EntropyRecordingMixin, D3STrainer), {})
    trainer = make_trainer(tiny_sft_model, args, [accuracy_reward, length_reward], trainer_cls=trainer_cls)
    trainer.recorded_entropies = []
    assert trainer._runs_old_policy_pass() and trainer.ref_model is not None
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a reference that is not the policy: its entropies differ
        for parameter in trainer.ref_model.parameters():
            parameter.add_(0.2 * torch.randn(parameter.shape, generator=generator))
    trainer.train()
    assert len(trainer.recorded_entropies) == 1
    ranked, policy, reference, valid = trainer.recorded_entropies[0]
    assert ranked is not None, "the old-policy pass gave no entropies: selection ran a pass of its own"
    torch.testing.assert_close(ranked[valid], policy[valid], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(policy[valid], reference[valid], atol=1e-3)  # the test can tell them apart


@pytest.mark.slow
def test_the_scoring_seam_refuses_passes_it_does_not_expect(tmp_path, tiny_sft_model, monkeypatch):
    """When TRL's scoring runs other log-prob passes than D3STrainer expects (another TRL, or a condition
    ported wrongly), training stops naming d3s/trl_contract.py, rather than rank by the wrong pass."""
    from d3s.rewards import accuracy_reward

    # TRL: the reference pass only. pods: no token level, so the misnamed pass is not asked for entropies
    # (the reference model, without the policy's fused head, would fail inside TRL first)
    args = config(tmp_path, "pods", max_steps=1, beta=0.04, metrics_log=None)
    trainer = make_trainer(tiny_sft_model, args, [accuracy_reward])
    assert not trainer._runs_old_policy_pass()
    # expects an old-policy pass TRL skips: TRL's reference pass would be taken for it
    monkeypatch.setattr(trainer, "_runs_old_policy_pass", lambda: True)
    with pytest.raises(RuntimeError, match=r"ran the log-prob passes \['reference'\].*SCORING_PASSES"):
        trainer.train()
    # expects no pass, TRL runs its reference pass
    monkeypatch.setattr(trainer, "_trl_runs_pass", lambda name: False)
    with pytest.raises(RuntimeError, match=r"one more log-prob pass.*SCORING_PASSES"):
        trainer.train()


@pytest.mark.slow
def test_update_tokens_is_the_steps_total_whatever_the_accumulation(tmp_path, tiny_sft_model):
    """selection/update_tokens is the tokens of the optimizer step, not the mean of its micro-batches: the
    same 32-rollout generation batch, PODS keeping 8 rows, trained in 1, 2 and 4 micro-batches logs the sum of
    the kept rows' completion tokens each time (issue 48: it logged 47 with one micro-batch, 11.75 with 4)."""
    from d3s.trainer import D3STrainer

    class KeptRows(D3STrainer):
        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            self.kept_masks.append(output["completion_mask"].clone())
            return output

    logged, kept = {}, {}
    for accumulation in (1, 2, 4):
        args = config(
            tmp_path / str(accumulation),
            "pods",
            max_steps=1,
            per_device_train_batch_size=32 // accumulation,
            gradient_accumulation_steps=accumulation,
            metrics_log=None,
        )
        trainer = make_trainer(tiny_sft_model, args, [length_reward], trainer_cls=KeptRows)
        trainer.kept_masks = []
        trainer.train()
        (mask,) = trainer.kept_masks
        assert mask.shape[0] == 8, "PODS keeps 2 of 8 rollouts of each of 4 prompts"
        kept[accumulation] = float(mask.sum())
        (entry,) = step_logs(trainer)
        logged[accumulation] = entry["selection/update_tokens"]
        assert entry["selection/update_tokens_cumulative"] == kept[accumulation]
    assert kept[1] == kept[2] == kept[4] > 8, "the same generation batch, the same kept rows"
    assert logged == kept

    # a log covering two steps gives the mean of their totals, as it does the loss
    args = config(tmp_path / "window", "pods", max_steps=2, logging_steps=2, metrics_log=None)
    trainer = make_trainer(tiny_sft_model, args, [length_reward])
    trainer.train()
    (entry,) = step_logs(trainer)
    assert entry["selection/update_tokens"] == entry["selection/update_tokens_cumulative"] / 2 > 8
