"""The desktop's programs run as a user of their own, and none of them can reach the server's token.

A program on a local desktop that ran as the server's user (root here) could read the
server's /proc/<pid>/environ, mem and open files, and with them its bearer token. Now the
server runs every program of its desktop (Xvfb, openbox, the pyautogui executor, apps,
commands) as `run_as` (`arpo-desktop`), in a /proc that hides other users' processes
(`arpo_envs.desktop.user`). A program sent through `/execute` tries every way to the token
it has and is refused each; it really is the other user; and what the server put into the
home (task files, uploads) is that user's to write. Before: `id -u` printed 0 and reading
/proc/<server pid>/mem at the server's heap gave its bytes.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path

import pytest
from arpo_envs.desktop.desktop import DesktopConfig
from arpo_envs.procs import marked_pids
from test_desktop_common import require_desktop, running_desk

from arpo.env.client import ClientConfig, EnvClient

SECRET = "tok-" + os.urandom(12).hex()

PROBE = r"""
import errno, json, os, sys
pid, addr, paths = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
out = {"uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups()}

def attempt(name, fn):
    try:
        out[name] = "read:" + fn().decode("utf-8", "replace")
    except OSError as e:
        out[name] = "refused:" + errno.errorcode.get(e.errno, str(e.errno))

def mem():
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as f:
        f.seek(addr)
        return f.read(4096)

attempt("environ", lambda: open(f"/proc/{pid}/environ", "rb").read())
attempt("cmdline", lambda: open(f"/proc/{pid}/cmdline", "rb").read())
attempt("mem", mem)
attempt("maps", lambda: open(f"/proc/{pid}/maps", "rb").read())
attempt("fds", lambda: "\n".join(os.listdir(f"/proc/{pid}/fd")).encode())
for p in paths:
    attempt(p, lambda p=p: open(p, "rb").read())
# everything else this program could read: every process's cmdline and environ, its own env
seen = []
for entry in os.listdir("/proc"):
    for part in ("cmdline", "environ"):
        try:
            seen.append(open(f"/proc/{entry}/{part}", "rb").read().decode("utf-8", "replace"))
        except OSError:
            pass
out["seen"] = "\n".join(seen) + "\n" + "\n".join(f"{k}={v}" for k, v in os.environ.items())
print(json.dumps(out))
"""


def _heap_address(pid: int) -> int:
    """The start of a readable region of the server's memory (what a program would read)."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        span, perms = line.split()[:2]
        if perms.startswith("r") and "[heap]" in line:
            return int(span.split("-")[0], 16)
    raise AssertionError("the server has no heap mapping")


def _uid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError(f"no Uid line for {pid}")


def test_a_program_on_the_desktop_is_another_user_and_cannot_reach_the_token(
    tmp_path: Path,
) -> None:
    require_desktop()
    if os.geteuid() != 0:
        pytest.skip("the server switches users only as root; this test runs as another user")
    template = tmp_path / "files"
    (template / "Documents").mkdir(parents=True)
    (template / "Documents" / "task.txt").write_text("placed by the server\n")
    # a tokens file as `arpo-envs up --tokens_file` writes it (0600), where a program can go
    keys = Path("/var/tmp") / f"arpo-test-keys-{os.getpid()}"
    keys.mkdir(mode=0o755, exist_ok=True)
    tokens_file = keys / "tokens.json"
    fd = os.open(tokens_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"http://127.0.0.1:1": SECRET}, f)
    try:
        with running_desk(tmp_path / "d", "--files-template", str(template), token=SECRET) as d:
            assert d.get("/platform", token=False).status == 401
            pid = d.pid
            files = [str(tokens_file), f"{d.root}/server.log", f"{d.root}/tree.json"]
            a = d.post("/execute", {"command": ["python", "-c", PROBE, str(pid),
                                                str(_heap_address(pid)), *files]})  # fmt: skip
            assert a.status == 200, a.body
            r = a.json()
            assert r["returncode"] == 0, r["error"]
            probe = json.loads(r["output"])
            # it really is another, unprivileged user, with no group of the server's
            assert probe["uid"] != 0 and probe["gid"] != 0 and 0 not in probe["groups"], probe
            assert d.sh("id -u")["output"].strip() == str(probe["uid"])
            for what in ("environ", "cmdline", "mem", "maps", "fds", *files):
                assert probe[what] in ("refused:EACCES", "refused:EPERM"), (what, probe[what])
            assert SECRET not in r["output"] and SECRET not in r["error"]
            assert "PATH=" in probe["seen"]  # it did read what it could
            # every process of the desktop (Xvfb, openbox, the executor, apps) is that user
            info = d.get("/desktop/info").json()
            assert d.post("/setup/launch", {"command": ["xterm"]}).status == 200
            d.act("pyautogui.moveTo(10, 10)")
            procs = marked_pids(d.root)
            assert {info["xvfb_pid"], info["wm_pid"], info["executor_pid"]} <= set(procs)
            assert {_uid(p) for p in procs} == {probe["uid"]}

            # what the server put into the home is the user's to change
            async def upload() -> None:
                async with EnvClient(ClientConfig(base_url=d.url, token=SECRET)) as env:
                    assert "1 bytes" in await env.upload("/home/user/new/up.txt", b"x")

            asyncio.run(upload())
            # a link the desktop's user plants never sends a write of the server elsewhere:
            # not as the file, not as a folder on the path (a root-owned link still works)
            victim = keys / "victim.txt"
            victim.write_text("root's\n")
            victim.chmod(0o644)
            plant = d.sh(f"ln -s {victim} ~/trap && ln -s {keys} ~/trapdir && echo ok")
            assert plant["output"].strip() == "ok", plant

            async def through_links() -> list[str]:
                out = []
                async with EnvClient(ClientConfig(base_url=d.url, token=SECRET)) as env:
                    for path in ("/home/user/trap", "/home/user/trapdir/planted.txt"):
                        try:
                            await env.upload(path, b"owned")
                            out.append(f"{path}: written")
                        except Exception as e:
                            out.append(f"{path}: {e}")
                return out

            refused = asyncio.run(through_links())
            assert all("symbolic link the desktop's user made" in r for r in refused), refused
            assert victim.read_text() == "root's\n" and not (keys / "planted.txt").exists()
            w = d.sh("echo more >> ~/new/up.txt && echo more >> ~/Documents/task.txt "
                     "&& touch ~/new/made && stat -c %u ~/new ~/new/up.txt ~/Documents/task.txt")  # fmt: skip
            assert w["returncode"] == 0, w
            assert set(w["output"].split()) == {str(probe["uid"])}
        # the server's own files stay its own
        assert os.stat(tmp_path / "d" / "server.log").st_mode & 0o077 == 0
    finally:
        shutil.rmtree(keys, ignore_errors=True)
    log = (tmp_path / "d" / "server.log").read_text()
    assert SECRET not in log


def test_the_user_fields_are_checked() -> None:
    for bad in ("root", "Bad Name", "x" * 40, "-x"):
        with pytest.raises(ValueError, match="run_as"):
            DesktopConfig(run_as=bad)
    with pytest.raises(ValueError, match="require_own_user needs run_as"):
        DesktopConfig(run_as="", require_own_user=True)
    assert DesktopConfig().run_as == "arpo-desktop"
