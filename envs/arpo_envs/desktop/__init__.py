"""The local desktop: a real Xvfb display with openbox and real applications behind the
OSWorld VM protocol, so an actor cannot tell it from an OSWorld VM. Parts, one file per job:

- `display`: Xvfb + openbox of one desktop (start, stop, lock files);
- `home`: the home directory and the LibreOffice profile template, rebuilt on reset;
- `procs`: the desktop's process environment and marker; finding and killing its processes;
- `executor`: /execute: pyautogui code in process, everything else as a subprocess;
- `screen`: screenshots (mss + PNG level 1) and the pointer;
- `windows`: window listing, waiting, activation (python-xlib, wmctrl);
- `server`: the aiohttp server of one desktop (`DesktopServer`, `DesktopConfig`);
- `fleet`: N desktop server processes: `arpo-envs up` / `arpo-envs down`.

Needs the `desktop` extra (mss, pyautogui, python-xlib) and the Debian packages that
`make sysdeps` installs.
"""
