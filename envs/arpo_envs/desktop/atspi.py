"""The AT-SPI accessibility tree of a local desktop, read over D-Bus, in OSWorld's XML.

OSWorld's VM server answers GET /accessibility with the AT-SPI tree of the GNOME
session, walked through pyatspi (`desktop_env/server/main.py`, `_create_atspi_node`).
A desktop started with `atspi=True` runs what that needs, per desktop and kept across
resets: a session bus (`dbus-daemon --session` on a socket in the desktop's run
folder) and `at-spi-bus-launcher --launch-immediately` (the accessibility bus and
`at-spi2-registryd`). Its apps get that session bus and no `NO_AT_BRIDGE`, and
LibreOffice runs with its GTK 3 plugin (`SAL_USE_VCLPLUGIN=gtk3`, set by `Desktop`), so
GTK 3 apps (mousepad) and LibreOffice register their widgets with the registry.

`read_apps` walks the registry's applications with a pure-Python D-Bus client
(jeepney), the same way OSWorld's code walks pyatspi's objects, and builds the same
elements:

- the tag is the role name with spaces as dashes ("push-button"; "unknown" when empty);
- `name`; every state as `st:<state>="true"` (AT-SPI's state names, lower case);
  every object attribute as `attr:<key>`;
- for a node both visible and showing that has the Component interface,
  `cp:screencoord="(x, y)"` and `cp:size="(w, h)"` (screen coordinates);
- the Text interface's whole text (U+FFFC and U+FFFD removed) as the element's text;
- `image="true"` / `selection="true"` when the node has those interfaces, the Value
  interface as `val:value|min|max|step`, each action as `act:<name>_desc` / `_kb`;
- children up to depth 50 and 1,024 per node (OSWorld's MAX_DEPTH and MAX_WIDTH);
- below a "document spreadsheet" (Calc), a table's children are its showing cells, row
  by row (OSWorld's `calc` flag).

The calls for a group of sibling nodes go out together and their replies are read after
(`_Walker.batch`), so a walk waits for a few round trips per group rather than one per
call; each batch waits at most `timeout_s`.

Deviations from OSWorld's server:
1. Calc's cells: OSWorld asks for cells by index from A1 and keeps the showing ones
   (up to 500 rows and columns of hidden cells before it gives up). Here the cells at
   the table's corners on screen give the first and last row and column in view, and
   only those cells are asked for (`_Walker.visible_cells`); the showing ones are kept,
   as there. A node with more than MAX_WIDTH children, or one that manages its
   descendants, is asked for its children one index at a time: GetChildren on a Calc
   sheet (2^31 children) makes LibreOffice build every cell and stop answering.
2. A budget: one answer walks at most `max_nodes` nodes (`DesktopConfig.a11y_max_nodes`)
   in document order; the rest is left out and logged. OSWorld's server has none.
3. LibreOffice's root pane is moved to where its GTK container is (`place_root_panes`):
   LibreOffice 7.4's GTK 3 plugin reports the window's content 25 pixels too high for a
   while after the window opens.
Apps that do not register (xterm) are listed as their frames only
(`windows.accessibility_xml`). An application that fails while it is walked (it exited,
or it did not answer within the timeout) is left out of that answer and logged.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from arpo_envs.a11y import NS
from arpo_envs.desktop.user import DesktopUser
from arpo_envs.procs import descendants, disown, own, set_parent_death_signal

log = logging.getLogger("arpo_envs.desktop.atspi")

MAX_DEPTH = 50
"""Deepest level walked (OSWorld's MAX_DEPTH)."""
MAX_WIDTH = 1024
"""Most children walked per node (OSWorld's MAX_WIDTH)."""

STATES = [
    "invalid",
    "active",
    "armed",
    "busy",
    "checked",
    "collapsed",
    "defunct",
    "editable",
    "enabled",
    "expandable",
    "expanded",
    "focusable",
    "focused",
    "has_tooltip",
    "horizontal",
    "iconified",
    "modal",
    "multi_line",
    "multiselectable",
    "opaque",
    "pressed",
    "resizable",
    "selectable",
    "selected",
    "sensitive",
    "showing",
    "single_line",
    "stale",
    "transient",
    "vertical",
    "visible",
    "manages_descendants",
    "indeterminate",
    "required",
    "truncated",
    "animated",
    "invalid_entry",
    "supports_autocompletion",
    "selectable_text",
    "is_default",
    "visited",
    "checkable",
    "has_popup",
    "read_only",
]
"""AT-SPI's StateType names by bit (atspi-constants.h), as pyatspi's `STATE_X` lower-cased."""

ACCESSIBLE = "org.a11y.atspi.Accessible"
REGISTRY = ("org.a11y.atspi.Registry", "/org/a11y/atspi/accessible/root")
BUS_LAUNCHER = "/usr/libexec/at-spi-bus-launcher"


class AtspiError(RuntimeError):
    """The session bus or the accessibility bus could not be started or reached."""


class A11yBus:
    """A desktop's session bus and AT-SPI registry (started after its display)."""

    def __init__(self, root: Path, env: dict[str, str], user: DesktopUser | None = None):
        self.socket = root / "run" / "bus"
        self.user = user
        """Whom the buses run as (None: the server's user), with the desktop's programs:
        a session bus admits its own user's connections and the server's (`_config`)."""
        self.address = f"unix:path={self.socket}"
        self.a11y = ""
        """The accessibility bus's address, asked once per start (not per tree read)."""
        self.env = env
        self.daemon: subprocess.Popen | None = None
        self.launcher: subprocess.Popen | None = None

    def session_env(self) -> dict[str, str]:
        """What the desktop's processes get on top of their environment."""
        return {"DBUS_SESSION_BUS_ADDRESS": self.address}

    def start(self, timeout_s: float = 10.0) -> None:
        """Start the session bus, then the accessibility bus launcher; wait until the
        accessibility bus answers (AtspiError naming what did not start)."""
        if not Path(BUS_LAUNCHER).exists():
            raise AtspiError(
                f"{BUS_LAUNCHER} is missing: install at-spi2-core (make setup does), or start "
                "the desktop without atspi"
            )
        self.socket.unlink(missing_ok=True)
        env = {**self.env, **self.session_env()}
        env.pop("NO_AT_BRIDGE", None)
        kw: dict[str, Any] = dict(
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True,
            preexec_fn=set_parent_death_signal,
            **(self.user.popen_kwargs() if self.user else {}),
        )  # fmt: skip
        config = ["--session"] if self.user is None else [f"--config-file={self._config()}"]
        self.daemon = subprocess.Popen(
            ["dbus-daemon", *config, "--nofork", "--nopidfile", f"--address={self.address}"],
            **kw,
        )
        own(self.daemon.pid)
        deadline = time.monotonic() + timeout_s
        while not self.socket.exists():
            if self.daemon.poll() is not None or time.monotonic() > deadline:
                raise AtspiError(f"dbus-daemon did not open {self.socket} within {timeout_s} s")
            time.sleep(0.01)
        self.launcher = subprocess.Popen([BUS_LAUNCHER, "--launch-immediately"], **kw)
        own(self.launcher.pid)
        while True:
            try:
                self.a11y = a11y_address(self.address, timeout_s=1.0)
                return
            except Exception as e:
                if self.launcher.poll() is not None or time.monotonic() > deadline:
                    raise AtspiError(
                        f"the accessibility bus did not come up within {timeout_s} s: {e}"
                    ) from e
                time.sleep(0.05)

    def _config(self) -> Path:
        """The session bus's configuration when it runs as the desktop's user: the system's
        session bus, which admits its own user only, and the server's user (which asks it
        for the accessibility bus; that bus admits root already)."""
        path = self.socket.with_name("session-bus.conf")
        path.write_text(
            '<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN" '
            '"http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">\n<busconfig>'
            "<include>/usr/share/dbus-1/session.conf</include>"
            f'<policy context="default"><allow user="{os.geteuid()}"/></policy></busconfig>\n'
        )
        return path

    def pids(self) -> list[int]:
        """The bus processes and what the launcher started (kept by a reset)."""
        out = []
        for p in (self.daemon, self.launcher):
            if p is not None and p.poll() is None:
                out.append(p.pid)
        if self.launcher is not None and self.launcher.poll() is None:
            out += descendants(self.launcher.pid)
        return out

    def alive(self) -> bool:
        return all(p is not None and p.poll() is None for p in (self.daemon, self.launcher))

    def stop(self) -> None:
        for p in (self.launcher, self.daemon):
            if p is not None and p.poll() is None:
                p.kill()
            if p is not None:
                p.wait(5)
                disown(p.pid)
        self.daemon = self.launcher = None
        self.a11y = ""


def _connect(address: str, timeout_s: float):
    from jeepney.io.blocking import open_dbus_connection

    return open_dbus_connection(address, auth_timeout=timeout_s)


def a11y_address(session_address: str, timeout_s: float = 5.0) -> str:
    """The accessibility bus's address, from `org.a11y.Bus.GetAddress` on the session bus."""
    from jeepney import DBusAddress, new_method_call

    conn = _connect(session_address, timeout_s)
    try:
        msg = new_method_call(
            DBusAddress("/org/a11y/bus", bus_name="org.a11y.Bus", interface="org.a11y.Bus"),
            "GetAddress",
        )
        return conn.send_and_get_reply(msg, timeout=timeout_s).body[0]
    finally:
        conn.close()


class Budget:
    """How much one /accessibility answer may walk: `max_nodes` elements in all (the
    desktop's `a11y_max_nodes`); `cut` counts the nodes left out once it is spent."""

    def __init__(self, max_nodes: int):
        self.left = max_nodes
        self.cut = 0

    def take(self, n: int) -> int:
        """How many of `n` nodes may still be walked (counted as walked); the rest are cut."""
        k = min(n, self.left)
        self.left -= k
        self.cut += n - k
        return k


_Ref = tuple[str, str]
_PROPS = "org.freedesktop.DBus.Properties"
_COMPONENT, _TABLE = "org.a11y.atspi.Component", "org.a11y.atspi.Table"
_CELL = re.compile(r"([A-Z]{1,3})([1-9][0-9]{0,6})")
"""A Calc cell's accessible name: its reference, e.g. "AB12"."""


class _Walker:
    """Calls on the accessibility bus and OSWorld's node building, one sibling group at a time.

    The calls for every node of a group are sent together and their replies read after
    (`batch`): the walk waits for one round trip per step of a group, not per call
    (a node takes 7 to 13 calls). Each batch waits at most `timeout_s` for its replies."""

    def __init__(self, conn, timeout_s: float, budget: Budget):
        self.conn = conn
        self.timeout_s = timeout_s
        self.budget = budget

    def batch(self, calls: list[tuple[_Ref, str, str, str | None, tuple]]) -> list[Any]:
        """Each call's reply body, in order; an error reply is its `DBusErrorResponse`
        (not raised: an interface a node lacks is an answer). TimeoutError when the
        replies do not all come within `timeout_s`."""
        from jeepney import (
            DBusAddress,
            DBusErrorResponse,
            HeaderFields,
            MessageType,
            new_method_call,
        )

        serials, data = [], []
        for ref, iface, method, sig, body in calls:
            msg = new_method_call(
                DBusAddress(ref[1], bus_name=ref[0], interface=iface), method, sig, body
            )
            serial = next(self.conn.outgoing_serial)
            data.append(msg.serialise(serial=serial))
            serials.append(serial)
        self.conn.sock.sendall(b"".join(data))  # one write for the batch, not one per call
        wanted, got = set(serials), {}
        deadline = time.monotonic() + self.timeout_s
        while len(got) < len(serials):
            msg = self.conn.receive(timeout=max(0.0, deadline - time.monotonic()))
            reply_to = msg.header.fields.get(HeaderFields.reply_serial)
            if reply_to in wanted:
                got[reply_to] = msg
        out = []
        for s in serials:
            msg = got[s]
            out.append(
                DBusErrorResponse(msg) if msg.header.message_type == MessageType.error else msg.body
            )
        return out

    def call(self, ref: _Ref, iface: str, method: str, sig=None, body=()) -> tuple:
        [reply] = self.batch([(ref, iface, method, sig, body)])
        if isinstance(reply, Exception):
            raise reply
        return reply

    def group(
        self, refs: list[_Ref], depth: int, flag: str, showing_only: bool = False
    ) -> list[ET.Element]:
        """The elements of sibling nodes `refs` with their subtrees, in order (OSWorld's
        `_create_atspi_node` for each). `showing_only`: leave out the nodes that are not
        showing (a Calc table's cells). Stops where the budget is spent."""
        if not refs:
            return []
        st, cp = NS["st"], NS["cp"]
        first = self.batch([
            c for ref in refs for c in (
                (ref, _PROPS, "GetAll", "s", (ACCESSIBLE,)),
                (ref, ACCESSIBLE, "GetState", None, ()),
                (ref, ACCESSIBLE, "GetAttributes", None, ()),
                (ref, ACCESSIBLE, "GetInterfaces", None, ()),
                (ref, ACCESSIBLE, "GetRoleName", None, ()),
            )
        ])  # fmt: skip
        nodes = []
        for i, ref in enumerate(refs):
            props, state, attributes, ifaces, role = first[5 * i : 5 * i + 5]
            for reply in (props, state, attributes, ifaces, role):
                if isinstance(reply, Exception):
                    raise reply
            words = state[0]
            states = {
                name for b, name in enumerate(STATES)
                if b // 32 < len(words) and words[b // 32] >> (b % 32) & 1
            }  # fmt: skip
            if showing_only and "showing" not in states:
                continue
            props = {k: v[1] for k, v in props[0].items()}
            nodes.append((ref, props, states, attributes[0], set(ifaces[0]), role[0].strip()))
        nodes = nodes[: self.budget.take(len(nodes))]
        second: list[tuple] = []
        for ref, _, states, _, ifaces, _ in nodes:
            if {"visible", "showing"} <= states and "org.a11y.atspi.Component" in ifaces:
                second.append((ref, _COMPONENT, "GetExtents", "u", (0,)))
            if "org.a11y.atspi.Text" in ifaces:
                second.append((ref, "org.a11y.atspi.Text", "GetText", "ii", (0, -1)))
            if "org.a11y.atspi.Value" in ifaces:
                second.append((ref, _PROPS, "GetAll", "s", ("org.a11y.atspi.Value",)))
            if "org.a11y.atspi.Action" in ifaces:
                second.append((ref, "org.a11y.atspi.Action", "GetActions", None, ()))
        replies = iter(self.batch(second))

        def answer() -> Any:
            reply = next(replies)
            if isinstance(reply, Exception):
                raise reply
            return reply[0]

        out: list[tuple[ET.Element, _Ref, dict, set, set, str, str]] = []
        for ref, props, states, attributes, ifaces, role in nodes:
            attrs: dict[str, str] = {"name": props.get("Name", "")}
            for name in STATES:  # AT-SPI's order, as pyatspi lists them
                if name in states:
                    attrs[f"{{{st}}}{name}"] = "true"
            for key, value in attributes.items():
                if key:
                    attrs[f"{{{NS['attr']}}}{key}"] = value
            if {"visible", "showing"} <= states and "org.a11y.atspi.Component" in ifaces:
                x, y, w, h = answer()
                attrs[f"{{{cp}}}screencoord"] = str((x, y))
                attrs[f"{{{cp}}}size"] = str((w, h))
            text = ""
            if "org.a11y.atspi.Text" in ifaces:
                text = answer().replace("\ufffc", "").replace("\ufffd", "")
            if "org.a11y.atspi.Image" in ifaces:
                attrs["image"] = "true"
            if "org.a11y.atspi.Selection" in ifaces:
                attrs["selection"] = "true"
            if "org.a11y.atspi.Value" in ifaces:
                value = {k: v[1] for k, v in answer().items()}
                for key, prop in (("value", "CurrentValue"), ("min", "MinimumValue"),
                                  ("max", "MaximumValue"), ("step", "MinimumIncrement")):  # fmt: skip
                    if prop in value:
                        attrs[f"{{{NS['val']}}}{key}"] = str(value[prop])
            if "org.a11y.atspi.Action" in ifaces:
                for name, desc, kb in answer():
                    name = name.replace(" ", "-")
                    attrs[f"{{{NS['act']}}}{name}_desc"] = desc
                    attrs[f"{{{NS['act']}}}{name}_kb"] = kb
            el = ET.Element((role or "unknown").replace(" ", "-"), attrs)
            if text:
                el.text = text
            # OSWorld's flag: below a spreadsheet document, a table is a sheet's cells
            sub = flag or ("calc" if role == "document spreadsheet" else "")
            out.append((el, ref, props, states, ifaces, role, sub))
        if depth < MAX_DEPTH:
            # the child lists of the group's ordinary nodes in one batch
            plain = [
                ref for _, ref, props, states, ifaces, role, sub in out
                if 0 < int(props.get("ChildCount", 0)) <= MAX_WIDTH
                and "manages_descendants" not in states
                and not (sub == "calc" and role == "table" and _TABLE in ifaces)
            ]  # fmt: skip
            lists = self.batch([(r, ACCESSIBLE, "GetChildren", None, ()) for r in plain])
            listed = dict(zip(plain, lists, strict=True))
            for el, ref, props, states, ifaces, role, sub in out:
                if self.budget.left <= 0:  # at most MAX_WIDTH counted per node
                    self.budget.cut += min(int(props.get("ChildCount", 0)), MAX_WIDTH)
                    continue
                if sub == "calc" and role == "table" and _TABLE in ifaces:
                    kids = self.visible_cells(ref)
                    el.extend(self.group(kids, depth + 1, sub, True))
                    continue
                if ref in listed:
                    if isinstance(listed[ref], Exception):
                        raise listed[ref]
                    kids = [tuple(c) for c in listed[ref][0]]
                else:
                    kids = self.children(ref, props, states)
                el.extend(self.group(kids, depth + 1, sub))
        return [el for el, *_ in out]

    def children(self, ref: _Ref, props: dict, states: set[str]) -> list[_Ref]:
        """The first MAX_WIDTH children of a node with more, or of one that manages its
        descendants (which makes them on request), asked for one index at a time: its
        GetChildren would make every one of them. (`group` lists the others' children.)"""
        n = int(props.get("ChildCount", 0))
        if n <= 0:
            return []
        if n > MAX_WIDTH:
            log.warning("max width reached: %d children, %d walked", n, MAX_WIDTH)
        replies = self.batch(
            [(ref, ACCESSIBLE, "GetChildAtIndex", "i", (i,)) for i in range(min(n, MAX_WIDTH))]
        )
        return [tuple(r[0]) for r in replies if not isinstance(r, Exception)]

    def visible_cells(self, table: _Ref) -> list[_Ref]:
        """The cells of a Calc sheet that lie in its table's box on screen, row by row.

        OSWorld visits a spreadsheet's cells by index from A1 and keeps the showing ones;
        here the first and last cell in view are the cells at the box's corners, and the
        rows and columns between them are asked for by position (the caller keeps the
        showing ones: frozen rows and columns leave a gap between)."""
        x, y, w, h = self.call(table, _COMPONENT, "GetExtents", "u", (0,))[0]
        if w <= 0 or h <= 0:
            return []
        corners = self.batch([
            (table, _COMPONENT, "GetAccessibleAtPoint", "iiu", (x, y, 0)),
            (table, _COMPONENT, "GetAccessibleAtPoint", "iiu", (x + w - 1, y + h - 1, 0)),
        ])  # fmt: skip
        where = []
        for reply in corners:
            if isinstance(reply, Exception):
                return []
            name = self.call(tuple(reply[0]), _PROPS, "Get", "ss", (ACCESSIBLE, "Name"))[0][1]
            m = _CELL.fullmatch(name)
            if m is None:
                log.warning("accessibility tree: a sheet's corner cell is named %r, not like "
                            "'A1': its cells are left out", name)  # fmt: skip
                return []
            col = 0
            for ch in m.group(1):
                col = col * 26 + ord(ch) - 64
            where.append((int(m.group(2)) - 1, col - 1))
        (r0, c0), (r1, c1) = where
        cells = (r1 - r0 + 1) * (c1 - c0 + 1)
        if cells > self.budget.left:  # rows past the budget are never asked for
            r1 = r0 + max(0, self.budget.left // max(1, c1 - c0 + 1))
        replies = self.batch([
            (table, _TABLE, "GetAccessibleAt", "ii", (r, c))
            for r in range(r0, r1 + 1) for c in range(c0, c1 + 1)
        ])  # fmt: skip
        return [tuple(r[0]) for r in replies if not isinstance(r, Exception)]

    def app_pid(self, ref: _Ref) -> int | None:
        try:
            return int(
                self.call(
                    ("org.freedesktop.DBus", "/org/freedesktop/DBus"), "org.freedesktop.DBus",
                    "GetConnectionUnixProcessID", "s", (ref[0],),
                )[0]
            )  # fmt: skip
        except Exception:
            return None


def _box(el: ET.Element) -> tuple[int, int, int, int] | None:
    cp = NS["cp"]
    pos, size = el.get(f"{{{cp}}}screencoord"), el.get(f"{{{cp}}}size")
    if pos is None or size is None:
        return None
    (x, y), (w, h) = (tuple(int(v) for v in re.findall(r"-?\d+", t)) for t in (pos, size))
    return x, y, w, h


def place_root_panes(tree: ET.Element) -> int:
    """Move every LibreOffice root pane, with all below it, to where its GTK container is;
    returns how many were moved.

    LibreOffice's GTK 3 plugin puts the window's content in a GTK box below the native
    menu bar, but reports the content's root pane, and so every toolbar, cell and sidebar
    button, at the top of the box as if the menu bar were not there: 25 pixels above where
    the screen has them (LibreOffice 7.4). The container has the root pane's size; its
    position is the true one, so the pane's subtree is shifted by the difference."""
    cp = NS["cp"]
    moved = 0
    for parent in tree.iter():
        outer = _box(parent)
        for child in parent:
            inner = _box(child) if child.tag == "root-pane" else None
            if outer is None or inner is None or outer[2:] != inner[2:] or outer == inner:
                continue
            dx, dy = outer[0] - inner[0], outer[1] - inner[1]
            for el in child.iter():
                b = _box(el)
                if b is not None:
                    el.set(f"{{{cp}}}screencoord", str((b[0] + dx, b[1] + dy)))
            moved += 1
    return moved


def read_apps(
    a11y_bus: str, timeout_s: float = 5.0, deadline_s: float = 30.0, max_nodes: int = 10_000
) -> tuple[list[tuple[int | None, ET.Element]], int]:
    """Every registered application's tree with its process id, in the registry's order,
    and how many nodes were left out past `max_nodes` (walked depth-first, as OSWorld
    lists them: what comes last in the document is cut first).

    Each batch of D-Bus calls waits at most `timeout_s`; applications not walked by
    `deadline_s` after the start are left out (logged), like an application that fails
    while it is walked."""
    conn = _connect(a11y_bus, timeout_s)
    try:
        budget = Budget(max_nodes)
        w = _Walker(conn, timeout_s, budget)
        t0 = time.monotonic()
        out = []
        for ref in w.call(REGISTRY, ACCESSIBLE, "GetChildren")[0]:
            ref = tuple(ref)
            if time.monotonic() - t0 > deadline_s:
                log.warning("accessibility tree: %s left out, past %.0f s", ref[0], deadline_s)
                continue
            try:
                [tree] = w.group([ref], 1, "") or [None]
            except Exception as e:
                log.warning("accessibility tree: %s left out: %r", ref[0], e)
                continue
            if tree is not None:
                place_root_panes(tree)
                out.append((w.app_pid(ref), tree))
        if budget.cut:
            log.warning("accessibility tree: %d nodes past the budget of %d left out",
                        budget.cut, max_nodes)  # fmt: skip
        return out, budget.cut
    finally:
        conn.close()
