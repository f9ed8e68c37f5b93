"""The local desktop's AT-SPI tree (`--atspi`), held against what the screen shows.

A real desktop server (Xvfb, openbox, a session bus, the AT-SPI registry) runs mousepad
(GTK 3) on a file: GET /accessibility must give its widgets in OSWorld's format, with
the file's text in the text widget, the frame where X has the window, and menus where
a click opens them (the pointer goes to the centre the tree gives, and the tree then
shows that menu's items on screen, below it). xterm, which has no AT-SPI bridge, is
listed as its frame. A reset keeps the buses working, a display restart restarts them,
and nothing outlives the server. The project's linearisation of such a tree is held
against OSWorld's own in `tests/test_a11y_osworld.py` (case `local-atspi`).
"""

from __future__ import annotations

import os
import re
import xml.etree.ElementTree as ET

import pytest
from arpo_envs.a11y import NS
from arpo_envs.desktop.atspi import BUS_LAUNCHER
from arpo_envs.procs import marked_pids
from test_desktop_common import Desk, require_desktop, start_desk, stop_desk_proc
from test_desktop_common import wait_until as until

from arpo.env import a11y

ST, CP = NS["st"], NS["cp"]


def require_atspi() -> None:
    """Skip (fail under CI, where `make sysdeps` installs them) without the buses."""
    require_desktop()
    missing = [p for p in ("/usr/bin/dbus-daemon", BUS_LAUNCHER) if not os.path.exists(p)]
    if missing:
        msg = f"the AT-SPI tree needs {missing}: run `make sysdeps`"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)


@pytest.fixture(scope="module")
def desk(tmp_path_factory) -> Desk:
    require_atspi()
    d = start_desk(tmp_path_factory.mktemp("atspi"), "--atspi")
    yield d
    stop_desk_proc(d.proc)
    assert d.proc.returncode == 0
    assert marked_pids(d.root) == [], "processes of the desktop outlived its server"


def open_note(desk: Desk, text: str) -> None:
    assert desk.post("/reset").status == 200
    desk.sh(f"printf '%s' '{text}' > ~/note.txt")
    a = desk.post("/setup/open_file", {"path": "/home/user/note.txt"})
    assert a.status == 200, a.body


def tree(desk: Desk) -> ET.Element:
    a = desk.get("/accessibility")
    assert a.status == 200, a.body
    return ET.fromstring(a.json()["AT"])


def box(el: ET.Element) -> tuple[int, int, int, int]:
    x, y = map(int, re.findall(r"-?\d+", el.get(f"{{{CP}}}screencoord", "")))
    w, h = map(int, re.findall(r"-?\d+", el.get(f"{{{CP}}}size", "")))
    return x, y, w, h


def mousepad(desk: Desk) -> ET.Element:
    """Mousepad's application node once its text widget holds the file (it registers
    with the registry as it starts)."""
    found: list[ET.Element] = []

    def ready() -> bool:
        found[:] = [
            app for app in tree(desk).findall("application")
            if app.get("name") == "mousepad" and app.find(".//text") is not None
        ]  # fmt: skip
        return bool(found)

    until(ready, timeout=20)
    return found[0]


