"""The user the desktop's programs run as, so that none of them can read its server's memory.

A program on the desktop runs whatever a task or an agent sends. Run as the server's own
user it could read the server's `/proc/<pid>/mem`, `environ` and open files, and with them
the server's bearer token. So when the server runs as root, every program of the desktop
runs as `DesktopConfig.run_as` (default `arpo-desktop`, a system user without a login or a
home of its own, created with `useradd` when missing) with no supplementary groups:
Xvfb, openbox, the session buses, the pyautogui executor and its forks, and whatever
`/execute`, `/setup/launch`, `/setup/open_file`, `/run_python` and `/run_bash_script`
start. Their environment is built from a short list (`procs.desktop_env(clean=True)`),
not from the server's, and their home is the desktop's home, owned by that user (rebuilt
and handed over on every reset; a file an upload creates is theirs too).

In the server's private mount namespace (where it has one, as root):

- /proc is a procfs of its own mounted with `hidepid=1` (`private_proc`): a program sees
  the processes of every user, but the files of no process of another user (cmdline,
  environ, mem, fd, maps) are refused to it, whatever their mode;
- a folder the user cannot pass through on its way to what it needs (the server's Python
  under /root, a desktop root under pytest's 0700 folders) is covered by a tmpfs that holds
  only those paths, bound from the originals (`open_paths`); the rest of that folder is
  out of sight of the desktop and of the server alike.

The server's own files stay its own: the desktop's root folder is 0711 (its `home`, `bin`,
`run` and `tmp` are reached by name; nothing in it can be listed), its log, state, logs
and spool folders 0600/0700 and owned by the server's user.

All desktops of a machine share one user by default: their programs can reach each
other's programs and homes (as they reach each other's displays, which ask for no
authentication), but no server. `--run-as` gives a desktop a user of its own.

A server that is not root cannot switch users: it says so once in its log and runs its
programs as itself, or refuses to start with `require_own_user`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import re
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("arpo_envs.desktop")

USER_NAME = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
"""What `useradd` accepts as a name (Debian's default NAME_REGEX, without the final `$`)."""


class DesktopUserError(RuntimeError):
    """The desktop's programs cannot run as the user asked for (the message says why)."""


@dataclass(frozen=True, slots=True)
class DesktopUser:
    """The user every program of one desktop runs as."""

    name: str
    uid: int
    gid: int

    def popen_kwargs(self) -> dict[str, Any]:
        """`subprocess.Popen` arguments that start a program as this user, no other group."""
        return {"user": self.uid, "group": self.gid, "extra_groups": []}

    def become(self) -> None:
        """Turn the calling (child, before exec) process into this user: for a preexec_fn
        that first needs root (Xvfb's `setns`)."""
        os.setgroups([])
        os.setgid(self.gid)
        os.setuid(self.uid)

    def give(self, path: Path) -> None:
        """Make `path` and everything under it this user's (symbolic links not followed)."""
        os.lchown(path, self.uid, self.gid)
        if not path.is_dir() or path.is_symlink():
            return
        for dirpath, dirnames, filenames in os.walk(path):
            for name in dirnames + filenames:
                with contextlib.suppress(FileNotFoundError):  # a program removed it
                    os.lchown(os.path.join(dirpath, name), self.uid, self.gid)

    def blocker(self, path: Path) -> Path | None:
        """The first folder on `path`'s way (itself included) this user cannot search, or
        None when it can reach `path`."""
        path = Path(os.path.abspath(path))
        for folder in [*reversed(path.parents), path]:
            try:
                st = os.stat(folder)
            except OSError:
                return None  # not there (yet): nothing to pass through
            if not stat.S_ISDIR(st.st_mode):
                return None
            if st.st_uid == self.uid:
                bit = stat.S_IXUSR
            elif st.st_gid == self.gid:
                bit = stat.S_IXGRP
            else:
                bit = stat.S_IXOTH
            if not st.st_mode & bit:
                return folder
        return None


def resolve(name: str, require: bool) -> DesktopUser | None:
    """The user the desktop's programs run as; None: the server's own (`name` is '', or
    the server is not root, which is logged once). DesktopUserError when it cannot be had
    (or `require` and the server cannot switch)."""
    if not name:
        return None
    if os.geteuid() != 0:
        me = pwd.getpwuid(os.geteuid()).pw_name if _known(os.geteuid()) else str(os.geteuid())
        msg = (
            f"the server runs as {me!r}, not root, so it cannot run the desktop's programs as "
            f"{name!r}: they run as {me!r} and can read this server's memory, and with it its "
            "token; start the server as root to separate them"
        )
        if require:
            raise DesktopUserError(msg + " (or drop --require-own-user)")
        log.warning("%s", msg)
        return None
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        entry = _create(name)
    if entry.pw_uid == 0 or entry.pw_uid == os.geteuid():
        raise DesktopUserError(
            f"run_as {name!r} is uid {entry.pw_uid}, the server's own user: the desktop's "
            "programs could read the server's memory; name an unprivileged user"
        )
    return DesktopUser(name, entry.pw_uid, entry.pw_gid)


def _known(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


def _create(name: str) -> pwd.struct_passwd:
    """Create the system user `name` (its own group, no home folder, no login shell)."""
    useradd = shutil.which("useradd", path=os.defpath + ":/usr/sbin:/sbin")
    if useradd is None:
        raise DesktopUserError(
            f"the user {name!r} does not exist and useradd is not installed: create it "
            f"(`useradd --system --user-group {name}`) or name an existing user with --run-as"
        )
    r = subprocess.run(
        [useradd, "--system", "--user-group", "--no-create-home", "--home-dir", "/nonexistent",
         "--shell", "/usr/sbin/nologin", "--comment", "programs of the arpo local desktops",
         name],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    try:  # another server may have created it meanwhile (useradd then fails)
        return pwd.getpwnam(name)
    except KeyError:
        raise DesktopUserError(
            f"could not create the user {name!r} for the desktop's programs: useradd exited "
            f"{r.returncode}: {r.stderr.strip()[-300:]}; create it by hand or name an existing "
            "user with --run-as"
        ) from None


def runtime_paths() -> list[Path]:
    """What a program of the desktop needs of the server's installation: its interpreter
    (which has pyautogui), its packages and the folders it runs from."""
    paths = [Path(sys.executable).resolve(), Path(sys.prefix), Path(sys.base_prefix)]
    paths += [Path(p) for p in sys.path if p and os.path.exists(p)]
    return [Path(os.path.abspath(p)) for p in paths]


def private_proc() -> bool:
    """Mount a procfs of this mount namespace's own on /proc with `hidepid=1`: a process
    reads the /proc/<pid> files of its own user's processes only (root reads all). False,
    changing nothing, where the kernel refuses."""
    from arpo_envs.desktop.home import _mount

    try:
        _mount("proc", "/proc", "proc", 0x2 | 0x4 | 0x8, "hidepid=1")  # nosuid, nodev, noexec
    except OSError as e:
        log.warning("no private /proc (%s): the desktop's programs can read every process's "
                    "cmdline", e)  # fmt: skip
        return False
    return True


def open_paths(user: DesktopUser, paths: list[Path], also: list[Path]) -> list[Path]:
    """Let `user` reach every path of `paths` (in this private mount namespace): each
    folder on the way that it cannot search is covered by a tmpfs (mode 0711) holding only
    the paths of `paths` and `also` (what the server itself still needs) that lie in it,
    bound from the originals. Returns the folders covered; DesktopUserError when a path
    stays out of reach (the path itself is closed to the user)."""
    from arpo_envs.desktop.home import MS_BIND, MS_REC, _mount

    covered: list[Path] = []
    for _ in range(8):  # a folder bound in may hold another closed one, on another path
        pending = [(p, user.blocker(p)) for p in paths]
        pending = [(p, b) for p, b in pending if b is not None]
        if not pending:
            return covered
        for p, b in pending:
            if b == p:  # a tmpfs over it would hide the very path
                raise DesktopUserError(
                    f"{p} is not searchable by the user {user.name!r} and the desktop's "
                    "programs need it; give it o+x or run them as another user (--run-as)"
                )
        block = pending[0][1]
        assert block is not None
        inside = sorted({p for p in [*paths, *also] if p.is_relative_to(block) and p != block})
        keep = [p for p in inside if not any(p != q and p.is_relative_to(q) for q in inside)]
        fds = [os.open(p, os.O_PATH | os.O_CLOEXEC) for p in keep if os.path.lexists(p)]
        keep = [p for p in keep if os.path.lexists(p)]
        try:
            _mount("tmpfs", str(block), "tmpfs", 0, "mode=0711,size=1m")
            for p, fd in zip(keep, fds, strict=True):
                for folder in reversed(p.parents):
                    if folder.is_relative_to(block) and folder != block and not folder.exists():
                        folder.mkdir(mode=0o755)
                if os.path.isdir(f"/proc/self/fd/{fd}"):
                    p.mkdir(mode=0o755)
                else:
                    p.touch(mode=0o644)
                _mount(f"/proc/self/fd/{fd}", str(p), flags=MS_BIND | MS_REC)
        finally:
            for fd in fds:
                os.close(fd)
        covered.append(block)
    raise DesktopUserError(f"the paths {paths} stay out of reach of {user.name!r}")
