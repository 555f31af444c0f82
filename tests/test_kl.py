"""The no-gradient KL diagnostic (d3s/evaluation/kl.py) and its loader (d3s.analysis.io.load_kl).

Checked against a brute-force computation: every completion scored alone, unpadded, with the model's full
logits and a Python loop over its tokens.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from d3s.analysis.figures import kl_figure
from d3s.analysis.io import load_kl
from d3s.data.synthetic import arithmetic_problems
from d3s.evaluation.kl import (
    KL_FILE,
    KLProbeSettings,
    completion_logprobs,
    eos_token_ids,
    kl_estimates,
    kl_to_reference,
    measure_checkpoint_kl,
    per_token_kl,
    probe_completions,
    probe_prompts,
    truncate_at_eos,
)
from d3s.provenance.settings_check import MixedSettingsError

PROBE = KLProbeSettings(
    prompts=4, samples=3, max_new_tokens=24, temperature=1.0, top_p=1.0, seed=7, batch_size=5
)


@pytest.fixture(scope="module")
def models(tiny_sft_model):
    """(policy, the same weights loaded again, a perturbed copy, tokenizer, probe prompts of mixed
    lengths)."""
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(tiny_sft_model)
    policy = AutoModelForCausalLM.from_pretrained(tiny_sft_model, dtype=torch.float32).eval()
    same = AutoModelForCausalLM.from_pretrained(tiny_sft_model, dtype=torch.float32).eval()
    perturbed = AutoModelForCausalLM.from_pretrained(tiny_sft_model, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in perturbed.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    prompts = [p.prompt for p in arithmetic_problems(2, seed=3, max_ops=1, max_operand=9)]
    prompts += [p.prompt for p in arithmetic_problems(2, seed=3, min_ops=2, max_ops=2, max_operand=9)]
    assert len({len(tokenizer(p)["input_ids"]) for p in prompts}) > 1  # left padding is exercised
    return policy, same, perturbed, tokenizer, prompts


def _brute_force_logps(model, prompt_ids, completion_ids) -> list[float]:
    """Log-prob of each completion token, the sequence alone (no padding), full logits, one token at a
    time."""
    ids = torch.tensor([list(prompt_ids) + list(completion_ids)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    out = []
    for t, token in enumerate(completion_ids):
        row = logits[len(prompt_ids) + t - 1]
        out.append(float(row[token] - torch.logsumexp(row, dim=0)))
    return out


def test_kl_of_a_model_to_itself_is_exactly_zero(models):
    policy, same, _, tokenizer, prompts = models
    result = kl_to_reference(policy, same, tokenizer, prompts, PROBE)
    assert result["k1"] == 0.0 and result["k3"] == 0.0 and result["k1_per_sequence"] == 0.0
    assert result["sequences"] == len(prompts) * PROBE.samples
    assert result["tokens"] >= result["sequences"]


def test_k1_and_k3_match_a_brute_force_computation_on_a_perturbed_copy(models):
    policy, _, perturbed, tokenizer, prompts = models
    result = kl_to_reference(policy, perturbed, tokenizer, prompts, PROBE)
    sequences = probe_completions(policy, tokenizer, prompts, PROBE)  # the same completions (seeded)
    k1_all, k3_all, per_sequence = [], [], []
    for prompt_ids, completion_ids in sequences:
        logp = _brute_force_logps(policy, prompt_ids, completion_ids)
        ref = _brute_force_logps(perturbed, prompt_ids, completion_ids)
        k1 = [a - b for a, b in zip(logp, ref, strict=True)]
        k3 = [math.exp(b - a) - (b - a) - 1 for a, b in zip(logp, ref, strict=True)]
        k1_all += k1
        k3_all += k3
        per_sequence.append(sum(k1))
    assert result["tokens"] == len(k1_all)
    assert result["k1"] == pytest.approx(sum(k1_all) / len(k1_all), rel=1e-4, abs=1e-7)
    assert result["k3"] == pytest.approx(sum(k3_all) / len(k3_all), rel=1e-4, abs=1e-7)
    assert result["k1_per_sequence"] == pytest.approx(sum(per_sequence) / len(per_sequence), rel=1e-4)
    assert result["k3"] > 1e-3  # the perturbation is visible: the comparison is not of zeros


def test_batched_scoring_masks_padding_and_matches_each_sequence_alone(models):
    policy, _, _, tokenizer, prompts = models
    sequences = probe_completions(policy, tokenizer, prompts, PROBE)
    lengths = {len(c) for _, c in sequences}
    assert len(lengths) > 1  # completions of different lengths: right padding is exercised
    batched = completion_logprobs(policy, sequences, batch_size=len(sequences), pad_id=tokenizer.pad_token_id)
    # a different pad id (a real token) must change nothing: padding is masked, not merely a harmless token
    other_pad = completion_logprobs(
        policy, sequences, batch_size=len(sequences), pad_id=tokenizer.eos_token_id
    )
    for (prompt_ids, completion_ids), row, row_other in zip(sequences, batched, other_pad, strict=True):
        alone = torch.tensor(_brute_force_logps(policy, prompt_ids, completion_ids), dtype=torch.float32)
        assert row.shape == (len(completion_ids),)
        torch.testing.assert_close(row, alone, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(row_other, row, atol=2e-5, rtol=1e-5)


def test_completions_end_at_their_first_eos(models):
    policy, _, _, tokenizer, prompts = models
    eos = eos_token_ids(policy, tokenizer)
    sequences = probe_completions(policy, tokenizer, prompts, PROBE)
    ended = [c for _, c in sequences if c and c[-1] in eos]
    assert ended and any(len(c) < PROBE.max_new_tokens for c in ended)  # the warm-started model stops
    for _, completion in sequences:
        assert sum(t in eos for t in completion) <= 1
        assert completion[-1] in eos or len(completion) == PROBE.max_new_tokens


def test_truncate_at_eos():
    assert truncate_at_eos([5, 7, 1, 9, 1, 3], {1}) == [5, 7, 1]
    assert truncate_at_eos([1, 5], {1, 2}) == [1]
    assert truncate_at_eos([5, 2, 1], {1, 2}) == [5, 2]
    assert truncate_at_eos([5, 6], {1}) == [5, 6]
    assert truncate_at_eos([], {1}) == []


def test_tokens_after_eos_and_padding_do_not_enter_the_estimates(models):
    policy, _, perturbed, tokenizer, prompts = models
    eos = tokenizer.eos_token_id
    prompt_ids = tokenizer(prompts[0])["input_ids"]
    generated = [4, 9, 12, eos, 30, 31, 32]  # as generate returns it: EOS, then tokens of a finished row
    completion = truncate_at_eos(generated, {eos})
    short = [(prompt_ids, completion)]
    mixed = [(prompt_ids, completion), (tokenizer(prompts[1])["input_ids"], [7, 8, 9, 10, 11, 12, 13, 14])]
    alone = kl_estimates(completion_logprobs(policy, short), completion_logprobs(perturbed, short))
    logp = completion_logprobs(policy, mixed, batch_size=2)
    ref = completion_logprobs(perturbed, mixed, batch_size=2)
    assert alone["tokens"] == 4 and len(logp[0]) == 4
    together = kl_estimates(logp[:1], ref[:1])
    for key in ("k1", "k3", "k1_per_sequence"):
        assert together[key] == pytest.approx(alone[key], rel=1e-5, abs=1e-8)


def test_the_same_seed_gives_the_same_result_and_leaves_the_callers_rng_alone(models):
    policy, _, perturbed, tokenizer, prompts = models
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first = kl_to_reference(policy, perturbed, tokenizer, prompts, PROBE)
    assert torch.equal(torch.get_rng_state(), state)
    second = kl_to_reference(policy, perturbed, tokenizer, prompts, PROBE)
    assert first == second
    other_seed = probe_completions(policy, tokenizer, prompts, dataclasses.replace(PROBE, seed=8))
    assert other_seed != probe_completions(policy, tokenizer, prompts, PROBE)


def test_k3_is_nonnegative_token_by_token(models):
    policy, _, perturbed, tokenizer, prompts = models
    sequences = probe_completions(policy, tokenizer, prompts, PROBE)
    logp = completion_logprobs(policy, sequences)
    ref = completion_logprobs(perturbed, sequences)
    for a, b in zip(logp, ref, strict=True):
        assert (per_token_kl(a, b)[1] >= 0).all()
    # and on log-ratios from tiny to large, where exp(x) - x - 1 in floating point can round below zero
    generator = torch.Generator().manual_seed(0)
    for scale in (1e-9, 1e-6, 1e-3, 1.0, 30.0):
        a = scale * torch.randn(10_000, generator=generator, dtype=torch.float64)
        k1, k3 = per_token_kl(a, torch.zeros_like(a))
        assert (k3 >= 0).all()
        torch.testing.assert_close(k1, a)


def test_bad_settings_fail_before_any_model_loads(tmp_path):
    with pytest.raises(ValueError, match="eval.kl.samples must be >= 1"):
        KLProbeSettings(samples=0).validate()
    with pytest.raises(ValueError, match="eval.kl.temperature must be > 0"):
        measure_checkpoint_kl(tmp_path / "missing", tmp_path / "missing", {}, tmp_path / "kl.json",
                              KLProbeSettings(temperature=0.0))  # fmt: skip
    assert not (tmp_path / "kl.json").exists()


def test_probe_prompts_are_the_first_training_prompts(models):
    from d3s.runs.resolve import training_rows

    tokenizer = models[3]
    config = {"seed": 2, "dataset": {"name": "synthetic", "count": 50, "max_ops": 1, "max_operand": 9}}
    assert probe_prompts(config, tokenizer, 5) == [
        row["prompt"] for row in training_rows(config, tokenizer)[:5]
    ]
    with pytest.raises(ValueError, match="eval.kl.prompts is 60"):
        probe_prompts(config, tokenizer, 60)


def test_one_file_per_checkpoint_then_the_loader_and_the_figure(tiny_sft_model, tmp_path):
    """measure_checkpoint_kl on a real checkpoint; then files of several runs gathered by load_kl, by step."""
    results = tmp_path / "results"
    config = {"seed": 0, "dataset": {"name": "synthetic", "count": 50, "max_ops": 1, "max_operand": 9}}
    settings = KLProbeSettings(prompts=3, samples=2, max_new_tokens=16, batch_size=6)
    out = results / "eval" / "grpo" / "seed0" / "step10" / KL_FILE
    record = measure_checkpoint_kl(
        tiny_sft_model,
        tiny_sft_model,
        config,
        out,
        settings,
        labels={"method": "grpo", "seed": 0, "step": 10},
    )
    on_disk = json.loads(out.read_text())
    assert on_disk == record and record["k1"] == 0.0 and record["sequences"] == 6
    assert record["settings"]["prompts"] == 3 and record["step"] == 10 and record["seconds"] > 0
    assert not list(out.parent.glob(".*"))  # no temporary file left beside it
    # more runs and checkpoints, written out of order; the final model's row takes the run's step count
    for method, seed, point, k1 in [
        ("grpo", 0, "final", 0.3), ("grpo", 0, "step20", 0.2), ("grpo", 1, "step10", 0.05),
        ("grpo", 1, "step20", 0.25), ("d3s", 0, "step20", 0.1), ("d3s", 0, "step10", 0.02),
    ]:  # fmt: skip
        path = results / "eval" / method / f"seed{seed}" / point / KL_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record | {"k1": k1, "k3": k1 / 2}))
    (results / "runs" / "grpo" / "seed0").mkdir(parents=True)
    (results / "runs" / "grpo" / "seed0" / "train_summary.json").write_text(json.dumps({"steps": 30}))
    kl = load_kl(results)
    assert list(zip(kl["method"], kl["seed"], kl["step"], strict=True)) == [
        ("d3s", 0, 10), ("d3s", 0, 20), ("grpo", 0, 10), ("grpo", 0, 20), ("grpo", 0, 30),
        ("grpo", 1, 10), ("grpo", 1, 20),
    ]  # fmt: skip
    assert kl.loc[(kl["method"] == "grpo") & (kl["step"] == 30), "final"].item()
    assert kl["k1"].tolist() == [0.02, 0.1, 0.0, 0.2, 0.3, 0.05, 0.25]
    fig = kl_figure(kl, ["grpo", "d3s"])
    assert [ax.get_title() for ax in fig.axes][:2] == [
        "KL to the initial policy, k1 (per token)",
        "KL to the initial policy, k3 (per token)",
    ]
    grpo_line = fig.axes[0].get_lines()[0]
    assert grpo_line.get_label() == "grpo"
    assert grpo_line.get_ydata().tolist() == pytest.approx([0.025, 0.225, 0.3])  # mean over seeds per step
    # a checkpoint measured with other probe settings is refused, unless mixing is allowed
    mixed = results / "eval" / "d3s" / "seed0" / "final" / KL_FILE
    mixed.parent.mkdir(parents=True)
    mixed.write_text(json.dumps(record | {"settings": record["settings"] | {"samples": 4}}))
    with pytest.raises(MixedSettingsError, match="probe settings differ"):
        load_kl(results)
    assert len(load_kl(results, allow_mixed=True)) == 8
