"""Files and folders of a run directory, readable by their owner only: files 0600, folders 0700.

    make_dirs(run_dir / "evidence" / "server")         # each folder it creates: 0700
    with open_private(run_dir / "events.jsonl", "a", encoding="utf-8") as f: ...   # created 0600

Why explicit modes rather than the process's umask: a run directory holds what a server answered, its
logs and the harness's options, and a server may echo a secret in a form no redaction foresaw; other
local users have no business reading any of it. The usual umask (022) would give every file 0644; the
mode given at creation is what the file has from its first byte (a chmod afterwards leaves a window).
A file or folder that already exists keeps its owner's mode, narrowed to 0600/0700 when we own it.
Temporary files (`.NAME.*.k3tmp`) are created 0600 too; `is_temp` tells them apart (a copy or a write
interrupted by a kill leaves one, which holds only redacted bytes).
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

FILE_MODE = 0o600
DIR_MODE = 0o700
TEMP_SUFFIX = ".k3tmp"


def make_dirs(path: Path) -> Path:
    """`path` and its missing parents, each created 0700 (existing ones are left as they are)."""
    missing = []
    here = Path(path)
    while not here.exists() and here != here.parent:
        missing.append(here)
        here = here.parent
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):
            folder.mkdir(mode=DIR_MODE)
    return Path(path)


def make_run_dir(path: Path) -> Path:
    """A run directory: created 0700, or an existing one narrowed to 0700 when it is ours."""
    make_dirs(path)
    with contextlib.suppress(OSError):
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077 and path.stat().st_uid == os.geteuid():
            path.chmod(mode & DIR_MODE)
    return path


def open_private(path: Path, mode: str = "ab", **kwargs: Any) -> IO[Any]:
    """`open(path, mode)` for writing ("w", "a", with "b" or not), the file created 0600 (its folders
    0700), an existing one of ours narrowed to 0600."""
    flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
    flags |= os.O_APPEND if "a" in mode else os.O_TRUNC
    make_dirs(Path(path).parent)
    fd = os.open(path, flags, FILE_MODE)
    try:
        narrow(fd)
        return os.fdopen(fd, mode, **kwargs)
    except BaseException:
        os.close(fd)
        raise


def narrow(fd: int) -> None:
    """The open file's mode without group and other bits (when we own it; else as it is)."""
    mode = stat.S_IMODE(os.fstat(fd).st_mode)
    if mode & 0o077:
        with contextlib.suppress(OSError):
            os.fchmod(fd, mode & 0o700)


def temp_beside(path: Path) -> tuple[int, str]:
    """A new temporary file in `path`'s folder (0600, as mkstemp makes them), to be renamed onto `path`."""
    make_dirs(Path(path).parent)
    return tempfile.mkstemp(dir=Path(path).parent, prefix=f".{Path(path).name}.", suffix=TEMP_SUFFIX)


def is_temp(path: Path) -> bool:
    """A temporary file of `temp_beside` (an interrupted write's leftover): never evidence."""
    return path.name.startswith(".") and path.name.endswith(TEMP_SUFFIX)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """`data` in a 0600 temporary file beside `path`, renamed onto it (a reader never sees half a file)."""
    fd, tmp = temp_beside(path)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_bytes_atomic_at(dir_fd: int, name: str, data: bytes) -> None:
    """`data` as `name` in the directory open as `dir_fd`, by a 0600 temporary file renamed onto it.

    Why by descriptor: a live run's directory may be moved away while a late writer (the design measurement)
    is still under way; a write by path would then land in whatever directory holds that name now (another
    run's), a write by descriptor in the run's own directory, wherever it went."""
    tmp = f".{name}.{os.urandom(6).hex()}{TEMP_SUFFIX}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), FILE_MODE, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


def narrow_existing(paths: Iterable[Path]) -> None:
    """Files made by others' writers (Locust's --csv, --logfile, --json-file, --html outputs inside a run
    directory, opened before a run starts with the process's umask): 0600 where they exist and are ours."""
    for path in paths:
        with contextlib.suppress(OSError):
            mode = stat.S_IMODE(os.stat(path).st_mode)
            if mode & 0o077 and os.stat(path).st_uid == os.geteuid():
                os.chmod(path, mode & (DIR_MODE if Path(path).is_dir() else FILE_MODE))


def restrict_umask() -> int:
    """The process's umask with group and other bits added (what was there kept): every file the process
    makes from now on without a mode of its own is its owner's only. Returns the umask it had."""
    before = os.umask(0o077)
    os.umask(before | 0o077)
    return before


def exposed(root: Path) -> list[str]:
    """Files and folders under `root` (itself included, as ".") that others than their owner may read,
    write or enter: what a run directory must not hold (Locust's own outputs, made with the umask)."""
    out = []
    for path in [Path(root), *sorted(Path(root).rglob("*"))]:
        with contextlib.suppress(OSError):
            if stat.S_IMODE(path.lstat().st_mode) & 0o077 and not path.is_symlink():
                out.append(path.relative_to(root).as_posix() or ".")
    return out
