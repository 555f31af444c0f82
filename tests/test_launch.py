"""d3s.orchestration: the accelerate command, launch settings, the vLLM server lifecycle and GPU assignment.

The vLLM server is played by a tiny HTTP server script answering /health; "python" for the training job
by a script that records how it was called. No GPU is used; the last test runs the workflow's train job
under `accelerate launch` on two CPU processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from helpers import ACCELERATE_DIR, REPO_ROOT, SCHEMA

from d3s.launch import TrainLaunch, VllmServerSettings, job_gpus
from d3s.orchestration.commands import (
    CPU_OVERRIDES,
    TRL_CLI,
    accelerate_command,
    vllm_serve_command,
)
from d3s.orchestration.gpu_slots import GpuSlots, assign_gpus, visible_gpu_ids
from d3s.orchestration.processes import start_process_group, stop_process_group
from d3s.orchestration.run_config import (
    batch_settings,
    build_run_config,
    prepare_training_job,
    train_launch,
)
from d3s.orchestration.training_job import run_training_job
from d3s.orchestration.vllm_server import vllm_server
from d3s.orchestration.workflow_config import check_workflow_config
from d3s.ports import free_port

PY = sys.executable

FAKE_SERVER = textwrap.dedent(
    """
    # Stands in for `trl vllm-serve`: answers GET /health with 200 after --delay seconds.
    import argparse, http.server, os, signal, subprocess, sys, time

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--pid-file", required=True)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--ignore-term", action="store_true")
    parser.add_argument("--exit-code", type=int)
    parser.add_argument("--child-pid-file")
    args, _ = parser.parse_known_args()
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # inherited by the child below
    if args.child_pid_file:  # a worker in the server's process group, like vLLM's
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open(args.child_pid_file, "w").write(str(child.pid))
    open(args.pid_file, "w").write(str(os.getpid()))
    print("fake server starting on GPUs", os.environ.get("CUDA_VISIBLE_DEVICES"), flush=True)
    if args.exit_code is not None:
        print("failing on purpose", flush=True)
        sys.exit(args.exit_code)
    time.sleep(args.delay)

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", args.port), Health)
    print("fake server listening", flush=True)
    server.serve_forever()
    """
)


@pytest.fixture
def fake_server(tmp_path):
    path = tmp_path / "fake_server.py"
    path.write_text(FAKE_SERVER)

    def command(port: int, *extra: str) -> list[str]:
        return [PY, str(path), "--port", str(port), "--pid-file", str(tmp_path / "server.pid"), *extra]

    return command


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def _gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def _get(url: str) -> int:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=5) as response:
        return response.status


def _wait_for_file(path: Path, within_s: float = 60.0) -> str:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if path.is_file() and path.read_text():
            return path.read_text()
        time.sleep(0.05)
    raise AssertionError(f"{path} never appeared")


# ---- commands and settings ----------------------------------------------------------------------------


def test_accelerate_command_follows_its_config_file():
    options = {"config_file": "ddp.yaml", "main_process_port": 29555, "threads_per_process": 2}
    command = accelerate_command(["worker.py", "a"], num_processes=2, **options)
    assert command == [
        PY, "-m", "accelerate.commands.launch", "--config_file", "ddp.yaml", "--num_processes", "2",
        "--num_machines", "1", "--main_process_port", "29555", "--num_cpu_threads_per_process", "2",
        "worker.py", "a",
    ]  # fmt: skip
    module = accelerate_command(["d3s.cli", "train"], num_processes=1, module=True, **options)
    assert module[-3:] == ["--module", "d3s.cli", "train"]
    with pytest.raises(ValueError, match="num_processes"):
        accelerate_command(["worker.py"], num_processes=0, **options)


def test_accelerate_configs_are_valid_accelerate_files():
    from accelerate.commands.config.config_args import load_config_from_file

    kinds = {}
    for name in ("ddp", "single_gpu", "zero2", "zero3"):
        config = load_config_from_file(str(ACCELERATE_DIR / f"{name}.yaml"))
        kinds[name] = (config.distributed_type.value, config.deepspeed_config.get("zero_stage"))
        assert config.mixed_precision == "bf16" and config.num_machines == 1
    assert kinds == {
        "ddp": ("MULTI_GPU", None),
        "single_gpu": ("NO", None),
        "zero2": ("DEEPSPEED", 2),
        "zero3": ("DEEPSPEED", 3),
    }
    zero3 = yaml.safe_load((ACCELERATE_DIR / "zero3.yaml").read_text())["deepspeed_config"]
    assert zero3["zero3_init_flag"] and zero3["zero3_save_16bit_model"]  # checkpoints vLLM can read


def _train_cfg(**changes):
    cfg = {
        "trainer": {"max_steps": 4, "per_device_train_batch_size": 32, "num_generations": 32},
        "resources": {"gpu": 8},
    }
    for key, value in changes.items():
        if key == "trainer":
            cfg["trainer"] = cfg["trainer"] | value
        else:
            cfg[key] = value
    return cfg


def test_train_launch_picks_the_accelerate_config_and_splits_gpus():
    launch = train_launch(_train_cfg(launch={"accelerate_config": "zero3"}), ACCELERATE_DIR)
    assert (launch.job_gpus, launch.train_gpus, launch.server) == (8, 8, None)
    assert launch.accelerate_config == ACCELERATE_DIR / "zero3.yaml"
    # one training GPU: DDP of one process is plain single-GPU training
    one = train_launch(_train_cfg(resources={"gpu": 1}), ACCELERATE_DIR)
    assert one.accelerate_config.name == "single_gpu.yaml"
    server = {"use_vllm": True, "vllm_mode": "server", "vllm_max_model_length": 4096}
    split = train_launch(
        _train_cfg(trainer=server, launch={"vllm_server": {"tensor_parallel_size": 2}}), ACCELERATE_DIR
    )
    assert (split.train_gpus, split.server.gpus, split.server.max_model_len) == (6, 2, 4096)
    own_file = ACCELERATE_DIR / "zero2.yaml"
    assert (
        train_launch(
            _train_cfg(launch={"accelerate_config": str(own_file)}), ACCELERATE_DIR
        ).accelerate_config
        == own_file
    )
    # a server the user runs (vllm_server_base_url): the workflow starts none and trains on every GPU
    external = train_launch(
        _train_cfg(trainer=server | {"vllm_server_base_url": "http://node:8000"}), ACCELERATE_DIR
    )
    assert (external.server, external.train_gpus) == (None, 8)


def _workflow_config(**train_changes):
    """config/smoke.yaml with _train_cfg(**train_changes) as its train section, as the workflow reads it."""
    cfg = yaml.safe_load((REPO_ROOT / "config" / "smoke.yaml").read_text())
    return cfg | {"train": _train_cfg(**train_changes)}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"launch": {"accelerate_config": "zero4"}},
            r"^config train\.launch\.accelerate_config: 'zero4': expected ddp, zero2, zero3",
        ),
        ({"resources": {"gpus": 2}}, r"^config train\.resources\.gpus: .*rename gpus to gpu"),
        ({"resources": {"gpu": "two"}}, r"^config train\.resources\.gpu: 'two' is not of type 'integer'"),
        ({"resources": {"gpu": -1}}, r"^config train\.resources\.gpu: -1 is less than the minimum of 0"),
        (
            {"resources": {"gpu": 1}, "trainer": {"use_vllm": True, "vllm_mode": "server"}},
            r"train\.resources\.gpu = 1, .*raise train\.resources\.gpu to 2 or more, "
            r"or use trainer\.vllm_mode: colocate",
        ),
        ({"launch": {"vllm_server": {}}}, r"train\.launch\.vllm_server is set but .*vllm_mode: server"),
        (
            {"trainer": {"use_vllm": True, "vllm_mode": "server", "vllm_server_port": 8000}},
            r"trainer\.vllm_server_port is set, but the workflow starts the vLLM server",
        ),
        (
            {
                "resources": {},
                "trainer": {"use_vllm": True, "vllm_mode": "server", "vllm_server_base_url": "u"},
            },
            r"trainer\.vllm_mode: server with train\.resources\.gpu 0: .* through NCCL, which needs CUDA",
        ),
        (
            {"trainer": {"use_vllm": True, "vllm_mode": "server"}, "launch": {"vllm_server": {"tp": 2}}},
            r"^config train\.launch\.vllm_server: unknown key\(s\) \['tp'\]; valid: tensor_parallel_size",
        ),
        (
            {
                "trainer": {"use_vllm": True, "vllm_mode": "server"},
                "launch": {"vllm_server": {"data_parallel_size": 0}},
            },
            r"^config train\.launch\.vllm_server\.data_parallel_size: 0 is less than the minimum of 1",
        ),
        ({"launch": {"accelerate": "ddp"}}, r"^config train\.launch: unknown key\(s\) \['accelerate'\]"),
    ],
)
def test_bad_launch_settings_name_the_field_and_the_fix(changes, message):
    """The schema's refusals and train_launch's (relations between keys), as the workflow's parse makes
    them."""
    with pytest.raises(ValueError, match=message) as error:
        check_workflow_config(_workflow_config(**changes), ACCELERATE_DIR, SCHEMA)
    assert str(error.value).startswith("config ") and "\n" not in str(error.value)


def test_colocated_vllm_without_gpus_needs_vllms_cpu_build(monkeypatch):
    """A CPU job generates with vLLM's CPU build in colocate mode (d3s/vllm_engine.py); refused without it."""
    import d3s.orchestration.run_config as run_config

    colocate = _workflow_config(resources={}, trainer={"use_vllm": True, "vllm_mode": "colocate"})
    monkeypatch.setattr(run_config, "cpu_vllm_installed", lambda: True)
    check_workflow_config(colocate, ACCELERATE_DIR, SCHEMA)
    monkeypatch.setattr(run_config, "cpu_vllm_installed", lambda: False)
    with pytest.raises(ValueError, match=r"train\.resources\.gpu is 0 and vLLM's CPU build is not installed"):
        check_workflow_config(colocate, ACCELERATE_DIR, SCHEMA)


