"""Writes the local task suite: OSWorld-schema task files, their input and gold files, oracles.

    python -m arpo_envs.tasks.generate            # rewrites envs/arpo_envs/tasks/local/

Every task runs offline on the local desktop (LibreOffice Calc, Mousepad, xterm under openbox):
its setup uploads files shipped beside the task file (`upload_file` with a `local_path`
relative to the task file's folder), runs shell commands and opens or launches applications;
its checker is one of OSWorld's metrics. Gold files are uploaded in the evaluator's
`postconfig`, i.e. only after the episode, then read back with `vm_file` (the pattern of OSWorld
task 4e6fcf72), so an agent never sees them. Each task file carries its oracle under "oracle":
the pyautogui actions that solve it (see `oracle.py`).

Layout: `local/<domain>/<id>.json` and `local/<domain>/<id>/<file>`; `local/test_all.json`
lists the ids by domain, as OSWorld's index does. The domains follow OSWorld's names:
libreoffice_calc, text_editor (Mousepad), os (terminal and files), multi_apps.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from arpo_envs.tasks.oracle import (
    calc_enter,
    calc_goto,
    calc_save,
    editor_replace_all,
    editor_save,
    shell,
    write,
)
from arpo_envs.tasks.xlsx_writer import write_xlsx

HOME = "/home/user"
"""The user's home on the desktop (OSWorld's VMs use the same path)."""
WORK = f"{HOME}/work"
GOLD_DIR = f"{HOME}/.gold"
"""Where postconfig puts gold files on the desktop (after the episode)."""
SUITE_DIR = Path(__file__).resolve().parent / "local"


@dataclass
class LocalTask:
    """One task as written: the OSWorld dict plus the files to ship beside it."""

    id: str
    domain: str
    raw: dict[str, Any]
    files: dict[str, Callable[[Path], None]] = field(default_factory=dict)
    """File name -> writer of that file (called with the destination path)."""


def _text(content: str) -> Callable[[Path], None]:
    return lambda p: p.write_text(content, encoding="utf-8")


def _sheet(sheets: dict[str, list[list[Any]]]) -> Callable[[Path], None]:
    return lambda p: write_xlsx(p, sheets)


def _pyautogui(code: str) -> dict[str, Any]:
    return {
        "type": "execute",
        "parameters": {"command": ["python", "-c", f"import pyautogui; import time; {code}"]},
    }


def _upload(task_id: str, name: str, path: str) -> dict[str, Any]:
    return {
        "type": "upload_file",
        "parameters": {"files": [{"local_path": f"{task_id}/{name}", "path": path}]},
    }


def _sh(command: str) -> dict[str, Any]:
    return {"type": "execute", "parameters": {"command": command, "shell": True}}


def _sleep(seconds: float) -> dict[str, Any]:
    return {"type": "sleep", "parameters": {"seconds": seconds}}


def _open(path: str) -> dict[str, Any]:
    return {"type": "open", "parameters": {"path": path}}


def _terminal() -> list[dict[str, Any]]:
    """Start an xterm in the work dir and give it the focus."""
    return [
        {
            "type": "launch",
            "parameters": {
                "command": f"xterm -title Terminal -e bash -c 'cd {WORK} && exec bash'",
                "shell": True,
            },
        },
        _sleep(1.5),
        {"type": "activate_window", "parameters": {"window_name": "Terminal"}},
    ]


def _calc_postconfig(name: str) -> list[dict[str, Any]]:
    """OSWorld's Calc postconfig: focus the document and save it (ctrl+s)."""
    return [
        {
            "type": "activate_window",
            "parameters": {"window_name": f"{name} - LibreOffice Calc", "strict": True},
        },
        _sleep(0.5),
        _pyautogui("pyautogui.hotkey('ctrl', 's');"),
        _sleep(0.5),
    ]


def _command_check(command: str, expected: str) -> dict[str, Any]:
    """exact_match of a shell command's output."""
    return {
        "func": "exact_match",
        "result": {"type": "vm_command_line", "command": command, "shell": True},
        "expected": {"type": "rule", "rules": {"expected": expected}},
    }


def _task(
    tid: str,
    domain: str,
    instruction: str,
    config: list[dict[str, Any]],
    evaluator: dict[str, Any],
    oracle: list[str],
    apps: list[str],
    files: dict[str, Callable[[Path], None]] | None = None,
) -> LocalTask:
    raw = {
        "id": tid,
        "snapshot": "local_desktop",
        "instruction": instruction,
        "source": "arpo local task suite",
        "config": config,
        "related_apps": apps,
        "evaluator": evaluator,
        "proxy": False,
        "fixed_ip": False,
        "possibility_of_env_change": "low",
        "oracle": oracle,
    }
    return LocalTask(tid, domain, raw, dict(files or {}))


# ---- LibreOffice Calc ------------------------------------------------------------------------

