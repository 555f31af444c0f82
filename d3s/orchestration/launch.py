"""Launching workflow jobs on GPUs: the accelerate command, GPU assignment, and the vLLM server.

The workflow's train and evaluate jobs use this module; it is importable and tested without GPUs.

- ``accelerate_command``: ``accelerate launch`` for ``d3s train``, one process per training GPU, with a
  config from ``workflow/accelerate/`` (DDP, DeepSpeed ZeRO-2, ZeRO-3).
- ``assign_gpus``: Snakemake never sets CUDA_VISIBLE_DEVICES for local jobs, so concurrent jobs would all
  land on GPU 0. Each job takes exclusive GPU ids through one lock file per GPU (``flock``: the kernel
  releases it when the holder exits, however it exits). Under Slurm the allocation already is the job's.
- ``vllm_server``: ``trl vllm-serve`` on its own GPUs for TRL's server mode: started in its own process
  group, polled on ``/health`` until it answers, and always stopped (SIGTERM to the group, then SIGKILL).
- ``run_training_job``: all of the above for one training job.
- ``check_workflow_config``: the launch settings of a workflow config, checked when Snakemake parses it.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import functools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

# Named accelerate configs (workflow/accelerate/<name>.yaml); ``single_gpu`` replaces ``ddp`` for one process.
ACCELERATE_CONFIGS = ("ddp", "zero2", "zero3", "zero3_offload")
SINGLE_PROCESS_CONFIG = "single_gpu"
DEFAULT_ACCELERATE_CONFIG = "ddp"
# Resource names of the Snakemake Slurm executor plugin (``gpu`` -> --gpus, ``cpus_per_gpu`` -> --cpus-per-gpu).
GPU_RESOURCE = "gpu"
LOCALHOST = "127.0.0.1"
# The `trl` console script, run by the given interpreter (no PATH lookup; `-m trl.cli.main` warns).
TRL_CLI = "import sys; from trl.cli import main; sys.exit(main())"
# Trainer fields the workflow sets itself in server mode (a free port per job, so jobs can share a machine).
# They differ between attempts of one run, so a resumed job never counts them as a configuration change
# (d3s.runs.run.PER_ATTEMPT_TRAINER_KEYS, the one list of per-attempt keys).
SERVER_FIELDS_SET_BY_WORKFLOW = ("vllm_server_host", "vllm_server_port", "vllm_group_port")
# `accelerate launch` flags that run any workflow/accelerate/ config on a job without a GPU. The configs' bf16
# mixed precision needs a GPU (DeepSpeed on the CPU takes fp32); accelerate's --cpu is not one of them: it
# replaces the DeepSpeed launcher by a single plain process. DeepSpeed picks its CPU accelerator and gloo itself.
CPU_OVERRIDES = ("--mixed_precision", "no")
# Trainer fields that fix the batch; with train.prompts_per_step the workflow derives them per GPU count.
BATCH_FIELDS = ("gradient_accumulation_steps", "steps_per_generation", "generation_batch_size")


# ---- settings ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class VllmServerSettings:
    """``trl vllm-serve`` options (train.launch.vllm_server); the server gets tp x dp GPUs of the job."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    enable_prefix_caching: bool | None = None
    startup_timeout_s: float = 1200.0
    extra_args: tuple[str, ...] = ()

    @property
    def gpus(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size


@dataclasses.dataclass(frozen=True)
class TrainLaunch:
    """How one training job runs: its GPUs, the accelerate config, and the vLLM server it starts (if any)."""

    job_gpus: int
    accelerate_config: Path
    server: VllmServerSettings | None = None

    @property
    def train_gpus(self) -> int:
        return self.job_gpus - (self.server.gpus if self.server else 0)


def accelerate_config_path(name: str, config_dir: str | os.PathLike[str]) -> Path:
    """The accelerate YAML for a name in ACCELERATE_CONFIGS or a path to a file; clear error otherwise."""
    if name in ACCELERATE_CONFIGS or name == SINGLE_PROCESS_CONFIG:
        path = Path(config_dir) / f"{name}.yaml"
        if not path.is_file():
            raise ValueError(f"accelerate config {name!r}: {path} is missing from the checkout")
        return path
    path = Path(name).expanduser()
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path
    raise ValueError(
        f"train.launch.accelerate_config: unknown accelerate config {name!r}; use one of "
        f"{', '.join(ACCELERATE_CONFIGS)} (workflow/accelerate/) or the path of an accelerate YAML file"
    )


def job_gpus(resources: Mapping[str, Any] | None, section: str) -> int:
    """The GPU count a job declares (``resources.gpu``); ``gpus`` and bad values fail with the fix."""
    resources = dict(resources or {})
    if "gpus" in resources:
        raise ValueError(
            f"{section}.resources.gpus: Snakemake's GPU resource is named 'gpu' (the Slurm plugin maps it to "
            f"--gpus, and the workflow assigns that many GPUs); rename gpus to gpu"
        )
    value = resources.get(GPU_RESOURCE, 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{section}.resources.gpu must be a whole number >= 0, got {value!r}")
    return value


def train_launch(
    train_cfg: Mapping[str, Any], accelerate_dir: str | os.PathLike[str], *, gpus: int | None = None
) -> TrainLaunch:
    """The launch settings of the config's training jobs; raises ValueError naming the field to change."""
    gpus = job_gpus(train_cfg.get("resources"), "train") if gpus is None else gpus
    launch = dict(train_cfg.get("launch") or {})
    unknown = set(launch) - {"accelerate_config", "vllm_server"}
    if unknown:
        raise ValueError(
            f"train.launch: unknown key(s) {sorted(unknown)}; valid: accelerate_config, vllm_server"
        )
    trainer = dict(train_cfg.get("trainer") or {})
    server_mode = bool(trainer.get("use_vllm")) and trainer.get("vllm_mode", "colocate") == "server"
    external = trainer.get("vllm_server_base_url") is not None  # a server the user runs: start none
    if launch.get("vllm_server") is not None and not server_mode:
        raise ValueError(
            "train.launch.vllm_server is set but the trainer does not use vLLM in server mode: set "
            "trainer.use_vllm: true and trainer.vllm_mode: server, or remove train.launch.vllm_server"
        )
    if server_mode and external and launch.get("vllm_server") is not None:
        raise ValueError(
            "trainer.vllm_server_base_url points to a server you run, so the workflow starts none: remove "
            "train.launch.vllm_server (or vllm_server_base_url to let the workflow start it)"
        )
    server = None
    if server_mode and not external:
        server = _server_settings(launch.get("vllm_server") or {}, trainer)
        preset = [name for name in SERVER_FIELDS_SET_BY_WORKFLOW if name in trainer]
        if preset:
            raise ValueError(
                f"trainer.{preset[0]} is set, but the workflow starts the vLLM server on a free port of the job's "
                f"node and sets {', '.join(SERVER_FIELDS_SET_BY_WORKFLOW)} itself: remove it (or set "
                "trainer.vllm_server_base_url to use a server you run)"
            )
        if gpus < server.gpus + 1:
            raise ValueError(
                f"train.resources.gpu = {gpus}, but vLLM server mode needs {server.gpus} GPU(s) for trl vllm-serve "
                f"(train.launch.vllm_server tensor_parallel_size x data_parallel_size) plus at least one for "
                f"training: raise train.resources.gpu to {server.gpus + 1} or more, or use trainer.vllm_mode: colocate"
            )
    if gpus == 0 and trainer.get("use_vllm"):
        raise ValueError(
            "trainer.use_vllm is set but train.resources.gpu is 0: vLLM needs GPUs; set train.resources.gpu "
            "(or trainer.use_vllm: false)"
        )
    name = launch.get("accelerate_config", DEFAULT_ACCELERATE_CONFIG)
    launch_obj = TrainLaunch(gpus, accelerate_config_path(str(name), accelerate_dir), server)
    if name == DEFAULT_ACCELERATE_CONFIG and launch_obj.train_gpus == 1:
        # DDP of one process is plain single-GPU training; accelerate's multi-GPU launcher wants two or more.
        launch_obj = dataclasses.replace(
            launch_obj, accelerate_config=accelerate_config_path(SINGLE_PROCESS_CONFIG, accelerate_dir)
        )
    return launch_obj


def _server_settings(raw: Mapping[str, Any], trainer: Mapping[str, Any]) -> VllmServerSettings:
    fields = {f.name for f in dataclasses.fields(VllmServerSettings)}
    unknown = set(raw) - fields
    if unknown:
        raise ValueError(
            f"train.launch.vllm_server: unknown key(s) {sorted(unknown)}; valid: {sorted(fields)}"
        )
    values = dict(raw)
    values.setdefault("max_model_len", trainer.get("vllm_max_model_length"))
    values["extra_args"] = tuple(str(a) for a in values.get("extra_args") or ())
    settings = VllmServerSettings(**values)
    for name in ("tensor_parallel_size", "data_parallel_size"):
        value = getattr(settings, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"train.launch.vllm_server.{name} must be an integer >= 1, got {value!r}")
    if not 0 < settings.gpu_memory_utilization <= 1:
        raise ValueError("train.launch.vllm_server.gpu_memory_utilization must be in (0, 1]")
    if settings.startup_timeout_s <= 0:
        raise ValueError("train.launch.vllm_server.startup_timeout_s must be > 0 (seconds)")
    return settings


def batch_settings(
    trainer: Mapping[str, Any], prompts_per_step: int | None, processes: int
) -> dict[str, Any]:
    """The trainer settings with the batch fixed for ``processes`` training processes.

    With ``prompts_per_step`` (train.prompts_per_step) the update covers that many prompts x G rollouts
    whatever the GPU count: gradient_accumulation_steps = prompts x G / (per-device batch x processes), and
    TRL's default steps_per_generation = gradient_accumulation_steps gives one optimizer step per
    generation batch. Without it the trainer settings are returned unchanged.
    """
    trainer = dict(trainer)
    if prompts_per_step is None:
        return trainer
    preset = [name for name in BATCH_FIELDS if name in trainer]
    if preset:
        raise ValueError(
            f"train.prompts_per_step and trainer.{preset[0]} both fix the batch: remove trainer.{preset[0]} "
            "(the workflow derives gradient_accumulation_steps from prompts_per_step and the GPU count)"
        )
    generations = int(trainer.get("num_generations", 8))
    micro = int(trainer.get("per_device_train_batch_size", 8))
    rollouts = prompts_per_step * generations
    if rollouts % (micro * processes):
        raise ValueError(
            f"train.prompts_per_step x num_generations = {prompts_per_step} x {generations} = {rollouts} rollouts "
            f"per step is not a multiple of per_device_train_batch_size x training processes = {micro} x "
            f"{processes}: change train.prompts_per_step, trainer.per_device_train_batch_size or the job's GPUs"
        )
    trainer["gradient_accumulation_steps"] = rollouts // (micro * processes)
    return trainer


def training_processes(train_cfg: Mapping[str, Any], accelerate_dir: str | os.PathLike[str]) -> int:
    """Processes of a training job: one per training GPU, or one on the CPU."""
    launch = train_launch(train_cfg, accelerate_dir)
    return max(1, launch.train_gpus)


def check_workflow_config(config: Mapping[str, Any], accelerate_dir: str | os.PathLike[str]) -> None:
    """Launch settings of a workflow config, checked at parse time (no GPU or heavy import needed)."""
    train_cfg = config["train"]
    job_gpus(config["eval"].get("resources"), "eval")
    processes = training_processes(train_cfg, accelerate_dir)
    overrides = dict(train_cfg.get("method_overrides") or {})
    for method in config["methods"]:
        trainer = dict(train_cfg["trainer"]) | dict(overrides.get(method) or {})
        batch_settings(trainer, train_cfg.get("prompts_per_step"), processes)


# ---- run configs ------------------------------------------------------------------------------------------


def build_run_config(
    *,
    method: str,
    seed: int,
    model: str,
    train_cfg: Mapping[str, Any],
    task: Mapping[str, Any],
    output_dir: str | os.PathLike[str],
    threads: int,
    processes: int = 1,
) -> dict[str, Any]:
    """The ``d3s train`` config of one run of the workflow (written to runs/<method>/seed<seed>/train.yaml).

    ``threads`` is the job's; the config gets each training process's share (per_process_threads), the count
    `d3s train` runs with and records in resolved_config.yaml, so a rerun compares like with like.
    """
    trainer = dict(train_cfg["trainer"]) | dict((train_cfg.get("method_overrides") or {}).get(method) or {})
    trainer = batch_settings(trainer, train_cfg.get("prompts_per_step"), processes)
    dataset = {"name": "synthetic"} | dict(train_cfg.get("dataset") or {})
    if dataset["name"] == "synthetic":
        dataset = dict(task) | dataset
    config: dict[str, Any] = {
        "method": method,
        "model": model,
        "seed": int(seed),
        "threads": per_process_threads(threads, processes),
        "output_dir": str(output_dir),
        "dataset": dataset,
        "template": train_cfg.get("template", "raw"),
        "reward": train_cfg.get("reward", "accuracy"),
        "trainer": trainer,
    }
    if train_cfg.get("data_dir"):
        config["data_dir"] = train_cfg["data_dir"]
    return config


def per_process_threads(threads: int, processes: int) -> int:
    """Each training process's share of a job's CPU threads (at least one)."""
    return max(1, int(threads) // max(1, int(processes)))


# ---- commands ---------------------------------------------------------------------------------------------


def accelerate_command(
    target: Sequence[str],
    *,
    num_processes: int,
    config_file: str | os.PathLike[str],
    main_process_port: int,
    threads_per_process: int,
    module: bool = False,
    cpu: bool = False,
    python: str = sys.executable,
) -> list[str]:
    """``accelerate launch`` of ``target`` (a script and its arguments, or a module with ``module=True``).

    The launcher follows the config file's ``distributed_type`` (workflow/accelerate/: DDP, ZeRO-2, ZeRO-3, or
    one process). ``cpu``: the job has no GPU, so the same config file trains on the CPU (CPU_OVERRIDES).
    """
    if num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}")
    command = [python, "-m", "accelerate.commands.launch", "--config_file", str(config_file)]
    if cpu:
        command += list(CPU_OVERRIDES)
    command += ["--num_processes", str(num_processes), "--num_machines", "1"]
    command += ["--main_process_port", str(main_process_port)]
    command += ["--num_cpu_threads_per_process", str(threads_per_process)]
    if module:
        command += ["--module"]
    return command + [str(part) for part in target]


def vllm_serve_command(
    model: str, *, host: str, port: int, settings: VllmServerSettings, python: str = sys.executable
) -> list[str]:
    """``trl vllm-serve`` (TRL 1.16's flags) for ``model`` on ``host:port``."""
    command = [python, "-c", TRL_CLI, "vllm-serve", "--model", str(model)]
    command += ["--host", host, "--port", str(port)]
    command += ["--tensor_parallel_size", str(settings.tensor_parallel_size)]
    command += ["--data_parallel_size", str(settings.data_parallel_size)]
    command += ["--gpu_memory_utilization", str(settings.gpu_memory_utilization)]
    if settings.max_model_len is not None:
        command += ["--max_model_len", str(settings.max_model_len)]
    if settings.enable_prefix_caching is not None:
        command += ["--enable_prefix_caching", str(settings.enable_prefix_caching).lower()]
    return command + list(settings.extra_args)


def free_port(host: str = LOCALHOST) -> int:
    """A TCP port free right now (jobs sharing a machine each need their own)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


# ---- processes --------------------------------------------------------------------------------------------


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it if the job process dies (even by SIGKILL); Linux only."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def start_process_group(
    command: Sequence[str],
    *,
    log_path: str | os.PathLike[str],
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen:
    """Start ``command`` as the leader of a new process group (so it and all its children can be stopped)."""
    # The child gets its own copy of the log's descriptor; this process closes its copy at once.
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            list(command),
            env=dict(env) if env is not None else None,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_process_group(process: subprocess.Popen, *, grace_s: float = 30.0) -> int | None:
    """SIGTERM the process group of ``process``, SIGKILL what is left after ``grace_s``; returns its exit code.

    Safe to call twice and on a process that already exited (its children may not have).
    """
    pgid, deadline = process.pid, time.monotonic() + grace_s
    with contextlib.suppress(ProcessLookupError):  # the group may be gone already
        os.killpg(pgid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=grace_s)
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)  # the leader is gone; give its children the rest of the grace period
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    return process.wait()


@contextlib.contextmanager
def signals_raise_system_exit() -> Iterator[None]:
    """Turn SIGTERM/SIGHUP (Snakemake or Slurm stopping the job) into SystemExit so ``finally`` blocks run."""
    signums = [getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name)]

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = {signum: signal.signal(signum, handler) for signum in signums}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def _tail(path: str | os.PathLike[str], lines: int = 20) -> str:
    if not Path(path).is_file():
        return ""
    return "\n".join(Path(path).read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])


@contextlib.contextmanager
def vllm_server(
    command: Sequence[str],
    *,
    host: str,
    port: int,
    log_path: str | os.PathLike[str],
    gpu_ids: Sequence[str] = (),
    startup_timeout_s: float = 1200.0,
    stop_grace_s: float = 30.0,
) -> Iterator[str]:
    """A vLLM server process for TRL's server mode, alive exactly as long as the ``with`` block; yields its URL.

    Starts ``command`` with CUDA_VISIBLE_DEVICES = ``gpu_ids`` and polls ``/health`` until it answers 200
    (RuntimeError if the process exits first, TimeoutError after ``startup_timeout_s``, both with the end
    of its log); leaving the block, an exception, SystemExit from a signal, or interpreter exit (atexit)
    stops it.
    """
    env = dict(os.environ) | ({"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpu_ids))} if gpu_ids else {})
    process = start_process_group(command, log_path=log_path, env=env)
    stop = functools.partial(stop_process_group, process, grace_s=stop_grace_s)
    atexit.register(stop)
    url = f"http://{host}:{port}/health"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through an HTTP proxy
    start = time.monotonic()
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(
                    f"the vLLM server exited with code {process.returncode} before answering {url}; "
                    f"its log ({log_path}) ends with:\n{_tail(log_path)}"
                )
            with (
                contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError, OSError),
                opener.open(url, timeout=5) as response,
            ):
                if response.status == 200:
                    break
            if time.monotonic() - start > startup_timeout_s:
                raise TimeoutError(
                    f"the vLLM server did not answer {url} within {startup_timeout_s:g} s "
                    f"(train.launch.vllm_server.startup_timeout_s); its log ({log_path}) ends with:\n"
                    f"{_tail(log_path)}"
                )
            time.sleep(1.0)
        yield url
    finally:
        stop()
        atexit.unregister(stop)


# ---- GPU assignment ---------------------------------------------------------------------------------------


def visible_gpu_ids(env: Mapping[str, str] | None = None) -> list[str]:
    """GPU ids this process may use: CUDA_VISIBLE_DEVICES when set, else every GPU nvidia-smi lists."""
    env = os.environ if env is None else env
    if "CUDA_VISIBLE_DEVICES" in env:
        ids = [part.strip() for part in env["CUDA_VISIBLE_DEVICES"].split(",") if part.strip()]
        return [] if ids and ids[0] == "-1" else ids
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


@dataclasses.dataclass
class GpuLease(contextlib.AbstractContextManager):
    """GPU ids held by this process until ``release`` (or its exit: the kernel drops its locks)."""

    ids: list[str]
    fds: list[int]

    def release(self) -> None:
        while self.fds:
            os.close(self.fds.pop())  # closing the only descriptor of a lock file releases its flock

    def __exit__(self, *exc: object) -> None:
        self.release()


class GpuSlots:
    """Exclusive GPU ids for concurrent jobs on one machine: one ``flock``-ed file per GPU in ``lock_dir``.

    A lock belongs to an open file description, so two processes (or two leases in one process) never
    hold the same GPU, and the kernel drops the locks of a process that dies, whatever kills it.
    ``lock_dir`` defaults to the node-local $D3S_GPU_LOCK_DIR or <tmp>/d3s-gpu-locks-<uid>.
    """

    def __init__(self, gpu_ids: Sequence[str], lock_dir: str | os.PathLike[str] | None = None) -> None:
        self.gpu_ids = [str(g) for g in gpu_ids]
        default = (
            os.environ.get("D3S_GPU_LOCK_DIR") or Path(tempfile.gettempdir()) / f"d3s-gpu-locks-{os.getuid()}"
        )
        self.lock_dir = Path(lock_dir if lock_dir is not None else default)

    def try_acquire(self, count: int, *, label: str = "") -> GpuLease | None:
        """``count`` free GPUs now, or None (taking none) if fewer are free."""
        import fcntl  # POSIX only; imported here so the workflow still parses elsewhere

        if count > len(self.gpu_ids):
            raise ValueError(
                f"the job needs {count} GPU(s) but only {len(self.gpu_ids)} are visible "
                f"({','.join(self.gpu_ids) or 'none'}): lower the job's resources.gpu or run it on a bigger machine"
            )
        self.lock_dir.mkdir(parents=True, exist_ok=True)
        # One scan at a time, so two jobs never split the free GPUs between them and both wait.
        guard = os.open(self.lock_dir / ".allocate.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(guard, fcntl.LOCK_EX)
            lease = GpuLease([], [])
            for gpu in self.gpu_ids:
                if len(lease.ids) == count:
                    break
                fd = os.open(self.lock_dir / f"gpu{gpu}.lock", os.O_RDWR | os.O_CREAT, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:  # another lease holds it
                    os.close(fd)
                    continue
                os.ftruncate(fd, 0)
                os.write(fd, f"pid {os.getpid()} {label}\n".encode())
                lease.ids.append(gpu)
                lease.fds.append(fd)
            if len(lease.ids) < count:
                lease.release()
                return None
            return lease
        finally:
            os.close(guard)

    def acquire(
        self, count: int, *, timeout_s: float | None = None, poll_s: float = 5.0, label: str = ""
    ) -> GpuLease:
        """Wait for ``count`` free GPUs (TimeoutError after ``timeout_s``; None waits for ever)."""
        start = time.monotonic()
        lease = self.try_acquire(count, label=label)
        if lease is None:
            print(
                f"waiting for {count} free GPU(s) among {self.gpu_ids} (locks in {self.lock_dir})", flush=True
            )
        while lease is None:
            if timeout_s is not None and time.monotonic() - start > timeout_s:
                raise TimeoutError(f"no {count} free GPU(s) among {self.gpu_ids} within {timeout_s:g} s")
            time.sleep(poll_s)
            lease = self.try_acquire(count, label=label)
        return lease


@contextlib.contextmanager
def assign_gpus(
    count: int,
    *,
    lock_dir: str | os.PathLike[str] | None = None,
    timeout_s: float | None = None,
    label: str = "",
    env: Mapping[str, str] | None = None,
) -> Iterator[list[str]]:
    """The GPU ids for a job needing ``count`` GPUs, held for the ``with`` block ([] when ``count`` is 0)."""
    if count <= 0:
        yield []
        return
    env = os.environ if env is None else env
    ids = visible_gpu_ids(env)
    # Inside a Slurm job (or with D3S_GPU_ASSIGNMENT=off) the scheduler has assigned the GPUs already.
    if "SLURM_JOB_ID" in env or env.get("D3S_GPU_ASSIGNMENT", "").lower() in ("off", "0", "false", "no"):
        if len(ids) < count:
            raise ValueError(
                f"the job needs {count} GPU(s) but its allocation shows {len(ids)} "
                f"(CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', '')!r}): check the profile's gpu resources"
            )
        yield ids[:count]
        return
    with GpuSlots(ids, lock_dir).acquire(count, timeout_s=timeout_s, label=label) as lease:
        yield lease.ids


# ---- one training job -------------------------------------------------------------------------------------


def write_yaml(path: str | os.PathLike[str], data: Mapping[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(yaml.safe_dump(dict(data), sort_keys=False), encoding="utf-8")


def training_env(gpu_ids: Sequence[str], base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment of the training processes: their GPUs, and localhost never through an HTTP proxy."""
    env = dict(os.environ if base is None else base)
    env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
    for name in ("NO_PROXY", "no_proxy"):
        hosts = [h for h in env.get(name, "").split(",") if h]
        env[name] = ",".join(hosts + [h for h in (LOCALHOST, "localhost") if h not in hosts])
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def prepare_training_job(
    run_config: Mapping[str, Any],
    config_path: str | os.PathLike[str],
    *,
    launch: TrainLaunch,
    gpu_ids: Sequence[str],
    threads: int,
    cpu: bool | None = None,
    python: str = sys.executable,
) -> tuple[list[str], dict[str, Any], list[str] | None]:
    """(accelerate command, final run config, vllm-serve command or None) for one training job.

    The first ``launch.train_gpus`` ids train, the rest serve; server mode gets free ports on this node.
    ``cpu`` (default: no CUDA device here) adds CPU_OVERRIDES, so the job's accelerate config runs on the CPU.
    """
    if len(gpu_ids) != launch.job_gpus:
        raise ValueError(f"the job declares {launch.job_gpus} GPU(s) but got {len(gpu_ids)}: {list(gpu_ids)}")
    processes = launch.train_gpus
    config = dict(run_config)
    config["threads"] = per_process_threads(threads, processes)
    trainer = dict(config["trainer"])
    server_command = None
    if launch.server is not None:
        port = free_port()
        trainer |= {"vllm_server_host": LOCALHOST, "vllm_server_port": port, "vllm_group_port": free_port()}
        server_command = vllm_serve_command(
            str(config["model"]), host=LOCALHOST, port=port, settings=launch.server, python=python
        )
    config["trainer"] = trainer
    command = accelerate_command(
        ["d3s.cli", "train", "--config", str(config_path)],
        module=True,
        num_processes=processes,
        config_file=launch.accelerate_config,
        main_process_port=free_port(),
        threads_per_process=config["threads"],
        cpu=not cuda_available() if cpu is None else cpu,
        python=python,
    )
    return command, config, server_command


def cuda_available() -> bool:
    """Whether this process sees a CUDA device (torch imported only here: the workflow parses without it)."""
    import torch

    return torch.cuda.is_available()


def run_training_job(
    run_config: Mapping[str, Any],
    config_path: str | os.PathLike[str],
    *,
    launch: TrainLaunch,
    gpu_ids: Sequence[str],
    threads: int,
    log_path: str | os.PathLike[str],
    python: str = sys.executable,
) -> None:
    """Run ``d3s train`` under accelerate on ``gpu_ids`` (with its vLLM server in server mode).

    Writes the final run config to ``config_path``. Every process started here is stopped on the way out,
    whether training finished, failed or the job was cancelled (call inside ``signals_raise_system_exit``).
    """
    command, config, server_command = prepare_training_job(
        run_config, config_path, launch=launch, gpu_ids=gpu_ids, threads=threads, python=python
    )
    write_yaml(config_path, config)
    train_ids = list(gpu_ids[: launch.train_gpus])
    with contextlib.ExitStack() as stack:
        if server_command is not None:
            server_log = f"{log_path}.vllm-server.log"
            print(
                f"starting the vLLM server on GPU(s) {list(gpu_ids[launch.train_gpus :])}: log {server_log}",
                flush=True,
            )
            stack.enter_context(
                vllm_server(
                    server_command,
                    host=LOCALHOST,
                    port=int(config["trainer"]["vllm_server_port"]),
                    gpu_ids=gpu_ids[launch.train_gpus :],
                    log_path=server_log,
                    startup_timeout_s=launch.server.startup_timeout_s,
                )
            )
        with open(log_path, "a", encoding="utf-8") as log:
            log.write(f"GPUs {train_ids}: {' '.join(command)}\n")
        process = start_process_group(command, log_path=log_path, env=training_env(train_ids))
        stack.callback(stop_process_group, process)
        code = process.wait()
    if code != 0:
        raise RuntimeError(f"training exited with code {code}; see {log_path}")


def resolved_trainer_configs(
    config: Mapping[str, Any],
    accelerate_dir: str | os.PathLike[str],
    task: Mapping[str, Any] | None = None,
    *,
    check_inputs: bool = True,
) -> dict[str, Any]:
    """Every method's D3SConfig as its training job builds it (first seed), checked without GPUs.

    Runs d3s.runs.run.resolve_config with check_hardware=False on the CPU (use_cpu forced, so nothing touches
    CUDA): unknown trainer fields, batch geometry for the job's process count, the schedule's keep
    values, the method's TRL settings and (unless ``check_inputs=False``: the workflow's input check reads
    them itself) the model path and training data all fail here, before any job is queued.
    ``generation_batch_size`` comes out per process; the job's is that times its training GPUs.
    """
    from d3s.runs.run import resolve_config

    train_cfg = config["train"]
    processes = training_processes(train_cfg, accelerate_dir)
    base = config["base_model"]
    model = "tiny" if base["kind"] == "tiny" else str(base["path"])
    seed = int(config["seeds"][0])
    resolved = {}
    for method in config["methods"]:
        run = build_run_config(
            method=method,
            seed=seed,
            model=model,
            train_cfg=train_cfg,
            task=dict(task or {}),
            output_dir=f"results/{config['experiment']}/runs/{method}/seed{seed}",
            threads=int(train_cfg.get("threads", 1)),
            processes=processes,
        )
        run["trainer"] = dict(run["trainer"]) | {"use_cpu": True}
        try:
            resolved[method] = resolve_config(run, check_hardware=False, check_inputs=check_inputs)
        except ValueError as err:
            raise ValueError(f"train.trainer (method {method}): {err}") from None
    return resolved