def test_job_gpus_reads_the_declared_count():
    assert job_gpus(None) == 0 and job_gpus({"gpu": 2}) == 2 and job_gpus({"cpus_per_gpu": 4}) == 0


def test_prompts_per_step_fixes_the_batch_whatever_the_gpu_count():
    trainer = {"num_generations": 32, "per_device_train_batch_size": 32}
    for processes, accumulation in [(8, 4), (4, 8), (1, 32)]:
        settings = batch_settings(trainer, 32, processes)
        assert settings["gradient_accumulation_steps"] == accumulation
        assert settings["per_device_train_batch_size"] * processes * accumulation == 32 * 32
    assert batch_settings(trainer, None, 8) == trainer  # without prompts_per_step: unchanged
    with pytest.raises(
        ValueError, match=r"not a multiple of per_device_train_batch_size x training processes = 32 x 3"
    ):
        batch_settings(trainer, 32, 3)
    with pytest.raises(ValueError, match=r"remove trainer\.gradient_accumulation_steps"):
        batch_settings(trainer | {"gradient_accumulation_steps": 2}, 32, 8)


def test_check_workflow_config_uses_the_training_gpus():
    check_workflow_config(_workflow_config(prompts_per_step=32, resources={"gpu": 8}), ACCELERATE_DIR, SCHEMA)
    config = _workflow_config(
        prompts_per_step=32,
        resources={"gpu": 4},
        trainer={"use_vllm": True, "vllm_mode": "server"},  # 3 training GPUs: 1,024 rollouts do not split
    )
    with pytest.raises(ValueError, match=r"^config train\.prompts_per_step .* 32 x 3"):
        check_workflow_config(config, ACCELERATE_DIR, SCHEMA)


