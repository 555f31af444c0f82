"""`python -m d3s.analysis.run_notebook ARGS`: papermill's command line, as the workflow's notebook jobs run
it (workflow/rules/analyse.smk), with two changes to how it starts:

- without the "iri" format checker's import (d3s.startup: 3-4 s a job);
- the kernel talks over Unix sockets in a folder of its own, not TCP ports. jupyter_client picks a kernel's
  five TCP ports by binding and releasing them, and the kernel binds them a second later: a notebook job
  started beside others (the workflow's four, Slurm's own sockets) can find one taken and die before its
  first cell ("ZMQError: Address already in use"; nteract/papermill#511, jupyter/jupyter_client#154). A
  socket file in a fresh folder cannot be taken.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
import tempfile
from pathlib import Path

from d3s.startup import skip_iri_format_checks

# A Unix socket's path holds at most 107 bytes; the kernel adds "-<n>" to the prefix below.
SOCKET_PATH_LIMIT = 100
# Where the socket folder goes when TMPDIR is too deep for a socket's path (pytest's, some job folders)
SHORT_TEMP_ROOTS = ("/tmp", "/dev/shm")


def kernel_socket_prefix(folder: str | Path) -> str | None:
    """The path prefix of the kernel's socket files in ``folder`` (ipc transport: ``<prefix>-<n>``); None
    when it is too long for a Unix socket's path."""
    prefix = str(Path(folder) / "kernel")
    return prefix if len(prefix.encode()) + len("-99999") <= SOCKET_PATH_LIMIT else None


def socket_folder() -> str | None:
    """A fresh folder for the kernel's sockets: under TMPDIR, or else under the first short root that takes
    one; None when none does (the kernel then keeps papermill's TCP ports)."""
    for root in (None, *SHORT_TEMP_ROOTS):
        try:
            folder = tempfile.mkdtemp(prefix="d3s-kernel-", dir=root)
        except OSError:
            continue
        if kernel_socket_prefix(folder):
            return folder
        os.rmdir(folder)
    return None


def ipc_config(folder: str | Path):
    """The traitlets configuration that makes every kernel manager use Unix sockets under ``folder``."""
    from traitlets.config import Config

    return Config({"KernelManager": {"transport": "ipc", "ip": kernel_socket_prefix(folder)}})


def main() -> None:
    skip_iri_format_checks()
    import papermill.cli
    from papermill.execute import execute_notebook

    folder = socket_folder()
    if folder is None:
        print("run_notebook: no folder short enough for the kernel's sockets; TCP ports", file=sys.stderr)
        papermill.cli.papermill()
        return
    try:
        # papermill passes unknown keywords of execute_notebook on to its notebook client, whose kernel
        # manager takes this configuration (nbclient's create_kernel_manager)
        papermill.cli.execute_notebook = functools.partial(execute_notebook, config=ipc_config(folder))
        papermill.cli.papermill()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
