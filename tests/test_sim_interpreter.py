"""The pyautogui interpreter of the simulated desktop: what it runs, what it refuses, and that
refused code never runs (no file appears, no state changes)."""

from __future__ import annotations

import pytest
from arpo_envs.sim import Desktop, execute, load_scene
from arpo_envs.sim.interpreter import ProgramError, command_to_code
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

PREFIX = "import pyautogui; import time; pyautogui.FAILSAFE = False; "


@pytest.fixture
def desk() -> Desktop:
    d = Desktop(1280, 720)
    load_scene(d, "type_submit", 0)
    return d


@pytest.mark.parametrize(
    "code",
    [
        "__import__('os').system('touch {marker}')",
        "import os; os.system('touch {marker}')",
        "open('{marker}', 'w').write('x')",
        "exec(\"open('{marker}', 'w')\")",
        "eval(\"__import__('os').system('touch {marker}')\")",
        "import subprocess; subprocess.run(['touch', '{marker}'])",
        "from os import system; system('touch {marker}')",
        "import pyautogui as p, os; os.system('touch {marker}')",
        "pyautogui.click.__globals__['os'].system('touch {marker}')",
        "time.__loader__.load_module('os').system('touch {marker}')",
        "pyautogui.write(open('{marker}', 'w').name)",
        "pyautogui.write(''.join(['touch', ' {marker}']))",
        "[pyautogui.click(1, 1) for _ in range(3)]; open('{marker}', 'w')",
        "x = open; x('{marker}', 'w')",
        "pyautogui.PAUSE = open('{marker}', 'w')",
        "(lambda: open('{marker}', 'w'))()",
        "pyautogui.click(1, 1)\nimport shutil; shutil.rmtree('/')",
    ],
)
def test_exec_style_code_is_refused_and_never_runs(desk: Desktop, tmp_path, code: str) -> None:
    marker = tmp_path / "pwned"
    before = (desk.version, desk.cursor, desk.lookup("widgets"))
    result = execute(PREFIX + code.format(marker=marker), desk)
    assert result.returncode == 1
    assert "not allowed on the simulated desktop" in result.error
    assert not marker.exists()
    # rejected as a whole: not even the allowed statements before the bad one ran
    assert (desk.version, desk.cursor, desk.lookup("widgets")) == before


def test_osworld_controller_actions_run(desk: Desktop) -> None:
    """The exact shapes OSWorld's PythonController.execute_action sends."""
    for code in [
        "pyautogui.moveTo(100, 200, 0.73, pyautogui.easeInOutQuad)",
        "pyautogui.click(button='left', x=300, y=310, clicks=2)",
        "pyautogui.click(button='right')",
        "pyautogui.mouseDown(button='left')",
        "pyautogui.mouseUp(button='left')",
        "pyautogui.rightClick(x=10, y=20)",
        "pyautogui.doubleClick(x=10, y=20)",
        "pyautogui.dragTo(400, 300, duration=1.0, button='left', mouseDownUp=True)",
        "pyautogui.hscroll(3)",
        "pyautogui.vscroll(-3)",
        "pyautogui.typewrite('it\\'s \"quoted\"')",
        "pyautogui.press('enter')",
        "pyautogui.keyDown('shift')",
        "pyautogui.keyUp('shift')",
        "pyautogui.hotkey('ctrl', 'a')",
    ]:
        result = execute(PREFIX + code, desk)
        assert (result.returncode, result.error) == (0, ""), code
    assert desk.cursor == (400, 300)  # where the drag ended


def test_uitars_style_program_with_docstring_and_clipboard(desk: Desktop) -> None:
    field = desk.widgets["text"]
    code = (
        "import pyautogui\nimport time\n'''\nObservation:\n\nThought:\nclick the field\n'''\n"
        f"\npyautogui.click({field.center[0]}.5, {field.center[1]}.25, button='left')"
        "\ntime.sleep(1)\nimport pyperclip\npyperclip.copy('hello world')"
        "\npyautogui.hotkey('ctrl', 'v')\ntime.sleep(0.5)\n\npyautogui.press('enter')"
    )
    result = execute(code, desk)
    assert result.returncode == 0, result.error
    assert result.sleep_s == 1.5
    assert desk.lookup("submitted.text") == "hello world"