FRUITS = [
    ["Item", "Qty", "Price"],
    ["Apple", 10, 0.5],
    ["Pear", 4, 0.75],
    ["Cherry", 25, 0.2],
    ["Mango", 3, 1.8],
    ["Plum", 8, 0.4],
]
SCORES = [
    ["Name", "Math", "Art"],
    ["Ana", 81, 90],
    ["Ben", 67, 72],
    ["Cleo", 94, 88],
    ["Dev", 58, 61],
    ["Eli", 73, 95],
]
EXPENSES = [
    ["Month", "Rent", "Food", "Travel"],
    ["Jan", 900, 310, 120],
    ["Feb", 900, 280, 60],
    ["Mar", 900, 335, 240],
    ["Apr", 950, 295, 0],
]
PEOPLE = [
    ["First", "Last", "City"],
    ["Maria", "Lopez", "Madrid"],
    ["John", "Smith", "Leeds"],
    ["Aiko", "Tanaka", "Osaka"],
    ["Omar", "Haddad", "Cairo"],
]


def _copy(rows: list[list[Any]]) -> list[list[Any]]:
    return [list(r) for r in rows]


def _set(rows: list[list[Any]], ref: str, value: Any) -> list[list[Any]]:
    """Set cell `ref` ("B7") in a row table, growing it as needed."""
    col = ord(ref[0]) - ord("A")
    row = int(ref[1:]) - 1
    while len(rows) <= row:
        rows.append([])
    while len(rows[row]) <= col:
        rows[row].append(None)
    rows[row][col] = value
    return rows


def calc_task(
    tid: str,
    name: str,
    instruction: str,
    before: list[list[Any]],
    after: list[list[Any]] | None,
    oracle: list[str],
    *,
    cells: dict[str, dict[str, Any]] | None = None,
    sheet: str = "Sheet1",
    extra_config: list[dict[str, Any]] | None = None,
    extra_files: dict[str, Callable[[Path], None]] | None = None,
    domain: str = "libreoffice_calc",
    apps: list[str] | None = None,
) -> LocalTask:
    """A Calc task: open `name` holding `before`; the saved file must hold `after` (sheet_data
    against a gold workbook) and pass the `cells` value rules (check_cell)."""
    path = f"{HOME}/{name}"
    gold = f"gold_{name}"
    rules: list[dict[str, Any]] = []
    postconfig = _calc_postconfig(name)
    files: dict[str, Callable[[Path], None]] = {name: _sheet({sheet: before})}
    if after is not None:
        files[gold] = _sheet({sheet: after})
        postconfig.append(_upload(tid, gold, f"{GOLD_DIR}/{gold}"))
        rules.append({"type": "sheet_data", "sheet_idx0": 0, "sheet_idx1": "EI0"})
    for ref, rule in (cells or {}).items():
        rules.append(
            {"type": "check_cell", "sheet_idx": 0, "coordinate": ref, "props": {"value": rule}}
        )
    evaluator: dict[str, Any] = {
        "postconfig": postconfig,
        "func": "compare_table",
        "result": {"type": "vm_file", "path": path, "dest": name},
        "options": {"rules": rules},
    }
    if after is not None:
        evaluator["expected"] = {"type": "vm_file", "path": f"{GOLD_DIR}/{gold}", "dest": gold}
    # Calc shows its window before it takes keys: wait until the document is ready for input.
    config = [*(extra_config or []), _upload(tid, name, path), _open(path), _sleep(2.0)]
    files.update(extra_files or {})
    return _task(
        tid, domain, instruction, config, evaluator, oracle, apps or ["libreoffice_calc"], files
    )


