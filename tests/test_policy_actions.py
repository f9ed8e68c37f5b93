"""UI-TARS action grammar and prompt text: hand-written responses of every action type and
coordinate form, their pyautogui code, parse failures, and the prompt strings."""

from __future__ import annotations

import ast
import re

import pytest

from arpo.errors import ActionParseError, ArpoError
from arpo.policy.actions import (
    DONE,
    FAIL,
    WAIT,
    ActionConfig,
    CallUser,
    Click,
    Drag,
    Finished,
    Frame,
    Hotkey,
    Hover,
    KeyDown,
    KeyUp,
    LeftDouble,
    Point,
    Press,
    RightSingle,
    Scroll,
    Type,
    Wait,
    format_action,
    format_response,
    parse_action,
    parse_response,
    smart_resize,
    to_pyautogui,
    try_parse_response,
)
from arpo.policy.prompt_text import (
    SYSTEM_MESSAGE,
    action_space,
    assistant_text,
    computer_use_prompt,
    with_box_tokens,
)

# ARPO's setting: 1920x1080 screenshots, shown to the model as 1932x1092.
FRAME = Frame.for_screen(1920, 1080)
IDENTITY = Frame(1920, 1080, 1920, 1080)

CODE_MODULES = {"pyautogui", "time", "pyperclip"}


def _literal(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str | int | float) and not isinstance(node.value, bool)
    return (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, ast.USub)
        and isinstance(node.operand, ast.Constant)
        and isinstance(node.operand.value, int | float)
    )


def assert_safe_code(code: str) -> list[tuple[str, list, dict]]:
    """The code compiles and is nothing but imports of pyautogui/time/pyperclip and calls of
    their functions with literal arguments (pyperclip only to copy). Returns the calls."""
    compile(code, "<a>", "exec")
    calls = []
    for stmt in ast.parse(code).body:
        if isinstance(stmt, ast.Import):
            assert all(a.name in CODE_MODULES and a.asname is None for a in stmt.names), code
            continue
        assert isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call), code
        call = stmt.value
        f = call.func
        assert isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name), code
        assert f.value.id in CODE_MODULES, code
        if f.value.id == "pyperclip":
            assert f.attr == "copy", code
        assert all(k.arg is not None for k in call.keywords), code
        assert all(_literal(a) for a in call.args), code
        assert all(_literal(k.value) for k in call.keywords), code
        calls.append(
            (
                f"{f.value.id}.{f.attr}",
                [ast.literal_eval(a) for a in call.args],
                {k.arg: ast.literal_eval(k.value) for k in call.keywords},
            )
        )
    return calls


def only_calls(code: str) -> list[tuple[str, list, dict]]:
    """The calls of `code` other than time.sleep."""
    return [c for c in assert_safe_code(code) if c[0] != "time.sleep"]


# ---- frames --------------------------------------------------------------------------------


def test_smart_resize_matches_the_reference_frames():
    assert smart_resize(width=1920, height=1080) == (1932, 1092)
    assert Frame(1932, 1092, 1920, 1080) == FRAME
    # 4K is scaled down into the pixel budget, both sides multiples of 28.
    w, h = smart_resize(width=3840, height=2160)
    assert w % 28 == 0 and h % 28 == 0 and w * h <= 2700 * 28 * 28
    assert smart_resize(width=1280, height=720) == (1288, 728)
    # Tiny images are scaled up to the minimum area.
    w, h = smart_resize(width=10, height=10)
    assert w * h >= 4 * 28 * 28


def test_frame_maps_both_ways_and_clamps():
    p = FRAME.to_screen(966, 546)  # centre of the image
    assert p == Point(960.0, 540.0)
    assert FRAME.to_model(Point(960, 540)) == (966, 546)
    assert FRAME.to_screen(5000, -20) == Point(1919.0, 0.0)
    rel = Frame.for_screen(1920, 1080, relative=True)
    assert rel.to_screen(500, 500) == Point(960.0, 540.0)
    assert rel.to_model(Point(960, 540)) == (500, 500)


@pytest.mark.parametrize(
    "args", [(0, 1, 1, 1), (1, 1, 1, -1), (1.5, 1, 1, 1), (True, 1, 1, 1), ("1", 1, 1, 1)]
)
def test_frame_rejects_bad_sizes(args):
    with pytest.raises(ValueError, match="positive int"):
        Frame(*args)


