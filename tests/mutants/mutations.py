"""The named mutations ``run_mutants.py`` applies, and the tests aimed at each.

A mutation rewrites one line: the line of ``path`` that holds ``anchor`` (a short,
distinctive piece of it, which must occur exactly once in the file) gets ``anchor``
replaced by ``replacement``; a replacement of several lines continues at that line's
indentation. When the code moves, re-target the anchor: the runner refuses a missing
or repeated one. ``tests`` are pytest node ids (a test function takes all its
parameters); every one of them must fail on the mutation.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MUTATIONS", "Mutation"]


@dataclass(frozen=True)
class Mutation:
    """One named break of the library, and the tests that must catch it.

    Example:
        >>> Mutation("m", "why", "dpmethods/x.py", "a + b", "a - b", ("tests/test_x.py",)).name
        'm'
    """

    name: str
    description: str
    path: str
    anchor: str
    replacement: str
    tests: tuple[str, ...]


_TF = "tests/integrations/transformers/test_models.py::"
_LOSSES = "dpmethods/integrations/transformers/losses.py"
_PLANS = "dpmethods/integrations/transformers/loss_plans.py"
_SPLIT_IDS = ("7-on-3", "8-on-4")
_CLASSIFICATION = tuple(
    f"{_TF}test_classification_heads_losses_equal_the_full_batch_loss[{s}-{k}]" for s in _SPLIT_IDS
    for k in ("single-label", "regression", "multi-label", "gpt2", "llama", "multiple-choice")
)
# Means over rows on equal shares: there equal weights are the right ones.
_EQUAL_WEIGHTS = (
    f"{_TF}test_classification_heads_losses_equal_the_full_batch_loss[8-on-4-regression]",
    f"{_TF}test_classification_heads_losses_equal_the_full_batch_loss[8-on-4-multi-label]",
    f"{_TF}test_ctc_loss_follows_the_configured_reduction[8-on-4-mean]",
)
_CTC = tuple(f"{_TF}test_ctc_loss_follows_the_configured_reduction[{s}-{r}]" for s in _SPLIT_IDS for r in ("sum", "mean"))
# The losses each replica computes as a mean of its own, weighted when joined.
_MEAN_LOSS_TESTS = (
    _TF + "test_a_token_averaged_cross_entropy_computed_by_the_model_equals_the_full_batch_loss",
    *_CLASSIFICATION,
    _TF + "test_question_answering_loss_equals_the_full_batch_loss",
    _TF + "test_a_weighted_loss_with_return_dict_false_is_the_first_element",
)
# The losses transformers computes as shares, given the full batch's num_items_in_batch.
_SHARE_LOSS_TESTS = tuple(_TF + t for t in (
    "test_gpt2_left_padded_loss_equals_the_full_batch_loss",
    "test_masked_lm_loss_with_ignored_labels_equals_the_full_batch_loss",
))
# Every test of a transformers loss joined over the replicas.
_LOSS_TESTS = (*_SHARE_LOSS_TESTS, *_CTC, *_MEAN_LOSS_TESTS)


def _but(tests: tuple[str, ...], left_out: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(t for t in tests if t not in left_out)


_GEN = "tests/integrations/transformers/test_generate.py::test_sequences_equal_one_device"
_GEN_MODELS = ("gpt2", "llama", "t5", "whisper")
_SPLITS = ("7-3", "8-4")
# Uneven shares (on 8 images and 4 replicas equal weights are the right ones).
_DETECTION_LOSSES = (
    "tests/integrations/test_torchvision.py::test_detection_training_losses_with_no_configuration",
    "tests/integrations/test_torchvision.py::test_torchvision_detection_training_with_targets[7-on-3]",
)
# Compared with one device on several replicas (the outputs, and gradients through the gather).
_ONE_DEVICE = (
    "tests/wrapper/test_data_parallel.py::test_outputs_equal_single_device[3]",
    "tests/wrapper/test_data_parallel.py::test_outputs_equal_single_device[5]",
    "tests/wrapper/test_data_parallel.py::test_outputs_equal_single_device[8]",
    "tests/wrapper/test_data_parallel.py::test_outputs_equal_single_device[13]",
    "tests/wrapper/test_data_parallel.py::test_gradients_equal_single_device_with_uneven_chunks",
    "tests/integrations/test_timm.py::test_timm_forward_features_and_head_without_configuration",
    _TF + "test_classification_heads_losses_equal_the_full_batch_loss",
)

MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "loss-plain-mean",
        "The replicas' losses averaged with equal weights, whatever their rows or counted labels.",
        _LOSSES,
        "kept = [loss.to(device) * w for loss, w in zip(losses, weights) if w != 0]",
        "kept = [loss.to(device) / len(losses) for loss in losses]",
        _but(_LOSS_TESTS, _EQUAL_WEIGHTS),
    ),
    Mutation(
        "loss-weights-equal",
        "The replicas' means weighted equally (the replicas without counted labels left out), "
        "not by their rows or counted labels.",
        _LOSSES,
        "kept = [loss.to(device) * w for loss, w in zip(losses, weights) if w != 0]",
        "kept = [loss.to(device) / sum(x != 0 for x in weights) for loss, w in zip(losses, weights) if w != 0]",
        _but(_MEAN_LOSS_TESTS, _EQUAL_WEIGHTS),
    ),
    Mutation(
        "loss-replica-0-only",
        "The joined loss is replica 0's alone: the other replicas' rows are ignored.",
        _LOSSES,
        "kept = [loss.to(device) * w for loss, w in zip(losses, weights) if w != 0]",
        "kept = [losses[0].to(device)]",
        _LOSS_TESTS,
    ),
    Mutation(
        "loss-tokens-weighted-by-rows",
        "Token-averaged losses weighted by each replica's rows, not its counted labels.",
        _LOSSES,
        "counts = torch.stack([(part != plan.ignore).sum() for part in parts]).tolist()  # one sync",
        "counts = list(sizes)",
        tuple(_TF + t for t in (
            "test_a_token_averaged_cross_entropy_computed_by_the_model_equals_the_full_batch_loss",
            "test_a_weighted_loss_with_return_dict_false_is_the_first_element",
        )),
    ),
    Mutation(
        "lost-num-items-in-batch",
        "The full batch's num_items_in_batch is not given to the replicas: each computes its "
        "own mean, and the means are summed as shares.",
        _LOSSES,
        'kwargs = {**kwargs, "num_items_in_batch": plan.count}',
        "kwargs = dict(kwargs)",
        _SHARE_LOSS_TESTS,
    ),
    Mutation(
        "num-items-counts-ignored-labels",
        "num_items_in_batch counts every label, -100 included.",
        _PLANS,
        'return LossPlan("sum", (counted != ignore).sum())',
        'return LossPlan("sum", torch.tensor(counted.numel()))',
        _SHARE_LOSS_TESTS,
    ),
    Mutation(
        "causal-count-unshifted",
        "A causal LM's num_items_in_batch counts all its labels, where the loss counts labels[..., 1:].",
        _PLANS,
        "else (labels[..., 1:], True)",
        "else (labels, True)",
        (_TF + "test_gpt2_left_padded_loss_equals_the_full_batch_loss",),
    ),
    Mutation(
        "ctc-sum-as-mean",
        "CTC's summed loss joined as a mean weighted by rows.",
        _PLANS,
        'return LossPlan(reduction if reduction in ("sum", "mean") else "cat")',
        'return LossPlan("mean")',
        tuple(t for t in _CTC if t.endswith("sum]")),
    ),
    Mutation(
        "spans-weighted-by-rows",
        "Question answering's start and end losses weighted by rows, not by counted positions.",
        "dpmethods/integrations/transformers/spans.py",
        "return [c / total for c in counts[0]] if total else [1.0 / len(sizes)] * len(sizes)",
        "return [s / sum(sizes) for s in sizes]",
        (_TF + "test_question_answering_loss_equals_the_full_batch_loss",),
    ),
    Mutation(
        "gather-dropped-row",
        "The gather drops replica 0's last row (and repeats the last row, keeping the shape).",
        "dpmethods/core/gather/join.py",
        "out = ops.gather_coalesced(tensors, n, dim, device)",
        "tensors = [t.narrow(dim, 0, t.shape[dim] - 1) if i % n == 0 else "
        "torch.cat([t, t.narrow(dim, t.shape[dim] - 1, 1)], dim) if i % n == n - 1 else t "
        "for i, t in enumerate(tensors)]\nout = ops.gather_coalesced(tensors, n, dim, device)",
        _ONE_DEVICE,
    ),
    Mutation(
        "gather-swapped-replicas",
        "The gather joins replica 1's rows before replica 0's.",
        "dpmethods/core/gather/join.py",
        "out = ops.gather_coalesced(tensors, n, dim, device)",
        "tensors = [tensors[i + 1] if i % n == 0 else tensors[i - 1] if i % n == 1 else t "
        "for i, t in enumerate(tensors)]\nout = ops.gather_coalesced(tensors, n, dim, device)",
        _ONE_DEVICE,
    ),
    Mutation(
        "gather-mean-unweighted",
        "gather='mean' averages the replicas' values equally, not by their shares of the batch.",
        "dpmethods/core/gather/values.py",
        "moved = [w * v for w, v in zip(weights, moved)]",
        "moved = [v / len(moved) for v in moved]",
        (
            "tests/stages/test_gather.py::test_mean_is_weighted_by_batch_share[sizes1]",
            "tests/stages/test_gather.py::test_mean_is_weighted_by_batch_share[sizes2]",
            "tests/wrapper/test_data_parallel.py::test_gradients_equal_single_device_with_uneven_chunks[7]",
            "tests/wrapper/test_data_parallel.py::test_gradients_equal_single_device_with_uneven_chunks[10]",
            *_DETECTION_LOSSES,
        ),
    ),
    Mutation(
        "detection-loss-unweighted",
        "torchvision detectors' training losses averaged over the replicas without their image counts.",
        "dpmethods/integrations/torchvision.py",
        'return gather(outputs, device, mode="mean", sizes=sizes)',
        'return gather(outputs, device, mode="mean")',
        _DETECTION_LOSSES[:1],
    ),
    Mutation(
        "scatter-off-by-one",
        "Each share after the first starts one row early: a row is repeated and the last one lost.",
        "dpmethods/core/scatter/run.py",
        "start += size",
        "start += size - (start == 0)",
        _ONE_DEVICE,
    ),
    Mutation(
        "per-replica-start",
        "The per_replica hook is told each replica's share size as its start, not the rows before it.",
        "dpmethods/core/call.py",
        "starts = accumulate(call.sizes[:-1], initial=0)",
        "starts = [0, *call.sizes[1:]]",
        (
            "tests/integrations/transformers/test_generate.py::test_prefix_allowed_tokens_fn_gets_each_items_index_in_the_whole_batch",
            _TF + "test_qwen2_vl_patches_of_all_images_split_by_row_with_no_configuration",
        ),
    ),
    Mutation(
        "prefix-offset-ignored",
        "A replica's prefix_allowed_tokens_fn gets the item's index in its share, not in the batch.",
        "dpmethods/integrations/transformers/fill.py",
        "return self.fn(batch_id + self.start, input_ids)",
        "return self.fn(batch_id, input_ids)",
        ("tests/integrations/transformers/test_generate.py::test_prefix_allowed_tokens_fn_gets_each_items_index_in_the_whole_batch",),
    ),
    Mutation(
        "vision-images-by-row",
        "A replica takes the images at its rows' indices, not those of its rows.",
        "dpmethods/integrations/transformers/vision.py",
        "first = sum(counts[:start])",
        "first = start",
        (_TF + "test_qwen2_vl_patches_of_all_images_split_by_row_with_no_configuration",),
    ),
    Mutation(
        "generate-fill-eos",
        "Greedy generate's finished rows filled with the eos id where one device fills with the pad id.",
        "dpmethods/integrations/transformers/fill.py",
        "fill = pad if pad is not None else eos",
        "fill = eos if eos is not None else pad",
        tuple(f"{_GEN}[{m}-1-{p}-{s}]" for m in _GEN_MODELS for p in (0, 2) for s in _SPLITS),
    ),
    Mutation(
        "beam-fill-eos",
        "Beam search's rows filled with the eos id where one device fills with a non-zero pad id.",
        "dpmethods/integrations/transformers/fill.py",
        "fill = -1 if eos is None else (pad or eos)",
        "fill = -1 if eos is None else (eos or pad)",
        tuple(f"{_GEN}[{m}-3-2-{s}]" for m in _GEN_MODELS for s in _SPLITS),
    ),
    Mutation(
        "int8-calibrated-per-share",
        "sentence-transformers' int8/uint8 ranges calibrated on each replica's share, not the batch.",
        "dpmethods/integrations/sentence_transformers.py",
        "if precision not in _CALIBRATED:",
        "if True:",
        ("tests/integrations/test_sentence_transformers.py::test_sentence_transformers_encode_outputs_and_precisions_with_no_configuration",),
    ),
    Mutation(
        "seed-per-replica-same",
        "Every worker process (and every mapped batch) seeded alike: their draws repeat each other.",
        "dpmethods/core/seeding.py",
        'digest = hashlib.blake2b(f"{seed}/{i}".encode(), digest_size=8).digest()',
        'digest = hashlib.blake2b(f"{seed}/0".encode(), digest_size=8).digest()',
        ("tests/processes/test_process_workers.py::test_seeded_sampling_is_reproducible_in_process_workers",),
    ),
)
