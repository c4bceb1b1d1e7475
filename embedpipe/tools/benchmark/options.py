"""What a benchmark section is, and the argparse types its options use.

A section is a module with ``NAME``, ``add_arguments(parser)``, ``run(args, workdir) -> dict``,
``report(result, args) -> str`` (markdown) and ``targets(result) -> list[dict]`` (its rows of the
Targets table, see :func:`embedpipe.tools.benchmark.report.target`), and optionally ``QUICK``: caps
``--quick`` puts on its options (``{"batches": 150}``: at most 150), and ``OPT_IN``: the name of
the option without which it does not run (``"distributed"``: only with ``--distributed``). The driver is a loop over
sections; bad values are refused by argparse, before any section runs.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from types import ModuleType


def integer(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
        return value

    return parse


def _unit(text: str, zero: bool) -> float:
    """``text`` as a number in [0, 1] (``zero``) or (0, 1]; else an argparse error."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0 <= value <= 1 and (zero or value > 0)):
        where = "[0, 1]" if zero else "(0, 1]"
        raise argparse.ArgumentTypeError(f"must be a number in {where}, got {text!r}")
    return value


def fraction(text: str) -> float:
    """An argparse type: a number in (0, 1]."""
    return _unit(text, zero=False)


def share(text: str) -> float:
    """An argparse type: a number in [0, 1]."""
    return _unit(text, zero=True)


def apply_quick(args: argparse.Namespace, sections: list[ModuleType]) -> None:
    """Cap each section's options at its ``QUICK`` values (``--quick``)."""
    for section in sections:
        for key, cap in getattr(section, "QUICK", {}).items():
            setattr(args, key, min(getattr(args, key), cap))
