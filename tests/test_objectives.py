"""Proof by equation: every registered method applies the gradient of its paper's objective.

A real D3STrainer trains the tiny model for two optimizer steps (several prompts, G = 8 rollouts with tied
and untied rewards, padded completions, two micro-batches per step; GSPO: four mini-batches per generation
batch, so its second step is off-policy and its clip acts). At the second step the test takes the gradient
the trainer is about to apply and recomputes it here from the equations, with its own forward passes of the
tiny model, one row at a time and unpadded:

    A_i      = (r_i - mean_group r) / (std_group r + 1e-4)       over all G (GRPO, the D-family), or over the
                                                                   kept members of the group (PODS)
    S        = argmax_{|S| = N} Var(A_S)                           per group or over the pooled batch
    T        = top-ceil(K n) tokens of S by |A_i| H_it (or H_it)   over the whole generation batch
    token:     L = -sum_{i,t in T} min(rho A, clip(rho) A) / D  + beta sum_{i,t in T} KL_it / D
               D = the valid tokens of the generation batch (token_norm "all") or of T ("selected")
    sequence:  s_i = exp(mean_{t in T_i} (log pi - log pi_old)),  L = mean_i -min(s_i A_i, clip(s_i) A_i)

The chosen S and T are the trainer's (ties have several right answers): the test checks that each is optimal
under the equations above, then differentiates the objective on them. Nothing here imports d3s except the
tiny model's tokenizer and the trainer under test, and TRL's loss is never called.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from helpers import TINY_TRAINER_ARGS, train_rows
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

G = 8


def tied_reward(completions, **kwargs):
    """Length mod 3: ties inside most groups, spread in most."""
    return [float(len(c) % 3) for c in completions]


class Probe(TrainerCallback):
    """The policy's weights at the start of every step and the gradient of every optimizer step."""

    def __init__(self, model):
        self.model, self.weights, self.grads = model, [], []

    def on_step_begin(self, args, state, control, **kwargs):
        self.weights.append({k: v.detach().clone() for k, v in self.model.state_dict().items()})

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.grads.append(
            {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}
        )


def run_trainer(model_path, tmp_path, monkeypatch, method, overrides):
    """Two optimizer steps; returns what the trainer generated, kept, masked and the gradients it applied."""
    import trl

    import d3s.trainer as trainer_module
    from d3s.trainer import D3SConfig, D3STrainer

    record = {"raw": [], "rewards": [], "selected": [], "loss_inputs": [], "kept": []}
    real_select = trainer_module.select_samples

    def recording_select(advantages, rewards, **kwargs):
        kept = real_select(advantages, rewards, **kwargs)
        record["kept"].append(kept.tolist())
        return kept

    class Recording(D3STrainer):
        def _compute_loss(self, model, inputs):
            record["loss_inputs"].append((self.state.global_step, {k: v for k, v in inputs.items()}))
            return super()._compute_loss(model, inputs)

        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            record["selected"].append((self.state.global_step, dict(output)))
            return output

    real_generate, real_rewards = (
        trl.GRPOTrainer._generate_and_score_completions,
        trl.GRPOTrainer._calculate_rewards,
    )

    def raw_generate(self, inputs):
        output = real_generate(self, inputs)
        record["raw"].append({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in output.items()})
        return output

    def raw_rewards(self, *args):
        rewards = real_rewards(self, *args)
        record["rewards"].append(rewards.clone())
        return rewards

    args = D3SConfig.for_method(
        method,
        output_dir=str(tmp_path / method),
        **(
            TINY_TRAINER_ARGS
            | dict(max_steps=2, max_grad_norm=0.0, metrics_log=None, lr_scheduler_type="constant")
            | dict(per_device_train_batch_size=16, gradient_accumulation_steps=2)
            | overrides
        ),
    )
    torch.set_num_threads(2)
    trainer = Recording(
        model=AutoModelForCausalLM.from_pretrained(model_path),
        args=args,
        reward_funcs=[tied_reward],
        train_dataset=train_rows(),
        processing_class=AutoTokenizer.from_pretrained(model_path),
    )
    probe = Probe(trainer.model)
    trainer.add_callback(probe)
    monkeypatch.setattr(trl.GRPOTrainer, "_generate_and_score_completions", raw_generate)
    monkeypatch.setattr(trl.GRPOTrainer, "_calculate_rewards", raw_rewards)
    monkeypatch.setattr(trainer_module, "select_samples", recording_select)
    trainer.train()
    return trainer, record, probe


