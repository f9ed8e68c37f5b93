"""Oracle building blocks: pyautogui code strings that drive the real local desktop.

An oracle is a list of actions, each one pyautogui code string as an agent would send it (the
server runs it after OSWorld's prefix `import pyautogui; import time; ...`). The helpers here
are keyboard-driven and wait where an application needs time, so the same oracle works on a
loaded machine (Calc runs shortcuts such as the Name Box's asynchronously: keys typed too
soon after one land in the grid):

- Calc: the Name Box (ctrl+shift+F5, then ctrl+a: focusing it does not select its text) moves to a cell or selects a range; saving is ctrl+s
  followed by Enter, which picks "Use Excel 2007-365!" if the keep-format dialog shows and only
  moves the cell cursor when it does not;
- Mousepad: ctrl+a / ctrl+end / ctrl+home and typing, ctrl+s to save;
- xterm: type a command line and Enter, then wait for it to finish.
"""

from __future__ import annotations


def write(text: str) -> str:
    """Type `text` (newlines press Enter)."""
    return f"pyautogui.write({text!r}, interval=0.01)"


def calc_goto(ref: str) -> str:
    """Move the cell cursor to `ref` ("B7") or select a range ("D2:D5") through the Name Box."""
    return (
        "pyautogui.hotkey('ctrl', 'shift', 'f5'); time.sleep(1.0); "
        "pyautogui.hotkey('ctrl', 'a'); time.sleep(0.1); "
        f"pyautogui.write({ref!r}, interval=0.03); time.sleep(0.2); "
        "pyautogui.press('enter'); time.sleep(0.6)"
    )


def calc_enter(ref: str, value: str) -> str:
    """One action: go to cell `ref` and enter `value` (text, number or formula)."""
    return f"{calc_goto(ref)}; {write(value + chr(10))}; time.sleep(0.3)"


def calc_save() -> str:
    """Save in the current (xlsx) format, answering the keep-format dialog if it shows."""
    return (
        "pyautogui.hotkey('ctrl', 's'); time.sleep(2.0); pyautogui.press('enter'); time.sleep(1.5)"
    )


def editor_save() -> str:
    return "pyautogui.hotkey('ctrl', 's'); time.sleep(1.0)"


def editor_replace_all(text: str) -> str:
    """Select the whole buffer and type `text` in its place."""
    return f"pyautogui.hotkey('ctrl', 'a'); time.sleep(0.2); {write(text)}; time.sleep(0.3)"


def shell(command: str, wait: float = 1.0) -> str:
    """Type a command line into the focused terminal, run it, wait `wait` seconds."""
    return f"{write(command + chr(10))}; time.sleep({wait})"
