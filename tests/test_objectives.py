"""Proof by equation: every registered method applies the gradient of its paper's objective.

A real D3STrainer trains the tiny model (several prompts of different lengths, so TRL pads them on the left;
G = 8 rollouts with tied and untied rewards, padded completions, two micro-batches per optimizer step). At the
checked step the test takes the gradient the trainer is about to apply and recomputes it here from the
equations, with its own forward passes of the tiny model, one row at a time and unpadded:

    A_i      = (r_i - mean_group r) / (std_group r + 1e-4)       over all G (GRPO, the D-family), or over the
                                                                   kept members of the group (PODS)
    S        = a best |S| = N subset: max Var(A_S), max sum r_S,   per group or over the pooled batch
               or any (random)
    T        = top-ceil(K n) tokens of S by |A_i| H_it (or H_it)   over the whole generation batch
    w_i      = exp(sum_t log pi_old - log pi_vLLM), 0 above 3      vLLM's importance-sampling correction
                                                                   (a forced mismatch; 1 without it)
    token:     L = -sum_{i,t in T} w_i min(rho A, clip(rho) A) / D  + beta sum_{i,t in T} KL_it / D
               D = the valid tokens of the generation batch (token_norm "all") or of T ("selected")
    sequence:  s_i = exp(mean_{t in T_i} (log pi - log pi_old)),  L = mean_i -w_i min(s_i A_i, clip(s_i) A_i)

N, K, the scopes, the rules, the re-normalisation, the clip range and GSPO's mini-batches are the papers'
numbers, written below in PAPERS (the registry is read only for its method names;
test_the_registry_holds_the_papers_numbers says which of its numbers drifted). GSPO is checked off-policy:
four mini-batches of two micro-batches each from one generation batch, every update after the first checked
against the generating policy's log-probs, with some sequence ratios clipped and some not. The chosen S and
T are the trainer's (ties, and the random rule, have several right answers): the test checks that each is a
valid choice under the equations above, then differentiates the objective on them. Nothing here imports d3s
but the trainer under test, the registry's method names and, in the registry test, the config; TRL's loss is
never called.
"""

from __future__ import annotations

import itertools
import math
import random
import zlib
from contextlib import contextmanager
from dataclasses import dataclass, replace

import pytest
import torch
from helpers import TINY_TRAINER_ARGS, serve_as_vllm
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

G = 8
TEMPERATURE = 1.0
# vLLM's importance-sampling correction: sequence_mask with C_max = 3 (TRL's default, the paper configs)
IS_CAP = 3.0
# GSPO's learning rates, tried in turn until the clip binds on some rows and not others: at 1e-6 each update
# moves the next one's sequence ratios by about 1e-4, so some land inside the clip range (1 - 3e-4, 1 + 4e-4)
# and some outside; which ones depends on the machine (its float results change the trajectory)
LR_GSPO = (1e-6, 2e-6, 5e-7, 4e-6)
# ... and, where every learning rate moves the ratios against the advantages (the clip binds only on a move
# with them), other seeds: a seed fixes the prompts and rollouts, so the rows and their ratios differ
SEEDS_GSPO = (42, 1, 2, 3)
# A ratio this close to a clip edge may be decided either way (the trainer's float32 passes and the test's
# differ by up to ~1e-6): the test accepts both decisions for it
EDGE = 1e-5
BIAS_CORRECTED_KL = True  # TRL's use_bias_correction_kl (its default): the KL estimate weighted by the ratio


# ---- what the papers say (docs/fidelity/objectives.md; ../shared/docs/paper-notes.md), not d3s.methods -----