def calc_tasks() -> list[LocalTask]:
    t = []
    f = "inventory.xlsx"
    t.append(
        calc_task(
            "calc-set-quantity",
            f,
            f"In {f}, change the quantity of Pear to 12.",
            FRUITS,
            _set(_copy(FRUITS), "B3", 12),
            [calc_enter("B3", "12"), calc_save()],
            cells={"B3": {"method": "eq", "ref": 12}},
        )
    )
    t.append(
        calc_task(
            "calc-header-cost",
            "fruit_costs.xlsx",
            "Type the column header Cost into cell D1 of fruit_costs.xlsx.",
            FRUITS,
            _set(_copy(FRUITS), "D1", "Cost"),
            [calc_enter("D1", "Cost"), calc_save()],
        )
    )
    t.append(
        calc_task(
            "calc-sum-quantity",
            "stock.xlsx",
            "In cell B7 of stock.xlsx, compute the total quantity of all items.",
            FRUITS,
            _set(_copy(FRUITS), "B7", 50),
            [calc_enter("B7", "=SUM(B2:B6)"), calc_save()],
            cells={"B7": {"method": "approx:0.001", "ref": 50}},
        )
    )
    t.append(
        calc_task(
            "calc-average-math",
            "scores.xlsx",
            "Put the average Math score of the students into cell B7 of scores.xlsx.",
            SCORES,
            _set(_copy(SCORES), "B7", 74.6),
            [calc_enter("B7", "=AVERAGE(B2:B6)"), calc_save()],
            cells={"B7": {"method": "approx:0.01", "ref": 74.6}},
        )
    )
    t.append(
        calc_task(
            "calc-max-art",
            "art_scores.xlsx",
            "In cell C7 of art_scores.xlsx, put the highest Art score, and label it with the text Best in cell A7.",
            SCORES,
            _set(_set(_copy(SCORES), "C7", 95), "A7", "Best"),
            [calc_enter("C7", "=MAX(C2:C6)"), calc_enter("A7", "Best"), calc_save()],
        )
    )
    costs = _set(_copy(FRUITS), "D1", "Cost")
    for i, row in enumerate(FRUITS[1:], start=2):
        _set(costs, f"D{i}", round(row[1] * row[2], 6))
    t.append(
        calc_task(
            "calc-line-costs",
            "order.xlsx",
            "In order.xlsx, add a column Cost: put the header Cost in D1 and, in D2:D6, the quantity times the price of each item.",
            FRUITS,
            costs,
            [calc_enter("D1", "Cost")]
            + [calc_enter(f"D{i}", f"=B{i}*C{i}") for i in range(2, 7)]
            + [calc_save()],
        )
    )
    no_cherry = [r for r in _copy(FRUITS) if r[0] != "Cherry"]
    t.append(
        calc_task(
            "calc-delete-row",
            "pantry.xlsx",
            "Delete the whole row of Cherry in pantry.xlsx so that the rows below move up.",
            FRUITS,
            no_cherry,
            [
                calc_goto("A4"),
                "pyautogui.hotkey('shift', 'space'); time.sleep(0.3)",
                "pyautogui.hotkey('ctrl', '-'); time.sleep(0.8)",
                calc_save(),
            ],
        )
    )
    no_travel = [r[:3] + ([None] if i else ["Travel"]) for i, r in enumerate(_copy(EXPENSES))]
    t.append(
        calc_task(
            "calc-clear-travel",
            "expenses.xlsx",
            "Clear the Travel amounts (D2:D5) in expenses.xlsx but keep the Travel header.",
            EXPENSES,
            no_travel,
            [calc_goto("D2:D5"), "pyautogui.press('delete'); time.sleep(0.3)", calc_save()],
        )
    )
    t.append(
        calc_task(
            "calc-fix-food",
            "household.xlsx",
            "The Food amount for March in household.xlsx is wrong; it should be 353. Correct it.",
            EXPENSES,
            _set(_copy(EXPENSES), "C4", 353),
            [calc_enter("C4", "353"), calc_save()],
            cells={"C4": {"method": "eq", "ref": 353}},
        )
    )
    kiwi = [*_copy(FRUITS), ["Kiwi", 15, 0.6]]
    t.append(
        calc_task(
            "calc-append-kiwi",
            "market.xlsx",
            "Add a row for Kiwi, with quantity 15 and price 0.6, right below the last item in market.xlsx.",
            FRUITS,
            kiwi,
            [
                calc_enter("A7", "Kiwi"),
                calc_enter("B7", "15"),
                calc_enter("C7", "0.6"),
                calc_save(),
            ],
        )
    )
    full = _set(_copy(PEOPLE), "D1", "Full Name")
    for i, row in enumerate(PEOPLE[1:], start=2):
        _set(full, f"D{i}", f"{row[0]} {row[1]}")
    t.append(
        calc_task(
            "calc-full-names",
            "contacts.xlsx",
            "In contacts.xlsx, put the header Full Name in D1 and fill D2:D5 with each person's first name, a space, and last name.",
            PEOPLE,
            full,
            [calc_enter("D1", "Full Name")]
            + [calc_enter(f"D{i}", f'=A{i}&" "&B{i}') for i in range(2, 6)]
            + [calc_save()],
        )
    )
    t.append(
        calc_task(
            "calc-count-above-70",
            "math_results.xlsx",
            "In cell E1 of math_results.xlsx, write how many students scored more than 70 in Math.",
            SCORES,
            _set(_copy(SCORES), "E1", 3),
            [calc_enter("E1", '=COUNTIF(B2:B6;">70")'), calc_save()],
            cells={"E1": {"method": "eq", "ref": 3}},
        )
    )
    totals = _set(_copy(EXPENSES), "E1", "Total")
    for i, row in enumerate(EXPENSES[1:], start=2):
        _set(totals, f"E{i}", sum(row[1:]))
    t.append(
        calc_task(
            "calc-month-totals",
            "monthly.xlsx",
            "In monthly.xlsx, add the header Total in E1 and, in E2:E5, the sum of Rent, Food and Travel of each month.",
            EXPENSES,
            totals,
            [calc_enter("E1", "Total")]
            + [calc_enter(f"E{i}", f"=SUM(B{i}:D{i})") for i in range(2, 6)]
            + [calc_save()],
        )
    )
    t.append(
        calc_task(
            "calc-title-row",
            "fruit_stock.xlsx",
            "Insert an empty row above the header row of fruit_stock.xlsx and type the title Inventory into the new cell A1.",
            FRUITS,
            [["Inventory"], *_copy(FRUITS)],
            [
                calc_goto("A1"),
                "pyautogui.hotkey('shift', 'space'); time.sleep(0.3)",
                "pyautogui.hotkey('ctrl', '+'); time.sleep(0.8)",
                calc_enter("A1", "Inventory"),
                calc_save(),
            ],
        )
    )
    copied = _copy(SCORES)
    for i, row in enumerate(SCORES, start=1):
        _set(copied, f"E{i}", row[1])
    t.append(
        calc_task(
            "calc-copy-column",
            "math_copy.xlsx",
            "Copy the Math column (B1:B6) of math_copy.xlsx, header included, to E1:E6.",
            SCORES,
            copied,
            [
                calc_goto("B1:B6"),
                "pyautogui.hotkey('ctrl', 'c'); time.sleep(0.5)",
                calc_goto("E1"),
                "pyautogui.hotkey('ctrl', 'v'); time.sleep(0.8)",
                calc_save(),
            ],
        )
    )
    t.append(
        calc_task(
            "calc-city-upper",
            "cities.xlsx",
            "In cities.xlsx, write the city of Aiko in capital letters (OSAKA) into cell E4.",
            PEOPLE,
            _set(_copy(PEOPLE), "E4", "OSAKA"),
            [calc_enter("E4", "=UPPER(C4)"), calc_save()],
            cells={"E4": {"method": "eq", "ref": "OSAKA"}},
        )
    )
    book = _set(_copy(SCORES), "D1", "Total")
    for i, row in enumerate(SCORES[1:], start=2):
        _set(book, f"D{i}", row[1] + row[2])
    for col, idx in (("B", 1), ("C", 2), ("D", None)):
        vals = [r[1] + r[2] if idx is None else r[idx] for r in SCORES[1:]]
        _set(book, f"{col}7", sum(vals) / len(vals))
    t.append(
        calc_task(
            "calc-gradebook",
            "gradebook.xlsx",
            "In gradebook.xlsx, add a Total column (header Total in D1, Math plus Art for each "
            "student in D2:D6), then put the average of each of the columns Math, Art and Total "
            "in row 7 (B7:D7).",
            SCORES,
            book,
            [calc_enter("D1", "Total")]
            + [calc_enter(f"D{i}", f"=B{i}+C{i}") for i in range(2, 7)]
            + [calc_enter(f"{c}7", f"=AVERAGE({c}2:{c}6)") for c in "BCD"]
            + [calc_save()],
            cells={"D7": {"method": "approx:0.01", "ref": 155.8}},
        )
    )
    return t


