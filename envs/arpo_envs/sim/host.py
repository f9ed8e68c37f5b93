"""What a widget may ask of the desktop it lives on.

The desktop (`desktop.py`) is built from widgets (`widgets.py`), and a widget that
reacts to input calls back into its desktop. This protocol sits below both so the
imports run one way, desktop -> widgets -> host: the widgets name only these three
members, and `Desktop` provides them.
"""

from __future__ import annotations

from typing import Any, Protocol


class WidgetHost(Protocol):
    """The part of `Desktop` that widgets use."""

    clipboard: str
    """The desktop's clipboard text (ctrl+c / ctrl+x / ctrl+v in a text field)."""

    def touch(self) -> None:
        """Record a visible change (the next screenshot redraws)."""

    def open_menu(self, bar: Any, index: int) -> None:
        """Open (or, when it is open, close) drop-down `index` of the `widgets.MenuBar` `bar`."""