@dataclass(frozen=True)
class Paper:
    """One method as its paper defines it. N and K as fractions of G at the start and the end of training."""

    sample_rule: str = "none"  # max_variance | max_reward | random | none
    sample_scope: str = "group"  # group: N of each prompt's G; batch: N x B of the pooled batch (cross-group)
    renormalize: bool = False  # PODS: advantages over the kept members of the group
    keep: tuple[float, float] = (1.0, 1.0)  # N / G
    token_rule: str = "none"  # adv_entropy (|A| H) | entropy (H) | none
    token_scope: str = "batch"  # batch: ranked over the kept rollouts of the generation batch | sequence
    tokens: tuple[float, float] = (1.0, 1.0)  # K
    linear: bool = False  # N and K move linearly in p = step / max_steps
    minibatches: int = 1  # optimizer steps per generation batch
    sequence: bool = False  # GSPO's sequence-level ratio, a mean over rows (loss_type grpo); else dapo
    clip: tuple[float, float] = (0.2, 0.2)  # (eps, eps_high); 0.2 is TRL's default, the papers give none
    zeroed: str = "excluded"  # what vLLM's correction zeroed: out of S, T and the denominators | "trl"
    token_norm: str = "all"  # D: every valid token of the kept rollouts | the kept tokens ("selected")
    kl_tokens: str = "selected"  # the KL on T | on every valid token ("all")


QUARTER = dict(keep=(0.25, 0.25))  # PODS (64, 16) and D3S Table 1 "GRPO+PODS": N = G/4; D1S/D2S: G/4 fixed
# D3S's schedule: N 8 -> 32 of G = 32, K 5 % -> 20 %, |A| x H over the kept rollouts of the batch [N][S]
D3S = dict(
    sample_rule="max_variance",
    sample_scope="batch",
    keep=(0.25, 1.0),
    token_rule="adv_entropy",
    tokens=(0.05, 0.20),
    linear=True,
)
GSPO = dict(sequence=True, clip=(3e-4, 4e-4), minibatches=4)  # GSPO v2 section 5.1, TRL's GSPO docs
PAPERS = {
    "grpo": Paper(zeroed="trl"),
    "pods": Paper("max_variance", "group", renormalize=True, **QUARTER),
    "pods_random": Paper("random", "group", renormalize=True, **QUARTER),  # PODS's rule ablation at (64, 16)
    "pods_max_reward": Paper("max_reward", "group", renormalize=True, **QUARTER),
    "d1s": Paper("max_variance", "group", **QUARTER),
    "d1s_cross": Paper("max_variance", "batch", **QUARTER),
    # D2S: D1S-Cross plus the token level, fixed at the D3S schedule's start (the paper gives no fixed values)
    "d2s": Paper("max_variance", "batch", token_rule="adv_entropy", tokens=(0.05, 0.05), **QUARTER),
    "d3s": Paper(**D3S),
    "d3s_i": Paper(**(D3S | dict(sample_scope="group"))),  # D3S Appendix D.1: intra-group
    # this suite's adaptive D3S (docs/studies.md): D3S until the first 3 steps' reward is low, then D3S-I;
    # the switch reads 3 steps of history first, so these short runs are D3S throughout (test_studies.py)
    "d3s_adaptive": Paper(**D3S),
    "entropy_8020": Paper(token_rule="entropy", tokens=(0.2, 0.2)),  # Beyond the 80/20 Rule: top 20 % by H
    "gspo": Paper(zeroed="trl", **GSPO),
    "gspo_d3s": Paper(**D3S, **GSPO),
}


def paper_of(method: str, overrides: dict) -> Paper:
    """The paper's method with the case's trainer overrides applied (the options the cases set)."""
    paper = PAPERS[method]
    changes = {k: overrides[k] for k in ("token_scope", "token_norm", "kl_tokens") if k in overrides}
    if "minibatches_per_generation" in overrides:
        changes["minibatches"] = overrides["minibatches_per_generation"]
    if "epsilon" in overrides:
        changes["clip"] = (overrides["epsilon"], overrides.get("epsilon_high", overrides["epsilon"]))
    if "token_keep_ratio" in overrides:
        assert not paper.linear, "a K override of a linear schedule would need its final value"
        changes["tokens"] = (overrides["token_keep_ratio"],) * 2
    return replace(paper, **changes)


