"""The argument parser of ``jaxdp-train`` and ``python -m jaxdp.launch``: no abbreviations, and
a "did you mean" for a mistyped flag.

argparse accepts any unambiguous prefix of a flag by default, so ``--zero-stag 2`` was silently
taken as ``--zero-stage 2``, and a later flag sharing that prefix would change what an old
command means. Both commands turn prefixes off (``allow_abbrev=False``) and name the closest
flag when one is unknown (``--stpes 5``: did you mean ``--steps``?).
"""

from __future__ import annotations

import argparse
import difflib
from typing import Any, NoReturn

__all__ = ["StrictParser"]


class StrictParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` without prefix matching; unknown flags get a suggestion.

    Args:
        unknown_hint: appended to the error when an unknown flag has no close match (e.g.
            where the flags of another command go).
    """

    def __init__(self, *args: Any, unknown_hint: str = "", **kwargs: Any):
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)
        self.unknown_hint = unknown_hint

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            self.unrecognized(extra)
        return parsed

    def unrecognized(self, extra: list[str]) -> NoReturn:
        flags = [
            s
            for a in self._actions
            for s in a.option_strings
            if s.startswith("--") and s != "--help"
        ]
        hints = []
        for word in extra:
            if not word.startswith("-"):
                continue
            name = word.split("=", 1)[0]
            close = difflib.get_close_matches(name, flags, n=1, cutoff=0.75)
            if close:
                hints.append(f"{name}: did you mean {close[0]}?")
        if hints:
            hint = " (" + "; ".join(hints) + ")"
        else:
            hint = f" ({self.unknown_hint})" if self.unknown_hint else ""
        self.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
