"""Every error code gpumode raises is in the one table (``gpumode.errors.CODES``), and the table is the one
documented in docs/api.md: a code added in one place and not the others fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from gpumode.errors import CODES

SRC = Path(__file__).resolve().parents[1] / "src" / "gpumode"
DOCS = Path(__file__).resolve().parents[1] / "docs"
RAISERS = {"RequestError", "JobError", "GroupNotPlannable"}  # their first argument is the code


def _text(node: ast.expr | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _raised_codes() -> dict[str, str]:
    found: dict[str, str] = {}
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            where = f"{path.relative_to(SRC)}:{getattr(node, 'lineno', 0)}"
            codes: list[str | None] = []
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", getattr(node.func, "attr", ""))
                if name in RAISERS and node.args:
                    codes.append(_text(node.args[0]))
                codes += [_text(kw.value) for kw in node.keywords if kw.arg == "code"]
            elif isinstance(node, ast.Assign) and any(
                getattr(t, "id", "") == "default_code" for t in node.targets
            ):
                codes.append(_text(node.value))
            found.update({code: where for code in codes if code is not None})
    return found


def test_every_raised_code_is_in_the_table() -> None:
    raised = _raised_codes()
    assert len(raised) > 20  # the scan finds the raises at all
    missing = {code: where for code, where in raised.items() if code not in CODES}
    assert missing == {}


def test_the_table_is_the_documented_one() -> None:
    documented = dict(re.findall(r"^\| `([a-z_]+)` \| ([a-z_]+) \|", (DOCS / "api.md").read_text(), re.M))
    assert documented == {code: c.kind.value for code, c in CODES.items()}
