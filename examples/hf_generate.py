"""Data-parallel ``generate`` and ``forward`` of a Hugging Face causal LM you don't own.

    python examples/hf_generate.py --devices cpu --replicas 4
    python examples/hf_generate.py --arch llama --devices cuda

The model is a tiny GPT-2 (or Llama) built from a config with random weights and
a fixed seed: nothing is downloaded, prompts are integer token ids. Once transformers
is imported, its ``generate`` and ``forward`` are parallel methods with no configuration::

    dp = dpmethods.DataParallel(model, device_ids=["cpu"] * 4)

Each replica stops when all of ITS sequences hit ``eos_token_id``, so replicas
return different lengths; the built-in gather mode ``"generate"`` pads the short ones
as ``generate`` itself fills a finished sequence (here with ``pad_token_id``), so the
result is token-for-token ``model.generate(batch)``. The script picks an
``eos_token_id`` that greedy decoding emits first for some prompts and builds a batch
where one replica's sequences all stop at once and others run to ``max_new_tokens``.

``dp(input_ids=..., attention_mask=...)`` gives back the model's own ``ModelOutput``
type. Its KV cache (a ``transformers`` ``Cache`` object) is joined into one cache
holding the whole batch, by the rule dpmethods ships for transformers' caches.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

import dpmethods

__all__ = ["build_model", "main", "ragged_batch"]

PAD_TOKEN_ID = 0


def build_model(arch: str = "gpt2", vocab_size: int = 64, seed: int = 0) -> Any:
    """A tiny randomly initialised causal LM (no download), in eval mode.

    Args:
        arch: ``"gpt2"`` (``GPT2LMHeadModel``) or ``"llama"`` (``LlamaForCausalLM``).
        vocab_size: the vocabulary size; token 0 is the pad token.
        seed: the seed of the weights.

    Example:
        >>> build_model("gpt2", vocab_size=32).config.vocab_size
        32
    """
    import transformers

    torch.manual_seed(seed)
    # bos/eos ids are set per generate call; the default GPT-2 ids lie outside a tiny vocab.
    common: dict[str, Any] = {
        "vocab_size": vocab_size, "bos_token_id": None, "eos_token_id": None,
        "pad_token_id": PAD_TOKEN_ID,
    }
    if arch == "gpt2":
        config: Any = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=128, **common)
        model: Any = transformers.GPT2LMHeadModel(config)
    elif arch == "llama":
        config = transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, max_position_embeddings=128, **common,
        )
        model = transformers.LlamaForCausalLM(config)
    else:
        raise ValueError(f"arch: expected 'gpt2' or 'llama', got {arch!r}")
    # A model built from a config has no loss_type, so transformers would log
    # "`loss_type=None` was set in the config but it is unrecognized" at the first loss;
    # ForCausalLM is the loss it falls back to, named here so the log does not appear.
    model.loss_type = "ForCausalLM"
    return model.eval()


def _generated(out: Tensor, prompt_len: int) -> Tensor:
    return out[:, prompt_len:]


def _lengths(new_tokens: Tensor, eos: int) -> list[int]:
    """Tokens generated per sequence up to and including its first ``eos``."""
    lengths = []
    for row in new_tokens.tolist():
        lengths.append(row.index(eos) + 1 if eos in row else len(row))
    return lengths


def ragged_batch(
    model: Any, batch: int, replicas: int, prompt_len: int, max_new_tokens: int, seed: int = 0
) -> tuple[Tensor, int]:
    """Equal-length prompts and an ``eos_token_id`` that make replicas finish at different lengths.

    Greedy decoding is probed on a pool of random prompts; the eos id is the token it
    emits first most often. The first replica's chunk gets only prompts that emit it
    at once (so that replica stops after one token), the others get prompts that
    run longest, plus one early stopper so a replica also pads inside its own output.

    Args:
        model: the causal LM.
        batch: the number of prompts.
        replicas: the number of devices the batch is split over.
        prompt_len: tokens per prompt.
        max_new_tokens: the generation length of the probe.
        seed: the seed of the prompt pool.

    Returns:
        ``(input_ids, eos_token_id)``.

    Example:
        >>> ids, eos = ragged_batch(build_model(), batch=4, replicas=2, prompt_len=4,
        ...                         max_new_tokens=4)
        >>> ids.shape
        torch.Size([4, 4])
    """
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    pool = torch.randint(1, vocab, (max(4 * batch, 32), prompt_len), generator=g)
    pool = pool.to(next(model.parameters()).device)
    with torch.no_grad():
        probe = model.generate(
            input_ids=pool, attention_mask=torch.ones_like(pool), max_new_tokens=max_new_tokens,
            do_sample=False, pad_token_id=PAD_TOKEN_ID, eos_token_id=None,
        )
    new = _generated(probe, prompt_len)
    firsts = [t for t in new[:, 0].tolist() if t != PAD_TOKEN_ID]
    if not firsts:
        raise RuntimeError("ragged_batch: greedy decoding only emitted the pad token; try another --seed")
    eos = Counter(firsts).most_common(1)[0][0]
    lengths = _lengths(new, eos)
    early = [i for i, n in enumerate(lengths) if n == 1]
    late = sorted(range(len(pool)), key=lambda i: -lengths[i])
    late = [i for i in late if lengths[i] > 1]
    first_chunk = dpmethods.parallel.chunk_sizes(batch, replicas)[0]
    # Repeating an early prompt is fine: what matters is that the whole chunk stops early.
    chosen = [early[k % len(early)] for k in range(first_chunk)]
    rest = batch - first_chunk
    tail = late[: max(rest - 1, 0)] + ([early[-1]] if rest > 0 else [])
    if len(tail) < rest:
        raise RuntimeError(
            f"ragged_batch: only {len(late)} of {len(pool)} prompts run past eos={eos}; "
            "try another --seed or a larger --vocab"
        )
    return pool[chosen + tail], eos


def _device_ids(devices: str, replicas: int | None) -> list[str] | list[int]:
    use_cuda = devices == "cuda" or (devices == "auto" and torch.cuda.is_available())
    if use_cuda:
        if not torch.cuda.is_available():
            raise SystemExit("--devices cuda: no CUDA GPU is available; use --devices cpu")
        return list(range(torch.cuda.device_count() if replicas is None else replicas))
    return ["cpu"] * (4 if replicas is None else replicas)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends each option's default, unless its help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "default:" in (action.help or "") or action.default is None:
            return action.help
        return super()._get_help_string(action)


def _require_transformers() -> None:
    try:
        import transformers  # noqa: F401
    except ModuleNotFoundError:
        sys.exit("examples/hf_generate.py needs the transformers library, which is not "
                 "installed: pip install transformers")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Compare data-parallel ``generate`` and ``forward`` with the single-device model.

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``); see ``--help``.

    Returns:
        A summary: ``tokens``/``reference`` (the generated ids, parallel and single
        device), ``tokens_equal``, ``lengths`` (tokens generated per sequence),
        ``replica_widths`` (the width each replica returned before padding),
        ``eos_token_id``, ``pad_token_id``, ``output_type``/``reference_type`` of
        ``forward``, ``logits_max_diff`` (vs the full batch on one device),
        ``logits_equal_per_chunk`` (bitwise vs one device run chunk by chunk),
        ``loss_diff`` and ``cache_type`` (what ``use_cache=True`` gathers to).

    Example:
        >>> main(["--batch", "4", "--replicas", "2", "--quiet"])["tokens_equal"]
        True
    """
    parser = argparse.ArgumentParser(
        description="Run generate and forward of a tiny random Hugging Face causal LM (no "
        "download) over several devices, and check the tokens against one device. "
        "Needs transformers: pip install transformers.",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--arch", choices=["gpt2", "llama"], default="gpt2",
                        help="the model class: GPT2LMHeadModel or LlamaForCausalLM")
    parser.add_argument("--devices", choices=["auto", "cpu", "cuda"], default="auto",
                        help="where the replicas run; auto: every GPU if there is one, "
                        "else CPU replicas")
    parser.add_argument("--replicas", type=int, default=None,
                        help="number of devices (default: 4 CPU replicas, or every GPU)")
    parser.add_argument("--batch", type=int, default=8, help="number of prompts")
    parser.add_argument("--prompt-len", type=int, default=5, help="tokens per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=8,
                        help="the most tokens generate adds to a prompt")
    parser.add_argument("--vocab", type=int, default=64, help="vocabulary size of the model")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and prompts")
    parser.add_argument("--quiet", action="store_true", help="print nothing, return the summary")
    args = parser.parse_args(argv)
    _require_transformers()

    def say(msg: str) -> None:
        if not args.quiet:
            print(msg)

    device_ids = _device_ids(args.devices, args.replicas)
    source = torch.device("cuda", device_ids[0]) if isinstance(device_ids[0], int) else "cpu"
    model = build_model(args.arch, args.vocab, args.seed).to(source)
    ids, eos = ragged_batch(
        model, args.batch, len(device_ids), args.prompt_len, args.max_new_tokens, args.seed
    )
    ids = ids.to(source)
    mask = torch.ones_like(ids)
    gen_kwargs: dict[str, Any] = {
        "max_new_tokens": args.max_new_tokens, "do_sample": False,
        "eos_token_id": eos, "pad_token_id": PAD_TOKEN_ID,
    }

    # generate and forward are built in: generate's outputs padded as transformers fills
    # finished rows, forward's loss joined as transformers averages it over the batch.
    dp = dpmethods.DataParallel(model, device_ids=device_ids)
    with torch.no_grad():
        reference = model.generate(input_ids=ids, attention_mask=mask, **gen_kwargs)
        tokens = dp.generate(input_ids=ids, attention_mask=mask, **gen_kwargs)
        # gather="list" shows what the replicas returned before padding.
        raw = dpmethods.DataParallel(
            model, device_ids=device_ids, methods={"generate": {"gather": "list"}}
        ).generate(input_ids=ids, attention_mask=mask, **gen_kwargs)

        out = dp(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False)
        ref_out = model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False)
        sizes = dpmethods.parallel.chunk_sizes(len(ids), len(device_ids))
        per_chunk = torch.cat([
            model(input_ids=i, attention_mask=m, use_cache=False).logits
            for i, m in zip(ids.split(sizes), mask.split(sizes), strict=True)
        ])
        cached = dp(input_ids=ids, attention_mask=mask)
    # transformers 5 names the field "cache"; 4.x called it "past_key_values".
    cache = cached["cache"] if "cache" in cached else cached.get("past_key_values")
    if isinstance(cache, list):
        cache_type = f"list of {len(cache)} {type(cache[0]).__name__}"
    else:
        cache_type = type(cache).__name__

    lengths = _lengths(_generated(reference, args.prompt_len).cpu(), eos)
    summary: dict[str, Any] = {
        "arch": args.arch,
        "replicas": len(device_ids),
        "eos_token_id": eos,
        "pad_token_id": PAD_TOKEN_ID,
        "tokens": tokens.cpu(),
        "reference": reference.cpu(),
        "tokens_equal": tokens.shape == reference.shape and torch.equal(tokens, reference),
        "lengths": lengths,
        "replica_widths": [int(r.shape[1]) - args.prompt_len for r in raw],
        "output_type": type(out).__name__,
        "reference_type": type(ref_out).__name__,
        "logits_max_diff": (out.logits - ref_out.logits).abs().max().item(),
        "logits_equal_per_chunk": torch.equal(out.logits, per_chunk),
        "loss": out.loss,
        "loss_diff": (out.loss - ref_out.loss).abs().item(),
        "cache_type": cache_type,
    }
    say(f"{type(model).__name__} (random init) on {len(device_ids)} replicas; "
        f"eos_token_id={eos}, pad_token_id={PAD_TOKEN_ID}")
    say(f"generated lengths per sequence: {lengths}")
    say(f"replica output widths before padding: {summary['replica_widths']}")
    say(f"dp.generate == model.generate: {summary['tokens_equal']} "
        f"(shape {list(tokens.shape)})")
    say(f"dp(...) -> {summary['output_type']} (model(...) -> {summary['reference_type']}); "
        f"max |logits diff| {summary['logits_max_diff']:.2e}; "
        f"bitwise equal to per-chunk logits: {summary['logits_equal_per_chunk']}")
    say(f"loss (joined over the replicas): {out.loss.item():.4f}, |diff| vs one device "
        f"{summary['loss_diff']:.2e}")
    say(f"use_cache=True gathers the KV cache as: {cache_type}")
    return summary


if __name__ == "__main__":
    main()