def test_action_config_validates():
    with pytest.raises(ValueError, match="scroll_clicks"):
        ActionConfig(scroll_clicks=0)
    with pytest.raises(ValueError, match="typing"):
        ActionConfig(typing="paste")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="drag_duration"):
        ActionConfig(drag_duration=-1)


# ---- every action type, real-looking responses ---------------------------------------------

REAL = [
    (
        "Thought: I need to open the Chrome browser. I can see its icon in the dock on the left "
        "side of the screen.\nAction: click(start_box='<|box_start|>(33,520)<|box_end|>')",
        Click(FRAME.to_screen(33, 520)),
        [("pyautogui.click", [33, 514], {"button": "left"})],
    ),
    (
        "Thought: The file is selected; opening it needs a double click.\n"
        "Action: left_double(start_box='(402,275)')",
        LeftDouble(FRAME.to_screen(402, 275)),
        [("pyautogui.doubleClick", [400, 272], {"button": "left"})],
    ),
    (
        "Thought: A context menu will offer Rename.\nAction: right_single(start_box='(966,546)')",
        RightSingle(Point(960.0, 540.0)),
        [("pyautogui.click", [960, 540], {"button": "right"})],
    ),
    (
        "Thought: Hovering shows the tooltip.\nAction: hover(start_box='(100,50)')",
        Hover(FRAME.to_screen(100, 50)),
        [("pyautogui.moveTo", [99, 49], {})],
    ),
    (
        "Thought: Select the range A1:C3 by dragging.\n"
        "Action: drag(start_box='<|box_start|>(120,300)<|box_end|>', "
        "end_box='<|box_start|>(420,380)<|box_end|>')",
        Drag(FRAME.to_screen(120, 300), FRAME.to_screen(420, 380)),
        [("pyautogui.moveTo", [119, 297], {}), ("pyautogui.dragTo", [417, 376], {"duration": 1.0})],
    ),
    (
        "Thought: Copy the selection.\nAction: hotkey(key='ctrl c')",
        Hotkey(("ctrl", "c")),
        [("pyautogui.hotkey", ["ctrl", "c"], {})],
    ),
    (
        "Thought: Save with the keyboard.\nAction: hotkey(key='Ctrl+Shift+S')",
        Hotkey(("ctrl", "shift", "s")),
        [("pyautogui.hotkey", ["ctrl", "shift", "s"], {})],
    ),
    (
        "Thought: Move left one cell.\nAction: hotkey(key='arrowleft')",
        Hotkey(("left",)),
        [("pyautogui.hotkey", ["left"], {})],
    ),
    (
        "Thought: Confirm.\nAction: press(key='enter')",
        Press("enter"),
        [("pyautogui.press", ["enter"], {})],
    ),
    (
        "Thought: Hold shift.\nAction: keydown(key='shift')",
        KeyDown("shift"),
        [("pyautogui.keyDown", ["shift"], {})],
    ),
    (
        "Thought: Release shift.\nAction: keyup(key='shift')",
        KeyUp("shift"),
        [("pyautogui.keyUp", ["shift"], {})],
    ),
    (
        "Thought: Enter the address and submit it.\n"
        "Action: type(content='https://www.google.com\\n')",
        Type("https://www.google.com\n"),
        [
            ("pyautogui.write", ["https://www.google.com"], {"interval": 0.1}),
            ("pyautogui.press", ["enter"], {}),
        ],
    ),
    (
        "Thought: Scroll down to see more rows.\n"
        "Action: scroll(start_box='<|box_start|>(966,546)<|box_end|>', direction='down')",
        Scroll("down", Point(960.0, 540.0)),
        [("pyautogui.scroll", [-5], {"x": 960, "y": 540})],
    ),
    (
        "Thought: Scroll up.\nAction: scroll(direction='up')",
        Scroll("up"),
        [("pyautogui.scroll", [5], {})],
    ),
    (
        "Thought: Scroll the sheet right.\nAction: scroll(start_box='(966,546)', direction='right')",
        Scroll("right", Point(960.0, 540.0)),
        [("pyautogui.hscroll", [5], {"x": 960, "y": 540})],
    ),
    (
        "Thought: Scroll left.\nAction: scroll(start_box='(966,546)', direction='left')",
        Scroll("left", Point(960.0, 540.0)),
        [("pyautogui.hscroll", [-5], {"x": 960, "y": 540})],
    ),
]


