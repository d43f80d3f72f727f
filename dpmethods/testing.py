"""Test helpers: check that each replica computed with its own parameters and buffers.

With ``cpu_replicas="distinct"`` every CPU replica has its own copies, as on
distinct GPUs. A replica that reads another replica's tensors (say, a list of
weights kept beside ``_parameters``, as ``nn.LSTM``'s ``_flat_weights``, and not
re-pointed when the replica is made) computes right on one machine and fails with a device
mismatch on several GPUs. :func:`assert_replicas_isolated` finds that on CPU: it
records, in each replica's thread, the storages every operator reads or writes
(a ``TorchDispatchMode``), and fails if a replica touched the parameters or buffers
of another replica of the same call, or holds one in a plain attribute (a tensor,
or a list or tuple of tensors) when its call starts.

:func:`assert_close_to_reference` compares a parallel result with the one-device
reference under a bound derived from the arithmetic (dtype, magnitude, and how many
terms the computation sums), so a comparison holds on any CPU's kernels.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree
from torch.utils._python_dispatch import TorchDispatchMode

from dpmethods.core.parallel_apply import REPLICA_CONTEXTS

__all__ = ["IsolationReport", "assert_close_to_reference", "assert_replicas_isolated"]


def _storage(t: Tensor) -> tuple[torch.device, int] | None:
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # sparse, nested, or no storage at all
        return None
    return (t.device, ptr) if ptr else None


class _Recorder(TorchDispatchMode):
    """The storages of every tensor an operator gets, in the thread that entered it."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: set[tuple[torch.device, int]] = set()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        for leaf in _pytree.tree_leaves((args, kwargs)):
            if isinstance(leaf, Tensor):
                key = _storage(leaf)
                if key is not None:
                    self.storages.add(key)
        return func(*args, **(kwargs or {}))


def _owned(replica: nn.Module) -> dict[tuple[torch.device, int], str]:
    """Storage -> name, for the replica's parameters and buffers."""
    out: dict[tuple[torch.device, int], str] = {}
    for prefix, m in replica.named_modules(remove_duplicate=False):
        for kind, group in (("parameter", m._parameters), ("buffer", m._buffers)):
            for name, t in group.items():
                key = None if t is None else _storage(t)
                if key is not None:
                    out.setdefault(key, f"{kind} {prefix + '.' if prefix else ''}{name}")
    return out


def _held(replica: nn.Module) -> Iterator[tuple[Tensor, str]]:
    """Tensors a replica's modules hold in plain attributes (alone, or in a list or tuple)."""
    for prefix, m in replica.named_modules(remove_duplicate=False):
        for attr, value in m.__dict__.items():
            items = value if isinstance(value, (list, tuple)) else (value,)
            for k, item in enumerate(items):
                if isinstance(item, Tensor):
                    where = f"{prefix + '.' if prefix else ''}{attr}"
                    yield item, where if items is not value else f"{where}[{k}]"


@dataclass
class IsolationReport:
    """What :func:`assert_replicas_isolated` saw.

    Attributes:
        replica_runs: replica calls recorded (one per replica per parallel call).
        checked_runs: those whose replica had tensors no other replica shared, so the
            check could fail (0 with shared CPU replicas: then there is nothing to check).
        violations: one line per replica that touched another replica's tensor.

    Example:
        >>> IsolationReport()
        IsolationReport(replica_runs=0, checked_runs=0, violations=[])
    """

    replica_runs: int = 0
    checked_runs: int = 0
    violations: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @contextlib.contextmanager
    def _record(self, i: int, replicas: Sequence[nn.Module]) -> Iterator[None]:
        # What the replica holds as it was made (its method may repair it, as
        # nn.LSTM's forward re-reads its weights when they changed identity).
        held = [(_storage(t), where) for t, where in _held(replicas[i])]
        recorder = _Recorder()
        with recorder:
            yield
        own = _owned(replicas[i])
        others: dict[tuple[torch.device, int], str] = {}
        for j, replica in enumerate(replicas):
            if j != i:
                for key, name in _owned(replica).items():
                    if key not in own:
                        others.setdefault(key, f"replica {j}'s {name}")
        bad = sorted(others[k] for k in recorder.storages if k in others)
        # Held, used or not: on distinct GPUs a use is a device mismatch.
        bad.extend(f"{others[k]} (held as {where})" for k, where in held if k in others)
        with self._lock:
            self.replica_runs += 1
            self.checked_runs += bool(others)
            if bad:
                self.violations.append(f"replica {i} touched {', '.join(bad)}")


