"""``dir(dpmethods)`` lists the public names, and the docs name only public names, at their homes."""

from __future__ import annotations

import importlib
import re
import types
import warnings
from pathlib import Path

import pytest

import dpmethods

_ROOT = Path(__file__).resolve().parents[2]
# Every page for users. docs/architecture.md is the map of the internal layers, for
# contributors: it names private modules on purpose.
_DOCS = sorted(
    {_ROOT / "README.md", _ROOT / "benchmarks" / "README.md", *(_ROOT / "docs").glob("*.md")}
    - {_ROOT / "docs" / "architecture.md"}
)
# `dpmethods.x.y` not preceded by a word character or a dot (torch.ops.dpmethods.gather_coalesced
# is torch's namespace), nor by a slash (a path). dpmethods._C is the compiled library: the
# page on its internals (docs/compiled_gather.md) names its entry points.
_REFERENCE = re.compile(r"(?<![\w./])dpmethods((?:\.\w+)+)")


def test_dir_lists_the_public_names_only() -> None:
    names = dir(dpmethods)
    for helper in ("Any", "TYPE_CHECKING", "annotations", "importlib", "gather", "core"):
        assert helper not in names
    assert set(dpmethods.__all__) <= set(names)
    assert {"__version__", "parallel", "extending"} <= set(names)
    for name in names:  # and each of them is there
        getattr(dpmethods, name)


def _public(owner: object, name: str) -> object:
    """``owner.name`` if it is a public name of ``owner``; raise AssertionError otherwise."""
    assert not name.startswith("_"), name
    if isinstance(owner, types.ModuleType):
        public = getattr(owner, "__all__", None)
        if public is not None and name in public:
            return getattr(owner, name)
        try:  # a public submodule (dpmethods.parallel, dpmethods.integrations.transformers)
            return importlib.import_module(f"{owner.__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{owner.__name__}.{name}":  # the module is there; a library it needs is not
                pytest.skip(f"{owner.__name__}.{name} needs {exc.name}, which is not installed")
            raise AssertionError(f"{name!r} is not public in {owner.__name__}") from None
    return getattr(owner, name)  # an attribute of a public class (DataParallel.map)


def _references() -> list[tuple[str, str]]:
    found = []
    for doc in _DOCS:
        for match in _REFERENCE.finditer(doc.read_text()):
            if not match.group(1).startswith("._C"):
                found.append((doc.relative_to(_ROOT).as_posix(), "dpmethods" + match.group(1)))
    return sorted(set(found))


def test_the_docs_name_something() -> None:
    assert len(_references()) > 20


@pytest.mark.parametrize(("doc", "reference"), _references())
def test_the_docs_name_public_names_at_their_homes(doc: str, reference: str) -> None:
    owner: object = dpmethods
    for part in reference.split(".")[1:]:
        if part in ("py", "md"):  # the end of a file name in prose (dpmethods.py)
            break
        owner = _public(owner, part)


def test_the_former_name_of_state_dicts_gives_its_names_and_warns_once() -> None:
    import dpmethods.checkpoints as former  # type: ignore[import-not-found]

    from dpmethods import state_dicts
    from dpmethods.vocab import warn_once

    warn_once.reset()
    with pytest.warns(FutureWarning, match=r"^dpmethods\.checkpoints is named dpmethods\.state_dicts: import "
                      r"its names from dpmethods\.state_dicts$"):
        assert former.unwrap is state_dicts.unwrap
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert former.load_state_dict is state_dicts.load_state_dict
    assert "checkpoints" not in dir(dpmethods)
