"""Ray Data front-end: :class:`Predictor`, a callable class for ``Dataset.map_batches``.

Ray Data schedules the work (one actor per GPU or group of GPUs, load balancing,
restarts, streaming, storage); a :class:`Predictor` is what each actor runs: it builds
the model once, turns a batch's columns into the method's arguments, runs the method
through :class:`dpmethods.DataParallel` over the actor's devices under
``torch.inference_mode()`` and turns the output back into columns. See docs/scaling.md.

This module imports Ray only to ask which GPUs Ray gave the actor (and only when Ray is
already imported); ``import dpmethods`` never imports it. A Predictor can also be called
directly on a dict of numpy arrays, as below.

Example:
    >>> import numpy as np, torch, dpmethods
    >>> from dpmethods.ray import Predictor
    >>> class Net(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.lin = torch.nn.Linear(4, 2)
    ...     @dpmethods.parallel_method
    ...     def encode(self, x):
    ...         return {"mean": self.lin(x), "norm": x.norm(dim=1)}
    >>> predict = Predictor(Net, "encode", columns={"x": "pixels"}, keep=["id"],
    ...                     device_ids=["cpu"] * 2)
    >>> out = predict({"id": np.arange(5), "pixels": np.ones((5, 4), dtype=np.float32)})
    >>> sorted(out), out["mean"].shape, out["norm"].round(3).tolist()
    (['id', 'mean', 'norm'], (5, 2), [2.0, 2.0, 2.0, 2.0, 2.0])

    In a pipeline (``pip install "ray[data]"``)::

        ds = ray.data.read_parquet(path).map_batches(
            Predictor, fn_constructor_kwargs={"factory": load_model, "method": "encode"},
            batch_size=64, num_gpus=1, compute=ray.data.ActorPoolStrategy(size=8))
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from dpmethods.core.parallel_apply import add_note
from dpmethods.data_parallel import DataParallel
from dpmethods.types.cut import Entry
from dpmethods.vocab.options import MethodOptions
from dpmethods.wrapper.registry import get_options

__all__ = ["Predictor", "devices_for"]

# numpy dtype kinds that become tensors: bool, signed and unsigned ints, floats, complex.
_NUMERIC = "biufc"


def devices_for(gpu_ids: Sequence[Any] | None, cuda_count: int) -> list[Any]:
    """The devices a :class:`Predictor` runs on without ``device_ids=``, given the GPU ids
    Ray gave its actor (None outside Ray) and the number of CUDA devices torch sees.

    Ray sets ``CUDA_VISIBLE_DEVICES`` to the actor's GPUs, so torch numbers them
    ``0..n-1``; where it does not (``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES``),
    torch sees every GPU and Ray's ids are torch's indices. No GPU means the CPU.

    Example:
        >>> devices_for(None, 2), devices_for([], 4)  # outside Ray; an actor given no GPU
        ([0, 1], ['cpu'])
        >>> devices_for([3, 5], 2), devices_for(["3", "5"], 8)  # Ray set the variable; it did not
        ([0, 1], [3, 5])
    """
    if gpu_ids is None:
        return list(range(cuda_count)) or ["cpu"]
    if not gpu_ids:
        return ["cpu"]
    if cuda_count == len(gpu_ids):
        return list(range(cuda_count))
    return [int(i) for i in gpu_ids]


def _actor_devices() -> list[Any]:
    ray = sys.modules.get("ray")  # a Ray worker has imported it; elsewhere, no Ray to ask
    in_ray = ray is not None and ray.is_initialized()
    gpu_ids = ray.get_gpu_ids() if in_ray else None  # type: ignore[union-attr]
    return devices_for(gpu_ids, torch.cuda.device_count() if torch.cuda.is_available() else 0)


def _nearest(name: str, names: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, list(names), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _check_names(arg: str, value: Any) -> None:
    if isinstance(value, str) or not isinstance(value, Iterable) or not all(isinstance(v, str) for v in value):
        hint = f"; pass {arg}=[{value!r}]" if isinstance(value, str) else ""
        raise TypeError(f"{arg}: expected a list of column names, got {value!r}{hint}")


def _argument_map(columns: Any) -> dict[str, str] | None:
    """``columns=`` as ``{argument: column}`` (None: every column but the kept ones)."""
    if columns is None:
        return None
    if isinstance(columns, Mapping):
        _check_names("columns", list(columns) + list(columns.values()))
        return dict(columns)
    if isinstance(columns, (list, tuple)):
        _check_names("columns", columns)
        return {c: c for c in columns}
    raise TypeError(
        "columns: expected a list of column names or a dict {argument: column}, got "
        f"{type(columns).__name__} {columns!r}"
    )


def _method_of(model: nn.Module, method: str) -> None:
    if not isinstance(method, str):
        raise TypeError(f"method: expected a method name (str), got {type(method).__name__} {method!r}")
    if method != "forward" and not callable(getattr(model, method, None)):
        names = [n for n in dir(model) if not n.startswith("_") and callable(getattr(model, n, None))]
        raise AttributeError(
            f"method: {type(model).__name__} has no method {method!r}{_nearest(method, names)}"
        )


def _table(batch: Any) -> tuple[dict[str, Any], bool]:
    """The batch's columns by name, and whether it is a pandas DataFrame."""
    pandas = sys.modules.get("pandas")
    if pandas is not None and isinstance(batch, pandas.DataFrame):
        return {str(c): batch[c] for c in batch.columns}, True
    if isinstance(batch, Mapping):
        return {str(k): v for k, v in batch.items()}, False
    raise TypeError(
        "batch: expected a dict of numpy arrays or a pandas DataFrame (map_batches' "
        f"batch_format 'numpy' or 'pandas'), got {type(batch).__module__}.{type(batch).__name__}"
    )