@contextlib.contextmanager
def assert_replicas_isolated(*, require_checks: bool = True) -> Iterator[IsolationReport]:
    """Fail if, inside the block, a replica touches another replica's parameters or buffers.

    Every parallel call in the block (any thread) is recorded. On leaving the block
    it raises ``AssertionError`` naming each replica and the tensors it touched that
    belong to another replica of the same call, and those it holds in a plain
    attribute (a tensor, or a list or tuple of tensors) when its call starts: on
    distinct GPUs using such a tensor is a device mismatch. Only replicas with tensors of their
    own can be checked: use ``cpu_replicas="distinct"`` on CPU devices (or distinct
    GPUs). With ``require_checks`` (the default) it also fails if nothing could be
    checked, so a test using it cannot pass vacuously.

    Args:
        require_checks: fail when no recorded replica had tensors of its own.

    Example:
        >>> import torch, dpmethods
        >>> from dpmethods.testing import assert_replicas_isolated
        >>> dp = dpmethods.DataParallel(
        ...     torch.nn.Linear(3, 5), device_ids=["cpu"] * 2, cpu_replicas="distinct")
        >>> with assert_replicas_isolated() as report:
        ...     _ = dp(torch.randn(4, 3))
        >>> report.replica_runs, report.violations
        (2, [])
    """
    report = IsolationReport()
    hooks = REPLICA_CONTEXTS
    hooks.append(report._record)
    try:
        yield report
    finally:
        hooks.remove(report._record)
    if report.violations:
        raise AssertionError(
            "replicas touched tensors of other replicas:\n" + "\n".join(sorted(report.violations))
        )
    if require_checks and not report.checked_runs:
        raise AssertionError(
            f"assert_replicas_isolated: expected replicas with tensors of their own, got "
            f"{report.replica_runs} replica runs that share all their tensors (use "
            f"cpu_replicas='distinct' and at least 2 devices)"
        )


def _leaf_tensor(x: Any) -> Tensor | None:
    """A tensor for a tensor, a numpy array or a numpy scalar; None for anything else."""
    if isinstance(x, Tensor):
        t = x.detach().cpu()
        return t.to_dense() if t.layout != torch.strided else t
    if type(x).__module__ == "numpy" and hasattr(x, "__array__"):
        return torch.as_tensor(x.copy() if hasattr(x, "copy") else x)
    return None


# The loosest bound accepted, as a fraction of the largest |expected| value: a looser one
# would let zeros, a sign flip or swapped rows pass.
_MAX_RELATIVE_BOUND = 0.1
_LOW = (torch.float16, torch.bfloat16)


def _advice(terms: int, dtype: torch.dtype, scale: float, peak: float, rtol: float) -> str:
    """What to do instead of a bound too loose for the values compared."""
    if peak == 0:
        return "The expected values are all zero (or not finite): leave scale out to compare them exactly."
    if scale > peak and 2 * rtol <= _MAX_RELATIVE_BOUND:  # fine at the values' own magnitude
        return (f"scale={scale:g} is far above the values compared: pass the magnitude of the "
                "values the computation summed, or leave scale out.")
    if dtype in _LOW:
        return (f"terms counts the roundings in {dtype} on the path to one output: kernels that "
                f"accumulate in float32 (matmuls and convolutions, autocast's too) round to "
                f"{dtype} once per layer, so count the layers, not their inner sizes; or compare "
                "the computation run in float32.")
    return (f"Check terms={terms} (the rounded steps on the path to one output element), "
            "or compare in float64.")


def _bound(expected: Tensor, terms: int, scale: float, dtype: torch.dtype, slack: float,
           name: str) -> tuple[float, float, float]:
    """(atol, rtol, magnitude) for a result of ``terms`` rounded steps in ``dtype``; a
    ValueError when that bound is not small against the values compared."""
    if isinstance(terms, bool) or not isinstance(terms, int) or terms < 0:
        raise ValueError(f"assert_close_to_reference: terms: expected an int >= 0, got {terms!r}")
    u = torch.finfo(dtype).eps / 2  # unit roundoff
    rtol = slack * 2 * math.sqrt(terms) * u  # both sides rounded: twice one side's error
    finite = expected[torch.isfinite(expected)]
    peak = float(finite.abs().max()) if finite.numel() else 0.0
    magnitude = max(scale, peak)
    atol = rtol * magnitude
    if atol + rtol * peak > _MAX_RELATIVE_BOUND * peak:
        raise ValueError(
            f"assert_close_to_reference: {name}: terms={terms} in {dtype} gives rtol {rtol:.3g} "
            f"and atol {atol:.3g} (magnitude {magnitude:.3g}): a bound of {atol + rtol * peak:.3g} "
            f"at the largest |expected| value, {peak:.3g}, more than {_MAX_RELATIVE_BOUND:g} of it, "
            "so zeros, a sign flip or swapped rows could pass. "
            + _advice(terms, dtype, scale, peak, rtol)
        )
    return atol, rtol, magnitude


