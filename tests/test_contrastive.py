"""transformers' contrastive models: logits_per_* and their loss over the whole batch.

Each family (CLIP, SigLIP and SigLIP 2, ALIGN, CLAP, Chinese-CLIP, AltCLIP, GroupViT,
OWL-ViT, OWLv2, BLIP, MetaCLIP 2, CLIPSeg, the vision-text dual encoder, TIPSv2, AIMv2,
BLIP-2's image-text contrast) from a tiny config with random weights, through
DataParallel with no configuration, against the bare model on the full batch: loss,
logits, embeddings and every parameter's gradient, on 7 items over 3 replicas and 8 over
4. Models whose logits or loss can't be computed again are warned about on equal shares
too.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _close import transformer_terms

from dpmethods import DataParallel
from dpmethods import _warn_once as warn_once
from dpmethods.testing import assert_close_to_reference

pytest.importorskip("transformers")
import _contrastive_models as models  # noqa: E402 (needs transformers)

SPLITS = [pytest.param(7, 3, id="7-on-3"), pytest.param(8, 4, id="8-on-4")]
# A tower (2 blocks of width 32, MLP 37, up to 17 tokens), its projection, the
# normalisation and the 32-wide products of the logits; a gradient runs the path back and
# sums over the batch's rows.
TERMS = transformer_terms(width=32, ff=37, seq=17, layers=2) + 3 * 32
GRAD_TERMS = 2 * TERMS + 8


@pytest.fixture(autouse=True)
def _fresh_warnings() -> Iterator[None]:
    warn_once.reset()
    yield


def _ours(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if str(w.message).startswith(("DataParallel", "gather"))]


def _objective(name: str, out: Any) -> torch.Tensor:
    if name in models.NO_LOSS:  # a function of every logit, coupling the whole batch
        return out.logits_per_text.logsumexp(1).mean() + out.logits_per_text.logsumexp(0).mean()
    return out.loss


def _run(name: str, model: Any, x: dict[str, Any], devices: int | None) -> tuple[Any, dict[str, torch.Tensor]]:
    model.zero_grad()
    call = model if devices is None else DataParallel(model, device_ids=["cpu"] * devices)
    out = call(**x, return_loss=name not in models.NO_LOSS)
    _objective(name, out).backward()
    return out, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("n,devices", SPLITS)
@pytest.mark.parametrize("name", list(models.BUILDERS))
def test_logits_loss_and_gradients_equal_one_device(name: str, n: int, devices: int) -> None:
    model, inputs = models.BUILDERS[name]()
    x = inputs(n)
    want, want_grads = _run(name, model, x, None)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got, got_grads = _run(name, model, x, devices)
    assert _ours(record) == []
    assert list(got.keys()) == list(want.keys())
    fields = [k for k in want if k == "loss" or k.startswith("logits_per_") or k.endswith("_embeds")]
    assert len(fields) >= 4
    # The loss's log-sum-exp over the batch: the logits' magnitude is the scale.
    scale = float(want.logits_per_text.detach().abs().max())
    for key in fields:
        assert_close_to_reference(got[key], want[key], terms=TERMS, scale=scale, msg=f"{name} {key}: ")
    assert got_grads.keys() == want_grads.keys()
    assert_close_to_reference(got_grads, want_grads, terms=GRAD_TERMS, scale=scale, msg=f"{name} grads: ")