def keep_count(paper: Paper, progress: float) -> int:
    """N(p) = (1 - p) N_init + p N_final (D3S); the tests' p and G give an integer (no rounding rule)."""
    fraction = (
        paper.keep[0] if not paper.linear else (1 - progress) * paper.keep[0] + progress * paper.keep[1]
    )
    value = fraction * G
    assert abs(value - round(value)) < 1e-9, f"N = {value} at p = {progress}: pick a G or p with a whole N"
    return round(value)


def keep_ratio(paper: Paper, progress: float) -> float:
    if not paper.linear:
        return paper.tokens[0]
    return (1 - progress) * paper.tokens[0] + progress * paper.tokens[1]


def test_the_registry_holds_the_papers_numbers(tmp_path):
    """The registry's methods are PAPERS's, and each resolves (at the papers' G = 32) to the papers'
    numbers."""
    from d3s.methods import METHODS
    from d3s.trainer_config import D3SConfig

    assert sorted(METHODS) == sorted(PAPERS), "a method without its paper's numbers here (or one removed)"
    drifted = {}
    for name, paper in PAPERS.items():
        args = D3SConfig.for_method(
            name,
            output_dir=str(tmp_path / name),
            num_generations=32,
            per_device_train_batch_size=32,
            use_cpu=True,
            report_to="none",
            bf16=False,
        )
        selects, ranks = paper.sample_rule != "none", paper.token_rule != "none"
        got = {
            "sample_rule": args.sample_rule,
            "keep": (args.keep_per_prompt / 32, args.keep_per_prompt_final / 32),
            "token_rule": args.token_rule,
            "linear": args.schedule == "linear",
            "minibatches": args.minibatches_per_generation,
            "sequence": args.importance_sampling_level == "sequence",
            "loss_type": args.loss_type,
            "clip": (args.epsilon, args.epsilon if args.epsilon_high is None else args.epsilon_high),
            "zeroed": args.zeroed_rollouts,
            "token_norm": args.token_norm,
            "kl_tokens": args.kl_tokens,
        }
        want = {
            "sample_rule": paper.sample_rule,
            "keep": paper.keep if paper.linear else (paper.keep[0],) * 2,
            "token_rule": paper.token_rule,
            "linear": paper.linear,
            "minibatches": paper.minibatches,
            "sequence": paper.sequence,
            "loss_type": "grpo" if paper.sequence else "dapo",
            "clip": paper.clip,
            "zeroed": paper.zeroed,
            "token_norm": paper.token_norm,
            "kl_tokens": paper.kl_tokens,
        }
        if selects:
            got |= {"sample_scope": args.sample_scope, "renormalize": args.renormalize}
            want |= {"sample_scope": paper.sample_scope, "renormalize": paper.renormalize}
        if ranks:
            got |= {
                "token_scope": args.token_scope,
                "tokens": (args.token_keep_ratio, args.token_keep_ratio_final),
            }
            want |= {
                "token_scope": paper.token_scope,
                "tokens": paper.tokens if paper.linear else (paper.tokens[0],) * 2,
            }
        wrong = {k: (got[k], want[k]) for k in want if got[k] != pytest.approx(want[k])}
        if wrong:
            drifted[name] = wrong
    assert not drifted, f"the registry's (got, paper) numbers that differ: {drifted}"


# ---- the run -----------------------------------------------------------------------------------------------


def tied_reward(completions, **kwargs):
    """Length mod 3: ties inside most groups, spread in most."""
    return [float(len(c) % 3) for c in completions]


def spread_reward(completions, **kwargs):
    """Length mod 3 plus a tie-breaker from the text: rollouts tie only where their texts are equal. PODS's
    max-reward rule keeps the 2 best of 8: under tied_reward those two mostly tie, so their advantages over
    the kept pair are 0 in every group and the zero gradient checks nothing."""
    return [float(len(c) % 3) + (zlib.crc32(c.encode()) % 1000) / 1000 for c in completions]


REWARD = {"pods_max_reward": spread_reward}  # every other case: tied_reward (ties, and spread, in a group)


