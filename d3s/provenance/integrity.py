"""What a saved folder holds, and the check that it still holds it: each file's size and xxh3-128 checksum,
recorded when a checkpoint or final model is written and verified before it is trusted (resume, the last-step
promotion, the final model, `d3s eval`, the workflow's re-run). Also: a save that ran out of disk space,
reported in one line, and moving a folder aside (never deleting it) with the reason.

xxh3-128 (the xxhash package, which datasets already installs): about 12 GB/s per core, ten times SHA-256 and
five times CRC-32 here; a checkpoint is read from disk faster than that only on the fastest NVMe arrays. It
guards against truncation, partial copies and flipped bits, not against someone forging a file
(docs/gpu/faults.md).

No torch import: the workflow's parse and `d3s eval`'s argument checks use it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import struct
import time
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import xxhash

from d3s.provenance.manifest import MODEL_FILE_PATTERNS, atomic_write_text, now

CHECKSUM = "xxh3_128"
# The record of a final model (a checkpoint's is in its completion mark, d3s_state.json).
FINAL_RECORD_FILE = "d3s_files.json"
_CHUNK = 16 << 20
_HASH_THREADS = max(1, min(8, os.cpu_count() or 1))
# Below this much free space, a failed save ran out of it (its own partial file took the rest).
_NEARLY_FULL_BYTES = 256 << 20


class IntegrityError(ValueError):
    """A saved model or checkpoint no longer holds what was written (a one-line reason)."""


class DiskFullError(OSError):
    """A save ran out of disk space; the message names the path and the space left there."""


def file_checksum(path: str | os.PathLike[str]) -> str:
    """The xxh3-128 checksum of the file at ``path`` (hex)."""
    digest = xxhash.xxh3_128()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as fh:
        while count := fh.readinto(buffer):
            digest.update(view[:count])
    return digest.hexdigest()


def record_files(folder: str | os.PathLike[str], exclude: Iterable[str] = ()) -> dict[str, dict[str, Any]]:
    """``{relative path: {size, mtime_ns, xxh3_128}}`` for every file under ``folder`` (DeepSpeed's
    global_step*/ included) but ``exclude``; files are hashed in parallel threads."""
    folder = Path(folder)
    skipped = set(exclude)
    paths = sorted(
        path
        for path in folder.rglob("*")
        if path.is_file() and path.relative_to(folder).as_posix() not in skipped
    )
    with ThreadPoolExecutor(_HASH_THREADS) as pool:
        checksums = list(pool.map(file_checksum, paths))
    record = {}
    for path, checksum in zip(paths, checksums, strict=True):
        stat = path.stat()
        record[path.relative_to(folder).as_posix()] = {
            "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns,
            CHECKSUM: checksum,
        }
    return record


def check_files(
    folder: str | os.PathLike[str], record: Mapping[str, Mapping[str, Any]], *, trust_unchanged: bool = False
) -> str | None:
    """None when every file of ``record`` is in ``folder`` with its recorded size and checksum (and every
    safetensors file is as long as its header says); else the first problem, in one line naming the file.

    ``trust_unchanged``: a file whose size and modification time are those recorded is not read (the
    workflow's check at every start; an evaluation reads everything)."""
    folder = Path(folder)
    to_hash = []
    for name, entry in sorted(record.items()):
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        stat = path.stat()
        if stat.st_size != entry["size"]:
            return f"{path} is {stat.st_size:,} bytes, {entry['size']:,} when it was saved"
        if not (trust_unchanged and stat.st_mtime_ns == entry.get("mtime_ns")):
            to_hash.append((path, entry))
    with ThreadPoolExecutor(_HASH_THREADS) as pool:
        checksums = list(pool.map(file_checksum, [path for path, _ in to_hash]))
    for (path, entry), checksum in zip(to_hash, checksums, strict=True):
        if checksum != entry[CHECKSUM]:
            return f"{path} does not match the {CHECKSUM} checksum recorded when it was saved (corrupted)"
    for name in sorted(record):
        if name.endswith(".safetensors"):
            problem = safetensors_problem(folder / name)
            if problem:
                return problem
    return None


def safetensors_problem(path: str | os.PathLike[str]) -> str | None:
    """None when the safetensors file at ``path`` is as long as its header says; else why not (one line).
    Reads the header only: it catches a truncated or overwritten file, not a flipped bit in the tensors."""
    path = Path(path)
    size = path.stat().st_size
    try:
        with open(path, "rb") as fh:
            (header_size,) = struct.unpack("<Q", fh.read(8))
            if header_size > size - 8:
                return f"{path} is {size:,} bytes, cut inside its header (truncated)"
            header = json.loads(fh.read(header_size))
        ends = [int(tensor["data_offsets"][1]) for key, tensor in header.items() if key != "__metadata__"]
    except (struct.error, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return f"{path} has no readable safetensors header (not a safetensors file, or overwritten)"
    expected = 8 + header_size + max(ends, default=0)
    if size != expected:
        return f"{path} is {size:,} bytes, its header describes {expected:,} (truncated or padded)"
    return None


def _is_model_file(name: str) -> bool:
    return "/" not in name and any(fnmatch(name, pattern) for pattern in MODEL_FILE_PATTERNS)


def model_weights_problem(folder: str | os.PathLike[str], *, trust_unchanged: bool = False) -> str | None:
    """Why the weights of the local model ``folder`` would not load, in one line naming the file; None
    when they would. Checked: a weight file is there, every shard an index names is there, its files match
    the record d3s wrote with them (final/'s d3s_files.json, a checkpoint's d3s_state.json), each safetensors
    file is as long as its header says and a pytorch_model*.bin is a whole zip archive. ``trust_unchanged``:
    as in check_files."""
    folder = Path(folder)
    weights = sorted(
        path
        for pattern in ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json", "*.bin.index.json")
        for path in folder.glob(pattern)
        if path.is_file()
    )
    if not weights:
        return f"{folder} holds no weight file (model.safetensors or pytorch_model.bin)"
    for index in (path for path in weights if path.name.endswith(".index.json")):
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError):
            return f"{index} is not a readable weight index (no weight_map)"
        missing = sorted(shard for shard in shards if not (folder / shard).is_file())
        if missing:
            return f"{folder / missing[0]} is missing (named by {index.name})"
    record = saved_record(folder)
    if record:
        model_record = {name: entry for name, entry in record.items() if _is_model_file(name)}
        problem = check_files(folder, model_record, trust_unchanged=trust_unchanged)
        if problem:
            return problem
    for path in weights:
        if path.name.endswith(".safetensors"):
            problem = safetensors_problem(path)
        elif path.name.endswith(".bin"):
            problem = _zip_problem(path)
        else:
            continue
        if problem:
            return problem
    return None


def _zip_problem(path: Path) -> str | None:
    try:
        with zipfile.ZipFile(path) as archive:
            archive.infolist()
    except (zipfile.BadZipFile, OSError):
        return f"{path} is not a whole torch archive (truncated or overwritten)"
    return None


def saved_record(folder: str | os.PathLike[str]) -> dict[str, dict[str, Any]] | None:
    """The files record d3s wrote with ``folder`` (final/'s d3s_files.json, else a checkpoint's
    d3s_state.json); None when there is none (a model d3s did not write, a checkpoint from before records)."""
    for name in (FINAL_RECORD_FILE, "d3s_state.json"):
        path = Path(folder) / name
        if path.is_file():
            try:
                files = json.loads(path.read_text(encoding="utf-8")).get("files")
            except (ValueError, AttributeError):
                raise IntegrityError(f"{path} is not valid JSON (corrupted)") from None
            return files or None
    return None


def write_final_record(folder: str | os.PathLike[str], record: Mapping[str, Mapping[str, Any]]) -> None:
    """Write final/'s record (``record``: its files, as record_files gives them)."""
    data = {"checksum": CHECKSUM, "files": dict(record)}
    atomic_write_text(Path(folder) / FINAL_RECORD_FILE, json.dumps(data, indent=1, sort_keys=True))


def set_aside(
    output_dir: str | os.PathLike[str], paths: Iterable[Path], *, label: str, reason: str, note: str
) -> Path:
    """Move ``paths`` (inside ``output_dir``) into ``output_dir/superseded-<UTC time>-<label>/`` with a
    README.txt giving ``reason`` and ``note``; nothing is deleted. Returns the new folder."""
    output_dir = Path(output_dir)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    folder = output_dir / f"superseded-{stamp}-{label}"
    suffix = 1
    while folder.exists():  # two in one second
        suffix += 1
        folder = output_dir / f"superseded-{stamp}-{label}-{suffix}"
    folder.mkdir(parents=True)
    moved = []
    for path in paths:
        if path.exists():
            os.replace(path, folder / path.name)  # same file system: a rename, nothing copied
            moved.append(path.name)
    readme = (
        f"Superseded at {now()} (UTC): {reason}\n\n{note}\n"
        + "".join(f"  {name}\n" for name in moved)
        + "Delete this folder yourself when it is no longer needed.\n"
    )
    atomic_write_text(folder / "README.txt", readme)
    return folder


def _errnos(err: BaseException) -> Iterator[int | None]:
    while err is not None:
        yield getattr(err, "errno", None)
        err = err.__cause__ or err.__context__


def _free_space(path: Path) -> tuple[int, int]:
    """(free, total) bytes of the file system holding ``path`` (its nearest existing folder)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    usage = shutil.disk_usage(path)
    return usage.free, usage.total


def _size(count: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"


@contextlib.contextmanager
def reporting_full_disk(path: str | os.PathLike[str], what: str) -> Iterator[None]:
    """Turn an OSError/RuntimeError of a save into DiskFullError naming ``path`` and the space left there
    when the save ran out of space (ENOSPC/EDQUOT, or a writer's error with the disk all but full: torch's
    "basic_ios::clear: iostream error" carries no errno, safetensors raises its own SafetensorError). Any
    other error passes through unchanged."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as err:
        if not isinstance(err, OSError | RuntimeError) and type(err).__name__ != "SafetensorError":
            raise
        free, total = _free_space(Path(path))
        no_space = {errno.ENOSPC, errno.EDQUOT} & set(_errnos(err)) or "No space left" in str(err)
        if not (no_space or free < _NEARLY_FULL_BYTES):
            raise
        cause = " ".join(f"{type(err).__name__}: {err}".split())
        raise DiskFullError(
            f"out of disk space writing {what} to {path}: {_size(free)} free there (of {_size(total)}); "
            f"make room or move output_dir to a larger disk, then run again: it resumes from the newest "
            f"complete checkpoint (nothing half-written is marked complete). [{cause[:300]}]"
        ) from err