# ---- the equations -----------------------------------------------------------------------------------------


def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    grouped = rewards.double().view(-1, G)
    return ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).flatten()


def subset_advantages(rewards: torch.Tensor, kept: list[int]) -> dict[int, float]:
    """PODS: each kept rollout's advantage over the kept members of its own group."""
    out = {}
    for group in {i // G for i in kept}:
        members = [i for i in kept if i // G == group]
        values = rewards.double()[members]
        spread = values.std() if len(members) > 1 else None
        for i, value in zip(members, values, strict=True):
            out[i] = 0.0 if spread is None else float((value - values.mean()) / (spread + 1e-4))
    return out


def best_variance(values: torch.Tensor, size: int) -> float:
    """max Var over subsets of ``size``: every subset for small pools, else the PODS lemma's splits."""
    values = values.double()
    if math.comb(values.numel(), size) <= 5000:
        return max(
            values[list(c)].var(unbiased=False).item()
            for c in itertools.combinations(range(values.numel()), size)
        )
    ordered = values.sort(descending=True).values
    n = ordered.numel()
    return max(
        torch.cat([ordered[:i], ordered[n - (size - i) :]]).var(unbiased=False).item()
        for i in range(size + 1)
    )


def row_passes(model, prompt: torch.Tensor, completion: torch.Tensor, temperature: float):
    """Log-probabilities and entropies (nats) of the completion tokens, one unpadded row."""
    ids = torch.cat([prompt, completion]).unsqueeze(0)
    logits = model(input_ids=ids).logits[0, prompt.numel() - 1 : -1].float() / temperature
    logps = logits.log_softmax(-1)
    return logps.gather(-1, completion.unsqueeze(-1)).squeeze(-1), -(logps.exp() * logps).sum(-1)


def model_with(model_path, weights):
    model = AutoModelForCausalLM.from_pretrained(model_path)
    model.load_state_dict(weights)
    return model


def rows_of(batch: dict) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    return [
        (tuple(p[pm.bool()].tolist()), tuple(c[cm.bool()].tolist()))
        for p, pm, c, cm in zip(
            batch["prompt_ids"],
            batch["prompt_mask"],
            batch["completion_ids"],
            batch["completion_mask"],
            strict=True,
        )
    ]


CASES = [(name, {}) for name in sorted(__import__("d3s.methods", fromlist=["METHODS"]).METHODS)] + [
    ("d3s", {"beta": 0.04}),  # the KL on the selected tokens (kl_tokens "selected", the default)
    ("d3s", {"beta": 0.04, "kl_tokens": "all"}),
    ("d3s", {"token_norm": "selected"}),
    ("d2s", {"token_scope": "sequence", "token_keep_ratio": 0.2}),
    ("gspo_d3s", {"beta": 0.04}),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "overrides"),
    CASES,
    ids=[f"{m}{'-' + '-'.join(f'{k}={v}' for k, v in o.items()) if o else ''}" for m, o in CASES],
)
def test_the_applied_gradient_is_the_objectives(tmp_path, tiny_sft_model, monkeypatch, method, overrides):
    from d3s.methods import get_method

    entry = get_method(method)
    gspo = bool(entry.trl_settings)
    if gspo:  # 4 mini-batches per generation batch: 8-row updates from a 32-row generation batch
        overrides = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1} | overrides
    trainer, record, probe = run_trainer(tiny_sft_model, tmp_path, monkeypatch, method, overrides)
    args = trainer.args
    step = 1  # the second optimizer step (global_step 1 at its start)
    generation = 0 if gspo else step  # GSPO generated at step 0 for steps 0-3
    raw = record["raw"][generation]
    rewards = record["rewards"][generation].sum(1)
    selected = dict(next(batch for s, batch in record["selected"] if s == generation))
    assert raw["prompt_mask"].all(), "equal-length prompts: no left padding to reproduce"

    # -- S: the kept rollouts are a best subset (the trainer's own choice among ties) --------------------
    generated = rows_of(raw)
    kept_rows = rows_of(selected)
    advantages_all = group_advantages(rewards)
    progress = generation / args.max_steps
    schedule = args.selection_schedule
    keep = schedule.keep_per_prompt(progress) if args.sample_rule != "none" else G
    # the trainer's decision (recorded), checked against the equations below; one record per generation
    kept = (
        record["kept"][generation // args.minibatches_per_generation]
        if keep < G
        else list(range(len(generated)))
    )
    assert [generated[i] for i in kept] == kept_rows, "the batch holds the decided rows, in order"
    prompts = len(generated) // G
    assert len(kept) == keep * prompts
    if args.sample_rule == "max_variance":
        pools = (
            [list(range(len(generated)))]
            if args.sample_scope == "batch"
            else [list(range(g * G, (g + 1) * G)) for g in range(prompts)]
        )
        for pool in pools:
            chosen = [i for i in kept if i in pool]
            got = advantages_all[chosen].var(unbiased=False).item()
            assert got >= best_variance(advantages_all[pool], len(chosen)) - 1e-9
    if args.renormalize and keep < G:
        advantage = subset_advantages(rewards, kept)
    else:
        advantage = {i: float(advantages_all[i]) for i in kept}
    torch.testing.assert_close(
        selected["advantages"].double(),
        torch.tensor([advantage[i] for i in kept], dtype=torch.float64),
        rtol=1e-5,
        atol=1e-5,
    )

    # -- T: the kept tokens are a top-ceil(K n) set by |A| x H over the generation batch ---------------------
    initial = AutoModelForCausalLM.from_pretrained(tiny_sft_model)
    old_policy = model_with(tiny_sft_model, probe.weights[generation])
    policy = model_with(tiny_sft_model, probe.weights[step])
    temperature = args.temperature
    tokens = {}
    with torch.no_grad():
        for i in kept:
            prompt, completion = map(torch.tensor, generated[i])
            old_logps, entropy = row_passes(old_policy, prompt, completion, temperature)
            ref_logps, _ = row_passes(initial, prompt, completion, temperature)
            tokens[i] = {
                "prompt": prompt,
                "completion": completion,
                "old": old_logps,
                "entropy": entropy,
                "ref": ref_logps,
            }
    ratio = schedule.token_keep_ratio(progress) if args.token_rule != "none" else 1.0
    valid_total = sum(t["completion"].numel() for t in tokens.values())
    if ratio < 1.0:
        mask = selected["token_mask"]
        for position, i in enumerate(kept):
            tokens[i]["kept"] = mask[position, : tokens[i]["completion"].numel()].clone()
            assert not mask[position, tokens[i]["completion"].numel() :].any(), "padding is never selected"
        for t, i in ((tokens[i], i) for i in kept):
            t["score"] = t["entropy"] * (abs(advantage[i]) if args.token_rule == "adv_entropy" else 1.0)
        groups = [[i] for i in kept] if args.token_scope == "sequence" else [kept]
        for group in groups:
            scores = torch.cat([tokens[i]["score"] for i in group])
            chosen = torch.cat([tokens[i]["kept"] for i in group])
            assert chosen.sum().item() == math.ceil(ratio * scores.numel() - 1e-9)
            if chosen.any() and (~chosen).any():
                assert scores[chosen].min() >= scores[~chosen].max() - 1e-4
    else:
        assert "token_mask" not in selected
        for i in kept:
            tokens[i]["kept"] = torch.ones_like(tokens[i]["completion"], dtype=torch.bool)
    kept_total = sum(int(tokens[i]["kept"].sum()) for i in kept)

    # -- the rows of this optimizer step (TRL shuffled and split the batch) ----------------------------------
    step_rows: list[int] = []
    for global_step, inputs in record["loss_inputs"]:
        if global_step != step:
            continue
        masks = inputs.get("token_mask")
        for position, row in enumerate(rows_of(inputs)):
            candidates = [i for i in kept if generated[i] == row and i not in step_rows]
            if masks is not None:  # identical rows may differ in their kept tokens: match the mask too
                candidates = [
                    i for i in candidates if torch.equal(masks[position, : len(row[1])], tokens[i]["kept"])
                ]
            step_rows.append(candidates[0])
    steps_per_generation = args.steps_per_generation
    assert len(step_rows) == len(kept) * args.gradient_accumulation_steps // steps_per_generation

    # -- the objective on those rows, differentiated here ----------------------------------------------------
    low, high = args.epsilon, args.epsilon_high if args.epsilon_high is not None else args.epsilon
    total = torch.zeros((), dtype=torch.float64)
    denominator = (kept_total if args.token_norm == "selected" else valid_total) * (
        args.gradient_accumulation_steps / steps_per_generation
    )
    for i in step_rows:
        t = tokens[i]
        logps, _ = row_passes(policy, t["prompt"], t["completion"], temperature)
        on_policy = generation == step and args.num_iterations == 1
        old = logps.detach() if on_policy else t["old"]
        k = t["kept"].double()
        kl = torch.exp(t["ref"] - logps) - (t["ref"] - logps) - 1
        kl_weight = k if args.kl_tokens == "selected" else torch.ones_like(k)
        a = advantage[i]
        if args.importance_sampling_level == "sequence":  # GSPO: loss_type grpo, a mean over the step's rows
            if k.sum() == 0:
                continue  # no kept token: out of the loss
            s = torch.exp(((logps - old) * k).sum() / k.sum())
            if args.use_bias_correction_kl:  # TRL's default: the KL estimate importance-weighted by the ratio
                kl = kl * s
            term = -torch.min(s * a, s.clamp(1 - low, 1 + high) * a)
            term = term + args.beta * (kl * k).sum() / k.sum()
            total = total + term / len(step_rows)
        else:  # token level, loss_type dapo: every token's term over the step's token count D
            rho = torch.exp(logps - old)
            if args.use_bias_correction_kl:
                kl = kl * rho
            per_token = -torch.min(rho * a, rho.clamp(1 - low, 1 + high) * a) * k + args.beta * kl * kl_weight
            total = total + per_token.double().sum() / denominator
    assert args.loss_type == ("grpo" if args.importance_sampling_level == "sequence" else "dapo")
    total.backward()
    applied = probe.grads[step]
    expected = {n: p.grad for n, p in policy.named_parameters() if p.grad is not None}
    assert applied.keys() == expected.keys()
    scale = max(g.abs().max().item() for g in expected.values())
    if scale == 0:  # only where no kept rollout carries an advantage (tied rewards; PODS max-reward)
        assert all(advantage[i] == 0 for i in step_rows)
        scale = 1.0
    for name in expected:
        torch.testing.assert_close(
            applied[name], expected[name].to(applied[name].dtype), rtol=1e-3, atol=1e-5 * scale, msg=name
        )


# ---- invariance: the mask and the summed gradient do not depend on how the batch is cut --------------------


def one_step(model_path, tmp_path, monkeypatch, micro_rollouts: int, **overrides):
    """One d2s step (N = 2 of 8, K = 5 %) on a 32-rollout generation batch, its 8 kept rollouts cut into
    micro-batches of ``micro_rollouts`` (gradient accumulation 8 / micro_rollouts)."""
    accumulation = 8 // micro_rollouts
    settings = dict(per_device_train_batch_size=32 // accumulation, gradient_accumulation_steps=accumulation)
    tag = f"{micro_rollouts}-{'-'.join(map(str, overrides.values()))}"
    trainer, record, probe = run_trainer(
        model_path, tmp_path / tag, monkeypatch, "d2s", settings | {"max_steps": 1} | overrides
    )
    (_, batch), *_ = record["selected"]
    return batch, probe.grads[0]


@pytest.mark.slow
def test_token_mask_and_gradient_do_not_depend_on_micro_batch_or_accumulation(
    tmp_path, tiny_sft_model, monkeypatch
):
    runs = {size: one_step(tiny_sft_model, tmp_path, monkeypatch, size) for size in (2, 4, 8)}
    batch, grads = runs[8]  # one micro-batch, no accumulation
    assert batch["token_mask"].any()
    for size in (2, 4):  # accumulation 4 and 2
        other, other_grads = runs[size]
        assert rows_of(other) == rows_of(batch), "the same generation batch"
        assert torch.equal(other["token_mask"], batch["token_mask"])
        for name in grads:
            torch.testing.assert_close(other_grads[name], grads[name], rtol=1e-4, atol=1e-7, msg=name)

    # TRL's per-micro-batch ranking (kept as token_scope micro_batch) is what depended on the cut
    _, small = one_step(tiny_sft_model, tmp_path, monkeypatch, 2, token_scope="micro_batch")
    _, whole = one_step(tiny_sft_model, tmp_path, monkeypatch, 8, token_scope="micro_batch")
    assert any(not torch.allclose(small[name], whole[name], rtol=1e-3, atol=1e-6) for name in whole)
