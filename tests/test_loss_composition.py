"""The selection loss composes with TRL's loss options (issue 57): each loss type, sequence-level ratios, the
off-policy mask, the entropy bonus (static and adaptive) and a mixture-of-experts model's router aux loss.

Two oracles. Where selection keeps every rollout and every token (T = m), the selection loss must be TRL's
loss: the same value and the same gradient, micro-batch by micro-batch of a real training run, and the same
adaptive-entropy state after it (a selecting method, d1s at N = G, trains with the selection loss; TRL's own
``_compute_loss`` runs on the same inputs beside it). Where selection keeps a subset T of m, the written
objective of docs/fidelity/objectives.md, computed here row by row in plain Python, is the oracle for
``selection_loss`` on random tensors (Hypothesis). What stays refused is refused in one line with its reason.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import TINY_TRAINER_ARGS, make_trainer
from hypothesis import given, settings
from hypothesis import strategies as st
from trl import GRPOTrainer

from d3s.objective import SELECTION_LOSSES, Objective, entropy_bonus, selection_loss
from d3s.trainer import D3SConfig

G = TINY_TRAINER_ARGS["num_generations"]
# two optimizer steps per generation batch of two micro-batches each: the second step is off-policy, so the
# ratios, clips, the off-policy mask and the old-policy log-probs all take part
GEOMETRY = dict(
    gradient_accumulation_steps=2,
    steps_per_generation=4,
    max_steps=2,
    learning_rate=2e-3,
    pack_micro_batches=False,
)


# ---- oracle 1: T = m, the selection loss is TRL's loss ----------------------------------------------------

ENTROPY_STATE = ("entropy_coef", "_last_world_entropy", "_entropy_window_stats")


def losses_beside_trl(trainer) -> list[dict]:
    """Train ``trainer`` with TRL's _compute_loss run first on every micro-batch's inputs, its state put back
    before the trainer's own loss runs; each micro-batch's two losses, gradients and entropy states."""
    records = []
    ours = trainer._compute_loss

    def both(model, inputs):
        params = [p for p in model.parameters() if p.requires_grad]
        before = {name: getattr(trainer, name) for name in ENTROPY_STATE}
        trl_loss = GRPOTrainer._compute_loss(trainer, model, inputs)
        trl_state = {name: getattr(trainer, name) for name in ENTROPY_STATE}
        trl_grads = torch.autograd.grad(trl_loss, params, allow_unused=True)
        for name, value in before.items():
            setattr(trainer, name, value)
        loss = ours(model, inputs)
        grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
        state = {name: getattr(trainer, name) for name in ENTROPY_STATE}
        records.append(dict(trl=trl_loss.detach(), ours=loss.detach(), trl_grads=trl_grads, grads=grads))
        records[-1] |= dict(trl_state=trl_state, state=state)
        return loss

    trainer._compute_loss = both
    trainer.train()
    return records


def assert_same_as_trl(records: list[dict]) -> None:
    assert len(records) == 2 * GEOMETRY["max_steps"]
    for index, record in enumerate(records):
        torch.testing.assert_close(
            record["ours"], record["trl"], rtol=1e-5, atol=1e-7, msg=f"micro-batch {index}"
        )
        for ours, trl in zip(record["grads"], record["trl_grads"], strict=True):
            if trl is None:
                assert ours is None or not ours.any()
                continue
            torch.testing.assert_close(ours, trl, rtol=1e-4, atol=1e-8, msg=f"gradient, micro-batch {index}")
        for name in ENTROPY_STATE:
            ours, trl = record["state"][name], record["trl_state"][name]
            if isinstance(trl, torch.Tensor):
                torch.testing.assert_close(ours, trl)
            else:
                assert ours == pytest.approx(trl), name
    assert any(record["trl_grads"][0] is not None and record["trl_grads"][0].any() for record in records)


KEEP_ALL = dict(keep_per_prompt=G, keep_per_prompt_final=G)  # d1s at N = G: the selection loss, no selection
ADAPTIVE = dict(use_adaptive_entropy=True, entropy_coef=0.01, entropy_target=5.0, entropy_coef_delta=0.01)
SEQUENCE = dict(importance_sampling_level="sequence")
# every loss type the selection loss computes, each once, with the options stacked on them (a run each costs
# ~20 s): sequence-level ratios under each row-weighing loss, the off-policy mask, the static and the adaptive
# entropy bonus
CASES = {
    "grpo-sequence-entropy_bonus": dict(loss_type="grpo", entropy_coef=0.05) | SEQUENCE,
    "bnpo": dict(loss_type="bnpo"),
    "dr_grpo": dict(loss_type="dr_grpo"),
    "dapo-off_policy_mask-adaptive_entropy": dict(loss_type="dapo", off_policy_mask_threshold=0.0) | ADAPTIVE,
    "luspo-sequence": dict(loss_type="luspo") | SEQUENCE,
    "cispo-off_policy_mask": dict(loss_type="cispo", epsilon_high=5.0, off_policy_mask_threshold=0.0),
    "sapo-entropy_bonus": dict(loss_type="sapo", entropy_coef=0.05),
}
assert {case["loss_type"] for case in CASES.values()} == set(SELECTION_LOSSES)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_with_every_token_kept_the_selection_loss_is_trls(tmp_path, tiny_sft_model, case):
    args = D3SConfig.for_method(
        "d1s", output_dir=str(tmp_path), **(TINY_TRAINER_ARGS | GEOMETRY | KEEP_ALL | CASES[case])
    )
    trainer = make_trainer(tiny_sft_model, args)
    assert trainer.owns_loss  # the selection loss, not TRL's
    records = losses_beside_trl(trainer)
    assert_same_as_trl(records)
    if "entropy" in case:
        assert (
            "entropy_coef" in trainer.state.log_history[0] and "policy_loss" in trainer.state.log_history[0]
        )
    if "adaptive" in case:  # the controller moved the coefficient, as TRL's moved it
        assert records[-1]["state"]["entropy_coef"] != 0.01


# ---- the router's aux loss of a mixture-of-experts model --------------------------------------------------


@pytest.fixture(scope="module")
def tiny_moe_model(tmp_path_factory):
    """A tiny Qwen3-MoE (4 experts, 2 a token, TRL's aux loss on), the tiny tokenizer, random weights."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from d3s.tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        router_aux_loss_coef=0.02,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_moe")
    Qwen3MoeForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.slow
def test_a_moe_model_trains_with_its_router_aux_loss_as_trl_adds_it(tmp_path, tiny_moe_model):
    args = D3SConfig.for_method(
        "d1s", output_dir=str(tmp_path / "keep_all"), **(TINY_TRAINER_ARGS | GEOMETRY | KEEP_ALL)
    )
    trainer = make_trainer(tiny_moe_model, args)
    assert trainer.aux_loss_enabled and trainer.router_aux_loss_coef == pytest.approx(0.02)
    assert_same_as_trl(losses_beside_trl(trainer))
    assert all(record["aux_loss"] > 0 for record in trainer.state.log_history if "aux_loss" in record)


@pytest.mark.slow
def test_d3s_trains_a_moe_model(tmp_path, tiny_moe_model):
    args = D3SConfig.for_method("d3s", output_dir=str(tmp_path), **(TINY_TRAINER_ARGS | dict(max_steps=2)))
    trainer = make_trainer(tiny_moe_model, args)
    assert not trainer.packs_micro_batches  # the aux loss is a statistic of each micro-batch
    trainer.train()
    steps = [record for record in trainer.state.log_history if "loss" in record]
    assert len(steps) == 2 and all(math.isfinite(record["loss"]) for record in steps)
    assert all(record["aux_loss"] > 0 for record in steps)


# ---- oracle 2: T a subset of m, the written objective ----------------------------------------------------


def written_objective(o: Objective, logps, old, adv, valid, kept, accumulation, dapo_d, sampling=None):
    """docs/fidelity/objectives.md's loss, one row and one token at a time, in float64 Python."""
    rows, cols = logps.shape
    sampling = old if sampling is None else sampling
    row_terms, counted_rows = [], 0
    for i in range(rows):
        toks = [t for t in range(cols) if kept[i, t]]
        mask = toks if o.kept_tokens_normalise else [t for t in range(cols) if valid[i, t]]
        a = float(adv[i])
        if o.sequence_level:
            mean = sum(float(logps[i, t] - old[i, t]) for t in toks) / max(len(toks), 1)
            ratio = {t: math.exp(mean) for t in range(cols)}
        else:
            ratio = {t: math.exp(float(logps[i, t] - old[i, t])) for t in range(cols)}
        keep_row = 1.0
        if o.off_policy_threshold is not None:
            live = [t for t in range(cols) if valid[i, t]]
            drift = sum(float(sampling[i, t] - logps[i, t]) for t in live) / max(len(live), 1)
            keep_row = 0.0 if (a < 0 and drift > o.off_policy_threshold) else 1.0
        terms = {}
        for t in range(cols):
            r = ratio[t]
            if o.loss_type == "cispo":
                value = -min(r, o.epsilon_high) * a * float(logps[i, t])
            elif o.loss_type == "sapo":
                tau = o.sapo_temperature_pos if a > 0 else o.sapo_temperature_neg
                value = -(1 / (1 + math.exp(-tau * (r - 1)))) * 4 / tau * a
            else:
                clipped = min(max(r, 1 - o.epsilon_low), 1 + o.epsilon_high)
                value = -min(r * a, clipped * a)
            terms[t] = value * (1.0 if kept[i, t] else 0.0) * keep_row
        summed = sum(terms[t] for t in mask)
        if o.loss_type in ("grpo", "sapo"):
            summed /= max(len(mask), 1)
        row_terms.append(summed)
        counted_rows += 1
    total = sum(row_terms)
    if o.loss_type in ("grpo", "sapo", "luspo"):
        return total / (counted_rows * accumulation)
    if o.loss_type == "bnpo":
        tokens = sum(
            1 for i in range(rows) for t in range(cols) if (kept if o.kept_tokens_normalise else valid)[i, t]
        )
        return total / (max(tokens, 1) * accumulation)
    if o.loss_type == "dr_grpo":
        return total / (counted_rows * o.max_completion_length * accumulation)
    return total / dapo_d  # dapo, cispo


@st.composite
def loss_problems(draw):
    rows, cols = draw(st.integers(1, 4)), draw(st.integers(1, 5))
    seed = draw(st.integers(0, 2**16))
    generator = torch.Generator().manual_seed(seed)
    logps = -torch.rand(rows, cols, generator=generator, dtype=torch.float64) * 3
    old = logps + (torch.rand(rows, cols, generator=generator, dtype=torch.float64) - 0.5) * 0.6
    sampling = old + (torch.rand(rows, cols, generator=generator, dtype=torch.float64) - 0.5) * 0.4
    adv = (torch.rand(rows, generator=generator, dtype=torch.float64) - 0.5) * 4
    lengths = [draw(st.integers(1, cols)) for _ in range(rows)]
    valid = torch.tensor([[1.0 if t < n else 0.0 for t in range(cols)] for n in lengths], dtype=torch.float64)
    kept = valid * torch.tensor(
        [[float(draw(st.booleans())) for _ in range(cols)] for _ in range(rows)], dtype=torch.float64
    )
    objective = Objective(
        loss_type=draw(st.sampled_from(SELECTION_LOSSES)),
        sequence_level=draw(st.booleans()),
        epsilon_low=0.2,
        epsilon_high=draw(st.sampled_from([0.2, 0.28, 5.0])),
        delta=None,
        beta=0.0,
        kl_on_kept_tokens=True,
        kl_bias_correction=False,
        kept_tokens_normalise=draw(st.booleans()),
        max_completion_length=cols,
        sapo_temperature_pos=draw(st.sampled_from([1.0, 2.0])),
        sapo_temperature_neg=1.05,
        off_policy_threshold=draw(st.sampled_from([None, 0.0, 0.05])),
    )
    return objective, logps, old, sampling, adv, valid, kept


@settings(max_examples=300, deadline=None)
@given(loss_problems(), st.sampled_from([1, 2]), st.floats(1.0, 40.0))
def test_the_selection_loss_is_the_written_objective(problem, accumulation, dapo_d):
    objective, logps, old, sampling, adv, valid, kept = problem
    terms = selection_loss(
        objective, logps, old, None, adv, valid, kept, None,
        rows_counted=torch.ones(len(adv), dtype=torch.bool), accumulation=accumulation,
        dapo_denominator=dapo_d, sampling_logps=sampling,
    )  # fmt: skip
    expected = written_objective(objective, logps, old, adv, valid, kept, accumulation, dapo_d, sampling)
    # the row scale is float32 (as in training): an error of ~1e-7 of each row's term, which may cancel
    assert terms.loss.item() == pytest.approx(expected, rel=1e-6, abs=1e-6)


def test_the_entropy_bonus_is_the_mean_entropy_of_the_kept_tokens():
    entropies = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    kept = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    assert entropy_bonus(entropies, kept, accumulation=2).item() == pytest.approx((1 + 3 + 5) / 3 / 2)
    assert entropy_bonus(entropies, torch.zeros_like(kept), accumulation=1).item() == 0.0


# ---- what stays refused ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, reason",
    [
        ({"loss_type": "vespo"}, "vespo's gamma weight"),
        ({"top_entropy_quantile": 0.2}, "a second token ranking"),
        ({"use_liger_kernel": True}, "Liger's fused loss"),
        (
            {"loss_type": "dapo", "importance_sampling_level": "sequence"},
            "weighting each rollout by its kept length",
        ),
    ],
)
def test_what_the_selection_loss_does_not_compute_is_refused_with_its_reason(tmp_path, overrides, reason):
    with pytest.raises(ValueError, match=reason):
        D3SConfig.for_method("d3s", output_dir=str(tmp_path), **(TINY_TRAINER_ARGS | overrides))


def test_packing_steps_aside_for_a_term_of_the_whole_micro_batch(tmp_path, tiny_sft_model):
    args = D3SConfig.for_method(
        "d3s", output_dir=str(tmp_path), **(TINY_TRAINER_ARGS | {"entropy_coef": 0.01})
    )
    trainer = make_trainer(tiny_sft_model, args)
    assert trainer.owns_loss and not trainer.packs_micro_batches
    assert "entropy bonus" in trainer._packing_blocker()