def test_mousepad_tree_holds_what_the_screen_shows(desk: Desk) -> None:
    open_note(desk, "alpha beta\ngamma")
    app = mousepad(desk)
    frame = app.find("frame")
    assert frame is not None and "note.txt" in frame.get("name", "")
    assert frame.get(f"{{{ST}}}active") == "true"
    # the window's content is where X has the window, and the frame (with the window
    # manager's decorations) around it
    info = desk.sh("xwininfo -id $(xdotool getactivewindow)")["output"]
    x = {
        k: int(v)
        for k, v in re.findall(r"(Absolute upper-left [XY]|Width|Height):\s+(-?\d+)", info)
    }
    content = frame.find("filler")
    assert content is not None
    assert box(content) == (
        x["Absolute upper-left X"],
        x["Absolute upper-left Y"],
        x["Width"],
        x["Height"],
    ), info
    fx, fy, fw, fh = box(frame)
    cx, cy, cw, ch = box(content)
    assert fx <= cx and fy <= cy and cx + cw <= fx + fw and cy + ch <= fy + fh
    # the text widget holds the file, inside the frame
    texts = [t for t in app.iter("text") if t.get(f"{{{ST}}}editable") == "true"]
    assert [t.text for t in texts] == ["alpha beta\ngamma"]
    tx, ty, tw, th = box(texts[0])
    assert fx <= tx and fy <= ty and tx + tw <= fx + fw and ty + th <= fy + fh
    # a menu is where the tree says: a click at its centre opens it, and its items show
    menu = next(m for m in app.iter("menu") if m.get("name") == "Edit")
    assert f"{{{CP}}}screencoord" in menu.attrib
    items_before = [i for i in menu if i.get(f"{{{ST}}}showing") == "true"]
    assert items_before == []
    mx, my, mw, mh = box(menu)
    desk.act(f"pyautogui.click({mx + mw // 2}, {my + mh // 2})")

    def opened() -> list[ET.Element]:
        m = next(m for m in mousepad(desk).iter("menu") if m.get("name") == "Edit")
        return [i for i in m if i.get(f"{{{ST}}}showing") == "true" and i.get("name", "").strip()]

    until(lambda: len(opened()) >= 3, timeout=10)
    items = opened()
    assert {i.get("name").strip() for i in items} >= {"Undo", "Redo"}
    for i in items:
        ix, iy, _, _ = box(i)
        assert iy >= my + mh - 2 and abs(ix - mx) < 200, (i.get("name"), box(i), box(menu))
    # the linearised table names what a model can click, with the same positions
    rows = a11y.linearize(ET.tostring(tree(desk), encoding="unicode")).splitlines()
    assert any(r.startswith("menu\tEdit") for r in rows), rows[:20]
    assert any(r.startswith("text\t\talpha beta") for r in rows), rows[:20]


def test_apps_without_a_bridge_are_frames_and_resets_keep_the_buses(desk: Desk) -> None:
    open_note(desk, "one")
    assert desk.post("/setup/launch", {"command": ["xterm"]}).status == 200
    until(
        lambda: any(a.get("name", "").lower() == "xterm" for a in tree(desk).findall("application"))
    )
    xterm = next(a for a in tree(desk).findall("application") if a.get("name").lower() == "xterm")
    assert [f.tag for f in xterm] == ["frame"] and len(xterm[0]) == 0
    mousepad(desk)
    # a reset kills the apps but not the buses: the next app registers again
    info = desk.get("/desktop/info").json()
    assert desk.post("/reset").status == 200
    assert tree(desk).findall("application") == []
    open_note(desk, "two")
    assert [t.text for t in mousepad(desk).iter("text") if t.text] == ["two"]
    # a restarted display restarts the buses (the launcher holds the old display)
    a = desk.post("/reset", {"restart_display": True})
    assert a.status == 200 and a.json()["display_restarted"] is True
    open_note(desk, "three")
    assert [t.text for t in mousepad(desk).iter("text") if t.text] == ["three"]
    assert info["root"] == desk.root and os.path.isdir(desk.root)


def test_without_atspi_the_tree_is_frames_and_no_bus_runs(tmp_path) -> None:
    require_desktop()
    d = start_desk(tmp_path / "d")
    try:
        open_note(d, "plain")
        until(lambda: tree(d).find("application/frame") is not None)
        app = tree(d).find("application")
        assert app is not None and [f.tag for f in app] == ["frame"] and len(app[0]) == 0
        env = d.sh("echo $DBUS_SESSION_BUS_ADDRESS $NO_AT_BRIDGE $SAL_USE_VCLPLUGIN")["output"]
        assert env.split() == ["disabled:", "1", "gen"]  # LibreOffice's X11 plugin, as make demo
    finally:
        stop_desk_proc(d.proc)


