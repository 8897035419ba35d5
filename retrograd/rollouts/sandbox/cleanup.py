"""Removing what sandboxes leave on the host, without ever acting through a link.

A sandboxed command owns the files it leaves behind and may plant symbolic links
(`ln -s /etc x`) or strip a directory's permissions (`chmod 000 d`). Removal here
opens every directory relative to its parent with O_NOFOLLOW, gives back the owner's
bits only to real directories (through that directory's own handle), and unlinks a
link as a link. Host folders live under one private per-user parent,
`<tmp>/retrograd-<uid>` (mode 0700, ours, not a link), and the reaper removes only
real folders there that this uid owns, with the mode they were made with, named
after a process that is gone."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from retrograd.rollouts.sandbox.base import SandboxError
from retrograd.runtime import owner

PRIVATE_MODE = 0o700  # of the per-user parent and of every folder made in it (tempfile.mkdtemp's mode)


def private_root() -> Path:
    """`<tmp>/retrograd-<uid>`, created 0700 on first use; refused when it is a link,
    another user's, or readable by others (someone planted it)."""
    path = Path(tempfile.gettempdir()) / f"retrograd-{os.geteuid()}"
    try:
        os.mkdir(path, PRIVATE_MODE)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not _is_private_folder(info):
        raise SandboxError(f"{path} must be a folder of uid {os.geteuid()} with mode 0700 (found mode "
                           f"{stat.filemode(info.st_mode)}, uid {info.st_uid}); remove it and try again")
    return path


def make_folder(kind: str) -> Path:
    """A new private folder `<kind>-<owner tag>-<random>` in `private_root()`, after
    removing the folders of that kind whose process has died."""
    root = private_root()
    reap_orphan_dirs(root, kind)
    return Path(tempfile.mkdtemp(prefix=f"{kind}-{owner.process_tag()}-", dir=root))


def reap_orphan_dirs(root: Path, kind: str) -> int:
    """Removes `<kind>-<tag>-*` folders under `root` left by runs that died without
    cleaning up; links, other users' folders and other modes are left alone."""
    reaped = 0
    for path in root.glob(f"{kind}-*"):
        tag = "-".join(path.name[len(kind) + 1:].split("-")[:2])
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            continue
        if _is_private_folder(info) and owner.is_dead(tag):
            force_remove(path)
            reaped += 1
    return reaped


def force_remove(path: Path) -> None:
    """Deletes `path` and everything below it (best effort), never following a link."""
    try:
        top = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    stack = [(top, iter([path.name]))]  # open directories, each with the names still to remove in it
    entered: list[str] = []  # the name of each directory on the stack (but the first) in its parent
    while stack:
        fd, names = stack[-1]
        name = next(names, None)
        if name is None:
            os.close(fd)
            stack.pop()
            if stack:
                _quietly(os.rmdir, entered.pop(), dir_fd=stack[-1][0])
            continue
        child = _open_real_directory(fd, name)
        if child is None:
            _quietly(os.unlink, name, dir_fd=fd)
        else:
            stack.append((child, iter(_quietly(os.listdir, child) or [])))
            entered.append(name)


def _open_real_directory(parent: int, name: str) -> int | None:
    """A readable fd of `name` when it is a directory and not a link, with the owner's
    rwx given back first; else None. Both act on the O_PATH handle of the directory
    itself (through /proc/self/fd, which needs no permission on it), never on a path."""
    try:
        handle = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)
    except OSError:  # a link (ELOOP/ENOTDIR), a file, or gone
        return None
    itself = f"/proc/self/fd/{handle}"
    try:
        _quietly(os.chmod, itself, PRIVATE_MODE)
        return _quietly(os.open, itself, os.O_RDONLY | os.O_DIRECTORY)
    finally:
        os.close(handle)


def _is_private_folder(info: os.stat_result) -> bool:
    return (stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid()
            and stat.S_IMODE(info.st_mode) == PRIVATE_MODE)


def _quietly(function, *args, **kwargs):
    try:
        return function(*args, **kwargs)
    except OSError:
        return None