# ---- text editor (Mousepad) ------------------------------------------------------------------


def editor_task(
    tid: str,
    name: str,
    instruction: str,
    before: str,
    after: str | None,
    oracle: list[str],
    *,
    contains: list[str] | None = None,
    lines: dict[str, list[str]] | None = None,
) -> LocalTask:
    """A Mousepad task on `name` (holding `before`): the saved file must equal `after`
    (compare_text_file against a gold file), or contain strings / match line regexes."""
    path = f"{HOME}/{name}"
    files = {name: _text(before)}
    config = [_upload(tid, name, path), _open(path)]
    result = {"type": "vm_file", "path": path, "dest": name}
    if after is not None:
        gold = f"gold_{name}"
        files[gold] = _text(after)
        evaluator = {
            "postconfig": [_upload(tid, gold, f"{GOLD_DIR}/{gold}")],
            "func": "compare_text_file",
            "result": result,
            "expected": {"type": "vm_file", "path": f"{GOLD_DIR}/{gold}", "dest": gold},
        }
    elif contains is not None:
        evaluator = {
            "func": "file_contains",
            "result": result,
            "expected": {"type": "rule", "rules": {"expected": contains}},
        }
    else:
        assert lines is not None
        evaluator = {
            "func": "check_list",
            "result": result,
            "expected": {"type": "rule", "rules": lines},
        }
    return _task(tid, "text_editor", instruction, config, evaluator, oracle, ["mousepad"], files)


