"""The README's commands, tested as written (issue 49).

Every shell command of the fenced ``bash`` blocks of README.md and the docs pages (SOURCES) is one test case.
Backslash continuations are joined, comments dropped, and an ``export`` line's variables are kept for the
commands after it in its block. Each command meets the first rule of RULES that matches it: the
rule either runs it (no GPU, no Hub, no cluster, cheap enough for CI) in a scratch folder, with the command's
own flags, or skips it with a reason that pytest's ``-ra`` summary prints. A command no rule matches FAILS, so
that a new command in the README cannot rot unnoticed: give it a rule.

Where a runner changes a command (a smaller ``--limit``, fewer ``--samples``, fewer ``--max-steps``, a scratch
``--out``), its comment says so. Relative paths of a command (``runs/...``, ``results/...``,
``../shared/data``) resolve in a scratch folder, where ``runs/d3s/final`` and ``runs/tiny-d3s/final`` are the
session's smoke run's final d3s model. The Hub is off (``HF_HUB_OFFLINE``) for every command that runs.

Each case records whether it ran and its wall seconds (``readme_command`` in its report's user_properties);
tests/conftest.py prints them as one table at the end of the session.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from helpers import REPO_ROOT, SHARED_DATA, SMOKE_ARGS, SMOKE_SECONDS

# The files whose fenced bash blocks are tested: every page with one (test_every_page_with_bash_is_a_source).
SOURCES = (
    "README.md",
    "docs/evaluation.md",
    "docs/workflow/stages.md",
    "docs/workflow/configuration.md",
    "docs/workflow/run-by-hand.md",
    "docs/workflow/regime-sweep.md",
    "docs/gpu.md",
    "docs/gpu/first-run.md",
    "docs/gpu/configurations.md",
    "docs/gpu/memory-plan.md",
    "docs/gpu/slurm.md",
    "docs/studies.md",
)
PAPER_CONFIGS = sorted(p.stem for p in (REPO_ROOT / "config" / "paper").glob("*.yaml"))
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
TIMEOUT_S = 600


@dataclass
class Command:
    """One shell command of a fenced bash block: its words (comments dropped, continuations joined), the
    variables ``export`` lines set before it in its block, and where it is written."""

    words: list[str]
    env: dict[str, str]
    sources: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return " ".join(self.words)


def fenced_bash_commands(path: Path) -> list[Command]:
    """The commands of ``path``'s fenced ``bash`` blocks, in order."""
    commands: list[Command] = []
    lines = iter(path.read_text().splitlines())
    for line in lines:
        if line.strip() != "```bash":
            continue
        env: dict[str, str] = {}
        pending = ""
        for body in lines:
            if body.strip().startswith("```"):
                break
            pending += body
            if pending.endswith("\\"):
                pending = pending[:-1]
                continue
            words = shlex.split(pending, comments=True)
            pending = ""
            if not words:
                continue
            if words[0] == "export":
                env |= dict(word.split("=", 1) for word in words[1:])
                continue
            source = path.relative_to(REPO_ROOT).as_posix() if path.is_relative_to(REPO_ROOT) else path.name
            commands.append(Command(words, dict(env), [source]))
    return commands


def expanded(command: Command) -> list[Command]:
    """``<name>`` replaced by each file of config/paper/."""
    if not any("<name>" in word for word in command.words):
        return [command]
    return [
        Command([word.replace("<name>", name) for word in command.words], command.env, command.sources)
        for name in PAPER_CONFIGS
    ]


# ---- the rules ---------------------------------------------------------------------------------------------

SNAKEMAKE = r"\.venv/bin/snakemake"
D3S = r"\.venv/bin/d3s"