@pytest.mark.parametrize(
    ("text", "action", "calls"), REAL, ids=[a.__class__.__name__ for _, a, _ in REAL]
)
def test_real_responses_parse_to_typed_actions_and_code(text, action, calls):
    r = parse_response(text, FRAME)
    assert r.parsed and r.error == ""
    assert r.actions == (action,)
    assert r.thought == text.split("\n")[0].removeprefix("Thought: ")
    assert len(r.commands) == 1
    assert only_calls(r.commands[0]) == calls
    assert r.action == r.commands[0]
    assert r.format_reward == 0.0


@pytest.mark.parametrize(
    ("text", "action", "token"),
    [
        ("Thought: The page is loading.\nAction: wait()", Wait(), WAIT),
        (
            "Thought: The chart is inserted; the task is complete.\n"
            "Action: finished(content='Inserted the chart.')",
            Finished("Inserted the chart."),
            DONE,
        ),
        ("Thought: Done.\nAction: finished()", Finished(""), DONE),
        (
            "Thought: There is no such setting; the task is infeasible.\nAction: call_user()",
            CallUser(),
            FAIL,
        ),
    ],
)
def test_terminal_actions_become_special_tokens(text, action, token):
    r = parse_response(text, FRAME)
    assert r.actions == (action,)
    assert r.commands == (token,)
    assert r.action == token


def test_coordinate_forms():
    def point_of(arg: str) -> Point:
        a = parse_action(f"click(start_box='{arg}')", IDENTITY)
        assert isinstance(a, Click)
        return a.point

    assert point_of("(100,200)") == Point(100, 200)
    assert point_of("( 100 , 200 )") == Point(100, 200)
    assert point_of("<|box_start|>(100,200)<|box_end|>") == Point(100, 200)
    assert point_of("[100, 200]") == Point(100, 200)
    assert point_of("<point>100 200</point>") == Point(100, 200)
    assert point_of("(100,200,300,400)") == Point(200, 300)  # a box means its centre
    assert point_of("<|box_start|>(100,200,300,400)<|box_end|>") == Point(200, 300)
    assert point_of("<bbox>100 200 300 400</bbox>") == Point(200, 300)
    assert point_of("(100.5,200.25)") == Point(100.5, 200.25)
    # point= / start_point= / end_point= keys (UI-TARS' newer prompt) are aliases.
    assert parse_action("click(point='<point>10 20</point>')", IDENTITY) == Click(Point(10, 20))
    assert parse_action(
        "drag(start_point='<point>1 2</point>', end_point='<point>3 4</point>')", IDENTITY
    ) == Drag(Point(1, 2), Point(3, 4))


def test_relative_coordinates_flag():
    rel = Frame(1932, 1092, 1920, 1080, relative=True)
    r = parse_response("Action: click(start_box='(500,500)')", rel)
    assert r.actions == (Click(Point(960.0, 540.0)),)
    assert only_calls(r.commands[0]) == [("pyautogui.click", [960, 540], {"button": "left"})]


def test_reflection_and_action_summary_formats():
    r = parse_response(
        "Reflection: The menu did not open last time.\nAction_Summary: Click File again.\n"
        "Action: click(start_box='(10,10)')",
        IDENTITY,
    )
    assert r.reflection == "The menu did not open last time."
    assert r.thought == "Click File again."
    r = parse_response("Action_Summary: Click it.\nAction: click(start_box='(10,10)')", IDENTITY)
    assert (r.thought, r.reflection) == ("Click it.", "")


def test_thought_may_be_absent_and_multiline():
    assert parse_response("Action: wait()", FRAME).thought == ""
    r = parse_response("Thought: line one\nline two\n\nAction: wait()", FRAME)
    assert r.thought == "line one\nline two"
    # Special tokens a decoder may leave at the end, and code fences, are tolerated.
    r = parse_response("```\nThought: t\nAction: wait()\n```<|im_end|>", FRAME)
    assert (r.thought, r.actions) == ("t", (Wait(),))