def editor_tasks() -> list[LocalTask]:
    t = []
    t.append(
        editor_task(
            "editor-append-line",
            "shopping.txt",
            "Add butter as a new last line of shopping.txt and save the file.",
            "milk\neggs\nbread\n",
            "milk\neggs\nbread\nbutter\n",
            ["pyautogui.hotkey('ctrl', 'end'); " + write("butter\n"), editor_save()],
        )
    )
    t.append(
        editor_task(
            "editor-title-line",
            "meeting.txt",
            "Insert the line '# Meeting notes' at the very top of meeting.txt and save it.",
            "budget approved\nnext review in May\n",
            "# Meeting notes\nbudget approved\nnext review in May\n",
            ["pyautogui.hotkey('ctrl', 'home'); " + write("# Meeting notes\n"), editor_save()],
        )
    )
    story = "The colour of the sky changed.\nShe liked that colour.\nColourful days, colour everywhere.\n"
    t.append(
        editor_task(
            "editor-replace-colour",
            "story.txt",
            "In story.txt, replace every lowercase 'colour' with 'color' (leave 'Colourful' as it is) and save.",
            story,
            story.replace("colour", "color"),
            [editor_replace_all(story.replace("colour", "color")), editor_save()],
        )
    )
    t.append(
        editor_task(
            "editor-delete-line",
            "todo.txt",
            "Remove the line 'call Bob' from todo.txt and save it.",
            "water plants\nbuy stamps\ncall Bob\npay rent\n",
            "water plants\nbuy stamps\npay rent\n",
            [
                "pyautogui.hotkey('ctrl', 'home'); pyautogui.press('down', presses=2, interval=0.05)",
                "pyautogui.hotkey('shift', 'down'); time.sleep(0.2); pyautogui.press('delete')",
                editor_save(),
            ],
        )
    )
    letter = "Dear Sam,\nI did not recieve your parcel yet.\nBest,\nKim\n"
    t.append(
        editor_task(
            "editor-fix-typo",
            "letter.txt",
            "Fix the spelling mistake 'recieve' in letter.txt and save.",
            letter,
            letter.replace("recieve", "receive"),
            [editor_replace_all(letter.replace("recieve", "receive")), editor_save()],
        )
    )
    t.append(
        editor_task(
            "editor-write-greeting",
            "greeting.txt",
            "Write Hello, world! into the empty file greeting.txt and save it.",
            "",
            None,
            [write("Hello, world!\n"), editor_save()],
            contains=["Hello, world!"],
        )
    )
    config_text = "[server]\nhost = 0.0.0.0\nport = 8080\nworkers = 4\n"
    t.append(
        editor_task(
            "editor-config-port",
            "server.ini",
            "Change the port in server.ini from 8080 to 9090 and save the file.",
            config_text,
            None,
            [editor_replace_all(config_text.replace("8080", "9090")), editor_save()],
            lines={
                "expect": [r"^port = 9090$", r"^workers = 4$", r"^host = 0\.0\.0\.0$"],
                "unexpect": ["8080"],
            },
        )
    )
    names = ["pear", "apple", "fig", "banana", "cherry"]
    t.append(
        editor_task(
            "editor-sort-lines",
            "words.txt",
            "Sort the lines of words.txt alphabetically and save.",
            "\n".join(names) + "\n",
            "\n".join(sorted(names)) + "\n",
            [editor_replace_all("\n".join(sorted(names)) + "\n"), editor_save()],
        )
    )
    checklist = "- [x] book flights\n- [ ] pack bags\n- [ ] water plants\n"
    t.append(
        editor_task(
            "editor-check-item",
            "trip.txt",
            "In trip.txt, mark 'pack bags' as done by changing its [ ] to [x], then save.",
            checklist,
            checklist.replace("[ ] pack", "[x] pack"),
            [
                "pyautogui.hotkey('ctrl', 'home'); pyautogui.press('down'); pyautogui.press('end')",
                "pyautogui.press('home'); pyautogui.press('right', presses=3, interval=0.05); "
                "pyautogui.press('delete'); " + write("x"),
                editor_save(),
            ],
        )
    )
    steps = ["preheat oven", "mix flour and eggs", "bake 20 minutes", "let cool"]
    numbered = "".join(f"{i}. {s}\n" for i, s in enumerate(steps, start=1))
    t.append(
        editor_task(
            "editor-number-lines",
            "recipe.txt",
            "Number the lines of recipe.txt as '1. ', '2. ' and so on at the start of each line, then save.",
            "".join(f"{s}\n" for s in steps),
            numbered,
            ["pyautogui.hotkey('ctrl', 'home')"]
            + [
                f"pyautogui.press('home'); {write(f'{i}. ')}; pyautogui.press('down')"
                for i in range(1, 5)
            ]
            + [editor_save()],
        )
    )
    return t


# ---- terminal and files ----------------------------------------------------------------------


def os_task(
    tid: str,
    instruction: str,
    setup_shell: str,
    oracle: list[str],
    evaluator: dict[str, Any],
    *,
    pre_terminal: list[dict[str, Any]] | None = None,
) -> LocalTask:
    config = [
        _sh(f"rm -rf {WORK} && mkdir -p {WORK} && cd {WORK} && {setup_shell}".rstrip(" &")),
        *_terminal(),
    ]
    config += pre_terminal or []
    return _task(tid, "os", instruction, config, evaluator, oracle, ["os", "terminal"])