def _column(table: Mapping[str, Any], name: str, arg: str) -> Any:
    if name not in table:
        raise ValueError(
            f"{arg}: {name!r} is not a column of the batch; its columns are "
            f"{sorted(table)}{_nearest(name, list(table))}"
        )
    return table[name]


def _argument(values: Any, device: torch.device) -> Any:
    """A column as an argument: numeric -> a tensor on ``device``; else a list per row."""
    if isinstance(values, torch.Tensor):
        return values.to(device)
    if not isinstance(values, np.ndarray) and hasattr(values, "to_numpy"):  # a pandas Series
        values = values.to_numpy()
        if values.dtype == object and len(values) and all(isinstance(v, np.ndarray) for v in values):
            # A tensor column in a DataFrame: one array per row, stacked when they agree.
            if len({(v.shape, v.dtype) for v in values}) == 1:
                values = np.stack(list(values))
    if not isinstance(values, np.ndarray):
        return list(values)
    if values.dtype.kind not in _NUMERIC:
        return values.tolist()
    if not values.flags.writeable:  # Ray's zero-copy batches are read-only
        values = values.copy()
    return torch.from_numpy(values).to(device)


# numpy has no bfloat16 nor float8: those are widened to float32, which holds them exactly.
_NUMPY_FLOATS = (torch.float16, torch.float32, torch.float64)


def _to_host(value: Any) -> Any:
    """Tensors (anywhere in lists, tuples, dicts) as CPU numpy arrays."""
    if isinstance(value, torch.Tensor):
        if value.requires_grad:  # a parameter returned as it is
            value = value.detach()
        if value.device.type != "cpu":
            value = value.cpu()
        if value.is_floating_point() and value.dtype not in _NUMPY_FLOATS:
            value = value.float()
        return value.numpy()
    if isinstance(value, list):
        return [_to_host(v) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_to_host(v) for v in value)
    if isinstance(value, Mapping):
        return {k: _to_host(v) for k, v in value.items()}
    return value


def _fields(value: Any) -> list[tuple[Any, Any]] | None:
    """A structured output's named parts (dict, ModelOutput, dataclass, namedtuple), or
    a tuple's numbered ones; None for anything else."""
    if isinstance(value, (torch.Tensor, np.ndarray, list)):
        return None
    if isinstance(value, Mapping):
        return list(value.items())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]
    if isinstance(value, tuple):
        names = getattr(value, "_fields", None)
        return list(zip(names, value)) if names else list(enumerate(value))
    return None