def _compare_floats(name: str, a: Tensor, e: Tensor, terms: int, scale: float,
                    dtype: torch.dtype | None, slack: float) -> str | None:
    if e.is_complex():
        a, e = torch.view_as_real(a.resolve_conj()), torch.view_as_real(e.resolve_conj())
    atol, rtol, magnitude = _bound(e, terms, scale, dtype or e.dtype, slack, name)
    a64, e64 = a.double(), e.double()
    nan_a, nan_e = a64.isnan(), e64.isnan()
    diff = torch.where(a64 == e64, 0.0, (a64 - e64).abs()).masked_fill(nan_a & nan_e, 0.0)
    allowed = torch.where(e64.isfinite(), atol + rtol * e64.abs(), 0.0)
    bad = (diff > allowed) | (nan_a != nan_e) | (diff.isnan() & ~(nan_a & nan_e))
    if not bool(bad.any()):
        return None
    rel = torch.where(diff == 0, 0.0, diff / e64.abs())
    over = torch.where(diff == 0, 0.0, diff / allowed).nan_to_num(math.inf)
    at = tuple(int(i) for i in torch.unravel_index(diff.nan_to_num(math.inf).argmax(), diff.shape))
    return (
        f"{name}: {int(bad.sum())} of {bad.numel()} elements differ by more than the bound; "
        f"max absolute difference {float(diff.nan_to_num(math.inf).max()):.3g} at {list(at)} "
        f"(actual {float(a64[at]):.9g}, expected {float(e64[at]):.9g}), max relative difference "
        f"{float(rel.nan_to_num(math.inf).max()):.3g}; bound |actual - expected| <= atol + "
        f"rtol * |expected| with rtol = {slack:g} * 2 * sqrt({terms}) * u = {rtol:.3g} "
        f"({dtype or e.dtype}) and atol = rtol * magnitude {magnitude:.3g} = {atol:.3g}; "
        f"the largest difference is {float(over.max()):.3g} times its bound"
    )


def _compare_leaf(name: str, actual: Any, expected: Any, terms: int, scale: float,
                  dtype: torch.dtype | None, slack: float) -> str | None:
    if isinstance(expected, float) and isinstance(actual, (int, float)) and not isinstance(actual, bool):
        # A Python float came from a tensor of the default dtype unless told otherwise.
        dtype = dtype or torch.get_default_dtype()
        actual, expected = torch.tensor(float(actual)), torch.tensor(expected)
    a, e = _leaf_tensor(actual), _leaf_tensor(expected)
    if a is None or e is None:
        if a is not None or e is not None or type(actual) is not type(expected) or actual != expected:
            return f"{name}: {actual!r} != expected {expected!r}"
        return None
    if a.shape != e.shape or a.dtype != e.dtype:
        return f"{name}: shape {tuple(a.shape)} and {a.dtype}, expected {tuple(e.shape)} and {e.dtype}"
    if e.is_floating_point() or e.is_complex():
        return _compare_floats(name, a, e, terms, scale, dtype, slack)
    if torch.equal(a, e):  # integers, bools, indices, tokens: exact
        return None
    wrong = (a != e).nonzero()
    return (f"{name}: {len(wrong)} of {e.numel()} elements differ, and {e.dtype} must be "
            f"exact; first at {wrong[0].tolist()}: actual {a[tuple(wrong[0])].item()}, "
            f"expected {e[tuple(wrong[0])].item()}")


def _leaves(tree: Any) -> tuple[list[tuple[str, Any]], Any]:
    try:
        pairs, spec = _pytree.tree_flatten_with_path(tree)
        return [(_pytree.keystr(path) or "value", leaf) for path, leaf in pairs], spec
    except ValueError:  # a node type registered without key paths
        leaves, spec = _pytree.tree_flatten(tree)
        return [(f"leaf {i}", leaf) for i, leaf in enumerate(leaves)], spec