def os_tasks() -> list[LocalTask]:
    t = []
    t.append(
        os_task(
            "os-run-typed-command",
            "A command is already typed in the terminal. Run it.",
            "true",
            ["pyautogui.press('enter'); time.sleep(1.0)"],
            _command_check(f"[ -f {WORK}/ready.flag ] && echo yes || echo no", "yes\n"),
            pre_terminal=[
                _pyautogui(
                    f"time.sleep(0.5); pyautogui.write('touch {WORK}/ready.flag', interval=0.01)"
                )
            ],
        )
    )
    t.append(
        os_task(
            "os-make-directory",
            f"Create the directory {WORK}/projects/alpha (with its parent).",
            "true",
            [shell(f"mkdir -p {WORK}/projects/alpha")],
            _command_check(f"[ -d {WORK}/projects/alpha ] && echo yes || echo no", "yes\n"),
        )
    )
    t.append(
        os_task(
            "os-rename-file",
            f"Rename {WORK}/report_draft.txt to report_final.txt in the same directory.",
            "echo 'Q3 figures' > report_draft.txt",
            [shell(f"mv {WORK}/report_draft.txt {WORK}/report_final.txt")],
            _command_check(
                f"cd {WORK} && ls && cat report_final.txt", "report_final.txt\nQ3 figures\n"
            ),
        )
    )
    t.append(
        os_task(
            "os-copy-to-backup",
            f"Copy {WORK}/notes.txt into the directory {WORK}/backup, keeping the original.",
            "echo 'remember the milk' > notes.txt && mkdir backup",
            [shell(f"cp {WORK}/notes.txt {WORK}/backup/")],
            _command_check(
                f"cat {WORK}/notes.txt {WORK}/backup/notes.txt",
                "remember the milk\nremember the milk\n",
            ),
        )
    )
    t.append(
        os_task(
            "os-delete-tmp-files",
            f"Delete every .tmp file in {WORK}/cache, and nothing else.",
            "mkdir cache && touch cache/a.tmp cache/b.tmp cache/keep.dat cache/c.tmp.bak",
            [shell(f"rm {WORK}/cache/*.tmp")],
            _command_check(f"ls {WORK}/cache", "c.tmp.bak\nkeep.dat\n"),
        )
    )
    t.append(
        os_task(
            "os-count-lines",
            f"Write the number of lines of {WORK}/data.csv (just the number) into {WORK}/count.txt.",
            "printf 'id,v\\n1,a\\n2,b\\n3,c\\n4,d\\n5,e\\n6,f\\n' > data.csv",
            # pyautogui types "<" as ">" on X11 (it presses shift with the keycode of "less"): no "<".
            [shell(f"cat {WORK}/data.csv | wc -l > {WORK}/count.txt")],
            _command_check(f"tr -d ' \\n' < {WORK}/count.txt; echo", "7\n"),
        )
    )
    t.append(
        os_task(
            "os-make-executable",
            f"Make the script {WORK}/run.sh executable.",
            "printf '#!/bin/sh\\necho ok\\n' > run.sh && chmod 644 run.sh",
            [shell(f"chmod +x {WORK}/run.sh")],
            _command_check(f"[ -x {WORK}/run.sh ] && echo yes || echo no", "yes\n"),
        )
    )
    t.append(
        os_task(
            "os-move-logs",
            f"Move all .log files from {WORK} into the directory {WORK}/logs (create it).",
            "touch app.log db.log readme.md",
            [shell(f"cd {WORK}"), shell("mkdir -p logs"), shell("mv *.log logs/")],
            _command_check(
                f"cd {WORK} && ls -p | tr '\\n' ' ' && ls logs | tr '\\n' ' '",
                "logs/ readme.md app.log db.log ",
            ),
        )
    )
    t.append(
        os_task(
            "os-archive-docs",
            f"Create a gzip-compressed tar archive {WORK}/docs.tar.gz of the directory docs in {WORK} (paths inside start with docs/).",
            "mkdir docs && echo one > docs/a.txt && echo two > docs/b.txt",
            [shell(f"cd {WORK}"), shell("tar czf docs.tar.gz docs", wait=1.5)],
            _command_check(
                f"cd {WORK} && tar tzf docs.tar.gz | grep -v '/$' | sort",
                "docs/a.txt\ndocs/b.txt\n",
            ),
        )
    )
    t.append(
        os_task(
            "os-symlink-latest",
            f"Create a symbolic link {WORK}/latest pointing to releases/v2 (a relative link).",
            "mkdir -p releases/v1 releases/v2",
            [shell(f"cd {WORK}"), shell("ln -s releases/v2 latest")],
            _command_check(f"readlink {WORK}/latest", "releases/v2\n"),
        )
    )
    t.append(
        os_task(
            "os-append-line",
            f"Append the line 'export EDITOR=vim' to the end of {WORK}/profile.sh.",
            "printf 'export LANG=C.UTF-8\\n' > profile.sh",
            [shell(f"echo 'export EDITOR=vim' >> {WORK}/profile.sh")],
            _command_check(f"cat {WORK}/profile.sh", "export LANG=C.UTF-8\nexport EDITOR=vim\n"),
        )
    )
    t.append(
        os_task(
            "os-replace-host",
            f"In {WORK}/settings.conf, replace every 'localhost' with '127.0.0.1'.",
            "printf 'db=localhost:5432\\ncache=localhost:6379\\nname=app\\n' > settings.conf",
            [shell(f"sed -i 's/localhost/127.0.0.1/g' {WORK}/settings.conf")],
            _command_check(
                f"cat {WORK}/settings.conf", "db=127.0.0.1:5432\ncache=127.0.0.1:6379\nname=app\n"
            ),
        )
    )
    t.append(
        os_task(
            "os-sort-by-type",
            f"In {WORK}, move the .jpg files into a new directory images and the .txt files "
            "into a new directory texts.",
            "touch a.jpg b.jpg notes.txt todo.txt keep.md",
            [
                shell(f"cd {WORK}"),
                shell("mkdir images texts"),
                shell("mv *.jpg images/"),
                shell("mv *.txt texts/"),
            ],
            _command_check(
                f"cd {WORK} && ls -p | tr '\\n' ' ' && ls images texts | tr '\\n' ' '",
                "images/ keep.md texts/ images: a.jpg b.jpg  texts: notes.txt todo.txt ",
            ),
        )
    )
    return t


