"""The simulated desktop: widgets drawn with Pillow behind the OSWorld VM protocol.

It exists for learning tests and throughput benchmarks; it never stands in for the
real desktop where a test names it. Parts, one file per job:

- `host`: what a widget may ask of its desktop (the protocol both sides share);
- `widgets`: buttons, text fields, check boxes, lists, menus, windows;
- `desktop`: one screen: input routing, focus, rendering, accessibility tree, state;
- `interpreter`: pyautogui programs interpreted from their syntax tree (never exec'd);
- `tasks`: task families, OSWorld-schema task dicts and their oracles;
- `latency`: the configurable step latency;
- `server`: the aiohttp server (`SimDesktopServer`, `SimConfig`).

What it shares with the local desktop lies below both: the PNG encoder that re-compresses
only the changed bands of a frame (`arpo_envs.png`) and the namespaces of OSWorld's
accessibility tree (`arpo_envs.a11y`).
"""

from arpo_envs.sim.desktop import Desktop
from arpo_envs.sim.interpreter import execute
from arpo_envs.sim.latency import LatencyConfig
from arpo_envs.sim.server import SimConfig, SimDesktopServer, serve_until, start_servers
from arpo_envs.sim.tasks import FAMILIES, TaskSpec, generate_tasks, load_scene, write_tasks

__all__ = [
    "FAMILIES",
    "Desktop",
    "LatencyConfig",
    "SimConfig",
    "SimDesktopServer",
    "TaskSpec",
    "execute",
    "generate_tasks",
    "load_scene",
    "serve_until",
    "start_servers",
    "write_tasks",
]
