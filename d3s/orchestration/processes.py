"""A job's processes: started in their own process group, always stopped with all their children."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from d3s.ports import LOCALHOST


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
        with contextlib.suppress(PermissionError):  # alive, but not ours to signal
            os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_process_group(process: subprocess.Popen, *, grace_s: float = 30.0) -> int | None:
    """SIGTERM the process group of ``process``, SIGKILL what is left after ``grace_s``; returns its exit
    code. Safe to call twice and on a process that already exited (its children may not have)."""
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
def process_group(
    command: Sequence[str],
    *,
    log_path: str | os.PathLike[str],
    env: Mapping[str, str] | None = None,
    grace_s: float = 30.0,
) -> Iterator[subprocess.Popen]:
    """``command`` in its own process group for the ``with`` block, stopped with all its children however the
    block is left (exception, a signal's SystemExit, or atexit)."""
    process = start_process_group(command, log_path=log_path, env=env)
    stop = functools.partial(stop_process_group, process, grace_s=grace_s)
    atexit.register(stop)
    try:
        yield process
    finally:
        stop()
        atexit.unregister(stop)


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


def training_env(gpu_ids: Sequence[str], base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment of the training processes: their GPUs, and localhost never through an HTTP proxy."""
    env = dict(os.environ if base is None else base)
    env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
    for name in ("NO_PROXY", "no_proxy"):
        hosts = [h for h in env.get(name, "").split(",") if h]
        env[name] = ",".join(hosts + [h for h in (LOCALHOST, "localhost") if h not in hosts])
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env