# ---- two applications ------------------------------------------------------------------------


def multi_tasks() -> list[LocalTask]:
    t = []
    ledger = [["Entry", "Amount"], ["Rent", 1200], ["Power", 85.5], ["Invoice", None]]
    note = "From: accounts\nInvoice total: 1234.56\nDue in 30 days.\n"
    t.append(
        calc_task(
            "multi-note-to-sheet",
            "ledger.xlsx",
            "The text file note.txt (open in the editor) gives an invoice total. Enter that amount into cell B4 of ledger.xlsx, next to Invoice.",
            ledger,
            _set(_copy(ledger), "B4", 1234.56),
            [calc_enter("B4", "1234.56"), calc_save()],
            cells={"B4": {"method": "approx:0.001", "ref": 1234.56}},
            extra_config=[
                _upload("multi-note-to-sheet", "note.txt", f"{HOME}/note.txt"),
                _open(f"{HOME}/note.txt"),
            ],
            extra_files={"note.txt": _text(note)},
            domain="multi_apps",
            apps=["libreoffice_calc", "mousepad"],
        )
    )
    numbers = [17, 42, 8]
    nums_sheet = [["Values"]]
    t.append(
        calc_task(
            "multi-numbers-to-sheet",
            "values.xlsx",
            "numbers.txt (open in the editor) lists three numbers. Put them, in order, into A2:A4 of values.xlsx, and their sum into A5.",
            nums_sheet,
            [["Values"], [17], [42], [8], [67]],
            [calc_enter(f"A{i}", str(n)) for i, n in enumerate(numbers, start=2)]
            + [calc_enter("A5", "=SUM(A2:A4)"), calc_save()],
            extra_config=[
                _upload("multi-numbers-to-sheet", "numbers.txt", f"{HOME}/numbers.txt"),
                _open(f"{HOME}/numbers.txt"),
            ],
            extra_files={"numbers.txt": _text("".join(f"{n}\n" for n in numbers))},
            domain="multi_apps",
            apps=["libreoffice_calc", "mousepad"],
        )
    )
    t.append(
        calc_task(
            "multi-count-files-to-sheet",
            "stats.xlsx",
            f"Count the files in {WORK}/photos (use the terminal if you like) and enter that number into cell B2 of stats.xlsx.",
            [["Folder", "Files"], ["photos", None]],
            [["Folder", "Files"], ["photos", 7]],
            [calc_enter("B2", "7"), calc_save()],
            cells={"B2": {"method": "eq", "ref": 7}},
            extra_config=[
                _sh(
                    f"rm -rf {WORK} && mkdir -p {WORK}/photos && cd {WORK}/photos && touch p1.jpg p2.jpg p3.jpg p4.png p5.png p6.jpg p7.gif"
                ),
            ],
            domain="multi_apps",
            apps=["libreoffice_calc", "os"],
        )
    )
    prices = [("Coffee", 3.2), ("Tea", 2.5), ("Juice", 4.1)]
    menu_text = "".join(f"{n}: {p}\n" for n, p in prices)
    t.append(
        calc_task(
            "multi-price-list-to-sheet",
            "menu.xlsx",
            "menu.txt (open in the editor) lists drinks with their prices. Copy them into "
            "menu.xlsx below the headers: names in A2:A4, prices in B2:B4, in the same order.",
            [["Drink", "Price"]],
            [["Drink", "Price"], *[[n, p] for n, p in prices]],
            [
                a
                for i, (n, p) in enumerate(prices, start=2)
                for a in (calc_enter(f"A{i}", n), calc_enter(f"B{i}", str(p)))
            ]
            + [calc_save()],
            extra_config=[
                _upload("multi-price-list-to-sheet", "menu.txt", f"{HOME}/menu.txt"),
                _open(f"{HOME}/menu.txt"),
            ],
            extra_files={"menu.txt": _text(menu_text)},
            domain="multi_apps",
            apps=["libreoffice_calc", "mousepad"],
        )
    )
    # Sheet -> text: the report is opened last, so the editor has the focus.
    budget = [["Item", "Cost"], ["Venue", 500], ["Food", 320], ["Music", 180]]
    report = "Party budget\nTotal cost: "
    t.append(
        _task(
            "multi-sheet-total-to-text",
            "multi_apps",
            "budget.xlsx (open in Calc) lists costs. At the end of the last line of report.txt (open in the editor), write the total cost as a plain number, then save report.txt.",
            [
                _upload("multi-sheet-total-to-text", "budget.xlsx", f"{HOME}/budget.xlsx"),
                _open(f"{HOME}/budget.xlsx"),
                _upload("multi-sheet-total-to-text", "report.txt", f"{HOME}/report.txt"),
                _open(f"{HOME}/report.txt"),
            ],
            {
                "func": "check_list",
                "result": {"type": "vm_file", "path": f"{HOME}/report.txt", "dest": "report.txt"},
                "expected": {
                    "type": "rule",
                    "rules": {
                        "expect": [r"^Party budget$", r"^Total cost: 1000(\.0+)?\s*$"],
                        "unexpect": [],
                    },
                },
            },
            ["pyautogui.hotkey('ctrl', 'end'); " + write("1000"), editor_save()],
            ["libreoffice_calc", "mousepad"],
            {"budget.xlsx": _sheet({"Sheet1": budget}), "report.txt": _text(report)},
        )
    )
    # Terminal -> editor.
    t.append(
        _task(
            "multi-line-count-to-editor",
            "multi_apps",
            f"Find how many lines {WORK}/server.log has (the terminal is open) and write just that number into answer.txt (open in the editor), then save it.",
            [
                _sh(
                    f"rm -rf {WORK} && mkdir -p {WORK} && seq 1 23 | sed 's/^/event /' > {WORK}/server.log"
                ),
                _upload("multi-line-count-to-editor", "answer.txt", f"{HOME}/answer.txt"),
                *_terminal(),
                _open(f"{HOME}/answer.txt"),
            ],
            {
                "func": "check_list",
                "result": {"type": "vm_file", "path": f"{HOME}/answer.txt", "dest": "answer.txt"},
                "expected": {"type": "rule", "rules": {"expect": [r"^\s*23\s*$"], "unexpect": []}},
            },
            [write("23\n"), editor_save()],
            ["os", "mousepad"],
            {"answer.txt": _text("")},
        )
    )
    # Sheet -> terminal: the terminal is started last, so it has the focus.
    t.append(
        _task(
            "multi-sheet-to-directories",
            "multi_apps",
            f"projects.xlsx (open in Calc) lists project codes in A2:A4. In the terminal, create one directory per code inside {WORK}/projects.",
            [
                _sh(f"rm -rf {WORK} && mkdir -p {WORK}/projects"),
                _upload("multi-sheet-to-directories", "projects.xlsx", f"{HOME}/projects.xlsx"),
                _open(f"{HOME}/projects.xlsx"),
                *_terminal(),
            ],
            _command_check(f"ls {WORK}/projects | tr '\\n' ' '", "apollo gemini mercury "),
            [shell(f"cd {WORK}/projects"), shell("mkdir mercury gemini apollo")],
            ["libreoffice_calc", "os"],
            {"projects.xlsx": _sheet({"Sheet1": [["Code"], ["mercury"], ["gemini"], ["apollo"]]})},
        )
    )
    return t