def _rows(value: Any, name: str, n: int) -> Any:
    """``value`` as a column of ``n`` rows (tensors to CPU numpy), or an error naming it."""
    shape = getattr(value, "shape", None) if isinstance(value, (torch.Tensor, np.ndarray)) else None
    if shape is not None and len(shape) and shape[0] == n:
        return _to_host(value)
    if isinstance(value, list) and len(value) == n:
        return _to_host(value)
    if shape is not None:
        what, got = f"a {tuple(shape)} {type(value).__name__}", shape[0] if len(shape) else None
    elif isinstance(value, list):
        what, got = "a list", len(value)
    else:
        what, got = f"a {type(value).__name__}", None
    rows = "no rows" if got is None else f"{got} rows"
    raise ValueError(
        f"output {name!r} is {what} with {rows}; expected one row per input row ({n} "
        "rows). A column is a tensor, array or list with one entry per row: return "
        "per-row values, or pass method kwargs that do (num_return_sequences=1 for "
        "generate; use_cache=False leaves a cache out)"
    )


def _cells(values: Any) -> list[Any]:
    """A column's values, one per row, as items: numeric arrays as tensors, numpy scalars as Python's."""
    if not isinstance(values, np.ndarray) and hasattr(values, "to_numpy"):  # a pandas Series
        values = values.to_numpy()
    cells = []
    for v in values:
        if isinstance(v, np.ndarray) and v.dtype.kind in _NUMERIC:
            v = torch.from_numpy(v if v.flags.writeable else v.copy())
        cells.append(v.item() if isinstance(v, np.generic) else v)
    return cells


def _join_rows(outs: list[Any]) -> Any:
    """Per-row outputs as one output of a row each: tensors (arrays) of one shape stacked,
    others listed, fields and tuple positions joined one by one; a per-row list's entries
    (:class:`~dpmethods.types.cut.Entry`, tuples and dicts included) listed as they are,
    one column, as the method's per-row list is on one device."""
    if any(isinstance(o, Entry) for o in outs):
        return [o.value if isinstance(o, Entry) else o for o in outs]
    first = outs[0]
    if isinstance(first, (torch.Tensor, np.ndarray)):
        if all(type(o) is type(first) and o.shape == first.shape for o in outs):
            return torch.stack(outs) if isinstance(first, torch.Tensor) else np.stack(outs)
        return list(outs)
    parts = _fields(first)
    if parts is None:
        return list(outs)
    if isinstance(first, tuple) and not hasattr(first, "_fields"):
        return tuple(_join_rows([o[i] for o in outs]) for i in range(len(first)))
    fields = [dict(_fields(o) or ()) for o in outs]
    # Every row's fields, not only the first row's: a ModelOutput leaves out its None
    # fields, and a field None in some rows only is a column with None in those rows.
    keys = list(dict.fromkeys(k for f in fields for k in f))
    joined = {k: [f.get(k) for f in fields] for k in keys}
    return {k: _join_rows(v) if any(x is not None for x in v) else None for k, v in joined.items()}


def _output_columns(out: Any, name: str, n: int, top: bool = True) -> dict[str, Any]:
    """The method's output as columns: see :class:`Predictor`."""
    parts = _fields(out)
    if parts is None:
        return {name: _rows(out, name, n)}
    columns: dict[str, Any] = {}
    for key, value in parts:
        if value is None:  # a ModelOutput's or dataclass's field that was not computed
            continue
        # Top-level fields keep their own names; a tuple's items and nested fields
        # are numbered or named after the column they belong to.
        column = key if top and isinstance(key, str) else f"{name}_{key}"
        for found, values in _output_columns(value, column, n, False).items():
            if found in columns:  # a field named as a tuple's item is named ('h_0' and h[0])
                raise ValueError(
                    f"output: two parts of the output give the column {found!r}, which can "
                    "hold one of them; rename a field of the output"
                )
            columns[found] = values
    return columns


