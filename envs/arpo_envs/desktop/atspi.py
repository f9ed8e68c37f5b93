"""The AT-SPI accessibility tree of a local desktop, read over D-Bus, in OSWorld's XML.

OSWorld's VM server answers GET /accessibility with the AT-SPI tree of the GNOME
session, walked through pyatspi (`desktop_env/server/main.py`, `_create_atspi_node`).
A desktop started with `atspi=True` runs what that needs, per desktop and kept across
resets: a session bus (`dbus-daemon --session` on a socket in the desktop's run
folder) and `at-spi-bus-launcher --launch-immediately` (the accessibility bus and
`at-spi2-registryd`). Its apps get that session bus and no `NO_AT_BRIDGE`, so GTK 3
apps (mousepad) register their widgets with the registry.

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
- children up to depth 50 and 1,024 per node (OSWorld's MAX_DEPTH and MAX_WIDTH).

Deviations: LibreOffice Calc's table walk (OSWorld visits only showing cells of a
spreadsheet's table) is not here: the desktops run LibreOffice with its own X11 plugin
(`SAL_USE_VCLPLUGIN=gen`, `arpo_envs.procs.desktop_env`), which has no AT-SPI bridge,
so LibreOffice, xterm and every other app that does not register are listed as their
frames only (`windows.accessibility_xml`). An application that fails while it is walked
(it exited, or it did not answer within the timeout) is left out of that answer and
logged.
"""

from __future__ import annotations

import logging
import subprocess
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from arpo_envs.a11y import NS
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

    def __init__(self, root: Path, env: dict[str, str]):
        self.socket = root / "run" / "bus"
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
        )  # fmt: skip
        self.daemon = subprocess.Popen(
            ["dbus-daemon", "--session", "--nofork", "--nopidfile", f"--address={self.address}"],
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


class _Walker:
    """Calls on the accessibility bus, each with a timeout, and OSWorld's node building."""

    def __init__(self, conn, timeout_s: float):
        self.conn = conn
        self.timeout_s = timeout_s

    def call(self, ref: tuple[str, str], iface: str, method: str, sig=None, body=()) -> tuple:
        from jeepney import DBusAddress, DBusErrorResponse, new_method_call

        msg = new_method_call(
            DBusAddress(ref[1], bus_name=ref[0], interface=iface), method, sig, body
        )
        reply = self.conn.send_and_get_reply(msg, timeout=self.timeout_s)
        if reply.header.message_type.name == "error":
            raise DBusErrorResponse(reply)
        return reply.body

    def prop(self, ref: tuple[str, str], iface: str, name: str) -> Any:
        return self.call(ref, "org.freedesktop.DBus.Properties", "Get", "ss", (iface, name))[0][1]

    def node(self, ref: tuple[str, str], depth: int) -> ET.Element:
        attrs: dict[str, str] = {"name": self.prop(ref, ACCESSIBLE, "Name")}
        words = self.call(ref, ACCESSIBLE, "GetState")[0]
        for i, name in enumerate(STATES):
            if i // 32 < len(words) and words[i // 32] >> (i % 32) & 1:
                attrs[f"{{{NS['st']}}}{name}"] = "true"
        for key, value in self.call(ref, ACCESSIBLE, "GetAttributes")[0].items():
            if key:
                attrs[f"{{{NS['attr']}}}{key}"] = value
        ifaces = set(self.call(ref, ACCESSIBLE, "GetInterfaces")[0])
        st = NS["st"]
        if (
            attrs.get(f"{{{st}}}visible") == "true"
            and attrs.get(f"{{{st}}}showing") == "true"
            and "org.a11y.atspi.Component" in ifaces
        ):
            x, y, w, h = self.call(ref, "org.a11y.atspi.Component", "GetExtents", "u", (0,))[0]
            attrs[f"{{{NS['cp']}}}screencoord"] = str((x, y))
            attrs[f"{{{NS['cp']}}}size"] = str((w, h))
        text = ""
        if "org.a11y.atspi.Text" in ifaces:
            count = self.prop(ref, "org.a11y.atspi.Text", "CharacterCount")
            text = self.call(ref, "org.a11y.atspi.Text", "GetText", "ii", (0, count))[0]
            text = text.replace("\ufffc", "").replace("\ufffd", "")
        if "org.a11y.atspi.Image" in ifaces:
            attrs["image"] = "true"
        if "org.a11y.atspi.Selection" in ifaces:
            attrs["selection"] = "true"
        if "org.a11y.atspi.Value" in ifaces:
            for key, prop in (("value", "CurrentValue"), ("min", "MinimumValue"),
                              ("max", "MaximumValue"), ("step", "MinimumIncrement")):  # fmt: skip
                attrs[f"{{{NS['val']}}}{key}"] = str(self.prop(ref, "org.a11y.atspi.Value", prop))
        if "org.a11y.atspi.Action" in ifaces:
            for name, desc, kb in self.call(ref, "org.a11y.atspi.Action", "GetActions")[0]:
                name = name.replace(" ", "-")
                attrs[f"{{{NS['act']}}}{name}_desc"] = desc
                attrs[f"{{{NS['act']}}}{name}_kb"] = kb
        role = self.call(ref, ACCESSIBLE, "GetRoleName")[0].strip()
        el = ET.Element((role or "unknown").replace(" ", "-"), attrs)
        if text:
            el.text = text
        if depth < MAX_DEPTH:
            for i, child in enumerate(self.call(ref, ACCESSIBLE, "GetChildren")[0]):
                if i == MAX_WIDTH:
                    log.warning("max width reached under %s", el.tag)
                    break
                el.append(self.node(tuple(child), depth + 1))
        return el

    def app_pid(self, ref: tuple[str, str]) -> int | None:
        try:
            return int(
                self.call(
                    ("org.freedesktop.DBus", "/org/freedesktop/DBus"), "org.freedesktop.DBus",
                    "GetConnectionUnixProcessID", "s", (ref[0],),
                )[0]
            )  # fmt: skip
        except Exception:
            return None


def read_apps(
    a11y_bus: str, timeout_s: float = 5.0, deadline_s: float = 30.0
) -> list[tuple[int | None, ET.Element]]:
    """Every registered application's tree with its process id, in the registry's order.

    Each D-Bus call waits at most `timeout_s`; applications not walked by `deadline_s` after
    the start are left out (logged), like an application that fails while it is walked."""
    conn = _connect(a11y_bus, timeout_s)
    try:
        w = _Walker(conn, timeout_s)
        t0 = time.monotonic()
        out = []
        for ref in w.call(REGISTRY, ACCESSIBLE, "GetChildren")[0]:
            ref = tuple(ref)
            if time.monotonic() - t0 > deadline_s:
                log.warning("accessibility tree: %s left out, past %.0f s", ref[0], deadline_s)
                continue
            try:
                out.append((w.app_pid(ref), w.node(ref, 1)))
            except Exception as e:
                log.warning("accessibility tree: %s left out: %s", ref[0], e)
        return out
    finally:
        conn.close()