def test_several_actions_run_in_order_and_stop_at_a_terminal_one():
    text = (
        "Thought: Type the name, then save.\n"
        "Action: type(content='report')\n\nhotkey(key='ctrl s')\n\nfinished()\n\nwait()"
    )
    r = parse_response(text, FRAME)
    assert r.actions == (Type("report"), Hotkey(("ctrl", "s")), Finished(), Wait())
    assert len(r.commands) == 3 and r.commands[2] == DONE
    assert only_calls(r.commands[0]) == [("pyautogui.write", ["report"], {"interval": 0.1})]
    assert r.action == DONE  # the one string a Turn records
    r = parse_response("Action: click(start_box='(1,1)')\n\nclick(start_box='(2,2)')", IDENTITY)
    assert r.actions == (Click(Point(1, 1)), Click(Point(2, 2)))
    assert r.action == "\n".join(r.commands)


def test_type_escapes_and_enter():
    def content(arg: str) -> str:
        a = parse_action(f"type(content={arg})", FRAME)
        assert isinstance(a, Type)
        return a.content

    assert content(r"'It\'s here'") == "It's here"
    assert content(r"'say \"hi\"'") == 'say "hi"'
    assert content(r"'a\nb'") == "a\nb"
    assert content(r"'tab\there'") == "tab\there"
    assert content(r"'back\\slash'") == "back\\slash"
    assert content(r"'C:\Users\new'") == "C:\\Users\new"  # unknown escapes stay as written
    assert content("'raw\nnewline'") == "raw\nnewline"
    assert content("\"double 'quoted'\"") == "double 'quoted'"
    # Unescaped quotes inside content, as UI-TARS sometimes writes them.
    assert content("'It's done'") == "It's done"
    assert content("'=SUM(A1:A3)'") == "=SUM(A1:A3)"
    r = parse_response("Action: type(content='It's 5 o'clock\\n')", FRAME)
    assert r.actions == (Type("It's 5 o'clock\n"),)
    calls = only_calls(r.commands[0])
    assert calls == [
        ("pyautogui.write", ["It's 5 o'clock"], {"interval": 0.1}),
        ("pyautogui.press", ["enter"], {}),
    ]


def test_type_goes_through_the_clipboard_when_pyautogui_cannot_type_it():
    code = to_pyautogui(Type("Grüße, 世界\n"))
    assert only_calls(code) == [
        ("pyperclip.copy", ["Grüße, 世界"], {}),
        ("pyautogui.hotkey", ["ctrl", "v"], {}),
        ("pyautogui.press", ["enter"], {}),
    ]
    assert code.isascii()
    assert only_calls(to_pyautogui(Type("abc"), ActionConfig(typing="clipboard")))[0] == (
        "pyperclip.copy",
        ["abc"],
        {},
    )
    assert to_pyautogui(Type("abc"), ActionConfig(typing="write", imports=False)).startswith(
        "pyautogui.write('abc', interval=0.1)"
    )
    # Empty content is a no-op step; a lone newline is just Enter.
    assert only_calls(to_pyautogui(Type(""))) == []
    assert only_calls(to_pyautogui(Type("\n"))) == [("pyautogui.press", ["enter"], {})]


def test_action_config_changes_the_code():
    cfg = ActionConfig(scroll_clicks=3, write_interval=0.0, drag_duration=0.25, imports=False)
    assert to_pyautogui(Scroll("down"), cfg) == "pyautogui.scroll(-3)"
    drag = to_pyautogui(Drag(Point(1, 2), Point(3, 4)), cfg)
    assert drag == "pyautogui.moveTo(1, 2)\npyautogui.dragTo(3, 4, duration=0.25)"
    assert "interval=0.0" in to_pyautogui(Type("x"), cfg)


def test_aliases_of_the_reference_parser():
    assert parse_action("left_single(start_box='(5,6)')", IDENTITY) == Click(Point(5, 6))
    assert parse_action("select(start_box='(1,2)', end_box='(3,4)')", IDENTITY) == Drag(
        Point(1, 2), Point(3, 4)
    )
    assert parse_action("release(key='ctrl')", IDENTITY) == KeyUp("ctrl")
    assert parse_action("hotkey(hotkey='ctrl a')", IDENTITY) == Hotkey(("ctrl", "a"))
    assert parse_action("click('(5,6)')", IDENTITY) == Click(Point(5, 6))  # positional
    assert parse_action('click(start_box="(5,6)",)', IDENTITY) == Click(Point(5, 6))
    assert parse_action("scroll(start_box='', direction='DOWN')", IDENTITY) == Scroll("down")


