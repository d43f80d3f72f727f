"""What the docs claim holds.

Detection: a detector pads each image to the largest of its batch, so a replica's results
equal the full batch's only for images that pad to the same size. Benchmarks: the tables
and the figures quoted are those of the committed result, one figure per result."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _close import FASTER_RCNN_TERMS

from dpmethods import DataParallel
from dpmethods.testing import assert_close_to_reference

_ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("doc", ["docs/real_models.md", "README.md"])
def test_docs_say_detection_matches_only_for_images_that_pad_alike(doc: str) -> None:
    text = " ".join((_ROOT / doc).read_text().split())
    assert (
        "The results equal the full batch's only for images that pad to the same size" in text
    ), doc
    assert "boxes and scores depend on which images run together" in text, doc


def _run(widths: list[int]) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    detection = pytest.importorskip("torchvision.models.detection")
    torch.manual_seed(0)
    model = detection.fasterrcnn_mobilenet_v3_large_fpn(
        weights=None, weights_backbone=None, num_classes=3, min_size=64, max_size=160,
        rpn_pre_nms_top_n_test=200, rpn_post_nms_top_n_test=20, box_score_thresh=0.0,
    ).eval()
    images = [torch.rand(3, 64, w, generator=torch.Generator().manual_seed(w)) for w in widths]
    dp = DataParallel(model, device_ids=["cpu"] * 2,
                      methods={"forward": {"split": ("images", "targets"), "gather": "extend"}})
    with torch.no_grad():
        return model(images), dp(images)


def _same(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> bool:
    """Whether two runs found the same detections, up to rounding. Both must give one dict
    of the same fields and dtypes per image (a mismatch there fails); another number of
    detections, or other labels, boxes or scores, is a difference."""
    assert len(a) == len(b)
    assert [{k: v.dtype for k, v in x.items()} for x in a] == [{k: v.dtype for k, v in x.items()} for x in b]
    if any(x[k].shape != y[k].shape for x, y in zip(a, b) for k in x):
        return False
    try:
        assert_close_to_reference(a, b, terms=FASTER_RCNN_TERMS)  # labels exactly
    except AssertionError:  # the structure matches: values differ
        return False
    return True


def test_detection_matches_the_full_batch_when_the_images_pad_alike() -> None:
    ref, got = _run([66, 70, 90, 94])  # every subset pads to 64 x 96
    assert _same(ref, got)


def test_detection_depends_on_the_batch_when_the_images_pad_differently() -> None:
    # Widths 66 and 70 pad to 96 on their replica, but to 160 beside 150 and 158 on one
    # device: the backbone sees other borders, so the boxes differ (as the docs say).
    ref, got = _run([66, 70, 150, 158])
    assert len(got) == len(ref) == 4
    assert not _same(ref[:2], got[:2])


def _bench_map() -> Any:
    sys.path.insert(0, str(_ROOT / "benchmarks"))
    try:
        import bench_map
    finally:
        sys.path.remove(str(_ROOT / "benchmarks"))
    return bench_map


def test_the_map_benchmark_tables_are_the_committed_result() -> None:
    """benchmarks/README.md shows the tables bench_map.py draws from results/map_cpu.json."""
    bench_map = _bench_map()
    saved = json.loads((_ROOT / "benchmarks" / "results" / "map_cpu.json").read_text())
    figures = [bench_map.Figure(**f) for f in saved["figures"]]
    for wl, facts in saved["workloads"].items():  # the saved speeds are the paired ones
        times = {f.path: f.rounds for f in figures if f.workload == wl}
        assert facts["speed_over_one_device"] == bench_map.speeds(times)
    drawn = bench_map.table(figures, saved["workloads"]).split("\n\n")
    readme = (_ROOT / "benchmarks" / "README.md").read_text()
    assert drawn[0] in readme and drawn[1] in readme


def test_the_map_figures_quoted_are_the_committed_ones() -> None:
    """One figure per result: the README and docs/map.md quote the benchmark's numbers."""
    saved = json.loads((_ROOT / "benchmarks" / "results" / "map_cpu.json").read_text())
    gil = saved["workloads"]["gil"]
    over_threads = next(t["median"] for t in gil["targets"] if t["slower"] == "map")
    over_one = gil["speed_over_one_device"]["map-processes"]
    quotes = {
        "README.md": f"`map` on processes was {over_threads:.2f}x the thread map and "
        f"{over_one:.2f}x one device",
        "docs/map.md": f"`generate` with `map` {over_threads:.2f}x the thread map and "
        f"{over_one:.2f}x one device",
        "benchmarks/README.md": f"On processes, `map` is {over_threads:.2f}x the thread map and "
        f"{over_one:.2f}x one device",
    }
    for doc, quote in quotes.items():
        assert quote in " ".join((_ROOT / doc).read_text().split()), doc


def test_the_long_map_figures_are_the_committed_result() -> None:
    """benchmarks/README.md shows the long-run tables bench_map.py draws from
    results/long_runs/map_cpu.json, and docs/map.md quotes that run's figures."""
    bench_map = _bench_map()
    saved = json.loads((_ROOT / "benchmarks" / "results" / "long_runs" / "map_cpu.json").read_text())
    figures = [bench_map.Figure(**f) for f in saved["figures"]]
    readme = (_ROOT / "benchmarks" / "README.md").read_text()
    for part in bench_map.table(figures, saved["workloads"]).split("\n\n"):
        assert part in readme, part
    w = saved["workloads"]
    ratio = {(wl, t["slower"]): t["median"] for wl in w for t in w[wl]["targets"]}
    quotes = [
        f"{ratio['checkpoint', 'map-checkpoint']:.2f}x the same map without it on threads",
        f"and {ratio['checkpoint', 'map-processes-checkpoint']:.2f}x on processes",
        f"{w['sigkill']['kill_to_output_s']['median']:.2f} s from a worker's SIGKILL",
        f"against {w['sigkill']['pool_start_s']['median']:.2f} s for a fresh two-worker pool's start-up",
        f"{ratio['oom-split', 'split']:.2f}x the time of the same batches cut in halves by hand on threads "
        f"and {ratio['oom-split', 'split-processes']:.2f}x on processes",
        f"{ratio['oom-split', 'split-first-processes']:.2f}x a map of its two halves",
    ]
    doc = " ".join((_ROOT / "docs" / "map.md").read_text().split())
    for quote in quotes:
        assert quote in doc, quote