def test_vllm_serve_command_uses_trl_flags():
    settings = VllmServerSettings(
        tensor_parallel_size=2,
        gpu_memory_utilization=0.85,
        max_model_len=4096,
        enable_prefix_caching=True,
        extra_args=("--enforce_eager",),
    )
    command = vllm_serve_command("Qwen/Qwen2.5-Math-7B", host="127.0.0.1", port=8123, settings=settings)
    assert command[:4] == [PY, "-c", TRL_CLI, "vllm-serve"]
    flags = command[4:]
    assert flags == [
        "--model", "Qwen/Qwen2.5-Math-7B", "--host", "127.0.0.1", "--port", "8123",
        "--tensor_parallel_size", "2", "--data_parallel_size", "1", "--gpu_memory_utilization", "0.85",
        "--max_model_len", "4096", "--enable_prefix_caching", "true", "--enforce_eager",
    ]  # fmt: skip
    # every flag is one TRL 1.16's `trl vllm-serve` parses (its parser, without vLLM)
    from trl.scripts.vllm_serve import make_parser

    parsed, extra = make_parser().parse_args_and_config(flags, return_remaining_strings=True)
    assert (parsed.model, parsed.port, parsed.tensor_parallel_size, parsed.max_model_len) == (
        "Qwen/Qwen2.5-Math-7B",
        8123,
        2,
        4096,
    )
    assert parsed.enable_prefix_caching is True and parsed.enforce_eager is True and extra == []


