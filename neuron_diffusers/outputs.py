"""A job's output folder: what made each output, which outputs are done, and one job at a time.

Resume by file name alone keeps an image made with another seed, counts a 0-byte or garbage file as done, and lets
two jobs with different settings mix their images in one folder. Instead:

- Every output stores its *settings key* (every setting that decides its pixels, `settings_key`) and that key's
  digest inside the file (PNG text chunks, MP4 metadata). An output is done only when it is a complete file whose
  digest is the request's.
- A complete output made with other settings stops the job before anything loads, naming the file and the settings
  that differ: regenerating it silently would destroy an image someone made on purpose, keeping it would mix two
  jobs. `--overwrite` regenerates; another `--out` keeps both. An incomplete output (0 bytes, truncated, garbage) is
  regenerated; a folder where an output goes is refused.
- One job per folder: `JobLock` holds an exclusive `flock` on `.neuron-diffusers.lock`, with the job's settings
  digest and pid inside for the message. The kernel drops the lock when its process dies, so a killed job never
  leaves a stale lock; the job holding it removes the temporary files a killed writer left behind.
- `summary.json` keeps the records of earlier runs whose files are still there (`merge_records`).
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import socket
import time
from pathlib import Path

#: Bumped when the meaning of a key field changes (never when a field is added: see `settings_key`).
KEY_VERSION = 1
LOCK_NAME = ".neuron-diffusers.lock"


def model_identity(source: str) -> str:
    """The model as the key names it: a tiny family or Hub id as given, a folder by its absolute path (so `./ckpt`
    and `/work/ckpt` are one model). Weights are not hashed: a changed checkpoint under the same name is not seen."""
    path = Path(source)
    return str(path.resolve()) if path.is_dir() else source


def settings_key(request, *, model: str, dtype: str, **job) -> dict:
    """Everything that decides `request`'s pixels: the model, the dtype, the settings of the whole `job` that do (the
    pipeline class, LoRAs; each left out when None or empty), and every field of the request (a dataclass).

    A field is left out when its metadata says `key=False` (the index: it is part of the file name), or when it holds
    its default: a field a later version adds (image inputs, LoRAs) therefore keeps every earlier output's digest.
    `metadata={"key": function}` stores `function(value)` instead (e.g. a file's sha256 rather than its path).
    The tensor-parallel layout (tp, dp, cfg) is not in the key: it only reorders floating-point sums, within 1/255
    of one process (tested), so a rerun on other ranks resumes.
    """
    key = {"key_version": KEY_VERSION, "model": model, "dtype": dtype}
    key.update({name: value for name, value in job.items() if value})
    for field in dataclasses.fields(request):
        rule = field.metadata.get("key", True)
        value = getattr(request, field.name)
        if rule is False or (field.default is not dataclasses.MISSING and value == field.default):
            continue
        key[field.name] = rule(value) if callable(rule) else value
    return key


def digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def key_text(key: dict) -> dict[str, str]:
    """The text chunks that record `key` inside an output."""
    return {"settings_key": json.dumps(key, sort_keys=True, ensure_ascii=False), "settings_digest": digest(key)}


def scan_outputs(outputs: dict[int, Path], keys: dict[int, dict], read_settings, overwrite: bool
                 ) -> tuple[frozenset[int], list[Path]]:
    """Which requests are done (index -> output path and settings key), and which outputs are broken.

    `read_settings(path)` returns the stored text of a complete output, or None. Raises a `ValueError` for a folder
    where an output goes, and (without `overwrite`) for complete outputs made with other settings.
    """
    done, broken, different = set(), [], []
    for index, path in outputs.items():
        if path.is_dir():
            raise ValueError(f"{path} is a folder, where the output of request {index} goes: move or remove it.")
        if overwrite or not os.path.lexists(path):
            continue
        stored = read_settings(path)
        if stored is None:
            broken.append(path)
        elif stored.get("settings_digest") == digest(keys[index]):
            done.add(index)
        else:
            different.append((path, _differences(stored, keys[index])))
    if different:
        path, why = different[0]
        more = f" (and {len(different) - 1} more output(s) like it)" if len(different) > 1 else ""
        raise ValueError(f"{path}{more} was made with other settings than this job's: {why}. Pass --overwrite to "
                         "regenerate, or choose another --out to keep both.")
    return frozenset(done), broken


def _differences(stored: dict[str, str], key: dict) -> str:
    try:
        old = json.loads(stored["settings_key"])
    except (KeyError, ValueError):
        return "it records no settings key (written by an older version or by another program)"
    names = sorted(name for name in set(old) | set(key) if old.get(name) != key.get(name))
    return "; ".join(f"{name} {_short(old.get(name))} here, {_short(key.get(name))} now" for name in names)


def _short(value) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 40 else text[:37] + "..."


class JobLock:
    """The exclusive lock of one output folder, held by one process for a whole job.

    A `flock` rather than a file that exists: the kernel releases it when the holder dies however it dies, so there
    is no stale lock to guess about. The file holds the holder's settings digest, pid, host and start time, which
    only ever serve the message of a job that is refused.
    """

    def __init__(self, out_dir: Path, job_digest: str):
        self.path = out_dir / LOCK_NAME
        self.job_digest = job_digest
        self._fd = None

    def acquire(self) -> JobLock:
        """Take the lock, or raise a `ValueError` naming the job that holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise ValueError(_in_use(self.path.parent, holder, self.job_digest)) from None
        record = {"digest": self.job_digest, "pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(record).encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            self.path.unlink(missing_ok=True)
            os.close(self._fd)  # closing drops the flock
            self._fd = None


def check_unlocked(out_dir: Path, job_digest: str) -> None:
    """Refuse, before anything starts, an `out_dir` that a running job with other settings holds (a shared-lock probe,
    released at once).

    A holder with this job's digest is left to `JobLock.acquire` on rank 0, whose refusal every rank raises: it may be
    this very job, when rank 0 of a process group that already runs (a test harness, a server) took the lock before
    another rank got here. So is a holder whose record is not written yet (`acquire` writes it just after taking the
    lock; seen in CI as "pid ? on ?" refusing this very job).
    """
    path = out_dir / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError):
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # succeeds when nobody holds it: a dead job's file
    except BlockingIOError:
        holder = _read_holder(fd)
        if holder.get("digest") not in (job_digest, None):
            raise ValueError(_in_use(out_dir, holder, job_digest)) from None
    finally:
        os.close(fd)


def _read_holder(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}


def _in_use(out_dir: Path, holder: dict, job_digest: str) -> str:
    who = f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}"
    same = "the same settings" if holder.get("digest") == job_digest else "other settings"
    return (f"--out {out_dir} is in use by another job ({who}) with {same}: two jobs in one folder would write "
            "the same file names and summary. Wait for it to finish, or choose another --out.")


def merge_records(previous: list, new: list[dict], out_dir: Path) -> list[dict]:
    """This run's image records plus the earlier runs' whose files are still there (a record per file, newest wins),
    sorted by file name."""
    records = {r["file"]: r for r in previous if isinstance(r, dict) and (out_dir / str(r.get("file", ""))).is_file()}
    records.update({r["file"]: r for r in new})
    return [records[name] for name in sorted(records)]


def read_summary_images(path: Path) -> list:
    """The image records of an earlier `summary.json` (none when it is missing or unreadable)."""
    try:
        images = json.loads(path.read_text()).get("images", [])
    except (OSError, ValueError, AttributeError):
        return []
    return images if isinstance(images, list) else []
