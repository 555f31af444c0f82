"""``trl vllm-serve`` for TRL's server mode: its own process group, waited for, always stopped."""

from __future__ import annotations

import contextlib
import os
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

from d3s.orchestration.processes import process_group


def _log_tail(path: str | os.PathLike[str], lines: int = 20) -> str:
    """The end of a log process_group opened (so it exists)."""
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
    """``command`` on ``gpu_ids``, alive exactly as long as the ``with`` block; yields its /health URL once
    that answers 200. RuntimeError if it exits first, TimeoutError after ``startup_timeout_s`` (both with
    the end of its log); leaving the block however (exception, a signal's SystemExit, atexit) stops it."""
    env = dict(os.environ) | ({"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpu_ids))} if gpu_ids else {})
    url = f"http://{host}:{port}/health"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through an HTTP proxy
    start = time.monotonic()
    with process_group(command, log_path=log_path, env=env, grace_s=stop_grace_s) as process:
        while True:
            if process.poll() is not None:
                raise RuntimeError(
                    f"the vLLM server exited with code {process.returncode} before answering {url}; "
                    f"its log ({log_path}) ends with:\n{_log_tail(log_path)}"
                )
            with (
                contextlib.suppress(OSError),  # URLError, refused, reset, timed out
                opener.open(url, timeout=5) as response,
            ):
                if response.status == 200:
                    break
            if time.monotonic() - start > startup_timeout_s:
                raise TimeoutError(
                    f"the vLLM server did not answer {url} within {startup_timeout_s:g} s "
                    f"(train.launch.vllm_server.startup_timeout_s); its log ({log_path}) ends with:\n"
                    f"{_log_tail(log_path)}"
                )
            time.sleep(1.0)
        yield url