def assert_close_to_reference(
    actual: Any, expected: Any, *, terms: int, scale: float = 0.0,
    dtype: torch.dtype | None = None, slack: float = 4.0, msg: str = "",
) -> None:
    """Fail unless ``actual`` equals the one-device ``expected`` up to rounding.

    A parallel result and its reference compute the same sums in another order: a
    batch split in shares makes BLAS pick other blockings, and another CPU has other
    kernels. Summing ``n`` terms ``x_i`` in a float type with unit roundoff
    ``u = eps / 2`` errs by at most ``n * u * sum |x_i|`` in the worst case, but
    rounding errors are independent and of either sign, and what they reach is about
    ``sqrt(n) * u * sum |x_i|`` (the probabilistic bound: Higham and Mary, *A New
    Approach to Probabilistic Rounding Error Analysis*, 2019); two such results differ
    by twice that. ``sum |x_i|`` is estimated by the magnitude of the values compared
    (the reference's largest finite ``|value|``), and ``slack`` (default 4) covers
    cancellation and the tail of the distribution. Each float tensor must hold,
    elementwise::

        |actual - expected| <= atol + rtol * |expected|
        rtol = slack * 2 * sqrt(terms) * u,   atol = rtol * magnitude

    ``terms`` counts the rounded steps on the path to one output element: the inner
    dimension of a matmul (plus one for a bias), summed over the layers of a network,
    plus the rows a mean or a weight gradient sums over; a step that amplifies
    relative errors (``exp`` of a large value, a square, a softmax of large logits)
    multiplies what comes before it by its condition number. In bfloat16 and float16,
    where kernels accumulate in float32 and round once per layer, it counts those
    roundings. ``terms=0`` asks for bit-identical floats (a concatenation of copies).
    NaNs must sit in the same places and infinities match exactly. Integer, bool, index
    and token tensors are always compared exactly, and shapes and dtypes must match.

    A bound that is not small against the values compared is refused, not used: when
    it exceeds a tenth of the largest ``|expected|`` value (too many terms for the
    dtype, or a ``scale`` far above the values), zeros, a sign flip or swapped rows
    could pass, and a ``ValueError`` says so, naming ``terms``, the dtype, the bound and
    the values' magnitude.

    Args:
        actual: a tensor, a numpy array, a Python number, or a pytree of them.
        expected: the one-device reference, of the same structure.
        terms: rounded steps on the path to an output element (see above).
        scale: the magnitude of the values summed, where it is larger than the
            result's (a log-sum-exp of large logits, a loss that cancels); by default
            the magnitude comes from the values compared.
        dtype: the dtype the arithmetic ran in, when lower than the tensors'
            (bfloat16 autocast); by default each tensor's own dtype.
        slack: the factor for cancellation and for ``|expected|`` standing in for
            ``sum |x_i|``.
        msg: a prefix for the failure message.

    Raises:
        AssertionError: naming each leaf that differs, with its max absolute and
            relative difference, where, the bound used, and how many times the bound
            the largest difference is.
        ValueError: when the bound is not small against the values compared.

    Example:
        >>> import torch, dpmethods
        >>> from dpmethods.testing import assert_close_to_reference
        >>> model = torch.nn.Linear(784, 32)
        >>> dp = dpmethods.DataParallel(model, device_ids=["cpu"] * 2)
        >>> x = torch.randn(10, 784)
        >>> assert_close_to_reference(dp(x), model(x), terms=785)  # 784 products + bias
        >>> assert_close_to_reference(torch.tensor([1, 2]), torch.tensor([1, 3]), terms=1)
        Traceback (most recent call last):
        ...
        AssertionError: value: 1 of 2 elements differ, and torch.int64 must be exact; first at [1]: actual 2, expected 3
    """
    got, got_spec = _leaves(actual)
    want, want_spec = _leaves(expected)
    prefix = f"{msg}: " if msg else ""
    if got_spec != want_spec:
        raise AssertionError(f"{prefix}structure {got_spec}, expected {want_spec}")
    errors = [
        err for (name, a), (_, e) in zip(got, want, strict=True)
        if (err := _compare_leaf(name, a, e, terms, scale, dtype, slack)) is not None
    ]
    if errors:
        raise AssertionError(prefix + "\n".join(errors))
