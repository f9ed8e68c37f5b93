"""Top-level windows of the display: list them, wait for one, activate or close one.

Listing reads openbox's `_NET_CLIENT_LIST` through python-xlib (well under a ms per
poll, no process per poll). Activating and closing go through `wmctrl`, with the
matching rules of OSWorld's server: the name is a case-insensitive substring of the
title, `strict` asks for the whole title with its case, `by_class` matches WM_CLASS.

`accessibility_xml` builds the desktop's tree in OSWorld's format: the AT-SPI trees of the
applications that registered (`arpo_envs.desktop.atspi`, on a desktop started with
`atspi=True`), and for every other window (all of them without `atspi`) its application
and frame with title, state and geometry, nothing below the frame.
"""

from __future__ import annotations

import subprocess
import xml.etree.ElementTree as ET
from dataclasses import dataclass

from Xlib import X, display, error

from arpo_envs.a11y import NS

NS_STATE, NS_COMPONENT = NS["st"], NS["cp"]


@dataclass(frozen=True, slots=True)
class Window:
    wid: int
    title: str
    wm_class: tuple[str, ...]
    pid: int | None
    x: int
    y: int
    width: int
    height: int
    active: bool


class WindowList:
    """A python-xlib connection to the display, for reading its windows."""

    def __init__(self, name: str):
        self.d = display.Display(name)
        self.root = self.d.screen().root
        self._atoms = {
            n: self.d.intern_atom(n)
            for n in (
                "_NET_CLIENT_LIST",
                "_NET_WM_NAME",
                "_NET_WM_PID",
                "_NET_ACTIVE_WINDOW",
                "UTF8_STRING",
            )
        }

    def close(self) -> None:
        self.d.close()

    def _prop(self, win, name: str):
        p = win.get_full_property(self._atoms[name], X.AnyPropertyType)
        return p.value if p is not None else None

    def windows(self) -> list[Window]:
        ids = self._prop(self.root, "_NET_CLIENT_LIST")
        active = self._prop(self.root, "_NET_ACTIVE_WINDOW")
        active_id = int(active[0]) if active is not None and len(active) else 0
        out = []
        for wid in ids if ids is not None else []:
            win = self.d.create_resource_object("window", int(wid))
            try:
                raw = self._prop(win, "_NET_WM_NAME")
                if raw is None:
                    raw = win.get_wm_name() or ""
                title = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
                cls = win.get_wm_class() or ()
                pid = self._prop(win, "_NET_WM_PID")
                geo = win.get_geometry()
                pos = win.translate_coords(self.root, 0, 0)
                out.append(
                    Window(
                        int(wid),
                        title,
                        tuple(cls),
                        int(pid[0]) if pid is not None and len(pid) else None,
                        -pos.x,
                        -pos.y,
                        geo.width,
                        geo.height,
                        int(wid) == active_id,
                    )
                )
            except error.XError:
                continue  # closed while we looked at it
        return out


def matches(w: Window, name: str, strict: bool, by_class: bool) -> bool:
    """OSWorld's (wmctrl's) window matching rule."""
    if by_class:
        cls = ".".join(w.wm_class)
        return cls == name if strict else name.lower() in cls.lower()
    return w.title == name if strict else name.lower() in w.title.lower()


def wmctrl(action: str, name: str, strict: bool, by_class: bool, env: dict[str, str]) -> int:
    """`wmctrl -[x][F]<action> name` (action "a": activate, "c": close); its exit code."""
    flags = ("x" if by_class else "") + ("F" if strict else "") + action
    r = subprocess.run(
        ["wmctrl", f"-{flags}", name], env=env, capture_output=True, timeout=10, check=False
    )
    return r.returncode


def accessibility_xml(
    windows: list[Window], registered: list[tuple[int | None, ET.Element]] = ()
) -> str:
    """OSWorld's tree: desktop-frame > the `registered` AT-SPI applications (process id,
    tree), then application > frame for each window no registered process owns."""
    ET.register_namespace("st", NS_STATE)
    ET.register_namespace("cp", NS_COMPONENT)
    root = ET.Element("desktop-frame", {"name": "main"})
    for _, tree in registered:
        root.append(tree)
    covered = {pid for pid, _ in registered if pid is not None}
    apps: dict[str, ET.Element] = {}
    for w in windows:
        if w.pid is not None and w.pid in covered:
            continue
        app_name = w.wm_class[-1] if w.wm_class else "unknown"
        app = apps.get(app_name)
        if app is None:
            app = apps[app_name] = ET.SubElement(root, "application", {"name": app_name})
        attrs = {
            "name": w.title,
            f"{{{NS_STATE}}}showing": "true",
            f"{{{NS_STATE}}}visible": "true",
            f"{{{NS_COMPONENT}}}screencoord": f"({w.x}, {w.y})",
            f"{{{NS_COMPONENT}}}size": f"({w.width}, {w.height})",
        }
        if w.active:
            attrs[f"{{{NS_STATE}}}active"] = "true"
        ET.SubElement(app, "frame", attrs)
    return ET.tostring(root, encoding="unicode")
