"""The Snakemake workflow: schema, parse-time refusals, lint, and the smoke run end to end."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import yaml
from helpers import REPO_ROOT, run_snakemake

# Every configuration is dry-run offline in test_dry_run_offline.py, the paper ones with their resources and
# trainer settings in test_paper_configs.py.


def test_default_decides_the_headline_and_standard_runs_every_method_alike():
    default = yaml.safe_load((REPO_ROOT / "config" / "config.yaml").read_text())
    standard = yaml.safe_load((REPO_ROOT / "config" / "standard.yaml").read_text())
    assert {"grpo", "pods", "d3s"} <= set(default["methods"]) and len(default["seeds"]) >= 5
    paper = pd.concat(pd.read_csv(REPO_ROOT / "results" / "paper" / f"d3s_table{n}.csv") for n in (1, 2))
    assert set(standard["methods"]) >= set(paper["method"]) - {"base"}  # every method of the paper's tables
    assert {"gspo", "d3s_i", "entropy_8020"} <= set(
        standard["methods"]
    )  # GSPO+D3S's baseline, appendix, 80/20
    assert default["train"]["threads"] == 1
    # the same testbed and power: only the methods, the experiment's name and the ablation rows differ
    for cfg in (default, standard):
        for key in ("methods", "experiment"):
            cfg.pop(key)
        cfg["analysis"].pop("ablation")
    assert default == standard


def test_schema_rejects_a_bad_config(tmp_path):
    cfg = yaml.safe_load((REPO_ROOT / "config" / "smoke.yaml").read_text())
    cfg["seeds"] = "zero"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(cfg))
    result = run_snakemake(["-n", "--configfile", str(bad)], REPO_ROOT)
    assert result.returncode != 0
    assert "seeds" in result.stdout + result.stderr


def test_unknown_method_fails_at_parse_time(tmp_path):
    cfg = yaml.safe_load((REPO_ROOT / "config" / "smoke.yaml").read_text())
    cfg["methods"] = ["grpo", "d3z"]
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(cfg))
    result = run_snakemake(["-n", "--configfile", str(bad)], REPO_ROOT)
    assert result.returncode != 0
    assert "unknown method 'd3z'" in result.stdout + result.stderr


# (what the config changes, what the one line must say): keys the schema bounds, one per kind of check
BAD_WORKFLOW_CONFIGS = [
    ({"seeds": [-1]}, "config seeds[0]: -1 is less than the minimum of 0"),
    ({"base_model": {"kind": "path"}}, "config base_model: 'path' is a required property"),
    ({"eval": {"benchmarks": ["aime26"]}}, "config eval.benchmarks[0]: unknown benchmark 'aime26'; valid"),
    ({"eval": {"bogus": 1}}, "config eval: unknown key(s) ['bogus']; valid: benchmarks, synthetic"),
    (
        {"train": {"resources": {"gpus": 2}}},
        "config train.resources.gpus: Snakemake's GPU resource is named gpu",
    ),
    (
        {"train": {"launch": {"accelerate_config": "zero4"}}},
        "accelerate_config: 'zero4': expected ddp, zero2",
    ),
    ({"train": {"trainer": {"num_generations": 1}}}, "num_generations: 1 is less than the minimum of 2"),
    ({"train": {"method_overrides": {"d3z": {}}}}, "config train.method_overrides: unknown method 'd3z'"),
    ({"analysis": {"headline": ["grpo", "d3z"]}}, "config analysis.headline[1]: unknown method 'd3z'"),
    ({"analysis": {"reference": "pods"}}, "config analysis.reference 'pods' is not one of the methods"),
]


def _merged(base: dict, changes: dict) -> dict:
    return base | {
        key: _merged(base.get(key) or {}, value) if isinstance(value, dict) and key != "base_model" else value
        for key, value in changes.items()
    }


@pytest.mark.parametrize(
    ("changes", "message"), BAD_WORKFLOW_CONFIGS, ids=[m for _, m in BAD_WORKFLOW_CONFIGS]
)
def test_a_bad_workflow_config_ends_in_one_line_at_parse_time(tmp_path, changes, message):
    """The schema's and common.smk's refusals: one line naming the key and the fix, no schema dump, no job."""
    cfg = _merged(yaml.safe_load((REPO_ROOT / "config" / "smoke.yaml").read_text()), changes)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(cfg))
    result = run_snakemake(["-n", "--configfile", str(bad)], REPO_ROOT)
    out = result.stdout + result.stderr
    assert result.returncode != 0
    assert [line for line in out.splitlines() if line.startswith("config ")] == [
        next(line for line in out.splitlines() if message in line)
    ], out
    assert "Failed validating" not in out and "rule " not in out, out


def test_schema_enums_are_the_registries():
    """The names the schema accepts are the registries' own, so neither can drift from the other."""
    from transformers.trainer_utils import SaveStrategy

    from d3s.data.benchmarks import BENCHMARKS
    from d3s.data.templates import TEMPLATES
    from d3s.grading.policies import ANSWER_POLICIES
    from d3s.methods import METHODS
    from d3s.orchestration.commands import ACCELERATE_CONFIGS
    from d3s.rewards import REWARD_SETS

    schema = yaml.safe_load((REPO_ROOT / "config" / "schema.yaml").read_text())
    names = {name: definition.get("enum") for name, definition in schema["$defs"].items()}
    assert names["method"] == list(METHODS)
    assert names["benchmark"] == list(BENCHMARKS)
    assert names["template"] == list(TEMPLATES)
    assert names["accelerate_config"] == list(ACCELERATE_CONFIGS)
    assert schema["properties"]["train"]["properties"]["reward"]["enum"] == list(REWARD_SETS)
    answer_policy = schema["properties"]["eval"]["properties"]["answer_policy"]["enum"]
    assert answer_policy == list(ANSWER_POLICIES)
    save_strategy = schema["$defs"]["trainer"]["properties"]["save_strategy"]["enum"]
    assert [s for s in save_strategy if s is not False] == [s.value for s in SaveStrategy]


