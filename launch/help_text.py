"""The description a tool's ``--help`` prints: its module docstring's first paragraph, whole."""

from __future__ import annotations


def help_description(doc: str | None) -> str:
    """The first paragraph of ``doc`` on one line, ending as a sentence (a trailing colon, which
    introduces the details below it, becomes a full stop)."""
    paragraph = " ".join((doc or "").strip().split("\n\n")[0].split())
    return paragraph[:-1] + "." if paragraph.endswith(":") else paragraph
