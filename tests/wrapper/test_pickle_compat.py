"""A wrapper pickled by an earlier release still loads: the paths its pickle names
(``dpmethods._wrapping``, ``dpmethods.data_parallel``, ``dpmethods.options``) stay.

``data/wrapper_v0.1.0.pkl`` is ``pickle.dumps`` of
``DataParallel(Sequential(Linear(3, 2)), device_ids=["cpu"] * 2, methods=["0"])``, made
with the code as it was before the package's modules moved (the parallel child ``"0"``
exercises the pickled method options).
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import torch

import dpmethods
from dpmethods.testing import assert_close_to_reference

_PICKLED = Path(__file__).parent / "data" / "wrapper_v0.1.0.pkl"


def test_the_pickle_names_the_paths_kept_for_it() -> None:
    names = set(re.findall(rb"dpmethods[\w.]*", _PICKLED.read_bytes()))
    assert names == {b"dpmethods._wrapping", b"dpmethods.data_parallel", b"dpmethods.options"}


def test_a_wrapper_pickled_by_an_earlier_release_loads_and_runs() -> None:
    dp = pickle.loads(_PICKLED.read_bytes())
    assert isinstance(dp, dpmethods.DataParallel)
    assert dp.device_ids == [torch.device("cpu")] * 2
    x = torch.randn(5, 3)
    expected = dp.module(x)
    # One Linear(3, 2): 3 products and the bias per output element.
    assert_close_to_reference(dp(x), expected, terms=4)
    assert_close_to_reference(getattr(dp, "0")(x), expected, terms=4)


def test_a_wrapper_pickled_by_an_earlier_release_maps_on_worker_processes() -> None:
    dp = pickle.loads(_PICKLED.read_bytes())
    batches = [torch.randn(n, 3) for n in (5, 2, 7)]
    try:
        with torch.no_grad():
            got = list(dp.map("forward", batches, workers="processes"))
            expected = [dp.module(b) for b in batches]
    finally:
        dp.close()
    for out, want in zip(got, expected, strict=True):
        assert_close_to_reference(out, want, terms=4)  # Linear(3, 2), as above