def varied_prompts(count: int = 200):
    """Distinct one-step sums of operands 0..19: prompts of 10 to 12 tokens, so a batch mixes lengths and TRL
    pads it on the left; distinct, so a (prompt, completion) pair names its group."""
    from datasets import Dataset

    problems = [(a, op, b) for a in range(20) for b in range(20) for op in "+-"]
    random.Random(0).shuffle(problems)
    return Dataset.from_list(
        [
            {"prompt": f"Q: {a}{op}{b}=\nA:", "answer": str(a + b if op == "+" else a - b)}
            for a, op, b in problems[:count]
        ]
    )


@contextmanager
def one_thread():
    """The test's own passes are single short rows: one torch thread costs less CPU than two (far less on
    a busy machine, where a second thread spins)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


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


def sampling_shift(row: tuple) -> float:
    """The forced mismatch of a rollout, sum_t log pi_old - log pi_vLLM, a function of its tokens (identical
    rollouts get the same): 2 puts w = 7.4 above the cap (zeroed), for about a quarter of the rollouts."""
    return (2.0, -0.4, 0.0, 0.4)[zlib.crc32(repr(row).encode()) % 4]


def force_mismatch(trainer, record: dict) -> None:
    """As tests/test_importance_sampling.py, through helpers.serve_as_vllm: transformers generates, and TRL
    receives the generating policy's own log-probs as vLLM's, the first token's lowered by the row's shift,
    so that its sequence ratio is exp(shift). The correction's settings are the config's (run_trainer);
    only ``use_vllm`` is switched on here."""

    def engine_logprobs(position, prompt, completion, model):
        with one_thread():
            own, _ = row_passes(model, torch.tensor(prompt), torch.tensor(completion), TEMPERATURE)
        own[0] -= sampling_shift((tuple(prompt), tuple(completion)))
        record["sampling"][(tuple(prompt), tuple(completion))] = own.double()
        return own.tolist()

    serve_as_vllm(trainer, engine_logprobs)


def run_trainer(model_path, tmp_path, monkeypatch, method, overrides, mismatch=False):
    """Train; returns what the trainer generated, selected and trained on, and the gradients it applied."""
    import trl

    from d3s.trainer import D3SConfig, D3STrainer

    record = {"raw": [], "rewards": [], "selected": [], "loss_inputs": [], "sampling": {}}

    class Recording(D3STrainer):
        def _compute_loss(self, model, inputs):
            if "completion_ids" in inputs:  # not a slot packing emptied (its rows train in a later one)
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

    correction = dict(
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode="sequence_mask",
        vllm_importance_sampling_clip_min=None,
        vllm_importance_sampling_clip_max=IS_CAP,
    )
    args = D3SConfig.for_method(
        method,
        output_dir=str(tmp_path / method),
        **(
            TINY_TRAINER_ARGS
            | dict(max_steps=2, max_grad_norm=0.0, metrics_log=None, lr_scheduler_type="constant")
            | dict(per_device_train_batch_size=16, gradient_accumulation_steps=2, temperature=TEMPERATURE)
            | dict(use_bias_correction_kl=BIAS_CORRECTED_KL)
            | (correction if mismatch else {})
            | overrides
        ),
    )
    torch.set_num_threads(2)
    trainer = Recording(
        model=AutoModelForCausalLM.from_pretrained(model_path),
        args=args,
        reward_funcs=[REWARD.get(method, tied_reward)],
        train_dataset=varied_prompts(),
        processing_class=AutoTokenizer.from_pretrained(model_path),
    )
    probe = Probe(trainer.model)
    trainer.add_callback(probe)
    if mismatch:
        force_mismatch(trainer, record)
    monkeypatch.setattr(trl.GRPOTrainer, "_generate_and_score_completions", raw_generate)
    monkeypatch.setattr(trl.GRPOTrainer, "_calculate_rewards", raw_rewards)
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


def gradient_mismatch(applied: dict, expected: dict, scale: float) -> str | None:
    """None where the trainer's gradient is the objective's, else the first parameter that differs."""
    for name in expected:
        try:
            torch.testing.assert_close(
                applied[name], expected[name].to(applied[name].dtype), rtol=1e-3, atol=max(1e-5 * scale, 1e-7)
            )
        except AssertionError as error:
            return f"{name}: {error}"
    return None


def positions_in(rows: list, generated: list) -> list[int]:
    """Each row's index in the generation batch. Prompts are distinct, so equal rows are rollouts of one
    prompt with equal tokens, reward and advantage: interchangeable, taken in order."""
    taken: set[int] = set()
    out = []
    for row in rows:
        i = next((i for i, g in enumerate(generated) if g == row and i not in taken), None)
        assert i is not None, "a trained row the generation batch does not hold (or holds fewer times)"
        taken.add(i)
        out.append(i)
    return out


@pytest.fixture(autouse=True)
def torch_threads_restored():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


METHOD_NAMES = sorted(__import__("d3s.methods", fromlist=["METHODS"]).METHODS)  # the names only
CASES = [(name, {}, False) for name in METHOD_NAMES] + [
    ("d3s", {"beta": 0.04}, False),  # the KL on the selected tokens (kl_tokens "selected", the default)
    ("d3s", {"beta": 0.04, "kl_tokens": "all"}, False),
    ("d3s", {"token_norm": "selected"}, False),
    ("d2s", {"token_scope": "sequence", "token_keep_ratio": 0.2}, False),
    # the schedule at a second point, p = 2/3 (N = 6 of 8, K = 15 %): a cosine schedule equals the linear
    # one at p = 1/2 and differs here
    ("d3s", {"max_steps": 3}, False),
    # the token-level clip, off-policy: four updates from one generation batch with GSPO's narrow clip range,
    # so that epsilon and epsilon_high bind on some tokens and not on others
    ("d3s", {"minibatches_per_generation": 4, "epsilon": 3e-4, "epsilon_high": 4e-4}, False),
    ("gspo_d3s", {"beta": 0.04}, False),
    # vLLM's importance-sampling correction against a forced mismatch: TRL's way (zeroed rollouts weigh 0 and
    # count), and the selecting methods' (zeroed rollouts take no slot and count nowhere), token and sequence
    ("grpo", {}, True),
    ("d2s", {"token_norm": "selected"}, True),
    ("gspo_d3s", {}, True),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "overrides", "mismatch"),
    CASES,
    ids=[
        m + "".join(f"-{k}={v}" for k, v in o.items()) + ("-vllm_mismatch" if x else "") for m, o, x in CASES
    ],
)
def test_the_applied_gradient_is_the_objectives(
    tmp_path, tiny_sft_model, monkeypatch, method, overrides, mismatch
):
    paper = paper_of(method, overrides)
    if paper.minibatches == 1:
        check_applied_gradient(paper, tmp_path, tiny_sft_model, monkeypatch, method, overrides, mismatch)
        return
    # Off-policy (GSPO's sequence ratios; the token-level case's token ratios): the clip must bind on some
    # rows or tokens (no policy gradient) and not on others, or one of its branches goes unchecked. Where the
    # ratios land depends on the machine's float results (another CPU, another trajectory), so the learning
    # rates are tried in turn, each run checked in full.
    tried = {}
    for seed, learning_rate in ((seed, rate) for seed in SEEDS_GSPO for rate in LR_GSPO):
        run_dir = tmp_path / f"seed{seed}-lr{learning_rate:g}"
        run_dir.mkdir()
        with pytest.MonkeyPatch.context() as patch:
            ratios = check_applied_gradient(
                paper, run_dir, tiny_sft_model, patch, method, overrides | {"seed": seed}, mismatch,
                learning_rate,
            )  # fmt: skip
        low, high = paper.clip
        clipped = [s for s, a in ratios if (a > 0 and s > 1 + high) or (a < 0 and s < 1 - low)]
        inside = [s for s, a in ratios if 1 - low <= s <= 1 + high]
        if clipped and inside:
            return
        tried[(seed, learning_rate)] = sorted(ratios)
    pytest.fail(
        "the clip never bound on some ratios and not others; (ratio, advantage) by (seed, learning rate): "
        f"{tried}"
    )


def check_applied_gradient(
    paper, tmp_path, tiny_sft_model, monkeypatch, method, overrides, mismatch, learning_rate=None
) -> list[tuple[float, float]]:
    """Train a few steps of ``method`` and check that every checked step applied the gradient of the paper's
    objective, recomputed here from the equations on the rows the trainer trained on; returns the off-policy
    ratios whose policy term trains with their advantages: GSPO's (s_i, A_i) of rows, the token level's
    (rho_it, A_i) of kept tokens (none where every checked step is on-policy: rho = 1)."""
    beta = overrides.get("beta", 0.0)
    accumulation = 2  # two micro-batches per optimizer step
    if paper.minibatches > 1:  # GSPO: a 128-rollout generation batch for 4 updates of 2 micro-batches each;
        # every update after the first is off-policy, and each is checked
        geometry = dict(
            per_device_train_batch_size=16, max_steps=paper.minibatches, learning_rate=learning_rate
        )
        generation, checked = 0, list(range(1, paper.minibatches))
    else:  # the last step, on its own 32-rollout generation batch: N and K at p = 1/2 (2 steps) or 2/3 (3)
        geometry = dict(per_device_train_batch_size=16, max_steps=overrides.get("max_steps", 2))
        generation = geometry["max_steps"] - 1
        checked = [generation]
    geometry["gradient_accumulation_steps"] = accumulation
    _, record, probe = run_trainer(
        tiny_sft_model, tmp_path, monkeypatch, method, geometry | overrides, mismatch
    )
    max_steps = geometry["max_steps"]
    steps_per_generation = paper.minibatches * accumulation
    call = generation // paper.minibatches  # the generation call that made the checked steps' rollouts
    raw = record["raw"][call]
    rewards = record["rewards"][call].sum(1)
    selected = dict(next(batch for s, batch in record["selected"] if s == generation))
    prompt_mask = raw["prompt_mask"]
    assert not prompt_mask.all(), "prompts of one length: no left padding to reproduce"
    assert all(torch.equal(row, row.sort().values) for row in prompt_mask), "the padding is on the left"

    generated = rows_of(raw)
    prompts = len(generated) // G
    assert prompts == geometry["per_device_train_batch_size"] * steps_per_generation // G
    assert len({prompt for prompt, _ in generated}) == prompts, "one group per prompt"
    initial = AutoModelForCausalLM.from_pretrained(tiny_sft_model)
    old_policy = model_with(tiny_sft_model, probe.weights[generation])

    # -- w: vLLM's importance-sampling weight of every rollout (1 without the forced mismatch) --------------
    weight = dict.fromkeys(range(len(generated)), 1.0)
    passes = {}  # the generating (old) policy's log-probs and entropies
    with torch.no_grad():
        for i, (prompt, completion) in enumerate(generated):
            if mismatch:
                passes[i] = row_passes(
                    old_policy, torch.tensor(prompt), torch.tensor(completion), TEMPERATURE
                )
                old_logps = passes[i][0]
                ratio = math.exp((old_logps.double() - record["sampling"][generated[i]]).sum().item())
                assert ratio == pytest.approx(math.exp(sampling_shift(generated[i])), rel=1e-3)
                weight[i] = 0.0 if ratio > IS_CAP else ratio
    excluded = mismatch and paper.zeroed == "excluded"  # what the correction zeroed is out of S, T and D
    eligible = [i for i in range(len(generated)) if weight[i] > 0 or not excluded]
    if mismatch:
        assert 0 < sum(w == 0 for w in weight.values()) < len(generated) // 2, (
            "some rollouts zeroed, not most"
        )

    # -- S: the kept rollouts are a valid subset under the paper's rule (the trainer's own choice) -----------
    advantages_all = group_advantages(rewards)
    progress = generation / max_steps
    keep = keep_count(paper, progress) if paper.sample_rule != "none" else G
    kept = positions_in(rows_of(selected), generated)
    pools = (
        [list(range(len(generated)))]
        if paper.sample_scope == "batch"
        else [list(range(g * G, (g + 1) * G)) for g in range(prompts)]
    )
    assert len(kept) == keep * prompts
    for pool in pools:
        chosen = [i for i in kept if i in pool]
        assert len(chosen) == keep * len(pool) // G, "N per group, or N x B from the pooled batch"
        candidates = [i for i in pool if i in eligible]
        assert len(candidates) >= len(chosen), "a pool too small for its slots: the test needs more rollouts"
        assert set(chosen) <= set(candidates), "a slot spent on a rollout the correction zeroed"
        if paper.sample_rule == "max_variance":
            got = advantages_all[chosen].var(unbiased=False).item()
            assert got >= best_variance(advantages_all[candidates], len(chosen)) - 1e-9
        elif paper.sample_rule == "max_reward":  # the largest reward sum (ties: any of the tied rollouts)
            best = rewards.double()[candidates].sort(descending=True).values[: len(chosen)].sum().item()
            assert rewards.double()[chosen].sum().item() == pytest.approx(best, abs=1e-9)
    if paper.renormalize and keep < G:
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
    tokens = {}
    with torch.no_grad():
        for i in kept:
            prompt, completion = map(torch.tensor, generated[i])
            old_logps, entropy = passes.get(i) or row_passes(old_policy, prompt, completion, TEMPERATURE)
            ref_logps = row_passes(initial, prompt, completion, TEMPERATURE)[0] if beta else None
            tokens[i] = {
                "prompt": prompt,
                "completion": completion,
                "old": old_logps,
                "entropy": entropy,
                "ref": ref_logps,
            }
    ratio = keep_ratio(paper, progress) if paper.token_rule != "none" else 1.0
    live = [i for i in kept if weight[i] > 0 or not excluded]
    valid_total = sum(tokens[i]["completion"].numel() for i in live)
    if ratio < 1.0:
        mask = selected["token_mask"]
        for position, i in enumerate(kept):
            tokens[i]["kept"] = mask[position, : tokens[i]["completion"].numel()].clone()
            assert not mask[position, tokens[i]["completion"].numel() :].any(), "padding is never selected"
        for i in kept:
            scale = abs(advantage[i]) if paper.token_rule == "adv_entropy" else 1.0
            tokens[i]["score"] = tokens[i]["entropy"] * scale
        groups = [[i] for i in live] if paper.token_scope == "sequence" else [live]
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
    kept_total = sum(int(tokens[i]["kept"].sum()) for i in live)

    # -- each checked step: its rows (TRL shuffled and split the batch), the objective on them ---------------
    low, high = paper.clip
    ratios = []  # GSPO: (s_i, A_i) of every row whose policy term trains
    for step in checked:
        step_rows: list[int] = []
        for global_step, inputs in record["loss_inputs"]:
            if global_step != step:
                continue
            masks = inputs.get("token_mask")
            for position, row in enumerate(rows_of(inputs)):
                candidates = [i for i in kept if generated[i] == row and i not in step_rows]
                if masks is not None:  # identical rows may differ in their kept tokens: match the mask too
                    candidates = [
                        i
                        for i in candidates
                        if torch.equal(masks[position, : len(row[1])], tokens[i]["kept"])
                    ]
                step_rows.append(candidates[0])
        assert len(step_rows) == len(kept) * accumulation // steps_per_generation

        policy = model_with(tiny_sft_model, probe.weights[step])
        on_policy = step == generation
        total = torch.zeros((), dtype=torch.float64)
        carried = 0  # rows whose policy term has a gradient under the equations
        on_edge = []  # GSPO: what the other clip decision would add, for ratios within float error of an edge
        denominator = (kept_total if paper.token_norm == "selected" else valid_total) * (
            accumulation / steps_per_generation
        )
        for i in step_rows:
            t = tokens[i]
            w = weight[i]
            if w == 0 and excluded:
                continue  # out of the loss (and of every denominator above)
            logps, _ = row_passes(policy, t["prompt"], t["completion"], TEMPERATURE)
            old = logps.detach() if on_policy else t["old"]
            k = t["kept"].double()
            kl = torch.exp(t["ref"] - logps) - (t["ref"] - logps) - 1 if beta else torch.zeros_like(logps)
            kl_weight = k if paper.kl_tokens == "selected" else torch.ones_like(k)
            a = advantage[i]
            if paper.sequence:  # GSPO: a mean over the step's rows
                if k.sum() == 0:
                    continue  # no kept token: out of the loss
                s = torch.exp(((logps - old) * k).sum() / k.sum())
                if BIAS_CORRECTED_KL:
                    kl = kl * s
                term = -torch.min(s * a, s.clamp(1 - low, 1 + high) * a) * w
                if w != 0 and a != 0:
                    edge = 1 + high if a > 0 else 1 - low  # past it, the clip binds: no policy gradient
                    binds = s.item() > edge if a > 0 else s.item() < edge
                    if abs(s.item() - edge) < EDGE:  # the trainer's float32 may fall either side
                        on_edge.append((1 if binds else -1) * -s * a * w / len(step_rows))
                    else:
                        ratios.append((s.item(), a))
                    carried += not binds
                total = total + (term + beta * (kl * k).sum() / k.sum()) / len(step_rows)
            else:  # token level, dapo: every token's term over the step's token count D
                rho = torch.exp(logps - old)
                if BIAS_CORRECTED_KL:
                    kl = kl * rho
                policy_term = -torch.min(rho * a, rho.clamp(1 - low, 1 + high) * a) * k * w
                carried += bool(a != 0 and w != 0 and k.any())
                if not on_policy and w != 0 and a != 0:  # each kept token's clip decision, as GSPO's rows'
                    edge = 1 + high if a > 0 else 1 - low
                    for j in k.nonzero().flatten().tolist():
                        binds = rho[j].item() > edge if a > 0 else rho[j].item() < edge
                        if abs(rho[j].item() - edge) < EDGE:
                            on_edge.append((1 if binds else -1) * -rho[j] * a * w / denominator)
                        else:
                            ratios.append((rho[j].item(), a))
                total = total + (policy_term + beta * kl * kl_weight).double().sum() / denominator
        total = total + 0.0 * sum(p.sum() for p in policy.parameters())  # a gradient for every parameter
        total.backward(retain_graph=bool(on_edge))
        applied = probe.grads[step]
        expected = {n: p.grad for n, p in policy.named_parameters()}
        assert applied.keys() == expected.keys()
        scale = max(g.abs().max().item() for g in expected.values())
        if scale == 0:  # where no row carries an advantage (tied rewards) or every ratio clips (off-policy)
            assert not carried
            scale = 1.0
        # A zero gradient would accept any loss, so an on-policy step must carry one. Off-policy steps may all
        # clip; the caller then asks for a ratio inside the clip range, whose row carries an advantage.
        assert carried or paper.minibatches > 1, (
            f"step {step}: no row carries a policy gradient: it checks nothing"
        )
        assert len(on_edge) <= 3, "too many ratios on the clip's edges: change LR_GSPO"
        others = [torch.autograd.grad(g, list(policy.parameters()), retain_graph=True) for g in on_edge]
        alternatives = []  # the objective's gradient under each decision of the ratios on an edge
        for choice in itertools.product((False, True), repeat=len(others)):
            alternatives.append(dict(expected))
            for flip, grads in zip(choice, others, strict=True):
                if flip:
                    for (name, _), extra in zip(policy.named_parameters(), grads, strict=True):
                        alternatives[-1][name] = alternatives[-1][name] + extra

        failures = [gradient_mismatch(applied, want, scale) for want in alternatives]
        assert not all(failures), f"step {step}, {failures[0]}"
    return ratios


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
