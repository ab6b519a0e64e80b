"""Replace one numbered section of an existing BENCHMARKS.md (``run_all.py --only``)."""

from __future__ import annotations

import re


def splice_section(path: str, number: int, text: str) -> None:
    r"""Replace section ``number`` of ``path``, from its ``## N.`` heading up to the next
    ``## `` heading, by ``text``; the rest of the file is kept as it was.

    >>> import os, tempfile
    >>> p = os.path.join(tempfile.mkdtemp(), "B.md")
    >>> _ = open(p, "w").write("# B\n\n## 6. a\nold 6\n\n## 7. b\nold 7\n\n## 8. c\nold 8\n")
    >>> splice_section(p, 7, "## 7. b\nnew 7")
    >>> print(open(p).read(), end="")
    # B
    <BLANKLINE>
    ## 6. a
    old 6
    <BLANKLINE>
    ## 7. b
    new 7
    <BLANKLINE>
    ## 8. c
    old 8
    """
    with open(path) as f:
        doc = f.read()
    m = re.search(rf"^## {number}\. .*?(?=^## |\Z)", doc, re.M | re.S)
    if m is None:
        raise SystemExit(f"run_all: {path} has no section {number} to replace; run without --only")
    with open(path, "w") as f:
        f.write(doc[: m.start()] + text.rstrip() + "\n\n" + doc[m.end() :])
