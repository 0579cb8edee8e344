"""What a command may write and replace: outputs own only what ctxext wrote, and one run writes an output at a time.

- :func:`check_regular_file` refuses an output path that exists and is not a regular file (a device such as
  ``/dev/full``, a named pipe, a socket): ctxext writes files by renaming a temporary file over the path, which would
  replace the node itself.
- :func:`check_replaceable_folder` decides whether ``--overwrite`` may remove an existing folder: only one ctxext
  wrote (recognised by ``is_ours``), never ``.``, the home folder, ``/``, a parent of the working directory or of an
  input.
- :class:`OutputLock` is an advisory ``fcntl`` lock on a lock file beside the output, holding the writer's pid: a
  second run on the same output is refused with the first one's pid. The kernel drops the lock when its process
  dies, so a lock file left by a killed run is stale: it is taken over, and said so.
- :func:`check_writable_folder` refuses an output folder that cannot be made or written, before any work: it creates
  and removes a temporary file in the nearest existing folder on the way (``os.access`` says yes to root, and knows
  nothing of read-only mounts).
- :func:`write_atomic` writes a file whole or not at all (a temporary file beside it, flushed to disk, renamed over
  it): the one helper for it, so that fsync, modes and clean-up are the same for every writer.
- :func:`staging_folder` gives a folder beside an output to write into, removed when its block ends;
  :func:`staged_folder` builds on it and replaces the output only when the writing completes, so a failed or
  interrupted run leaves the earlier output as it was.
- :func:`file_damage` says why a file ctxext (or a library it saves with) wrote cannot be read back: a truncated
  safetensors file, a torch.save archive with a missing end or a bad CRC, JSON that does not parse.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
import struct
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable, Iterator

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; one writer per output is then the user's to ensure
    fcntl = None


def first_record(path: str | os.PathLike) -> dict | None:
    """The JSON object on a JSON-lines file's first line, or None (unreadable, not JSON, not an object): how ctxext
    tells its own run logs and rows files from a user's file of the same name."""
    try:
        with open(path, "rb") as fh:
            first = json.loads(fh.readline())
    except (OSError, ValueError, RecursionError):
        return None
    return first if isinstance(first, dict) else None


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder")):
        if test(mode):
            return name
    return "not a regular file"


