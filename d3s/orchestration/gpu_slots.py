"""GPU ids for a job: its declared count, and ids of its own on a shared machine, since Snakemake never
sets CUDA_VISIBLE_DEVICES for local jobs (docs/gpu/launch.md, "GPU assignment")."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from d3s.launch import GPU_RESOURCE
from d3s.launch import job_gpus as job_gpus  # the workflow's job scripts import it from here
from d3s.orchestration.processes import signals_raise_system_exit


def visible_gpu_ids(env: Mapping[str, str] | None = None) -> list[str]:
    """GPU ids this process may use: CUDA_VISIBLE_DEVICES when set, else every GPU nvidia-smi lists."""
    env = os.environ if env is None else env
    if "CUDA_VISIBLE_DEVICES" in env:
        ids = [part.strip() for part in env["CUDA_VISIBLE_DEVICES"].split(",") if part.strip()]
        return [] if ids and ids[0] == "-1" else ids
    query = ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=30, check=True).stdout
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
    """Exclusive GPU ids for concurrent jobs on one machine: one ``flock``-ed file per GPU in ``lock_dir``
    ($D3S_GPU_LOCK_DIR or <tmp>/d3s-gpu-locks-<uid>). A lock belongs to an open file description, so two
    leases never hold one GPU, and the kernel drops a dead process's locks, whatever killed it."""

    def __init__(self, gpu_ids: Sequence[str], lock_dir: str | os.PathLike[str] | None = None) -> None:
        self.gpu_ids = [str(g) for g in gpu_ids]
        default = os.environ.get("D3S_GPU_LOCK_DIR") or f"{tempfile.gettempdir()}/d3s-gpu-locks-{os.getuid()}"
        self.lock_dir = Path(lock_dir if lock_dir is not None else default)

    def try_acquire(self, count: int, *, label: str = "") -> GpuLease | None:
        """``count`` free GPUs now, or None (taking none) if fewer are free."""
        import fcntl  # POSIX only; imported here so the workflow still parses elsewhere

        if count > len(self.gpu_ids):
            raise ValueError(
                f"the job needs {count} GPU(s) but only {len(self.gpu_ids)} are visible "
                f"({','.join(self.gpu_ids) or 'none'}): lower the job's resources.gpu or run it on a bigger "
                "machine"
            )
        self.lock_dir.mkdir(parents=True, exist_ok=True)
        # One scan at a time, so two jobs never split the free GPUs between them and both wait.
        with open(self.lock_dir / ".allocate.lock", "a") as guard:
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
                f"(CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', '')!r}): check the profile's gpu "
                "resources"
            )
        yield ids[:count]
        return
    with GpuSlots(ids, lock_dir).acquire(count, label=label) as lease:
        yield lease.ids


def granted_gpus(resources: Any, declared: int, section: str) -> int:
    """The GPUs Snakemake granted a job (it scales ``gpu`` down to --resources gpu=N, the default profile's
    visible GPUs); SystemExit with the fix when a job that declares some got none."""
    granted = int(getattr(resources, GPU_RESOURCE, 0) or 0)
    if declared and not granted:
        raise SystemExit(
            f"{section}.resources.gpu = {declared}, but Snakemake gave this job no GPU (none visible to the "
            "profile, or --resources gpu=0): run on a GPU machine (docs/gpu/launch.md)"
        )
    return granted


@contextlib.contextmanager
def gpu_job(log_path: str | os.PathLike[str], gpus: int, label: str, mode: str = "w") -> Iterator[list[str]]:
    """A workflow job's body: its output to its log, SIGTERM/SIGHUP as SystemExit (so ``finally`` blocks
    stop its processes), and ``gpus`` GPU ids of its own held throughout."""
    with (
        open(log_path, mode) as log,
        contextlib.redirect_stdout(log),
        contextlib.redirect_stderr(log),
        signals_raise_system_exit(),
        assign_gpus(gpus, label=label) as gpu_ids,
    ):
        yield gpu_ids


def cuda_available() -> bool:
    """Whether this process sees a CUDA device (torch imported only here: the workflow parses without it)."""
    import torch

    return torch.cuda.is_available()
