"""d3s.startup: what workflow processes skip at start-up, and why no result can depend on it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO_ROOT


def _formats(schema) -> set[str]:
    """Every value of a JSON-schema "format" keyword in ``schema`` (a property *named* format is not one)."""
    found: set[str] = set()
    if isinstance(schema, dict):
        if isinstance(schema.get("format"), str):
            found.add(schema["format"])
        for key, value in schema.items():
            if key == "properties" and isinstance(value, dict):
                for sub in value.values():
                    found |= _formats(sub)
            elif key != "format":
                found |= _formats(value)
    elif isinstance(schema, list):
        for item in schema:
            found |= _formats(item)
    return found


def test_no_schema_a_workflow_process_validates_against_uses_an_iri_format():
    import nbformat

    workflow = yaml.safe_load((REPO_ROOT / "config" / "schema.yaml").read_text())
    notebook_schemas = sorted((Path(nbformat.__file__).parent / "v4").glob("*.schema.json"))
    assert notebook_schemas
    used = _formats(workflow).union(*(_formats(json.loads(p.read_text())) for p in notebook_schemas))
    assert not {name for name in used if name.startswith("iri")}, used


def _fresh(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_validating_the_workflow_config_leaves_the_iri_checker_out_and_still_refuses_a_bad_config():
    out = _fresh(
        "import sys, yaml\n"
        "from d3s.orchestration.workflow_config import validate_config\n"
        "config = yaml.safe_load(open('config/smoke.yaml'))\n"
        "validate_config(config, 'config/schema.yaml')\n"
        "config['seeds'] = 'zero'\n"
        "try:\n"
        "    validate_config(config, 'config/schema.yaml')\n"
        "except ValueError as exc:\n"
        "    print('refused:', exc)\n"
        "print(sys.modules['rfc3987_syntax'])\n"
    )
    assert "refused: config seeds:" in out and out.strip().endswith("None")


def test_the_checker_is_the_only_format_check_given_up():
    """With the module hidden, jsonschema checks every format it checked before but the two "iri" ones."""
    code = "import sys\n{skip}import jsonschema\nprint(sorted(jsonschema.FormatChecker().checkers))\n"
    skip = "from d3s.startup import skip_iri_format_checks\nskip_iri_format_checks()\n"
    with_it = set(eval(_fresh(code.format(skip=""))))
    without = set(eval(_fresh(code.format(skip=skip))))
    assert with_it - without == {"iri", "iri-reference"} and without <= with_it


def test_the_notebook_runner_is_papermills_command_line():
    done = subprocess.run(
        [sys.executable, "-m", "d3s.analysis.run_notebook", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "Usage:" in done.stdout and "--kernel" in done.stdout


def _probe_notebook(folder: Path) -> None:
    import nbformat

    probe = nbformat.v4.new_notebook()
    probe.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    probe.cells = [
        nbformat.v4.new_code_cell("answer = 0", metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell(
            "from ipykernel.connect import get_connection_info\n"
            "info = get_connection_info(unpack=True)\n"
            "print(info['transport'], info['ip'], answer)"
        ),
    ]
    nbformat.write(probe, folder / "probe.ipynb")


@pytest.mark.parametrize("temp_root", ["short", "too_deep"])
def test_the_notebook_runners_kernel_uses_unix_sockets_in_a_folder_of_its_own(tmp_path, temp_root):
    """No TCP port to race for (d3s.analysis.run_notebook): the kernel reports the ipc transport, its
    sockets under a fresh d3s-kernel- folder in TMPDIR (or in /tmp when TMPDIR is too deep for a socket's
    path), which is gone after the run; papermill's parameters apply."""
    import nbformat

    _probe_notebook(tmp_path)
    temp = Path(tempfile.mkdtemp(dir="/tmp")) if temp_root == "short" else tmp_path / ("deep" * 20)
    temp.mkdir(exist_ok=True)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "d3s.analysis.run_notebook", "probe.ipynb", "out.ipynb"]
            + ["-k", "python3", "--no-progress-bar", "-p", "answer", "42"],
            cwd=tmp_path,
            env=os.environ | {"TMPDIR": str(temp)},
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        if temp_root == "short":
            shutil.rmtree(temp)
    assert done.returncode == 0, done.stderr[-3000:]
    out = nbformat.read(tmp_path / "out.ipynb", as_version=4)
    transport, prefix, answer = out.cells[-1].outputs[0]["text"].split()
    assert transport == "ipc" and answer == "42"
    folder = Path(prefix).parent
    assert Path(prefix).name == "kernel" and folder.name.startswith("d3s-kernel-") and not folder.exists()
    assert folder.parent == (temp if temp_root == "short" else Path("/tmp"))
    assert "without encryption" not in done.stderr  # ipykernel's warning for a TCP kernel


def test_a_socket_path_too_long_for_a_unix_socket_is_not_used():
    from d3s.analysis.run_notebook import kernel_socket_prefix

    assert kernel_socket_prefix("/tmp/d3s-kernel-x") == "/tmp/d3s-kernel-x/kernel"
    assert kernel_socket_prefix("/" + "deep/" * 30) is None


def test_the_parse_time_check_of_a_paper_config_imports_no_torch():
    """Every `snakemake` start (and, on a cluster, every job's) runs check_workflow_config; a GPU config's
    memory plan asks the registry for keep counts, which must not pull torch in (3 s a start here)."""
    out = _fresh(
        "import sys, yaml\n"
        "from d3s.orchestration.workflow_config import check_workflow_config\n"
        "config = yaml.safe_load(open('config/paper/qwen2.5-math-7b.yaml'))\n"
        "check_workflow_config(config, 'workflow/accelerate', 'config/schema.yaml')\n"
        "from d3s.methods import METHODS\n"
        "print(METHODS['d3s'].keep_per_prompt(8), sorted({'torch', 'rfc3987_syntax'} & set(sys.modules)))\n"
        "print(sys.modules['rfc3987_syntax'])\n"
    )
    assert out.split("\n")[:2] == ["(2, 8) ['rfc3987_syntax']", "None"], out