def test_content_cannot_inject_code():
    evil = "'); import os; os.system('x"
    for text in (
        "Action: type(content='" + evil + "')",
        "Action: type(content='" + evil.replace("'", "\\'") + "')",
        'Action: type(content="' + evil + '")',
        "Action: hotkey(key='" + evil.replace("'", "\\'") + "')",
        "Action: press(key='" + evil.replace("'", "\\'").replace(" ", "") + "')",
    ):
        r = parse_response(text, FRAME)
        for code in r.commands:
            tree = ast.parse(code)
            names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
            assert names <= CODE_MODULES, code
            assert not any(
                isinstance(n, ast.Import) and n.names[0].name == "os" for n in ast.walk(tree)
            )
            assert_safe_code(code)
        strings = [
            c.value
            for code in r.commands
            for c in ast.walk(ast.parse(code))
            if isinstance(c, ast.Constant) and isinstance(c.value, str)
        ]
        assert any("os.system" in s for s in strings), text  # it is in a literal, not run
    code = to_pyautogui(Type("\x00\r\u2028'\"\\"))
    assert_safe_code(code)
    assert code.isascii()


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "no 'Action:'"),
        ("Thought: I will click the button.", "no 'Action:'"),
        ("Thought: x\nAction:", "nothing after"),
        ("Thought: x\nAction: open_app(app_name='chrome')", "unknown action 'open_app'"),
        ("Action: click()", "missing start_box"),
        ("Action: click(start_box='(1,2)', button='left')", "unknown argument 'button'"),
        ("Action: click(start_box='(1,2)', start_box='(3,4)')", "twice"),
        ("Action: click(start_box='somewhere')", "not a point"),
        ("Action: click(start_box='(1,2,3)')", "not a point"),
        ("Action: click(start_box='(1,2)'", "expected ',' or ')'"),
        ("Action: click(start_box='(1,2)", "unterminated string"),
        ("Action: click start_box='(1,2)'", "expected '('"),
        ("Action: click(start_box='(1,2)') and then more", "new line"),
        ("Action: click(start_box='(1,2)')\nI hope this works.", "expected '('"),
        ("Action: drag(start_box='(1,2)')", "missing end_box"),
        ("Action: scroll(start_box='(1,2)', direction='diagonal')", "direction"),
        ("Action: scroll(start_box='(1,2)')", "missing direction"),
        ("Action: hotkey(key='')", "at least one key"),
        ("Action: press(key='ctrl c')", "exactly one key"),
        ("Action: type()", "missing content"),
        ("Action: type(content='unterminated)", "unterminated string"),
        ("Action: wait(5)", "unexpected positional"),
        ("Action: 42", "expected an action name"),
    ],
)
def test_parse_failures_name_the_reason(text, reason):
    with pytest.raises(ActionParseError, match=re.escape(reason)) as info:
        parse_response(text, FRAME)
    assert isinstance(info.value, ArpoError) and isinstance(info.value, ValueError)
    r = try_parse_response(text, FRAME)
    assert (r.parsed, r.actions, r.commands, r.action) == (False, (), (), "")
    assert reason in r.error
    assert r.format_reward == -1.0
    assert r.text == text


def test_non_strings_and_huge_responses_are_parse_errors():
    with pytest.raises(ActionParseError, match="must be a str"):
        parse_response(b"Action: wait()", FRAME)  # type: ignore[arg-type]
    with pytest.raises(ActionParseError, match="exceeds"):
        parse_response("Action: wait()" + " " * 70_000, FRAME)
    assert not try_parse_response(None, FRAME).parsed  # type: ignore[arg-type]


def test_action_in_the_thought_does_not_confuse_the_parser():
    r = parse_response(
        "Thought: The Action: menu is at the top; Action: click it.\n"
        "Action: type(content='Action: done')",
        FRAME,
    )
    assert r.actions == (Type("Action: done"),)
    assert r.thought == "The Action: menu is at the top; Action: click it."


def test_typed_actions_validate():
    with pytest.raises(ValueError, match="direction"):
        Scroll("diagonal")
    with pytest.raises(ValueError, match="finite"):
        Point(float("nan"), 0)


# ---- the code runs on the simulated desktop ---------------------------------------------------