@dataclass(frozen=True)
class Rule:
    """A command whose text fully matches ``pattern`` is run by ``runner`` (a fixture's name below), or,
    when ``runner`` is None, skipped for ``reason``. ``expand``: run once per config/paper/ file; ``slow``:
    the case runs for more than a few seconds (marked slow)."""

    pattern: str
    reason: str
    runner: str | None = None
    expand: bool = False
    slow: bool = True
    changes: str = ""  # what the runner changes in the command, for the table (its comment says why)


RULES = (
    # ---- skipped: GPU, Hub, cluster, interactive, or too long for CI -------------------------------------
    Rule(r"bash scripts/setup\.sh && .*", "sets up a fresh .venv (5.5 min) before the main job or the suite"),
    Rule(f"{SNAKEMAKE} --cores 2", "the default main job: 7.5 min on 2 cores"),
    Rule(f"{SNAKEMAKE} --cores 2 --configfile config/standard\\.yaml", "every method of the paper: 24 min"),
    Rule(
        f"{SNAKEMAKE} --cores 2 --config methods=\\[grpo,d3s\\]",
        "the default main job with two methods: minutes; its dry run is the -n case below",
    ),
    Rule(
        f"{SNAKEMAKE} --cores 2 --configfile config/smoke-vllm\\.yaml",
        "the vLLM smoke workflow: tests/test_vllm_workflow.py runs it (112-288 s of CPU)",
    ),
    Rule(
        f"{SNAKEMAKE} --cores 2 --configfile config/smoke\\.yaml --config methods=\\[grpo\\]",
        "a second smoke workflow (one method, ~1 min of CPU): the session's smoke run covers its jobs",
    ),
    Rule(
        f"{SNAKEMAKE} --cores 2 --configfile config/studies/\\w+\\.yaml",
        "one study: 19-28 min; tests/test_studies.py runs every study's smoke",
    ),
    Rule(
        f"{SNAKEMAKE} --workflow-profile workflow/profiles/default .*",
        "a paper configuration: GPUs and the Hub",
    ),
    Rule(f"{SNAKEMAKE} --workflow-profile workflow/profiles/slurm .*", "a Slurm cluster and GPUs"),
    Rule(f"{D3S} regime --config config/regime\\.yaml --cores 2", "the regime sweep: about 1.5 h on 2 cores"),
    Rule(
        f"{D3S} regime --config config/regime-smoke\\.yaml",
        "the regime sweep's smoke: tests/test_regime.py runs it (130-326 s of CPU)",
    ),
    Rule(
        f"{D3S} train --method d3s --model Qwen/Qwen2\\.5-Math-1\\.5B .*",
        "a 1.5B model from the Hub, on GPUs",
    ),
    Rule(
        f"{D3S} eval --audit --data-dir \\.\\./shared/data .*",
        "the grader audit of the real copies (~80 s of CPU): test_evaluation.py::test_audit_on_real_copies",
    ),
    Rule(
        f"{SNAKEMAKE} --cores 2 --configfile config/studies/\\w+\\.yaml config/studies/smoke/overlay\\.yaml",
        "a study's smoke: tests/test_studies.py runs every study's smoke",
    ),
    Rule(f"{SNAKEMAKE} --cores 4 --configfile config/gpu-smoke\\.yaml", "the GPU smoke workflow: a GPU"),
    Rule(r"\.venv/bin/jupyter lab notebooks/", "interactive: a Jupyter server"),
    Rule(r"\.venv/bin/tensorboard --logdir .*", "interactive: a TensorBoard server on a paper run's logs"),
    Rule(r"tmux new -s \w+", "interactive: a terminal session on a cluster's login node"),
    Rule(r"pip install -c constraints\.txt .*", "installs into the environment (the test extra has it)"),
    # ---- run ---------------------------------------------------------------------------------------------
    Rule(f"{SNAKEMAKE} --cores 2 --configfile config/smoke\\.yaml", "", "smoke_command"),
    Rule(f"{SNAKEMAKE} -n --configfile config/paper/<name>\\.yaml", "", "dry_run_command", expand=True),
    Rule(f"{SNAKEMAKE} -n --configfile config/paper/[\\w.-]+\\.yaml", "", "dry_run_command"),
    Rule(f"{SNAKEMAKE} -n --config .*", "", "dry_run_command"),
    Rule(
        f"{SNAKEMAKE} --report report\\.html", "", "report_command", changes="+ the smoke run's --configfile"
    ),
    Rule(f"{D3S} regime --config config/regime\\.yaml -n", "", "dry_run_command", slow=False),
    Rule(f"{D3S} plan --config config/paper/[\\w.-]+\\.yaml", "", "dry_run_command"),
    Rule(
        f"{D3S} train --config examples/tiny\\.yaml( .*)?",
        "",
        "train_command",
        changes="--max-steps 2, SFT 50 steps",
    ),
    Rule(
        f"{D3S} eval --model (runs/[\\w-]+|results/tiny/runs/d3s/seed0)/final .*",
        "",
        "eval_command",
        changes="--limit 2 --samples 2 ...",
    ),
)