def test_arpo_envs_up_atspi_gives_every_desktop_its_bus(tmp_path) -> None:
    """`arpo-envs up --atspi` (what `arpo train` starts for a tree observation type): each
    desktop's processes are on that desktop's own session bus, and `down` leaves nothing."""
    from arpo_envs.cli import build_parser
    from arpo_envs.desktop.fleet import FleetConfig, up

    require_atspi()
    assert build_parser().parse_args(["up", "--atspi"]).atspi is True
    cfg = FleetConfig(n=2, base_port=0, atspi=True, state_file=tmp_path / "state.json")
    fleet = up(cfg)
    try:
        buses = []
        for e in fleet.envs:
            d = Desk(e.url, "", "", "", 0, None)  # type: ignore[arg-type]
            buses.append(d.sh("echo $DBUS_SESSION_BUS_ADDRESS")["output"].strip())
            ask = (
                "python -c 'import os; from arpo_envs.desktop.atspi import a11y_address; "
                'print(a11y_address(os.environ["DBUS_SESSION_BUS_ADDRESS"]))\''
            )
            assert d.sh(ask)["output"].startswith("unix:"), d.sh(ask)
        assert all(b.startswith("unix:path=") for b in buses) and len(set(buses)) == 2, buses
        roots = [s.root for s in fleet.state.servers]
    finally:
        fleet.down()
    assert all(marked_pids(r) == [] for r in roots)


def test_an_a11y_tree_episode_on_the_local_suite_sees_the_desktops_table(desk: Desk, tmp_path):
    """A local-suite task (mousepad) played by its oracle with `a11y_tree`: the first prompt
    holds the linearised table of what /accessibility answers on that screen (mousepad's
    widgets, the file's text), and the checker scores the episode 1."""
    import asyncio
    import json

    from arpo_envs.tasks import SUITE_DIR
    from transformers import AutoProcessor

    from arpo import wire
    from arpo.actor.episode import EpisodeConfig, run_episode
    from arpo.actor.scripted import ScriptedPolicy
    from arpo.env.environment import Environment
    from arpo.env.runner import RunnerConfig
    from arpo.env.task import Task, load_task_pool
    from arpo.env.taskfiles import BlobCache, FileSource, TaskFiles
    from arpo.policy.prompt import pixel_bounds
    from arpo.policy.prompt_text import observation_text
    from arpo.policy.tiny import build_tiny_model
    from arpo.record import Status

    processor = AutoProcessor.from_pretrained(build_tiny_model(tmp_path / "tiny"))
    tok = processor.tokenizer
    lo, hi = pixel_bounds(processor)
    index = TaskFiles()
    [task] = load_task_pool(SUITE_DIR / "text_editor" / "editor-append-line.json", index)
    files = FileSource.local(index, BlobCache(tmp_path / "cache"))
    # the scripted policy turns each oracle step into one UI-TARS action: no sleeps
    task["oracle"] = [re.sub(r"; time\.sleep\([\d.]+\)", "", a) for a in task["oracle"]]
    cfg = EpisodeConfig(max_steps=0, observation_type="a11y_tree")
    cfg.validate()

    async def go():
        env = Environment(0, desk.url, RunnerConfig(reset_before_setup=True), files=files)
        try:
            assert await env.prepare(Task.from_dict(task, domain="local")) is None
            until(lambda: "mousepad" in desk.get("/accessibility").json()["AT"])
            xml = await env.client.accessibility()
            grant = wire.Grant("g/0/1", task["id"], "g", 0, 0, json.dumps(task))
            policy = ScriptedPolicy(tokenizer=tok, min_pixels=lo, max_pixels=hi)
            return xml, await run_episode(env, grant, policy, cfg, actor_id="a0")
        finally:
            await env.close()

    xml, traj = asyncio.run(go())
    assert traj.status == Status.OK and traj.checker_score == 1.0, traj.error
    table = a11y.trim(a11y.linearize(xml), tok, cfg.a11y_max_tokens)
    assert "text\t\t" in table and "menu\tFile" in table, table
    want = tok.encode(observation_text("a11y_tree", table), add_special_tokens=False)
    ids = traj.turns[0].prompt_ids.tolist()
    assert any(ids[i : i + len(want)] == want for i in range(len(ids) - len(want) + 1))