def all_tasks() -> list[LocalTask]:
    return calc_tasks() + editor_tasks() + os_tasks() + multi_tasks()


def write_suite(out: Path = SUITE_DIR) -> dict[str, list[str]]:
    """Write every task and its files under `out` (replacing what was there); returns the index."""
    tasks = all_tasks()
    ids = [t.id for t in tasks]
    if len(set(ids)) != len(ids):
        raise ValueError(f"duplicate task ids: {sorted({i for i in ids if ids.count(i) > 1})}")
    if out.exists():
        shutil.rmtree(out)
    index: dict[str, list[str]] = {}
    for t in tasks:
        folder = out / t.domain
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{t.id}.json").write_text(json.dumps(t.raw, indent=2) + "\n", encoding="utf-8")
        for name, writer in t.files.items():
            (folder / t.id).mkdir(exist_ok=True)
            writer(folder / t.id / name)
        index.setdefault(t.domain, []).append(t.id)
    (out / "test_all.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    (out / "README.md").write_text(_readme(tasks), encoding="utf-8")
    return index


def _readme(tasks: list[LocalTask]) -> str:
    rows = "".join(
        f"| {t.id} | {t.domain} | {len(t.raw['oracle'])} | {t.raw['evaluator']['func']} |\n"
        for t in tasks
    )
    return (
        "# Local task suite\n\n"
        "Written by `python -m arpo_envs.tasks.generate` (do not edit by hand). OSWorld's task\n"
        "schema; `oracle` is the list of pyautogui actions that solves the task; steps is its\n"
        "length. Files a task uploads are in the folder named after it, beside its task file.\n\n"
        "| id | domain | steps | checker |\n|---|---|---|---|\n" + rows
    )


if __name__ == "__main__":
    idx = write_suite()
    print(
        f"wrote {sum(map(len, idx.values()))} tasks to {SUITE_DIR}: "
        + ", ".join(f"{d} {len(v)}" for d, v in idx.items())
    )