def rule_for(command: Command) -> Rule | None:
    return next((rule for rule in RULES if re.fullmatch(rule.pattern, command.text)), None)


def readme_cases() -> list[Command]:
    """Every command of SOURCES once (its sources listed), ``<name>`` expanded where its rule runs it."""
    cases: dict[str, Command] = {}
    for source in SOURCES:
        for command in fenced_bash_commands(REPO_ROOT / source):
            rule = rule_for(command)
            for case in expanded(command) if rule is not None and rule.expand else [command]:
                if case.text in cases:
                    cases[case.text].sources += [s for s in case.sources if s not in cases[case.text].sources]
                else:
                    cases[case.text] = case
    return list(cases.values())


def short_id(command: Command) -> str:
    text = command.text.replace(".venv/bin/", "")
    for long, short in (("config/paper/", "paper/"), ("workflow/profiles/", ""), ("--configfile", "-c")):
        text = text.replace(long, short)
    return text if len(text) <= 90 else text[:87] + "..."


CASES = readme_cases()


# ---- running a command as written --------------------------------------------------------------------------


def run_as_written(command: Command, cwd: Path, env: dict[str, str], words: list[str] | None = None) -> float:
    """Run ``words`` (default: the command's) in ``cwd``, ``.venv/bin/X`` being this interpreter's X, with the
    command's exported variables on ``env`` and the Hub off; the wall seconds. Fails on a non-zero exit."""
    words = list(words or command.words)
    if words[0].startswith(".venv/bin/"):
        words[0] = str(Path(sys.executable).parent / words[0].removeprefix(".venv/bin/"))
    started = time.monotonic()
    done = subprocess.run(
        words,
        cwd=cwd,
        env=env | command.env | OFFLINE,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    seconds = time.monotonic() - started
    assert done.returncode == 0, f"{command.text}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return seconds


def replaced(words: list[str], flag: str, value: str) -> list[str]:
    """``words`` with ``flag``'s value set to ``value`` (added if absent)."""
    if flag in words:
        at = words.index(flag) + 1
        return words[:at] + [value] + words[at + 1 :]
    return words + [flag, value]


@pytest.fixture(scope="module")
def scratch(tmp_path_factory, smoke_workflow) -> Path:
    """A working folder for the `d3s eval` commands: ``runs/d3s/final`` and
    ``runs/tiny-d3s/final`` linked to the smoke run's final d3s model, ``results/tiny/runs/d3s/seed0`` to its
    run folder (its record too), ``../shared/data`` to the benchmark copies (when present)."""
    root = tmp_path_factory.mktemp("readme")
    work = root / "work"
    final = smoke_workflow / "results" / "smoke" / "runs" / "d3s" / "seed0" / "final"
    assert (final / "config.json").is_file(), final
    for run in ("d3s", "tiny-d3s"):
        (work / "runs" / run).mkdir(parents=True)
        (work / "runs" / run / "final").symlink_to(final)
    # a default run's folder (docs/evaluation.md: the synthetic task a run trained on, from its record)
    (work / "results" / "tiny" / "runs" / "d3s").mkdir(parents=True)
    (work / "results" / "tiny" / "runs" / "d3s" / "seed0").symlink_to(final.parent)
    if SHARED_DATA.is_dir():
        (root / "shared").mkdir()
        (root / "shared" / "data").symlink_to(SHARED_DATA)
    return work


@pytest.fixture
def smoke_command(smoke_workflow, request) -> Callable[[Command], float | None]:
    """The smoke command IS the session's smoke run (conftest.py's smoke_workflow): the same arguments, run
    once for the session; its seconds are those of that run."""

    def run(command: Command) -> float | None:
        assert command.words[0] == ".venv/bin/snakemake" and command.words[1:] == SMOKE_ARGS, command.text
        assert (smoke_workflow / "results" / "smoke" / "report.md").is_file()
        return request.config.stash.get(SMOKE_SECONDS, None)

    return run


@pytest.fixture
def dry_run_command(offline_work) -> Callable[[Command], float]:
    """Commands that only read configs (``snakemake -n``, ``d3s regime -n``, ``d3s plan``) in the session's
    offline copy of the workflow: no data, the Hub off; they write nothing but Snakemake's metadata there."""
    work, env = offline_work
    return lambda command: run_as_written(command, work, env)


@pytest.fixture
def report_command(smoke_workflow, tmp_path) -> Callable[[Command], float]:
    """``snakemake --report report.html`` reports the default's run (results/tiny), which CI does not make;
    it runs here, in a copy of the session's smoke run, with that run's ``--configfile config/smoke.yaml``
    added: the same command for the run that exists."""

    def run(command: Command) -> float:
        work = Path(shutil.copytree(smoke_workflow, tmp_path / "work", symlinks=True))
        words = command.words + SMOKE_ARGS[2:]  # the smoke run's --configfile
        seconds = run_as_written(command, work, dict(os.environ), words)
        assert (work / "report.html").stat().st_size > 10_000
        return seconds

    return run


# examples/tiny.yaml: a 500-step SFT, then 40 steps of D3S. Measured 2026-11-28 on the shared 2-core machine,
# as written: 74 s of wall time and 72 s of CPU (the 40 steps: 8 s), 98-121 s and 114-128 s beside other jobs
# (the 40 steps: 29 s); most of it is imports and the SFT, so --max-steps alone would save little. Each
# command runs with its flags as written plus --max-steps TRAIN_MAX_STEPS, on a scratch copy of
# examples/tiny.yaml whose SFT is shorter (TRAIN_SFT_STEPS): 12-54 s of wall time each, load permitting.
EXAMPLE = "examples/tiny.yaml"
TRAIN_SFT_STEPS = 50
TRAIN_MAX_STEPS = "2"


@pytest.fixture
def train_command(tmp_path) -> Callable[[Command], float]:
    """``d3s train --config examples/tiny.yaml [...]`` in a scratch folder with examples/ copied (its own: the
    eval commands' runs/tiny-d3s/final is the smoke model)."""

    def run(command: Command) -> float:
        work = tmp_path / "work"
        shutil.copytree(REPO_ROOT / "examples", work / "examples")
        config = yaml.safe_load((work / EXAMPLE).read_text())
        config["tiny"]["sft_steps"] = TRAIN_SFT_STEPS  # shorter: see TRAIN_SFT_STEPS
        (work / EXAMPLE).write_text(yaml.safe_dump(config, sort_keys=False))
        words = replaced(command.words, "--max-steps", TRAIN_MAX_STEPS)
        seconds = run_as_written(command, work, dict(os.environ), words)
        output_dir = words[words.index("--output-dir") + 1] if "--output-dir" in words else "runs/tiny-d3s"
        assert (work / output_dir / "final" / "config.json").is_file()
        assert (work / output_dir / "metrics.jsonl").stat().st_size > 0
        return seconds

    return run


# The docs' evaluations on the smoke run's final model: 2 problems per benchmark (--limit 2) and 2 samples
# (--samples 2, --k 1) instead of the paper's 32 on whole benchmarks, 16 new tokens at most (the tiny model
# answers in a few), and a scratch --out under the test's folder where the command writes to /tmp.
EVAL_LIMITS = {"--limit": "2", "--samples": "2", "--k": "1", "--max-tokens": "16"}


@pytest.fixture
def eval_command(scratch, tmp_path) -> Callable[[Command], float]:
    def run(command: Command) -> float:
        if not (SHARED_DATA / "aime24" / "test.jsonl").is_file():
            pytest.skip(f"{command.text}: the benchmark copies are not at {SHARED_DATA}")
        words = list(command.words)
        for flag, value in EVAL_LIMITS.items():
            words = replaced(words, flag, value)  # smaller: see EVAL_LIMITS
        out = words[words.index("--out") + 1]
        if Path(out).is_absolute():
            words = replaced(words, "--out", str(tmp_path / "out"))  # scratch, not /tmp
        env = dict(os.environ) | {"D3S_DATA_DIR": str(SHARED_DATA)}  # docs/evaluation.md's data root
        seconds = run_as_written(command, scratch, env, words)
        written = Path(words[words.index("--out") + 1])
        assert list((written if written.is_absolute() else scratch / written).rglob("summary.json"))
        return seconds

    return run


def param(command: Command) -> object:
    rule = rule_for(command)
    slow = rule is not None and rule.runner is not None and rule.slow
    return pytest.param(command, id=short_id(command), marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("command", [param(c) for c in CASES])
def test_readme_command(command: Command, request, record_property) -> None:
    rule = rule_for(command)
    where = ", ".join(command.sources)
    if rule is None:
        record_property("readme_command", (command.text, where, "FAILED: no rule", None))
        pytest.fail(f"{command.text} ({where}): no rule in tests/test_readme_commands.py's RULES; add one")
    if rule.runner is None:
        record_property("readme_command", (command.text, where, f"skipped: {rule.reason}", None))
        pytest.skip(f"{command.text}: {rule.reason}")
    seconds = request.getfixturevalue(rule.runner)(command)
    record_property("readme_command", (command.text, where, f"ran {rule.changes}".strip(), seconds))


def test_every_source_has_commands() -> None:
    """The parser finds the blocks: a renamed fence or a moved file would otherwise test nothing."""
    for source in SOURCES:
        assert fenced_bash_commands(REPO_ROOT / source), source
    assert any(rule_for(c) and rule_for(c).runner for c in CASES)


def test_every_page_with_bash_is_a_source() -> None:
    """A docs page with a fenced bash block is in SOURCES: a page split off another keeps its commands."""
    pages = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").rglob("*.md"))]
    with_bash = {p.relative_to(REPO_ROOT).as_posix() for p in pages if fenced_bash_commands(p)}
    assert with_bash == set(SOURCES)


def test_the_parser_joins_lines_drops_comments_and_keeps_exports(tmp_path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "```bash\nexport A=1 B='two words'\n# a comment\n.venv/bin/d3s eval --model m \\\n"
        "    --out o   # trailing\n\n```\n\n```python\nprint(1)\n```\n```bash\n.venv/bin/x\n```\n"
    )
    first, second = fenced_bash_commands(page)
    assert first.words == [".venv/bin/d3s", "eval", "--model", "m", "--out", "o"]
    assert first.env == {"A": "1", "B": "two words"} and first.sources == ["page.md"]
    assert second.words == [".venv/bin/x"] and second.env == {}  # exports end with their block
    assert rule_for(second) is None  # a command no rule knows: its case fails