def test_trainer_config_fields_the_workflow_sets_exist_in_grpo_config():
    import dataclasses

    from trl import GRPOConfig

    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    assert {
        "vllm_server_host",
        "vllm_server_port",
        "vllm_group_port",
        "vllm_mode",
        "vllm_server_base_url",
    } <= fields


# ---- the train rule's command -------------------------------------------------------------------------


def _smoke_train_cfg(**resources):
    cfg = yaml.safe_load((REPO_ROOT / "config" / "smoke.yaml").read_text())
    return cfg["train"] | {"resources": resources}, cfg["task"]


def test_train_rule_with_two_gpus_builds_the_accelerate_command(tmp_path):
    train_cfg, task = _smoke_train_cfg(gpu=2)
    launch = train_launch(train_cfg, ACCELERATE_DIR)
    run = build_run_config(
        method="d3s", seed=0, model="results/smoke/base_model", train_cfg=train_cfg, task=task,
        output_dir="results/smoke/runs/d3s/seed0", threads=4, processes=launch.train_gpus,
    )  # fmt: skip
    config_path = tmp_path / "train.yaml"
    command, config, server = prepare_training_job(
        run, config_path, launch=launch, gpu_ids=["0", "1"], threads=4, cpu=False, python="/venv/bin/python"
    )
    port = command[command.index("--main_process_port") + 1]
    assert command == [
        "/venv/bin/python", "-m", "accelerate.commands.launch",
        "--config_file", str(ACCELERATE_DIR / "ddp.yaml"),
        "--num_processes", "2", "--num_machines", "1", "--main_process_port", port,
        "--num_cpu_threads_per_process", "2",
        "--module", "d3s.cli", "train", "--config", str(config_path),
    ]  # fmt: skip
    assert server is None and config["threads"] == 2 and config["trainer"] == run["trainer"]
    # a job without a GPU runs the same config file on the CPU: fp32, the DeepSpeed launcher kept
    on_cpu, _, _ = prepare_training_job(
        run, config_path, launch=launch, gpu_ids=["0", "1"], threads=4, cpu=True
    )
    assert on_cpu[5:7] == list(CPU_OVERRIDES) == ["--mixed_precision", "no"] and "--cpu" not in on_cpu
    with pytest.raises(ValueError, match="declares 2 GPU"):
        prepare_training_job(run, config_path, launch=launch, gpu_ids=["0"], threads=4)


def test_paper_config_on_eight_gpus_in_server_mode(tmp_path):
    cfg = yaml.safe_load((REPO_ROOT / "config" / "paper" / "qwen2.5-math-7b.yaml").read_text())
    train_cfg = dict(cfg["train"])
    train_cfg["trainer"] = train_cfg["trainer"] | {"vllm_mode": "server"}
    train_cfg["launch"] = {"accelerate_config": "zero3", "vllm_server": {"tensor_parallel_size": 1}}
    launch = train_launch(train_cfg, ACCELERATE_DIR)
    assert launch.train_gpus == 7
    with pytest.raises(ValueError, match=r"32 x 7"):  # 1,024 rollouts do not split over 7 training GPUs
        build_run_config(
            method="d3s",
            seed=0,
            model="m",
            train_cfg=train_cfg,
            task={},
            output_dir="o",
            threads=64,
            processes=7,
        )
    train_cfg["prompts_per_step"] = 28  # 28 x 32 = 896 = 32 x 7 x 4
    run = build_run_config(
        method="d3s", seed=0, model="Qwen/Qwen2.5-Math-7B", train_cfg=train_cfg, task={}, output_dir="o",
        threads=64, processes=7,
    )  # fmt: skip
    command, config, server = prepare_training_job(
        run, tmp_path / "train.yaml", launch=launch, gpu_ids=[str(i) for i in range(8)], threads=64
    )
    assert command[command.index("--config_file") + 1] == str(ACCELERATE_DIR / "zero3.yaml")
    assert command[command.index("--num_processes") + 1] == "7" and config["threads"] == 9
    trainer = config["trainer"]
    assert trainer["gradient_accumulation_steps"] == 4
    assert (
        trainer["vllm_server_host"] == "127.0.0.1"
        and trainer["vllm_server_port"] != trainer["vllm_group_port"]
    )
    assert server[server.index("--port") + 1] == str(trainer["vllm_server_port"])
    assert server[server.index("--max_model_len") + 1] == "4096"  # from trainer.vllm_max_model_length


