"""Run manifests: what produced a result (config, versions, commit, seed, threads, hardware, inputs)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import platform
import subprocess
import tempfile
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGES = (
    "d3s",
    "torch",
    "transformers",
    "trl",
    "accelerate",
    "datasets",
    "math-verify",
    "latex2sympy2_extended",
    "vllm",  # generation backend on GPUs (None where not installed)
)
REPO_ROOT = Path(__file__).resolve().parents[2]


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write via a temporary file in the same folder and rename, so readers never see a partial file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def package_versions() -> dict[str, str | None]:
    return {"python": platform.python_version()} | {name: _version(name) for name in PACKAGES}


def git_state(root: Path = REPO_ROOT) -> dict[str, Any]:
    """The commit of the d3s checkout and whether its tree had uncommitted changes."""

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain") if commit else None
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def hardware() -> dict[str, Any]:
    import torch

    fields: dict[str, str] = {}
    with contextlib.suppress(OSError):  # no /proc/cpuinfo: not Linux
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())  # the first processor's
    cpu = fields.get("model name") or platform.processor() or platform.machine()
    # "AMD EPYC" names several generations; vendor, family, model and stepping tell them apart, and torch's
    # kernel level (AVX2, AVX512, ...) decides the float results: runs on two such machines may diverge
    ident = [fields.get(key) for key in ("vendor_id", "cpu family", "model", "stepping")]
    cpu_id = "{} family {} model {} stepping {}".format(*ident) if all(ident) else None
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]  # 0 without CUDA
    return {
        "cpu": cpu,
        "cpu_id": cpu_id,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_count": os.cpu_count(),
        "gpus": gpus,
        "gpu_count": len(gpus),
        "platform": platform.platform(),
    }


def sha256_file(path: str | os.PathLike[str]) -> str:
    """The file's SHA-256; remembered per (path, size, mtime) so a 15 GB checkpoint read by several
    benchmarks of one evaluation is hashed once."""
    stat = os.stat(path)
    return _sha256_of(os.path.realpath(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=256)
def _sha256_of(path: str, size: int, mtime_ns: int) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


# Files that define a saved model as it generates (weights, config, tokenizer); optimizer and trainer
# state in a checkpoint folder do not change what the model computes, so they are not hashed.
MODEL_FILE_PATTERNS = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "pytorch_model*.bin",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "chat_template.*",
)


def model_files(model: str | os.PathLike[str]) -> dict[str, Path]:
    """``{"model/<file>": path}`` for the files of a local model folder; empty for a hub id."""
    folder = Path(model).expanduser()
    if not folder.is_dir():
        return {}
    files = {
        path.name: path for pattern in MODEL_FILE_PATTERNS for path in folder.glob(pattern) if path.is_file()
    }
    return {f"model/{name}": files[name] for name in sorted(files)}


def stable_hash(obj: Any, length: int = 12) -> str:
    """A short SHA-256 of ``obj`` as canonical JSON (sorted keys): equal settings give equal hashes."""
    text = json.dumps(obj, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:length]


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def build_manifest(
    config: dict[str, Any], seed: int, threads: int, inputs: dict[str, str | os.PathLike[str]] | None = None
) -> dict[str, Any]:
    """A manifest for a job starting now; ``inputs`` maps a role to a file whose checksum is recorded."""
    import torch

    return {
        "config": config,
        "seed": seed,
        "torch_threads": threads,
        "torch_interop_threads": torch.get_num_interop_threads(),
        "versions": package_versions(),
        "git": git_state(),
        "hardware": hardware(),
        "inputs": {role: {"path": str(p), "sha256": sha256_file(p)} for role, p in (inputs or {}).items()},
        "started": now(),
        "finished": None,
    }


def write_json(path: str | os.PathLike[str], data: Any, *, sort_keys: bool = False) -> None:
    """``data`` as indented JSON (what JSON cannot hold as its str), written atomically."""
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=sort_keys, default=str) + "\n")