# Trainer settings whose workflow range is narrower than `d3s train`'s, on purpose: the workflow names the
# checkpoints it evaluates from max_steps, so -1 (train for num_train_epochs) is refused there.
WORKFLOW_NARROWS = {"max_steps"}
# Probe values around every bound the two sides use: 0, 1, 2, the seed range's end, and past them.
RANGE_PROBES = (
    -(2**33),
    -2,
    -1,
    -0.5,
    0,
    1e-9,
    0.5,
    1 - 1e-9,
    1,
    1 + 1e-9,
    1.5,
    2,
    3,
    2**32 - 1,
    2**32,
    1e12,
)


def test_trainer_ranges_agree_with_the_schema():
    """config/schema.yaml's typed trainer settings and D3SConfig's TRAINER_RANGES accept the same values:
    every setting with a bound in the schema has a range in TRAINER_RANGES, and each value probed is accepted
    by both or by neither (the schema's types aside: it refuses a float for an integer setting)."""
    import jsonschema

    from d3s.trainer_config import TRAINER_RANGES

    schema = yaml.safe_load((REPO_ROOT / "config" / "schema.yaml").read_text())
    bounds = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
    disagree = []
    for name, spec in schema["$defs"]["trainer"]["properties"].items():
        bounded = any(bound in spec for bound in bounds)
        if not bounded and name not in TRAINER_RANGES:
            continue
        if not bounded or name not in TRAINER_RANGES:
            disagree.append(f"{name}: a range in {'the schema' if bounded else 'TRAINER_RANGES'} only")
            continue
        accepts, description = TRAINER_RANGES[name]
        integer = "integer" in ([spec["type"]] if isinstance(spec["type"], str) else spec["type"])
        for value in RANGE_PROBES:
            if integer and not float(value).is_integer():
                continue
            value = int(value) if integer else value
            in_schema = jsonschema.Draft202012Validator(spec).is_valid(value)
            in_trainer = bool(accepts(value))
            if in_schema != in_trainer and not (name in WORKFLOW_NARROWS and in_trainer):
                disagree.append(
                    f"{name} = {value!r}: schema {in_schema}, TRAINER_RANGES ({description}) {in_trainer}"
                )
    assert not disagree, disagree