# ---- processes ----------------------------------------------------------------------------------------


def test_stop_process_group_kills_the_whole_group(tmp_path, fake_server):
    process = start_process_group(
        fake_server(free_port(), "--child-pid-file", str(tmp_path / "child.pid")), log_path=tmp_path / "log"
    )
    child = int(_wait_for_file(tmp_path / "child.pid"))
    assert stop_process_group(process, grace_s=10) == -signal.SIGTERM
    assert _gone(process.pid) and _gone(child)
    assert stop_process_group(process) == -signal.SIGTERM  # a second stop is harmless


def test_server_is_started_waited_for_and_stopped(tmp_path, fake_server):
    port = free_port()
    server = vllm_server(
        fake_server(port, "--delay", "1.0", "--child-pid-file", str(tmp_path / "child.pid")),
        host="127.0.0.1",
        port=port,
        gpu_ids=["3"],
        log_path=tmp_path / "server.log",
        startup_timeout_s=60,
    )
    with (
        server as url
    ):  # the server listens only after its 1 s delay: entering waited for /health, not the process
        assert "fake server listening" in (tmp_path / "server.log").read_text()
        assert url == f"http://127.0.0.1:{port}/health" and _get(url) == 200
        pid = int((tmp_path / "server.pid").read_text())
        child = int((tmp_path / "child.pid").read_text())
        assert _alive(pid) and _alive(child)
    assert _gone(pid) and _gone(child)
    assert "fake server starting on GPUs 3" in (tmp_path / "server.log").read_text()


def test_server_is_stopped_when_the_job_raises(tmp_path, fake_server):
    port = free_port()
    with (
        pytest.raises(RuntimeError, match="training failed"),
        vllm_server(fake_server(port), host="127.0.0.1", port=port, log_path=tmp_path / "log"),
    ):
        pid = int((tmp_path / "server.pid").read_text())
        raise RuntimeError("training failed")
    assert _gone(pid)


def test_server_ignoring_sigterm_is_killed(tmp_path, fake_server):
    port = free_port()
    command = fake_server(port, "--ignore-term", "--child-pid-file", str(tmp_path / "child.pid"))
    with vllm_server(command, host="127.0.0.1", port=port, log_path=tmp_path / "log", stop_grace_s=1.0):
        pid = int((tmp_path / "server.pid").read_text())
        child = int((tmp_path / "child.pid").read_text())
    assert _gone(pid) and _gone(child)


def test_server_that_never_answers_times_out_and_is_stopped(tmp_path, fake_server):
    port = free_port()
    server = vllm_server(
        fake_server(port, "--delay", "60"),
        host="127.0.0.1",
        port=port,
        log_path=tmp_path / "log",
        startup_timeout_s=1.5,
    )
    with (
        pytest.raises(
            TimeoutError,
            match=r"did not answer http://127\.0\.0\.1:\d+/health within 1\.5 s .*startup_timeout_s",
        ),
        server,
    ):
        pytest.fail("the block ran without a server")
    assert _gone(int((tmp_path / "server.pid").read_text()))


def test_server_that_exits_early_is_reported_with_its_log(tmp_path, fake_server):
    port = free_port()
    server = vllm_server(
        fake_server(port, "--exit-code", "3"), host="127.0.0.1", port=port, log_path=tmp_path / "log"
    )
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 3 .*failing on purpose"), server:
        pytest.fail("the block ran without a server")


