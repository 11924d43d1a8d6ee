"""Field metadata for the configuration dataclasses whose fields are flags."""

from __future__ import annotations


def flag(help_text: str, **extra) -> dict:
    """Field metadata: the flag's help text, argparse extras such as choices, and ``aliases``: other
    spellings of the flag (Megatron's), a list, or a dict of spelling -> the factor its value is scaled by."""
    return {"help": help_text, **extra}