def test_typing_editing_and_select_all(desk: Desktop) -> None:
    field = desk.widgets["text"]
    x, y = field.center
    steps = [
        f"pyautogui.click({x}, {y})",
        "pyautogui.write('hello')",
        "pyautogui.press(['left', 'left', 'backspace'])",  # hel|lo -> he|lo
        "pyautogui.write('X')",
        "pyautogui.press('end'); pyautogui.write(['a', 'b'])",
        "pyautogui.keyDown('shift'); pyautogui.press('q'); pyautogui.keyUp('shift')",
    ]
    for code in steps:
        assert execute(PREFIX + code, desk).returncode == 0
    assert field.value == "heXloabQ"
    execute(PREFIX + "pyautogui.hotkey('ctrl', 'a'); pyautogui.write('new')", desk)
    assert field.value == "new"
    execute(PREFIX + "pyautogui.press('nosuchkey'); pyautogui.press('f5')", desk)
    assert field.value == "new"  # unknown and unbound keys do nothing, like pyautogui


def test_print_answers_queries(desk: Desktop) -> None:
    r = execute(
        PREFIX + "pyautogui.moveTo(12, 34); print(pyautogui.position()); print(pyautogui.size())",
        desk,
    )
    assert r.output == "Point(x=12, y=34)\nSize(width=1280, height=720)\n"
    r = execute("import platform; print(platform.system())", desk)
    assert (r.output, r.returncode) == ("Linux\n", 0)
    r = execute("print('a', 1, sep='-', end='!')", desk)
    assert r.output == "a-1!"


def test_runtime_errors_stop_after_earlier_statements_like_python(desk: Desktop) -> None:
    r = execute(PREFIX + "pyautogui.moveTo(5, 6)\npyautogui.click(1, 2, bogus=3)\n", desk)
    assert r.returncode == 1
    assert "TypeError" in r.error and "bogus" in r.error
    assert desk.cursor == (5, 6)  # the first line ran, like in a real interpreter
    r = execute(PREFIX + "pyautogui.click(1, 2, button='sideways')", desk)
    assert r.returncode == 1 and "ValueError" in r.error
    r = execute("pyautogui.click(1, 2)", desk)
    assert r.returncode == 1 and "NameError: name 'pyautogui' is not defined" in r.error
    r = execute(PREFIX + "pyautogui.click(1, 2", desk)
    assert r.returncode == 1 and "SyntaxError" in r.error
    r = execute(PREFIX + "pyautogui.press('a', presses=10**9)", desk)
    assert r.returncode == 1  # 10**9 is not a literal


def test_command_lines() -> None:
    assert command_to_code(["python", "-c", "pass"]) == "pass"
    assert command_to_code(["/usr/bin/python3", "-c", "pass"]) == "pass"
    assert command_to_code("python3 -c 'import pyautogui'") == "import pyautogui"
    for bad in (["ls", "-l"], ["python", "script.py"], "rm -rf /", [1, 2], "python -c 'x"):
        with pytest.raises(ProgramError):
            command_to_code(bad)


FUNCS = [
    "click",
    "doubleClick",
    "tripleClick",
    "rightClick",
    "middleClick",
    "moveTo",
    "moveRel",
    "dragTo",
    "dragRel",
    "mouseDown",
    "mouseUp",
    "write",
    "typewrite",
    "press",
    "keyDown",
    "keyUp",
    "hotkey",
    "scroll",
    "hscroll",
    "vscroll",
    "position",
    "size",
]
literals = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-5000, 5000)
    | st.floats(-5000, 5000, allow_nan=False)
    | st.text(max_size=6)
    | st.sampled_from(["enter", "tab", "ctrl", "a", "left", "right", "primary", "esc"]),
    lambda inner: st.lists(inner, max_size=3),
    max_leaves=4,
)
KWARGS = ["x", "y", "clicks", "button", "interval", "presses", "duration", "bogus"]


@st.composite
def programs(draw) -> str:
    lines = []
    for _ in range(draw(st.integers(1, 6))):
        func = draw(st.sampled_from(FUNCS))
        args = [repr(a) for a in draw(st.lists(literals, max_size=3))]
        kwargs = draw(st.dictionaries(st.sampled_from(KWARGS), literals, max_size=2))
        args += [f"{k}={v!r}" for k, v in kwargs.items()]
        lines.append(f"pyautogui.{func}({', '.join(args)})")
    return "\n".join(lines)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(code=programs(), family=st.sampled_from(["fill_form", "menu_pick", "list_select"]))
