"""The local desktop: a real Xvfb display with openbox and real applications behind the
OSWorld VM protocol, so an actor cannot tell it from an OSWorld VM. Parts, one file per job:

- `display`: Xvfb + openbox of one desktop (start, stop, lock files);
- `home`: the home directory and the LibreOffice profile template, rebuilt on reset;
- `executor`: /execute: pyautogui code in process, everything else as a subprocess;
- `screen`: screenshots (mss + PNG level 1) and the pointer;
- `windows`: window listing, waiting, activation (python-xlib, wmctrl);
- `atspi`: the AT-SPI trees of the apps that register, read over D-Bus;
- `desktop`: one desktop: its display, home, /tmp and programs, started, reset, stopped
  (`Desktop`, `DesktopConfig`);
- `server`: the aiohttp server of one desktop, one process each (`DesktopServer`);
- `fleet`: N desktop server processes: `arpo-envs up` / `status` / `down`.

The processes of a desktop (its environment and marker; finding and killing them) are
`arpo_envs.procs`, which the VM fleet uses too.

What it shares with the simulated desktop lies below both: the PNG encoder
(`arpo_envs.png`) and the namespaces of OSWorld's accessibility tree (`arpo_envs.a11y`).

Needs the `desktop` extra (mss, pyautogui, python-xlib) and the Debian packages that
`make sysdeps` installs.
"""