def check_regular_file(path: str | os.PathLike, flag: str, *, subject: str | None = None) -> None:
    """Raise ValueError if ``path`` exists (following links) and is not a regular file. Touches nothing.
    ``subject``: how the messages name ``path`` (default ``"FLAG PATH"``; ``output='r.json'`` from Python)."""
    subject = subject or f"{flag} {path}"
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):  # a missing path (or one under a file: reported elsewhere)
        if os.path.islink(path):
            raise ValueError(f"{subject} is a link to nothing; give a file name ctxext can create") from None
        return
    except OSError as exc:
        raise ValueError(f"{subject}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(mode):
        raise ValueError(f"{subject} is {_kind(mode)}; ctxext writes only regular files: give a file name")


def _protected(folder: Path, inputs: tuple[Path, ...]) -> str | None:
    """Why ``folder`` may never be removed, or None."""
    here = Path.cwd().resolve()
    if folder == Path(folder.anchor):
        return "the filesystem root"
    if folder == Path.home().resolve():
        return "your home folder"
    if folder == here:
        return "the working directory"
    if folder in here.parents:
        return "a parent of the working directory"
    for source in inputs:
        if folder == source or folder in source.parents:
            return f"the input {source} or a folder holding it"
    return None


def never_replaced(folder: str | os.PathLike) -> str | None:
    """Why ``folder`` is one that ``--overwrite`` never removes whatever it holds (the filesystem root, the home
    folder, the working directory or a parent of it), or None."""
    return _protected(Path(folder).expanduser().resolve(), ())


def check_replaceable_folder(out: str | os.PathLike, flag: str, *, is_ours: Callable[[Path], bool],
                             inputs: tuple[str | os.PathLike, ...] = (), what: str = "a ctxext output") -> None:
    """Raise ValueError unless ``--overwrite`` may remove the existing folder ``out``: ctxext wrote it
    (``is_ours(folder)``) or it is empty, and it is none of the folders that are never removed. Touches nothing."""
    folder = Path(out).expanduser()
    if not folder.exists() and not folder.is_symlink():
        return
    if folder.is_symlink():
        raise ValueError(f"{flag} {out} is a link; ctxext replaces only folders it wrote: give a new folder")
    resolved = folder.resolve()
    reason = _protected(resolved, tuple(Path(p).expanduser().resolve() for p in inputs if p))
    if reason:
        raise ValueError(f"{flag} {out} is {reason}; ctxext never replaces it: give a new folder")
    if not folder.is_dir():
        raise ValueError(f"{flag} {out} is a file; pass a folder")
    if any(folder.iterdir()) and not is_ours(folder):
        raise ValueError(f"{flag} {out} holds files ctxext did not write (it is not {what}); --overwrite replaces "
                         "only ctxext's own outputs: give a new or empty folder")


def lock_path(output: str | os.PathLike) -> Path:
    path = Path(output)
    return path.with_name(f".{path.name}.ctxext-lock")


class OutputLock:
    """``with OutputLock(path, flag):`` holds an exclusive advisory lock on ``path``'s lock file, or raises
    ValueError naming the pid of the run that holds it. The lock file is removed on release. ``subject``: how the
    messages name ``path`` where it is not the one ``flag`` names (a file beside it); default ``"FLAG PATH"``."""

    def __init__(self, output: str | os.PathLike, flag: str = "--output", *, subject: str | None = None):
        self.output, self.flag = Path(output), flag
        self.subject = subject or f"{flag} {self.output}"
        self.path = lock_path(output)
        self._fd: int | None = None
        self._made: Path | None = None
        #: pid recorded in a lock file whose process no longer held it (a killed run), or None.
        self.stale_pid: int | None = None

    def _recorded_pid(self, fd: int) -> int | None:
        try:
            text = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
            return int(text) if text.isdigit() else None
        except OSError:
            return None

    def acquire(self) -> "OutputLock":
        if fcntl is None:
            return self
        missing = self.path.parent
        while not missing.parent.exists() and missing.parent != missing:
            missing = missing.parent
        self._made = None if missing.exists() else missing  # removed again on release if still empty
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                pid = self._recorded_pid(fd)
                os.close(fd)
                if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    who = f"pid {pid}" if pid else "another process"
                    raise ValueError(f"{self.subject} is being written by another ctxext run ({who}); "
                                     f"wait for it to finish or choose another {self.flag}") from None
                raise ValueError(f"{self.subject}: cannot lock {self.path}: {exc.strerror}") from None
            # the holder before us may have removed the file after we opened it: lock the file that is there now
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            break
        previous = self._recorded_pid(fd)
        if previous and previous != os.getpid():
            self.stale_pid = previous
            print(f"ctxext: note: took over a stale lock on {self.output} left by pid {previous}, which no longer "
                  "holds it (a run that was killed)", file=sys.stderr)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)  # closing drops the lock
            self._fd = None
        folder = self.path.parent
        while self._made is not None and folder != self._made.parent:  # folders made for the lock and left empty
            try:
                folder.rmdir()
            except OSError:
                break
            folder = folder.parent

    def __enter__(self) -> "OutputLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def give_default_mode(path: str | os.PathLike, folder: bool) -> None:
    """``tempfile.mkdtemp`` / ``mkstemp`` create 0700 / 0600 (private on purpose); what is renamed into place as a
    result gets the mode ``mkdir`` / ``open`` would have given it (a serving engine under another account reads it)."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, (0o777 if folder else 0o666) & ~mask)


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Write ``data`` (a str as UTF-8) to ``path`` whole or not at all: into a temporary file beside it (same
    filesystem, so the rename is atomic), flushed to disk, then renamed over ``path``; folders on the way are made.
    A failure or an interrupt removes the temporary file and leaves ``path`` as it was. The file gets the mode
    ``open`` would have given it, not ``mkstemp``'s 0600."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode("utf-8") if isinstance(data, str) else data)
            fh.flush()
            os.fsync(fh.fileno())  # on disk before the rename: a crash never leaves an empty file in place
        give_default_mode(tmp, folder=False)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def staging_folder(out: str | os.PathLike) -> Iterator[Path]:
    """A new, empty folder beside ``out`` (same filesystem, so renames from it into ``out`` are atomic) with the mode
    ``mkdir`` would have given, not ``mkdtemp``'s 0700. Whatever is still in it when the block ends, completed or
    not, is removed; what the caller moved out of it (into ``out``) stays. ``out`` itself is never touched here."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        give_default_mode(staging, folder=True)
        yield staging
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def staged_folder(out: str | os.PathLike) -> Iterator[Path]:
    """A :func:`staging_folder` for the caller to write a whole result into. When the block completes, it replaces
    ``out`` (a folder there is removed first: the caller has checked that it may be); when the block raises, it is
    removed and ``out`` is left as it was."""
    out = Path(out)
    with staging_folder(out) as staging:
        yield staging
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)


