"""The text of UI-TARS-1.5's computer-use prompt, as the ARPO reference builds its chat.

The reference conversation is

    system:    SYSTEM_MESSAGE
    user:      computer_use_prompt(instruction)        (text only)
    user:      <screenshot 0>
    assistant: Thought: ...\\nAction: ...               (response 0)
    user:      <screenshot 1>
    assistant: ...

with every screenshot of the episode kept. This module holds only strings; the token ids
(chat template, image placeholder tokens) are built elsewhere from them. Earlier assistant
turns are the sampled tokens themselves when they come from a rollout; `assistant_text`
writes them for demonstrations and `with_box_tokens` restores the box tokens in a response
that was decoded with special tokens skipped (what OSWorld's agent does to its history).

Other observation types (OSWorld's `observation_type`, `arpo.record.OBSERVATION_TYPES`):
the task prompt says what the agent is given (`computer_use_prompt(observation_type=...)`; for
`som` the action space adds `click(mark=N)`, and with a table it notes that coordinates are
screen pixels, the table's unit), and each turn's user message starts with OSWorld's own
sentence around the table (`observation_text`), before the screenshot when there is one.
With `screenshot` every string here is the reference's, unchanged.

Deviations from the reference text: the system message is Qwen's "You are a helpful
assistant." (ARPO's has a typo, "Your are"); `call_user()` is listed only on request
(`call_user=True`, as OSWorld's UI-TARS agent offers it; ARPO's prompt omits it but its parser
accepts it).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from arpo.policy.actions import Action, CoordStyle, Frame, format_response
from arpo.record import OBSERVATION_TYPES

SYSTEM_MESSAGE = "You are a helpful assistant."
"""The system turn of the chat; the task prompt goes in the first user turn."""

_GIVEN = {
    "screenshot": "with screenshots",
    "a11y_tree": "with the accessibility tree of the screen",
    "screenshot_a11y_tree": "with screenshots and the accessibility tree of the screen",
    "som": "with screenshots tagged with numbered marks and the table of the marks",
}
"""What the agent is given, per observation type (the reference's: with screenshots)."""
_HEADER = (
    "You are a GUI agent. You are given a task and your action history, {given}. "
    "You need to perform the next action to complete the task.\n"
    "\n"
    "## Output Format\n"
    "```\n"
    "Thought: ...\n"
    "Action: ...\n"
    "```\n"
)
_MARK_LINE = (
    "click(mark=N) # Click the element tagged N on the screenshot (N is its index in the "
    "table); left_double, right_single and hover take mark=N too."
)
_SCREEN_NOTE = "- Coordinates are screen pixels, the unit of the positions in the table.\n"
_ASK = "What's the next step that you will do to help with the task?"
_OBSERVATION_TEXT = {
    "a11y_tree": "Given the info from accessibility tree as below:\n{table}\n" + _ASK,
    "screenshot_a11y_tree": (
        "Given the screenshot and info from accessibility tree as below:\n{table}\n" + _ASK
    ),
    "som": "Given the tagged screenshot and info from accessibility tree as below:\n{table}\n"
    + _ASK,
}
"""OSWorld's PromptAgent's user message of each turn, around the (trimmed) table."""


def _check_observation(observation_type: str) -> None:
    if observation_type not in OBSERVATION_TYPES:
        raise ValueError(
            f"observation_type must be one of {', '.join(OBSERVATION_TYPES)}, got "
            f"{observation_type!r}"
        )


def observation_text(observation: str, table: str) -> str:
    """The text of a turn's user message: OSWorld's sentence around the accessibility table
    (`a11y_tree`, `screenshot_a11y_tree`) or the mark table (`som`); "" for `screenshot`,
    whose message is the image alone (UI-TARS's)."""
    _check_observation(observation)
    if observation == "screenshot":
        return ""
    return _OBSERVATION_TEXT[observation].format(table=table)


_TYPE_NOTE = (
    " # Use escape characters \\', \\\", and \\n in content part to ensure we can parse the "
    "content in normal python string format. If you want to submit your input, use \\n at "
    "the end of content. "
)
_FINISHED_NOTE = (
    " # Use escape characters \\', \\\", and \\n in content part to ensure we can parse the "
    "content in normal python string format."
)
_WAIT_NOTE = " #Sleep for 5s and take a screenshot to check for any changes."
_CALL_USER_NOTE = (
    " # Submit the task and call the user when the task is unsolvable, or when you need the "
    "user's help."
)


def action_space(
    *, call_user: bool = False, coords: CoordStyle = "box", marks: bool = False
) -> str:
    """The `## Action Space` lines: every action UI-TARS may emit, with its argument syntax
    (`marks`: also `click(mark=N)`, for the som observation)."""
    if coords == "point":
        at, start, end = "point", "start_point", "end_point"
        p1, p2 = "<point>x1 y1</point>", "<point>x2 y2</point>"
    elif coords in ("box", "plain"):
        at, start, end = "start_box", "start_box", "end_box"
        p1, p2 = "<|box_start|>(x1,y1)<|box_end|>", "<|box_start|>(x3,y3)<|box_end|>"
        if coords == "plain":
            p1, p2 = "(x1,y1)", "(x3,y3)"
    else:
        raise ValueError(f"coords must be 'box', 'plain' or 'point', got {coords!r}")
    lines = [
        f"click({at}='{p1}')",
        *([_MARK_LINE] if marks else []),
        f"left_double({at}='{p1}')",
        f"right_single({at}='{p1}')",
        f"drag({start}='{p1}', {end}='{p2}')",
        "hotkey(key='')",
        "type(content='xxx')" + _TYPE_NOTE,
        f"scroll({at}='{p1}', direction='down or up or right or left')",
        "wait()" + _WAIT_NOTE,
        "finished(content='xxx')" + _FINISHED_NOTE,
    ]
    if call_user:
        lines.append("call_user()" + _CALL_USER_NOTE)
    return "\n".join(lines)


def computer_use_prompt(
    instruction: str,
    *,
    language: str = "English",
    call_user: bool = False,
    coords: CoordStyle = "box",
    observation_type: str = "screenshot",
) -> str:
    """The first user turn: role, output format, action space, notes and the task instruction.

    `language` is the language the model should think in (the reference uses English);
    `observation_type` what each turn shows (`arpo.record.OBSERVATION_TYPES`; "screenshot" gives
    the reference's text).
    """
    _check_observation(observation_type)
    if not isinstance(instruction, str) or not instruction.strip():
        raise ValueError("the instruction must be a non-empty string (the task's `instruction`)")
    if not isinstance(language, str) or not language.strip() or "\n" in language:
        raise ValueError(f"language must be a one-line name such as 'English', got {language!r}")
    return (
        _HEADER.format(given=_GIVEN[observation_type])
        + "\n## Action Space\n\n"
        + action_space(call_user=call_user, coords=coords, marks=observation_type == "som")
        + "\n\n## Note\n"
        + f"- Use {language} in `Thought` and `Action` part.\n"
        + "- Write a small plan and finally summarize your next action (with its target "
        "element) in one sentence in `Thought` part.\n"
        + (_SCREEN_NOTE if observation_type != "screenshot" else "")
        + "\n## User Instruction\n"
        + instruction
        + "\n"
    )


def assistant_text(
    thought: str, actions: Sequence[Action], frame: Frame, *, coords: CoordStyle = "box"
) -> str:
    """An assistant turn, `Thought: ...\\nAction: ...`, as UI-TARS writes it: positions mapped
    from the screen into `frame`, several actions separated by blank lines."""
    return format_response(thought, tuple(actions), frame, coords=coords)


_PLAIN_BOX = re.compile(r"((?:start_box|end_box)=)(['\"])\(\s*(\d+)\s*,\s*(\d+)\s*\)\2")
_ACTION_LINE = re.compile(r"^[ \t]*Action:", re.M)


def with_box_tokens(response: str) -> str:
    """Put `<|box_start|>`/`<|box_end|>` back around `start_box='(x,y)'` and `end_box=...`
    in the action part of a response decoded without special tokens."""
    m = _ACTION_LINE.search(response)
    if m is None:
        return response
    head, tail = response[: m.end()], response[m.end() :]
    return head + _PLAIN_BOX.sub(r"\1\2<|box_start|>(\3,\4)<|box_end|>\2", tail)