class Predictor:
    """A callable class for Ray Data's ``map_batches``: one model per actor, a method
    of it run on each batch over the actor's devices.

    Args:
        factory: a picklable zero-argument callable that builds the model (an
            ``nn.Module``), called once per actor; the model is put in ``eval()`` mode.
        method: the method to run: a parallel method (decorated, registered, or one a
            library has with no configuration, as transformers ``generate`` or
            sentence-transformers ``encode``), or ``"forward"``.
        columns: which columns become which arguments: a list passes each column as the
            keyword argument of its name, a dict maps argument names to column names.
            Default: every column not in ``keep``, each as the keyword of its name.
            Numeric columns become tensors on the first device; string and object
            columns become Python lists (one entry per row). Over several devices each
            replica gets its rows of every column, lists included (unless the method's
            ``broadcast=`` names the argument).
        keep: input columns copied unchanged into the output (an id column).
        output: the column name of a tensor (or list) output, and the stem of a tuple's
            columns ``{output}_0``, ``{output}_1``, ...; default: the method's name.
        batch_size, max_tokens, length, collate: item mode, as ``DataParallel.map`` takes
            them (docs/map.md#items-of-mixed-lengths): each row is an item, a dict of the
            arguments ``columns`` gives it; a batch's rows are sorted by length, run in
            sub-batches over the devices and returned in their order; a per-row list is
            one column, whatever its entries, as on one device.
        device_ids: the devices to split each batch over, through
            :class:`dpmethods.DataParallel` with the method's own options (replicas
            cached between batches); on one device the method runs there as it is.
            Default: the GPUs Ray gave the actor (every visible GPU outside Ray), else
            the CPU.
        **method_kwargs: keyword arguments passed to every call (``max_new_tokens=``).

    A batch (a dict of numpy arrays, or a pandas DataFrame) gives the output in the same
    format, with one row per input row: a tensor or per-row list is one column; a dict,
    ``ModelOutput``, dataclass or namedtuple is one column per field (fields that are
    None are left out); a tuple is ``{output}_0``, ``{output}_1``, ...; tensors come
    back as CPU numpy arrays (bfloat16 widened to float32). An output without one row
    per input row is an error naming it. The call runs under ``torch.inference_mode()``.

    Example:
        >>> import numpy as np, torch
        >>> from dpmethods.ray import Predictor
        >>> predict = Predictor(lambda: torch.nn.Linear(3, 2), columns={"input": "x"},
        ...                     output="y", device_ids=["cpu"] * 2)
        >>> out = predict({"x": np.zeros((4, 3), dtype=np.float32)})
        >>> list(out), out["y"].shape
        (['y'], (4, 2))
    """

    def __init__(
        self,
        factory: Callable[[], nn.Module],
        method: str = "forward",
        *,
        columns: Sequence[str] | Mapping[str, str] | None = None,
        keep: Sequence[str] = (),
        output: str | None = None,
        device_ids: Sequence[Any] | None = None,
        batch_size: int | None = None,
        max_tokens: int | None = None,
        length: Callable[[Any], int] | None = None,
        collate: Callable[[list[Any]], Any] | None = None,
        **method_kwargs: Any,
    ) -> None:
        if not callable(factory):
            raise TypeError(
                f"factory: expected a zero-argument callable that builds the model, got "
                f"{type(factory).__name__} {factory!r}"
            )
        self._arguments = _argument_map(columns)
        _check_names("keep", keep)
        self._keep = list(keep)
        if batch_size is None and max_tokens is None:
            for name, value in (("length", length), ("collate", collate)):
                if value is not None:  # ignored otherwise: each Ray batch would run as one call
                    raise TypeError(
                        f"{name}: applies to item mode (with batch_size= or max_tokens=), but "
                        f"neither was given, so each batch runs as one call; got {name}={value!r}"
                    )
        if output is not None and not isinstance(output, str):
            raise TypeError(f"output: expected a column name (str), got {type(output).__name__} {output!r}")
        model = factory()
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"factory: expected it to return a torch.nn.Module, got {type(model).__name__}"
            )
        _method_of(model, method)
        taken = sorted(set(method_kwargs) & set(self._arguments or ()))
        if taken:
            raise TypeError(f"method_kwargs: {taken} are also arguments given by columns=")
        # Given as they are: DataParallel names a string or a number that is not a list.
        devices = _actor_devices() if device_ids is None else device_ids
        self._dp = DataParallel(model.eval(), device_ids=devices, cache_replicas=True)
        first = self._dp.device_ids[0] if self._dp.device_ids else "cpu"  # none: no GPU here
        self._device = torch.device("cuda", first) if isinstance(first, int) else torch.device(first)
        model.to(self._device)  # where DataParallel scatters from
        self._method = method
        # On one device (DataParallel has put the model there) the method is called as
        # it is: DataParallel would return the same, after a scatter and gather of one
        # share that cost more than a small model's batch.
        self._parallel = len(self._dp.device_ids) > 1
        self._split: tuple[str, ...] = ()  # list arguments the devices split by row (_split_rows)
        target = self._dp if self._parallel else self._dp.module
        self._call = target if method == "forward" else getattr(target, method)
        self._name = output if output is not None else method
        self._kwargs = method_kwargs
        self._items: dict[str, Any] | None = None
        self._no_rows: dict[str, Any] | None = None  # item mode: the last batch's columns, no rows
        if batch_size is not None or max_tokens is not None:
            self._items = dict(batch_size=batch_size, max_tokens=max_tokens, length=length, collate=collate, window=None)
            with torch.inference_mode():  # the map checks them (on no items) now, not at the first batch
                self._dp.map(method, [], **self._items, **method_kwargs).close()  # type: ignore[attr-defined]

    def __call__(self, batch: Any) -> Any:
        """Run the method on ``batch``; returns its columns (and the kept ones)."""
        table, is_pandas = _table(batch)
        arguments = self._arguments
        if arguments is None:
            arguments = {c: c for c in table if c not in self._keep}
        kept = {c: _column(table, c, "keep") for c in self._keep}
        inputs = {a: _column(table, c, "columns") for a, c in arguments.items()}
        n = len(next(iter(table.values()))) if table else 0
        with torch.inference_mode():
            # No rows: item mode has no item to run, but the output still has its columns
            # (not the kept ones alone): those of the actor's last batch, with no rows, or
            # before any, the method's on the batch's empty columns, called as without item mode.
            if self._items is not None and n == 0 and self._no_rows is not None:
                columns = dict(self._no_rows)
            elif self._items is None or n == 0:
                kwargs = {a: _argument(v, self._device) for a, v in inputs.items()}
                self._split_rows([a for a, v in kwargs.items() if isinstance(v, list)])
                try:
                    out = self._call(**kwargs, **self._kwargs)
                except Exception as exc:
                    if self._items is None:
                        raise
                    raise add_note(exc, "dpmethods: Predictor: the batch has no rows: item mode called "
                                   "the method once on its empty columns, for the output's columns") from None
                columns = _output_columns(out, self._name, n)
            else:  # each row an item: sorted, batched and run by the map, in their order again
                cells = {a: _cells(v) for a, v in inputs.items()}
                rows = [{a: c[r] for a, c in cells.items()} for r in range(n)]
                mapped = self._dp.map(self._method, rows, **self._items, **self._kwargs)
                mapped.entries = True  # type: ignore[attr-defined]  # a per-row list's entries: one column each
                outs = list(mapped)
                columns = _output_columns(_join_rows(outs), self._name, n)
                self._no_rows = {k: v[:0] if isinstance(v, np.ndarray) else [] for k, v in columns.items()}
        clash = sorted(set(columns) & set(kept))
        if clash:
            raise ValueError(
                f"keep: {clash} are also output columns of {self._method!r}; keep other "
                "columns, or pass output= to name the output differently"
            )
        result = {**kept, **columns}
        if not is_pandas:
            return result
        pandas = sys.modules["pandas"]
        return pandas.DataFrame(
            {k: list(v) if isinstance(v, np.ndarray) and v.ndim > 1 else v for k, v in result.items()},
            index=batch.index,
        )

    def _split_rows(self, names: list[str]) -> None:
        """Have the devices split the list arguments ``names`` by row, as they split tensors.

        A column has one entry per row, but DataParallel gives a list argument whole to
        every replica unless the method's ``split=`` names it: a replica would pair its
        share of the tensor columns with the first rows of a string column. The wrapper
        is made again (once per new name) with the method's own options plus these; an
        argument the method's own ``broadcast=`` names stays whole, as the method asks.
        """
        if not self._parallel:  # one device: the method runs as it is, on the whole batch
            return
        dp, method = self._dp, self._method
        opts = get_options(dp.module, method) or MethodOptions(dim=dp.dim)
        split = (*self._split, *(n for n in names if n not in self._split and n not in opts.split))
        split = tuple(n for n in split if n not in opts.broadcast)
        if split == self._split:
            return
        self._split = split
        options = {f.name: getattr(opts, f.name) for f in dataclasses.fields(opts)}
        options["split"] = (*opts.split, *split)
        self._dp = DataParallel(dp.module, device_ids=dp.device_ids, cache_replicas=True, methods={method: options})
        self._call = self._dp if method == "forward" else getattr(self._dp, method)

    def __repr__(self) -> str:
        return f"Predictor({type(self._dp.module).__name__}.{self._method}, devices={self._dp.device_ids})"