def check_writable_folder(path: str | os.PathLike, flag: str) -> None:
    """Raise ValueError unless ``path`` is a folder ctxext can create files in, or one it can make. The nearest
    existing folder on the way (``path`` itself when it exists) is probed by creating and removing a temporary file
    (``os.access`` cannot tell: it says yes to root and knows nothing of read-only mounts). Leaves nothing behind."""
    folder = Path(path).expanduser().absolute()
    here = folder
    while not os.path.lexists(here) and here != here.parent:
        here = here.parent
    if os.path.islink(here) and not os.path.exists(here):
        raise ValueError(f"{flag} {path}: {here} is a link to nothing; give a folder ctxext can create")
    try:
        mode = os.stat(here).st_mode
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot read {here} ({exc.strerror or exc})") from None
    if not stat.S_ISDIR(mode):
        kind = "a file" if stat.S_ISREG(mode) else _kind(mode)
        if here == folder:
            raise ValueError(f"{flag} {path} is {kind}, not a folder; give a folder")
        raise ValueError(f"{flag} {path} cannot be made: {here} is {kind}, not a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=".ctxext-write-probe-", dir=here)
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot create files in {here} ({exc.strerror or exc}); "
                         "choose a folder you can write") from None
    os.close(fd)
    os.unlink(probe)


def _safetensors_damage(path: Path, size: int) -> str | None:
    with path.open("rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            return f"truncated: {size} bytes, shorter than a safetensors header"
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            return f"truncated: {size} bytes, its header alone needs {8 + n}"
        try:
            header = json.loads(fh.read(n))
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return "not a safetensors file (its header does not parse)"
    expected = 8 + n + end
    if size < expected:
        return f"truncated: {size} of {expected} bytes"
    if size > expected:
        return f"{size - expected} bytes past the tensors its header lists (written twice or appended to)"
    return None


#: zip archives up to this size have every member's CRC checked by :func:`file_damage` (reading them whole); larger
#: ones only their directory, which a truncated file lacks
CRC_CHECK_LIMIT = 1 << 30


def file_damage(path: str | os.PathLike) -> str | None:
    """Why the file at ``path`` cannot be read back, or None (also for a format it cannot check). Checked by format:
    ``.safetensors`` (its header, and a size that covers every tensor it lists), zip archives (``torch.save``'s
    format: the central directory, and each member's CRC up to ``CRC_CHECK_LIMIT``), ``.json``. Loads nothing."""
    path = Path(path)
    try:
        st = os.stat(path)
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if not stat.S_ISREG(st.st_mode):
        return f"is {_kind(st.st_mode)}"
    size = st.st_size
    try:
        if size == 0:
            return "empty"
        if path.suffix == ".safetensors":
            return _safetensors_damage(path, size)
        if path.suffix == ".json":
            try:
                json.loads(path.read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError) as exc:
                return f"not valid JSON ({exc})"
            return None
        with path.open("rb") as fh:
            magic = fh.read(4)
        if magic.startswith(b"PK") or b"PK\x03\x04".startswith(magic):  # a zip archive, as torch.save writes
            if not zipfile.is_zipfile(path):
                return (f"truncated ({size} bytes): a torch.save archive ends with a directory of its members, and "
                        "this one has none")
            with zipfile.ZipFile(path) as archive:
                bad = archive.testzip() if size <= CRC_CHECK_LIMIT else None
            if bad is not None:
                return f"damaged: the data of {bad} does not match its CRC"
    except (OSError, zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError) as exc:
        return f"cannot be read ({getattr(exc, 'strerror', None) or exc})"
    return None