def test_any_call_with_any_literals_answers_like_a_process(code: str, family: str) -> None:
    """Whatever the arguments, the interpreter answers with a return code; it never raises."""
    desk = Desktop(640, 480)
    load_scene(desk, family, 1)
    result = execute(PREFIX + code, desk)
    assert result.returncode in (0, 1)
    assert (result.returncode == 0) == (result.error == "")
    assert 0 <= desk.cursor[0] < 640 and 0 <= desk.cursor[1] < 480
    desk.screenshot_png()
    desk.accessibility_xml()


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=80))
def test_arbitrary_text_never_escapes_the_interpreter(code: str) -> None:
    result = execute(code, Desktop(640, 480))
    assert result.returncode in (0, 1)


def _count_events(desk: Desktop) -> dict[str, int]:
    """Count what reaches the desktop: calls of its input methods, and wheel notches."""
    counts = {"scroll_notches": 0}

    def counting(name: str):
        real = getattr(desk, name)

        def call(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            if name == "scroll":
                counts["scroll_notches"] += abs(int(args[0]))
            return real(*args, **kwargs)

        return call

    for name in ("move", "click", "scroll", "key_down", "key_up", "mouse_down", "mouse_up"):
        setattr(desk, name, counting(name))
    return counts


def test_a_program_s_key_presses_are_bounded(desk: Desktop) -> None:
    """press(<10k keys>, presses=1000) froze every desktop of the process for 5 s: a
    program gets at most MAX_KEY_EVENTS key presses, over all its calls, then a ValueError
    as Python would raise it (exit code 1); within the budget typing works as before.
    The bound is checked on what reached the desktop, not on the wall clock."""
    from arpo_envs.sim.interpreter import MAX_KEY_EVENTS

    counts = _count_events(desk)
    keys = repr(["a"] * 10_000)
    r = execute(f"import pyautogui; pyautogui.press({keys}, presses=1000)", desk)
    assert r.returncode == 1 and "ValueError" in r.error and str(MAX_KEY_EVENTS) in r.error
    assert counts.get("key_down", 0) <= MAX_KEY_EVENTS, counts
    counts.clear()
    counts["scroll_notches"] = 0
    many = "import pyautogui\n" + f"pyautogui.write({'x' * 1000!r})\n" * 30
    r = execute(many, desk)
    assert r.returncode == 1 and "input events" in r.error
    assert counts.get("key_down", 0) <= MAX_KEY_EVENTS, counts
    assert execute("import pyautogui; pyautogui.write('hello')", desk).returncode == 0


@pytest.mark.parametrize(
    ("call", "events", "per_call"),
    [
        ("pyautogui.click(10, 10, clicks=1000)", ("click",), 1000),
        ("pyautogui.scroll(500)", ("scroll_notches",), 500),
        ("pyautogui.moveTo(5, 5); pyautogui.moveTo(6, 6)", ("move",), 2),
        ("pyautogui.hotkey('ctrl', 'a')", ("key_down", "key_up"), 4),
        ("pyautogui.mouseDown(); pyautogui.mouseUp()", ("mouse_down", "mouse_up"), 2),
    ],
)
def test_a_program_s_clicks_and_other_events_are_bounded(
    desk: Desktop, call: str, events: tuple[str, ...], per_call: int
) -> None:
    """3,000 calls of click(clicks=1000) (3 million clicks) held the simulated desktop for
    6 s: clicks, scroll steps, moves and key/button downs share the key presses' budget.
    20,000 lines of each call would deliver at least 40,000 events; at most the budget
    (and the one call that crossed it) reach the desktop."""
    from arpo_envs.sim.interpreter import MAX_KEY_EVENTS

    counts = _count_events(desk)
    r = execute("import pyautogui\n" + f"{call}\n" * 20_000, desk)
    assert r.returncode == 1 and "input events" in r.error, r.error[-300:]
    delivered = sum(counts.get(e, 0) for e in events)
    assert 0 < delivered <= MAX_KEY_EVENTS + per_call, counts
    assert execute(f"import pyautogui; {call}", desk).returncode == 0
