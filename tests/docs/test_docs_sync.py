"""The README's options table and DataParallel signature say what the code has."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import dpmethods

_README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_the_options_table_names_every_field_of_method_options() -> None:
    section = _README[_README.index("## Options"):]
    section = section[: section.index("\n## ", 3)]
    rows = set(re.findall(r"^\| `(\w+)` \|", section, re.M))
    fields = {f.name for f in dataclasses.fields(dpmethods.MethodOptions)}
    assert rows == fields
    shown = re.search(r"`@parallel_method\((.*?)\)`", section).group(1)  # type: ignore[union-attr]
    assert [p.split("=")[0] for p in shown.split(", ")] == [f.name for f in dataclasses.fields(dpmethods.MethodOptions)]


def test_the_data_parallel_signature_shown_matches_the_code() -> None:
    shown = re.search(r"`DataParallel\((module, .*?)\)`", _README).group(1)  # type: ignore[union-attr]
    parts = []
    for p in list(inspect.signature(dpmethods.DataParallel.__init__).parameters.values())[1:]:
        if p.kind == p.KEYWORD_ONLY and "*" not in parts:
            parts.append("*")
        default = "" if p.default is p.empty else "=" + repr(p.default).replace("'", '"')
        parts.append(p.name + default)
    assert shown == ", ".join(parts)
