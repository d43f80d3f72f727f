"""A small VAE whose ``encode``, ``decode`` and ``training_step`` run data-parallel.

    python examples/vae.py --devices cpu --replicas 4 --steps 20
    python examples/vae.py --devices cuda            # every GPU

``torch.nn.DataParallel`` only parallelizes ``forward``; with
``dpmethods.DataParallel`` each ``@parallel_method`` is split over the devices
too. The script trains a few steps on synthetic data through
``dp.training_step`` (a loss gathered with ``gather="mean"``, weighted by each
replica's share of the batch, so it is the full-batch mean even when the batch
does not divide evenly) and checks that ``dp.encode(x)`` and ``dp.decode(z)``
match the single-device ``model.encode(x)`` and ``model.decode(z)``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import dpmethods

__all__ = ["VAE", "Posterior", "main", "synthetic_data"]


@dataclass
class Posterior:
    """The approximate posterior ``q(z | x)``: a diagonal Gaussian.

    Args:
        mu: the mean, ``[batch, latent]``.
        logvar: the log-variance, ``[batch, latent]``.

    Example:
        >>> p = Posterior(torch.zeros(2, 3), torch.zeros(2, 3))
        >>> p.sample(torch.ones(2, 3)).tolist()[0]
        [1.0, 1.0, 1.0]
    """

    mu: Tensor
    logvar: Tensor

    def sample(self, eps: Tensor) -> Tensor:
        """The reparameterised sample ``mu + sigma * eps``."""
        return self.mu + torch.exp(0.5 * self.logvar) * eps


class VAE(nn.Module):
    """A multilayer-perceptron VAE with parallel ``encode``, ``decode`` and ``training_step``.

    Args:
        features: the size of an input vector.
        hidden: the width of the hidden layers.
        latent: the size of the latent code.

    Example:
        >>> vae = VAE(features=6, hidden=8, latent=2)
        >>> vae.encode(torch.randn(3, 6)).mu.shape
        torch.Size([3, 2])
    """

    def __init__(self, features: int = 32, hidden: int = 64, latent: int = 8) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(features, hidden), nn.SiLU())
        self.to_mu = nn.Linear(hidden, latent)
        self.to_logvar = nn.Linear(hidden, latent)
        self.decoder = nn.Sequential(
            nn.Linear(latent, hidden), nn.SiLU(), nn.Linear(hidden, features)
        )

    @dpmethods.parallel_method
    def encode(self, x: Tensor) -> Posterior:
        """``q(z | x)`` for a batch ``x`` of shape ``[batch, features]``."""
        h = self.encoder(x)
        return Posterior(self.to_mu(h), self.to_logvar(h))

    @dpmethods.parallel_method
    def decode(self, z: Tensor) -> Tensor:
        """The reconstruction mean for latent codes ``z`` of shape ``[batch, latent]``."""
        return self.decoder(z)

    def forward(self, x: Tensor, eps: Tensor) -> tuple[Tensor, Posterior]:
        posterior = self.encode(x)
        return self.decode(posterior.sample(eps)), posterior

    # The noise is an argument, not drawn inside: replicas run in threads that share
    # the global RNG, so drawing here would make the parallel loss differ from one device's.
    @dpmethods.parallel_method(gather="mean")
    def training_step(self, x: Tensor, eps: Tensor) -> Tensor:
        """The negative ELBO per item, averaged over the batch (a 0-dim loss)."""
        recon, posterior = self(x, eps)
        nll = F.mse_loss(recon, x, reduction="none").sum(-1)
        kl = -0.5 * (1 + posterior.logvar - posterior.mu**2 - posterior.logvar.exp()).sum(-1)
        return (nll + kl).mean()


def synthetic_data(n: int, features: int, rank: int = 3, seed: int = 0) -> Tensor:
    """``n`` points near a random ``rank``-dimensional subspace, for the VAE to find.

    Args:
        n: the number of points.
        features: the dimension of each point.
        rank: the dimension of the subspace.
        seed: the seed of the generator (the global RNG is left alone).

    Example:
        >>> synthetic_data(4, 5).shape
        torch.Size([4, 5])
    """
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(rank, features, generator=g)
    codes = torch.randn(n, rank, generator=g)
    return codes @ basis + 0.05 * torch.randn(n, features, generator=g)


def _device_ids(devices: str, replicas: int | None) -> list[str] | list[int]:
    use_cuda = devices == "cuda" or (devices == "auto" and torch.cuda.is_available())
    if use_cuda:
        if not torch.cuda.is_available():
            raise SystemExit("--devices cuda: no CUDA GPU is available; use --devices cpu")
        count = torch.cuda.device_count()
        return list(range(count if replicas is None else replicas))
    return ["cpu"] * (4 if replicas is None else replicas)


def _max_diff(a: Tensor, b: Tensor) -> float:
    return (a.detach().cpu() - b.detach().cpu()).abs().max().item()


def _max_abs(*tensors: Tensor) -> float:
    return max(t.detach().abs().max().item() for t in tensors)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends each option's default, unless its help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "default:" in (action.help or "") or action.default is None:
            return action.help
        return super()._get_help_string(action)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train the VAE data-parallel and compare its methods with the single-device model.

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``); see ``--help``.

    Returns:
        A summary: ``losses`` per step, ``encode_max_diff``, ``decode_max_diff`` and
        ``loss_diff`` (parallel vs single device), ``grad_max_diff``, the largest
        ``|value|`` each compares (``encode_max_abs``, ``decode_max_abs``, ``loss_abs``,
        ``grad_max_abs``), ``replicas``, ``batch`` and ``posterior_type`` (the type
        ``dp.encode`` returned).

    Example:
        >>> summary = main(["--steps", "2", "--quiet"])
        >>> summary["posterior_type"]
        'Posterior'
    """
    parser = argparse.ArgumentParser(
        description="Train a small VAE through dp.training_step on synthetic data, and check "
        "that dp.encode and dp.decode, split over several devices, match one device.",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--devices", choices=["auto", "cpu", "cuda"], default="auto",
                        help="where the replicas run; auto: every GPU if there is one, "
                        "else CPU replicas")
    parser.add_argument("--replicas", type=int, default=None,
                        help="number of devices (default: 4 CPU replicas, or every GPU)")
    parser.add_argument("--steps", type=int, default=20, help="training steps")
    parser.add_argument("--batch", type=int, default=66,
                        help="batch size; need not divide by --replicas")
    parser.add_argument("--features", type=int, default=32, help="input features per item")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and data")
    parser.add_argument("--quiet", action="store_true", help="print nothing, return the summary")
    args = parser.parse_args(argv)

    def say(msg: str) -> None:
        if not args.quiet:
            print(msg)

    device_ids = _device_ids(args.devices, args.replicas)
    source = torch.device("cuda", device_ids[0]) if isinstance(device_ids[0], int) else "cpu"
    torch.manual_seed(args.seed)
    model = VAE(features=args.features).to(source)
    dp = dpmethods.DataParallel(model, device_ids=device_ids)
    data = synthetic_data(args.batch * 4, args.features, seed=args.seed).to(source)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    # One step compared against one device: same loss and same gradients.
    x = data[: args.batch]
    eps = torch.randn(args.batch, model.to_mu.out_features, device=source)
    ref_loss = model.training_step(x, eps)
    ref_grads = torch.autograd.grad(ref_loss, list(model.parameters()))
    dp_loss = dp.training_step(x, eps)
    dp_grads = torch.autograd.grad(dp_loss, list(model.parameters()))
    loss_diff = abs(dp_loss.item() - ref_loss.item())
    grad_diff = max(_max_diff(a, b) for a, b in zip(dp_grads, ref_grads, strict=True))

    losses: list[float] = []
    for step in range(args.steps):
        start = (step * args.batch) % (len(data) - args.batch + 1)
        x = data[start : start + args.batch]
        eps = torch.randn(args.batch, model.to_mu.out_features, device=source)
        loss = dp.training_step(x, eps)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())

    with torch.no_grad():
        x = data[: args.batch]
        posterior = dp.encode(x)
        ref = model.encode(x)
        recon = dp.decode(posterior.mu)
        ref_recon = model.decode(ref.mu)
    encode_diff = max(_max_diff(posterior.mu, ref.mu), _max_diff(posterior.logvar, ref.logvar))
    decode_diff = _max_diff(recon, ref_recon)

    summary: dict[str, Any] = {
        "replicas": len(device_ids),
        "devices": [str(d) for d in device_ids],
        "batch": args.batch,
        "losses": losses,
        "loss_diff": loss_diff,
        "grad_max_diff": grad_diff,
        "encode_max_diff": encode_diff,
        "decode_max_diff": decode_diff,
        "loss_abs": abs(ref_loss.item()),
        "grad_max_abs": _max_abs(*ref_grads),
        "encode_max_abs": _max_abs(ref.mu, ref.logvar),
        "decode_max_abs": _max_abs(ref_recon),
        "posterior_type": type(posterior).__name__,
    }
    say(f"VAE on {len(device_ids)} replicas ({', '.join(summary['devices'])}), batch {args.batch}")
    if losses:
        say(f"training_step loss: {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps")
    say(f"training_step vs one device: |loss diff| {loss_diff:.2e}, max |grad diff| {grad_diff:.2e}")
    say(f"dp.encode(x) -> {summary['posterior_type']}; max |diff| vs model.encode(x): {encode_diff:.2e}")
    say(f"dp.decode(z) max |diff| vs model.decode(z): {decode_diff:.2e}")
    return summary


if __name__ == "__main__":
    main()