def test_lint_clean():
    result = run_snakemake(["--lint"], REPO_ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Lints for" not in result.stdout + result.stderr


@pytest.mark.slow
def test_smoke_workflow_end_to_end(smoke_workflow):
    """The smoke configuration (run by the smoke_workflow fixture, conftest.py): base model, 2 methods x 1
    seed, checkpoint and final evaluation, the four notebooks, report.md, and Snakemake's HTML report."""
    work = smoke_workflow
    out = work / "results" / "smoke"
    for method in ("grpo", "d3s"):
        run = out / "runs" / method / "seed0"
        assert (run / "metrics.jsonl").stat().st_size > 0
        assert (run / "resolved_config.yaml").is_file()
        assert (run / "checkpoint-2" / "tokenizer.json").is_file()
        assert (out / "eval" / method / "seed0" / "step2" / "summary.json").is_file()
        assert (out / "eval" / method / "seed0" / "final" / "summary.json").is_file()
        for point in ("step2", "final"):  # eval.kl: the KL to the initial policy, measured at each
            kl = json.loads((out / "eval" / method / "seed0" / point / "kl.json").read_text())
            assert kl["sequences"] == 4 * 2 and kl["tokens"] > 0 and kl["k3"] >= 0
            assert kl["reference"].endswith("smoke/base_model") and kl["point"] == point
    kl_table = pd.read_csv(out / "tables" / "kl.csv")
    assert sorted(set(zip(kl_table["method"], kl_table["step"], strict=True))) == [
        ("d3s", 2),
        ("d3s", 4),
        ("grpo", 2),
        ("grpo", 4),
    ]
    for stem in (
        "training_dynamics",
        "grad_norm",
        "kl",
        "learning_curves",
        "pass_at_k",
        "var_after_selection",
    ):
        assert (out / "figures" / f"{stem}.png").is_file() and (out / "figures" / f"{stem}.pdf").is_file()
    report = (out / "report.md").read_text()
    assert "## Main table: ours" in report and "| d3s |" in report
    assert report.startswith("# Reproduction report: smoke\n\n## The papers' claims at this scale")
    claims = pd.read_csv(out / "tables" / "claims.csv")
    assert list(claims.columns[:9]) == [
        "claim", "method", "reference", "estimate", "ci_low", "ci_high", "seeds", "verdict",
        "min_detectable_effect",
    ]  # fmt: skip
    assert set(claims["verdict"]) <= {"supported", "refuted", "inconclusive"}
    grpo_gain = claims[(claims["claim"] == "gain_over_base") & (claims["method"] == "grpo")]
    assert grpo_gain["reference"].tolist() == ["base"] and grpo_gain["seeds"].tolist() == [1]
    assert {"pass_at_1", "speedup_steps", "ordering_agrees_with_paper"} <= set(claims["claim"])
    assert (out / "tables" / "claims.provenance.json").is_file()
    for stem in ("training_dynamics", "kl", "learning_curves", "pass_at_k"):
        assert f"figures/{stem}.png" in report
    # Nothing left to do: a second run is a no-op.
    again = run_snakemake(["-n", "--configfile", "config/smoke.yaml"], work)
    assert "Nothing to be done" in again.stdout + again.stderr
    html = run_snakemake(["--configfile", "config/smoke.yaml", "--report", "report.html"], work, timeout=300)
    assert html.returncode == 0, html.stdout[-2000:] + html.stderr[-2000:]
    assert (work / "report.html").stat().st_size > 10_000


@pytest.mark.parametrize(
    ("section", "key", "value", "message"),
    [
        ("task", "bounded", "yes", "'yes' is not of type 'boolean'"),
        ("base_model", "sft_box_error", [0.1], "is too short"),
        ("base_model", "sft_box_error", [0.1, 1.5], "1.5 is greater than the maximum of 1"),
        ("analysis", "references", {"gspo_d3s": 3}, "3 is not of type 'string'"),
    ],
)
def test_schema_refuses_bad_testbed_and_claims_options(section, key, value, message):
    """The options of the testbed and the claims: defaults filled in, bad values refused naming the value."""
    from snakemake.utils import validate

    schema = str(REPO_ROOT / "config" / "schema.yaml")
    cfg = yaml.safe_load((REPO_ROOT / "config" / "smoke.yaml").read_text())
    validate(cfg, schema)
    assert cfg["task"]["bounded"] is False and cfg["base_model"]["sft_box_error"] == [0.0, 0.0]
    assert cfg["analysis"]["references"] == {"gspo_d3s": "gspo"}
    cfg[section][key] = value
    with pytest.raises(Exception) as error:
        validate(cfg, schema)
    assert message in str(error.value)


@pytest.mark.slow
def test_d3s_eval_of_a_run_model_scores_it_on_the_task_it_trained_on(smoke_workflow, tmp_path):
    """Issue 49: `d3s eval --model <run>/final --benchmarks synthetic` without --synthetic evaluates on the
    task the run trained on (its resolved_config.yaml), says so in one line, and, with the workflow's samples,
    seed and problems, gives the workflow's own Pass@1 of that model."""
    import subprocess
    import sys

    work = smoke_workflow
    out = work / "results" / "smoke"
    evaluated = out / "eval" / "d3s" / "seed0" / "final"
    settings = json.loads((evaluated / "resume_key.json").read_text())["settings"]
    smoke = yaml.safe_load((work / "config" / "smoke.yaml").read_text())
    # the workflow's options, but the task: only the problem count stays (the same problems, 12 of them)
    flags = {flag: text for flag, text in settings.items() if flag != "--synthetic"}
    flags |= {
        "--synthetic": f"count={smoke['eval']['synthetic']['count']}",
        "--k": "1",
        "--benchmarks": "synthetic",
    }
    flags |= {"--out": str(tmp_path / "cli"), "--batch-size": str(smoke["eval"]["batch_size"])}
    command = [sys.executable, "-m", "d3s.cli", "eval", *(w for pair in flags.items() for w in pair)]
    done = subprocess.run(command, cwd=work, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    trained_on = "synthetic: the task the run trained on (min_ops=1, max_ops=2, max_operand=9, bounded=0; "
    assert trained_on in done.stdout
    ours = json.loads((tmp_path / "cli" / "synthetic" / "summary.json").read_text())
    workflow = json.loads((evaluated / "synthetic" / "summary.json").read_text())
    assert ours["n_problems"] == workflow["n_problems"] == smoke["eval"]["synthetic"]["count"]
    assert ours["pass_at_k"]["1"] == pytest.approx(workflow["pass_at_k"]["1"])