def test_generated_code_runs_on_the_simulated_desktop():
    interp = pytest.importorskip("arpo_envs.sim.interpreter")
    desktop = pytest.importorskip("arpo_envs.sim.desktop")
    desk = desktop.Desktop(1920, 1080, draw_cursor=False)
    fast = ActionConfig(write_interval=0.0, type_settle=0.0, drag_duration=0.0)
    for text, _, _ in REAL:
        for code in parse_response(text, FRAME, config=fast).commands:
            steps = interp.compile_program(code)
            assert all(s.error is None for s in steps), (code, steps)
            result = interp.execute(code, desk)
            assert result.returncode == 0, (code, result.error)


# ---- formatting --------------------------------------------------------------------------------


def test_format_action_writes_what_ui_tars_emits():
    p = Point(960, 540)
    assert format_action(Click(p), FRAME) == "click(start_box='<|box_start|>(966,546)<|box_end|>')"
    assert format_action(Click(p), FRAME, coords="plain") == "click(start_box='(966,546)')"
    assert format_action(Click(p), FRAME, coords="point") == "click(point='<point>966 546</point>')"
    assert (
        format_action(Drag(p, Point(0, 0)), FRAME, coords="point")
        == "drag(start_point='<point>966 546</point>', end_point='<point>0 0</point>')"
    )
    assert format_action(Hotkey(("ctrl", "c")), FRAME) == "hotkey(key='ctrl c')"
    assert format_action(Type("It's\n"), FRAME) == "type(content='It\\'s\\n')"
    assert format_action(Scroll("down"), FRAME) == "scroll(direction='down')"
    assert format_action(Finished(), FRAME) == "finished()"
    assert format_action(CallUser(), FRAME) == "call_user()"
    assert format_response("", [Wait()], FRAME) == "Action: wait()"
    with pytest.raises(ValueError, match="at least one action"):
        format_response("t", [], FRAME)


# ---- prompt text ---------------------------------------------------------------------------------


def test_computer_use_prompt_sections():
    text = computer_use_prompt("Make cell A1 bold.")
    assert text.startswith("You are a GUI agent. You are given a task and your action history")
    for section in ("## Output Format", "## Action Space", "## Note", "## User Instruction"):
        assert section in text
    assert text.index("## Output Format") < text.index("## Action Space") < text.index("## Note")
    assert text.endswith("## User Instruction\nMake cell A1 bold.\n")
    assert "```\nThought: ...\nAction: ...\n```" in text
    assert "- Use English in `Thought`" in text
    assert "call_user()" not in text
    assert "call_user()" in computer_use_prompt("x", call_user=True)
    assert "- Use Chinese in `Thought`" in computer_use_prompt("x", language="Chinese")
    assert "type(content='xxx') # Use escape characters \\', \\\", and \\n" in text
    assert SYSTEM_MESSAGE == "You are a helpful assistant."
    with pytest.raises(ValueError, match="instruction"):
        computer_use_prompt("  ")
    with pytest.raises(ValueError, match="language"):
        computer_use_prompt("x", language="")


def test_every_action_in_the_action_space_parses():
    """The examples the prompt shows are themselves valid actions (with numbers filled in)."""
    for coords in ("box", "plain", "point"):
        for line in action_space(call_user=True, coords=coords).splitlines():
            call = line.split(" #")[0]
            call = call.replace("x1 y1", "10 20").replace("x2 y2", "30 40")
            call = call.replace("(x1,y1)", "(10,20)").replace("(x3,y3)", "(30,40)")
            call = call.replace("down or up or right or left", "down").replace("key=''", "key='a'")
            parse_action(call, FRAME)


def test_assistant_text_round_trips_and_box_tokens_come_back():
    actions = [Click(Point(100, 200)), Type("hello\n")]
    text = assistant_text("Click the box, then type.", actions, IDENTITY)
    assert text == (
        "Thought: Click the box, then type.\n"
        "Action: click(start_box='<|box_start|>(100,200)<|box_end|>')\n\n"
        "type(content='hello\\n')"
    )
    r = parse_response(text, IDENTITY)
    assert r.thought == "Click the box, then type." and list(r.actions) == actions
    plain = assistant_text("t", actions, IDENTITY, coords="plain")
    assert with_box_tokens(plain) == assistant_text("t", actions, IDENTITY)
    assert with_box_tokens("no action here (1,2)") == "no action here (1,2)"
    dragged = "Action: drag(start_box='(1, 2)', end_box='(3,4)')"
    assert with_box_tokens(dragged) == (
        "Action: drag(start_box='<|box_start|>(1,2)<|box_end|>', "
        "end_box='<|box_start|>(3,4)<|box_end|>')"
    )