JOB = textwrap.dedent(
    """
    # A workflow job holding a vLLM server, as train_run.py does.
    import sys, time
    from d3s.orchestration.processes import signals_raise_system_exit
    from d3s.orchestration.vllm_server import vllm_server

    command, port, ready = sys.argv[1].split(), int(sys.argv[2]), sys.argv[3]
    with (
        signals_raise_system_exit(),
        vllm_server(command, host="127.0.0.1", port=port, log_path=ready + ".log"),
    ):
        open(ready, "w").write("ready")
        time.sleep(600)
    """
)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_server_dies_with_a_cancelled_job(tmp_path, fake_server, signum):
    """Snakemake/Slurm stop a job with SIGTERM (the finally path) or SIGKILL (the parent-death signal)."""
    if signum == signal.SIGKILL and not sys.platform.startswith("linux"):
        pytest.skip("the parent-death signal is Linux only")
    port = free_port()
    job_script = tmp_path / "job.py"
    job_script.write_text(JOB)
    ready = tmp_path / "ready"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    job = subprocess.Popen([PY, str(job_script), " ".join(fake_server(port)), str(port), str(ready)], env=env)
    try:
        _wait_for_file(ready)
        server_pid = int((tmp_path / "server.pid").read_text())
        assert _alive(server_pid)
        job.send_signal(signum)
        assert job.wait(timeout=60) == (128 + signum if signum == signal.SIGTERM else -signum)
        assert _gone(server_pid)
    finally:
        job.kill()


FAKE_PYTHON = textwrap.dedent(
    """
    #!{python}
    # "python" of a training job: `-c <trl cli> vllm-serve ...` runs the fake server, anything else is
    # `-m accelerate.commands.launch ...`, which checks the server answers and records how it was called.
    import json, os, subprocess, sys, urllib.request, yaml

    args = sys.argv[1:]
    if args[0] == "-c" and args[2] == "vllm-serve":
        port = args[args.index("--port") + 1]
        record = {{"argv": args, "gpus": os.environ["CUDA_VISIBLE_DEVICES"]}}
        open("{out}/server.json", "w").write(json.dumps(record))
        os.execv(
            sys.executable, [sys.executable, "{server}", "--port", port, "--pid-file", "{out}/server.pid"]
        )
    config = yaml.safe_load(open(args[args.index("--config") + 1]))
    url = f"http://127.0.0.1:{{config['trainer']['vllm_server_port']}}/health"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({{}}))
    status = opener.open(url, timeout=5).status
    record = {{"argv": args, "gpus": os.environ["CUDA_VISIBLE_DEVICES"], "health": status, "config": config,
              "no_proxy": os.environ["NO_PROXY"]}}
    open("{out}/train.json", "w").write(json.dumps(record))
    sys.exit(int(os.environ.get("FAKE_TRAIN_EXIT", "0")))
    """
).lstrip()


@pytest.mark.parametrize("exit_code", [0, 1])
def test_training_job_in_server_mode(tmp_path, monkeypatch, exit_code):
    server_script = tmp_path / "fake_server.py"
    server_script.write_text(FAKE_SERVER)
    fake_python = tmp_path / "python"
    fake_python.write_text(FAKE_PYTHON.format(python=PY, out=tmp_path, server=server_script))
    fake_python.chmod(0o755)
    monkeypatch.setenv("FAKE_TRAIN_EXIT", str(exit_code))
    launch = TrainLaunch(3, ACCELERATE_DIR / "ddp.yaml", VllmServerSettings(startup_timeout_s=60))
    run = {"model": "some/model", "trainer": {"use_vllm": True, "vllm_mode": "server"}}
    job = dict(
        launch=launch,
        gpu_ids=["4", "5", "6"],
        threads=8,
        log_path=tmp_path / "train.log",
        python=str(fake_python),
    )
    if exit_code:
        with pytest.raises(RuntimeError, match=r"training exited with code 1; see .*train\.log"):
            run_training_job(run, tmp_path / "train.yaml", **job)
    else:
        run_training_job(run, tmp_path / "train.yaml", **job)
    served = json.loads((tmp_path / "server.json").read_text())
    trained = json.loads((tmp_path / "train.json").read_text())
    assert served["gpus"] == "6" and trained["gpus"] == "4,5"  # the last GPU serves, the others train
    assert served["argv"][served["argv"].index("--model") + 1] == "some/model"
    assert trained["health"] == 200  # the server answered before training started
    assert (
        trained["config"]["threads"] == 4
        and trained["argv"][trained["argv"].index("--num_processes") + 1] == "2"
    )
    assert trained["config"] == yaml.safe_load((tmp_path / "train.yaml").read_text())
    assert "127.0.0.1" in trained["no_proxy"].split(",")
    assert _gone(int((tmp_path / "server.pid").read_text()))  # stopped, whether training passed or failed


