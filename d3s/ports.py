"""The host and ports of the processes a job starts: accelerate's rendezvous, vLLM's server and its
weight-sync group (d3s.orchestration), and the torch group of TRL's colocated engine (d3s.vllm_engine)."""

from __future__ import annotations

import socket

LOCALHOST = "127.0.0.1"


def free_port(host: str = LOCALHOST) -> int:
    """A TCP port free right now (jobs sharing a machine each need their own)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