# ---- GPU assignment -----------------------------------------------------------------------------------


def test_visible_gpu_ids_follow_cuda_visible_devices():
    assert visible_gpu_ids({"CUDA_VISIBLE_DEVICES": "0, 2"}) == ["0", "2"]
    assert visible_gpu_ids({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert visible_gpu_ids({"CUDA_VISIBLE_DEVICES": "-1"}) == []


def test_leases_never_share_a_gpu(tmp_path):
    slots = GpuSlots(["0", "1"], tmp_path)
    first, second = slots.try_acquire(1), slots.try_acquire(1)
    assert (first.ids, second.ids) == (["0"], ["1"])
    assert slots.try_acquire(1) is None and slots.try_acquire(2) is None
    first.release()
    assert slots.try_acquire(1).ids == ["0"]
    with pytest.raises(ValueError, match=r"needs 3 GPU\(s\) but only 2 are visible"):
        slots.try_acquire(3)
    with pytest.raises(TimeoutError, match="no 2 free GPU"):
        slots.acquire(2, timeout_s=0.2, poll_s=0.05)


def test_assign_gpus_locally_and_under_slurm(tmp_path):
    env = {"CUDA_VISIBLE_DEVICES": "0,1"}
    with (
        assign_gpus(1, lock_dir=tmp_path, env=env) as first,
        assign_gpus(1, lock_dir=tmp_path, env=env) as second,
    ):
        assert (first, second) == (["0"], ["1"])
    with assign_gpus(0, lock_dir=tmp_path, env=env) as none:
        assert none == []
    slurm = {"SLURM_JOB_ID": "42", "CUDA_VISIBLE_DEVICES": "2,3"}
    with assign_gpus(2, lock_dir=tmp_path / "unused", env=slurm) as ids:
        assert ids == ["2", "3"]  # the allocation is the job's own: no locks
    assert not (tmp_path / "unused").exists()
    with pytest.raises(ValueError, match="allocation shows 2"), assign_gpus(4, env=slurm):
        pass


HOLDER = textwrap.dedent(
    """
    import json, sys, time
    from d3s.orchestration.gpu_slots import GpuSlots

    lock_dir, count, hold, out = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    with GpuSlots(["0", "1", "2", "3"], lock_dir).acquire(count, poll_s=0.02) as lease:
        start = time.monotonic()
        time.sleep(hold)
        end = time.monotonic()
    with open(out, "a") as fh:
        fh.write(json.dumps({"ids": lease.ids, "start": start, "end": end}) + "\\n")
    """
)


def test_concurrent_jobs_get_disjoint_gpus(tmp_path):
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    out = tmp_path / "leases.jsonl"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    jobs = [
        subprocess.Popen([PY, str(script), str(tmp_path / "locks"), "2", "0.3", str(out)], env=env)
        for _ in range(6)
    ]
    assert [job.wait(timeout=120) for job in jobs] == [0] * 6
    leases = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(leases) == 6
    for i, a in enumerate(leases):
        assert len(set(a["ids"])) == 2
        for b in leases[i + 1 :]:
            if a["start"] < b["end"] and b["start"] < a["end"]:  # held at the same time
                assert not set(a["ids"]) & set(b["ids"]), (a, b)


def test_gpus_are_released_when_the_holder_is_killed(tmp_path):
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    holder = subprocess.Popen([PY, str(script), str(tmp_path), "4", "600", str(tmp_path / "out")], env=env)
    slots = GpuSlots(["0", "1", "2", "3"], tmp_path)
    try:
        deadline = time.monotonic() + 60
        while (lease := slots.try_acquire(1)) is not None:  # until the holder has all four
            lease.release()
            assert time.monotonic() < deadline, "the holder never took the GPUs"
            time.sleep(0.05)
        holder.kill()  # SIGKILL: no finally, no atexit
        holder.wait(timeout=30)
        lease = slots.try_acquire(4)
        assert lease is not None and lease.ids == ["0", "1", "2", "3"]
        lease.release()
    finally:
        holder.kill()


# ---- the workflow's train job on two CPU processes ------------------------------------------------------
