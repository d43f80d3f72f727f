"""Models and factories for tests/processes/test_process_workers.py.

Spawned worker processes rebuild these by importing this module (the repository root
is on the sys.path that spawn hands to its children), so everything here is module-level.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time
import types
import warnings
import weakref
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

import dpmethods


class Net(nn.Module):
    """One parallel method per output kind and per gather mode."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    @dpmethods.parallel_method
    def encode(self, x: torch.Tensor, *, scale: float = 1.0) -> Any:
        if torch.isnan(x).any():
            raise ValueError("encode: a NaN batch")
        y = self.lin(x) * scale
        return {"y": y, "n": x.shape[0], "norm": y.norm(dim=1)}

    @dpmethods.parallel_method
    def warned(self, x: torch.Tensor) -> torch.Tensor:
        """Warns once per share, naming its rows; a share holding a NaN then raises."""
        warnings.warn(f"a share of {len(x)} rows", UserWarning, stacklevel=1)
        if torch.isnan(x).any():
            raise ValueError("warned: a NaN share")
        return self.lin(x)

    @dpmethods.parallel_method
    def warns_locally(self, x: torch.Tensor) -> torch.Tensor:
        """Warns with a category defined in the call: no other process can import it."""

        class LocalWarning(UserWarning):
            pass

        warnings.warn("heads up", LocalWarning, stacklevel=1)
        return self.lin(x)

    @dpmethods.parallel_method
    def output(self, x: torch.Tensor) -> Any:
        from transformers.modeling_outputs import BaseModelOutput

        return BaseModelOutput(last_hidden_state=self.lin(x), hidden_states=(x, self.lin(x)))

    @dpmethods.parallel_method
    def to_numpy(self, x: torch.Tensor) -> np.ndarray:
        return self.lin(x).numpy()

    @dpmethods.parallel_method(gather="extend")
    def words(self, x: torch.Tensor) -> list[str]:
        return [f"row {float(r.sum()):.4f}" for r in self.lin(x)]

    @dpmethods.parallel_method
    def big(self, x: torch.Tensor) -> torch.Tensor:
        # Over the inline limit: through shared memory, both ways.
        return self.lin(x).repeat(1, 40000)

    @dpmethods.parallel_method
    def pid(self, x: torch.Tensor) -> torch.Tensor:
        return torch.full((x.shape[0],), os.getpid())

    @dpmethods.parallel_method
    def exhausting(self, x: torch.Tensor) -> torch.Tensor:
        if float(x[0, 0]) < 0:
            next(iter(()))  # raises StopIteration, as a method's own next() may
        return self.lin(x)

    @dpmethods.parallel_method
    def sleepy(self, x: torch.Tensor, seconds: float = 0.0) -> torch.Tensor:
        time.sleep(seconds)
        return self.lin(x)

    @dpmethods.parallel_method(gather="stack")
    def stacked(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).sum(0)

    @dpmethods.parallel_method(gather="mean")
    def mean(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).mean()

    @dpmethods.parallel_method(gather="sum")
    def total(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).sum()

    @dpmethods.parallel_method(gather="pad", pad_value=-1.0)
    def padded(self, x: torch.Tensor) -> torch.Tensor:
        # A length that depends on the chunk: the gather pads dim 1.
        return self.lin(x)[:, : 1 + x.shape[0] % 3]

    @dpmethods.parallel_method(gather="list")
    def listed(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)

    @dpmethods.parallel_method
    def exits(self, x: torch.Tensor) -> torch.Tensor:
        raise SystemExit(3)  # a BaseException: it ends the job, not the worker

    @dpmethods.parallel_method
    def terminated(self, x: torch.Tensor) -> torch.Tensor:
        """SIGTERM to its own worker process, as ``kill <pid>`` of a stuck worker."""
        os.kill(os.getpid(), signal.SIGTERM)  # the worker's handler raises in this job
        time.sleep(60)  # not reached
        return self.lin(x)

    @dpmethods.parallel_method
    def unfetched(self, x: torch.Tensor) -> torch.Tensor:
        """Per row, the shared-memory blocks of this worker's replies that no caller
        has fetched yet (its resource sharer holds their descriptors until then)."""
        from multiprocessing import resource_sharer

        sharer = resource_sharer._resource_sharer
        return torch.full((x.shape[0],), len(sharer._cache))

    @dpmethods.parallel_method
    def unsendable(self, x: torch.Tensor) -> Any:
        return (r for r in self.lin(x))  # a generator: it can't be pickled back

    @dpmethods.parallel_method
    def drawn(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        return self.lin(x) + torch.rand(len(x), 3, generator=generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class Ticker(nn.Module):
    """A buffer a method updates in place, as a static cache or a scratch buffer is."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(1))

    @dpmethods.parallel_method
    def tick(self, x: torch.Tensor) -> torch.Tensor:
        self.count += 1
        return self.count.expand(len(x)).clone()


def build_net() -> Net:
    """A factory: the same weights as ``torch.manual_seed(0); Net()``."""
    torch.manual_seed(0)
    return Net().eval()


def build_net_doubled() -> Net:
    """A factory whose model differs from ``build_net``'s (the workers' model is its)."""
    net = build_net()
    with torch.no_grad():
        net.lin.weight.mul_(2)
    return net


def tiny_gpt2() -> Any:
    import transformers

    config = transformers.GPT2Config(
        vocab_size=64, n_positions=64, n_embd=16, n_layer=2, n_head=2,
        bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


def count_calls(module: nn.Module, args: Any, output: Any) -> Any:
    """A picklable forward hook that doubles the output (a hook change must be seen)."""
    return output * 2


class Shifted:
    """A forward hook object with a setting (as activation steering has): adds ``shift``."""

    def __init__(self) -> None:
        self.shift = 0.0

    def __call__(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return output + self.shift


class Watched(nn.Module):
    """A square layer (``.t()`` keeps its shape), an attribute, an options dict, a
    config object, a buffer, a dict of tensors, two layers that are not its children
    (one in a list, one set with ``object.__setattr__``), a hook object and a head: each
    is a way to change the module between batches."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)
        self.scale = 1.0
        self.options = {"shift": 0.0}
        self.config = types.SimpleNamespace(shift=0.0)
        self.register_buffer("shift", torch.zeros(4))
        self.tables = {"offset": torch.zeros(4)}  # a tensor that is no buffer
        self.helpers = [nn.Linear(4, 4)]
        object.__setattr__(self, "unlisted", nn.Linear(4, 4))
        self.lin.register_forward_hook(Shifted())  # held by the hook dict only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x) * self.scale + self.shift + self.options["shift"] + self.config.shift
        y = self.unlisted(self.helpers[0](y + self.tables["offset"]))
        return self.head(y.tanh() if self.training else y)


class DoubledLinear(nn.Linear):
    """``Linear`` whose output is doubled: what ``module.__class__ = DoubledLinear`` gives."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


class Patched(nn.Module):
    """Two ``Linear`` layers; tests replace :meth:`Patched.forward` on the class (a
    method patched in the caller's process) with :func:`patched_forward`."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 3), nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x).relu())  # type: ignore[no-any-return]


class PatchedChild(Patched):
    """A :class:`Patched` that inherits its ``forward``: a test overrides it on this class
    alone."""


def patched_forward(self: Patched, x: torch.Tensor) -> torch.Tensor:
    """What :class:`Patched` runs once patched: another model's output."""
    return self.second(self.first(x).tanh() * 3)  # type: ignore[no-any-return]


class Grown(nn.Module):
    """A ``Linear(4, 3)`` whose forward takes a ``fast_path`` where its class has one (as
    libraries look for an optional method): tests add methods to the class at run time."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fast = getattr(self, "fast_path", None)
        return self.lin(x) if fast is None else fast(x)  # type: ignore[no-any-return]


def library_addition() -> Any:
    """A function made as a library runs, to add to a class (a closure, as transformers'
    ``smart_apply``), from a file outside site-packages: a library installed from its
    source checkout."""

    def tidy(module: nn.Module, fn: Any) -> None:
        for child in module.children():
            fn(child)

    return tidy


class Holder(nn.Module):
    """Runs ``self.model``: a test puts a fresh model in it (the workers get it) and
    changes that one, on one pool of workers for every case."""

    def __init__(self) -> None:
        super().__init__()
        self.model: nn.Module = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)  # type: ignore[no-any-return]


class Locked(nn.Module):
    """Holds a lock that its ``__getstate__`` leaves out (as a client or a cache would
    be): it never crosses, and each process makes its own."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.guard = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        del state["guard"]
        return state  # type: ignore[no-any-return]

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.guard = threading.Lock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.guard:
            return self.lin(x)  # type: ignore[no-any-return]


class MarkedLater(nn.Module):
    """A class a test marks batch-coupled after the workers hold its instance."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x


GLOO_PRELOAD = ["torch", "torch._dynamo", "torch.distributed.fsdp", "dpmethods.distributed"]


def spawn_gloo(target: Any, world: int, outdir: Any, *args: Any, timeout_s: float = 150) -> list[Any]:
    """Run ``target(rank, world, *args)`` on ``world`` gloo ranks on 127.0.0.1 (fresh
    processes); each rank's return value, saved by the rank. Fails the test past ``timeout_s``."""
    import multiprocessing
    import socket
    import time
    from pathlib import Path

    import pytest
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # A forkserver imports torch once for every rank of every run instead of once per
    # rank; the ranks are fresh processes all the same, and their DataParallel workers
    # are spawned as a user's are. The preload is test_distributed's: whichever run
    # starts the forkserver, the others find what they import there.
    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    if method == "forkserver":
        multiprocessing.get_context("forkserver").set_forkserver_preload(GLOO_PRELOAD)
    context = mp.start_processes(
        _gloo_rank, args=(world, port, str(outdir), target, args), nprocs=world, join=False,
        start_method=method,
    )
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for p in context.processes:
                p.kill()
            pytest.fail(f"the {world}-rank gloo run did not finish in {timeout_s} s")
    return [torch.load(Path(outdir, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def _gloo_rank(rank: int, world: int, port: int, outdir: str, target: Any, args: tuple[Any, ...]) -> None:
    import traceback
    from datetime import timedelta
    from pathlib import Path

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        torch.save(target(rank, world, *args), os.path.join(outdir, f"rank{rank}.pt"))
    except BaseException:
        Path(outdir, f"error{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        torch.distributed.destroy_process_group()


SHARD_BATCHES = 7


def shard_batches() -> list[torch.Tensor]:
    return [torch.full((2, 4), float(i)) for i in range(SHARD_BATCHES)]


def shard_maps(rank: int, world: int, workers: str) -> dict[str, Any]:
    """One rank of the shard test: ordered and unordered maps with shard=True."""
    dp = dpmethods.DataParallel(build_net(), device_ids=["cpu"] * 2, workers=workers)
    with torch.no_grad():
        ordered = list(dp.map("encode", shard_batches(), shard=True))
        pairs = list(dp.map("encode", iter(shard_batches()), shard=True, ordered=False))
    dp.close()
    return {"ordered": ordered, "indices": [i for i, _ in pairs], "pairs": pairs}


def shard_checkpointed(rank: int, world: int, workers: str, path: str) -> dict[str, Any]:
    """One rank of a resumable sharded map: stopped after one output, then run again."""
    dp = dpmethods.DataParallel(build_net(), device_ids=["cpu"] * 2, workers=workers)
    with torch.no_grad():
        with dp.map("encode", shard_batches(), shard=True, ordered=False, checkpoint=path) as first:
            taken = [next(first), next(first)]  # the second is not asked past: it comes again
        rest = list(dp.map("encode", shard_batches(), shard=True, ordered=False, checkpoint=path))
    dp.close()
    return {"taken": taken, "rest": rest}


class Unloadable:
    """Pickles in the caller, but raises when a worker unpickles it (a class it can't import)."""

    def __reduce__(self) -> Any:
        return (_fail_to_load, ())


def _fail_to_load() -> Any:
    raise ModuleNotFoundError("No module named 'only_in_the_caller'")


class Probe:
    """Unpickled while a reply is read: records what ``watched`` says at that moment."""

    watched: ClassVar[Any] = None
    seen: ClassVar[list[Any]] = []

    def __reduce__(self) -> Any:
        return (_probe_loaded, ())


def _probe_loaded() -> Probe:
    Probe.seen.append(Probe.watched())
    return Probe()


class InBatchLoss(nn.Module):
    """A loss over in-batch negatives; the contract test marks it batch-coupled."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(a @ b.T, torch.arange(len(a)))


class Box:
    """An output object without a type rule (its tensor is not seen by the tree walk)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


_LOG = logging.getLogger("tests.helpers.processes.contract")


class CodedError(ValueError):
    """An exception whose ``__init__`` takes a keyword-only argument, not its message
    (as many libraries' do): pickle cannot rebuild it by calling it with its ``args``."""

    def __init__(self, *, code: int) -> None:
        super().__init__(f"contract: failed with code {code}")
        self.code = code


NOTED: set[str] = set()  # what note_once logged in this process
_NOTING = threading.Lock()


def note_once(text: str) -> None:
    """Log ``text`` once per process, as transformers' ``logger.warning_once`` does (its
    ``lru_cache`` may log twice from two threads at once; the lock makes it exact)."""
    with _NOTING:
        if text in NOTED:
            return
        NOTED.add(text)
    _LOG.warning(text)


class Contract(nn.Module):
    """One model for the thread/process contract tests: a tiny GPT-2, a conv, options."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = tiny_gpt2()
        torch.manual_seed(1)
        self.lin = nn.Linear(4, 3)
        self.conv = nn.Conv2d(3, 4, 1)
        self.loss = InBatchLoss()
        self.options = {"scale": 1.0}

    @dpmethods.parallel_method(gather="pad", pad_value=1)
    def generate(self, ids: torch.Tensor) -> torch.Tensor:
        return self.gpt.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=1, do_sample=False)

    @dpmethods.parallel_method
    def hidden(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.gpt(ids)
        count = len(out.hidden_states) if out.hidden_states is not None else 0
        return {"logits": out.logits, "hidden": torch.full((len(ids),), count)}

    @dpmethods.parallel_method
    def scaled(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.options["scale"]

    @dpmethods.parallel_method
    def boxed(self, x: torch.Tensor) -> Box:
        return Box(self.lin(x))

    @dpmethods.parallel_method(gather="mean")
    def coupled(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.loss(a, b)

    @dpmethods.parallel_method
    def warns(self, x: torch.Tensor) -> torch.Tensor:
        import warnings

        warnings.warn("contract: a plain warning", UserWarning, stacklevel=1)
        dpmethods.vocab.warn_once.warn_once("contract: a warn-once warning")
        return self.lin(x)

    @dpmethods.parallel_method
    def logs(self, x: torch.Tensor) -> torch.Tensor:
        _LOG.warning("contract: logged %d rows", x.shape[0])  # once per share
        note_once("contract: logged once")  # once per process, as transformers' warning_once
        try:
            raise ValueError("contract: the logged error")
        except ValueError:
            _LOG.exception("contract: logged with its traceback")
        _LOG.info("contract: an info record")  # made where the caller's level lets it be
        return x * 2

    @dpmethods.parallel_method
    def fails(self, x: torch.Tensor) -> torch.Tensor:
        raise CodedError(code=x.shape[0])

    @dpmethods.parallel_method
    def views(self, z: torch.Tensor) -> dict[str, torch.Tensor]:
        """``z`` as given (a conjugate view, say), and views with the conjugate and negative bits."""
        return {"given": z, "conj": z.conj(), "neg": z.conj().imag}

    @dpmethods.parallel_method
    def nested(self, x: torch.Tensor) -> torch.Tensor:
        """``lin`` of the first row and of the rest, as one nested tensor."""
        return torch.nested.nested_tensor([self.lin(x[:1]), self.lin(x[1:])])

    @dpmethods.parallel_method
    def noisy(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + torch.rand(len(x), 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class BeyondStorage(nn.Module):
    """Tensors that are more than their storage: a parameter that is the conjugate view
    of another's storage, a buffer that is a negative view, and a quantized buffer (its
    scale and zero point live in its quantizer)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(4)
        z = torch.randn(3, dtype=torch.complex64, generator=g)
        self.base = nn.Parameter(z, requires_grad=False)
        self.conj = nn.Parameter(z.conj(), requires_grad=False)  # base's storage, conjugated
        self.register_buffer("neg", torch.randn(3, dtype=torch.complex64, generator=g).conj().imag)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch deprecates its quantized tensors
            self.register_buffer("q", torch.quantize_per_tensor(torch.randn(3, generator=g), 0.05, 3, torch.qint8))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"base": self.base * x, "conj": self.conj * x, "neg": self.neg * x.real,
                "q": self.q.dequantize() * x.real}


class SparseHeld(nn.Module):
    """Sparse parameters, COO and CSR, frozen, a trained one, and a sparse buffer.
    ``described`` says, per row, what the module holds as its replica or worker sees it:
    the frozen ones (a replica thread's trained parameters are torch's broadcast tensors)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(5)
        w = torch.randn(3, 3, generator=g) * torch.eye(3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch's CSR support is in beta
            self.csr = nn.Parameter(w.to_sparse_csr(), requires_grad=False)
        self.coo = nn.Parameter(w.to_sparse(), requires_grad=False)
        self.trained = nn.Parameter(w.to_sparse())
        self.register_buffer("held", (2 * w).to_sparse())

    @dpmethods.parallel_method
    def described(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        frozen = [p for name, p in self.named_parameters() if name in ("csr", "coo")]
        kept = self.state_dict(keep_vars=True)
        facts = [len(list(self.parameters())), len(frozen), *(isinstance(p, nn.Parameter) for p in frozen), *(p.requires_grad for p in frozen),
                 *(isinstance(kept[k], nn.Parameter) for k in ("csr", "coo", "held")),
                 isinstance(self.coo, nn.Parameter)]
        y = sum(torch.sparse.mm(t, x.T).T for t in (self.coo, self.trained, self.held))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            y = y + (self.csr @ x.T).T
        return {"y": y, "facts": torch.tensor(facts).expand(x.shape[0], -1)}


class Parametrized(nn.Module):
    """torch's parametrizations, whose modules torch refuses to pickle: a weight-normed
    Conv1d (as Wav2Vec2's, HuBERT's and Encodec's) and an orthogonal Linear."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(2, 4, 3), dim=2)
        self.lin = nn.utils.parametrizations.orthogonal(nn.Linear(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.conv(x).mean(-1))


class LockedLinear(nn.Linear):
    """A Linear holding a lock that its ``__getstate__`` leaves out, as :class:`Locked`:
    a test parametrizes its weight (then torch makes its class per module)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.guard = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("guard")
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.guard = threading.Lock()


_LOCKS: list[Any] = []


class SemaphoreNet(Net):
    """A method that makes a named semaphore in its process (as torch.compile or loky do)."""

    @dpmethods.parallel_method(gather="extend")
    def semaphore(self, x: torch.Tensor) -> list[str]:
        import multiprocessing

        lock = multiprocessing.get_context("spawn").Lock()
        _LOCKS.append(lock)  # alive until the process exits
        return [str(lock._semlock.name), str(os.getpid())]  # type: ignore[attr-defined]


class EnvProbe(nn.Module):
    """Returns its input and the worker's OMP_NUM_THREADS and torch thread count."""

    def forward(self, x: torch.Tensor) -> Any:
        return x, os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads()


_CYCLES: list[Any] = []  # weak references to the cycles GcProbe's builds left behind


class _Cycle:
    def __init__(self) -> None:
        self.me = self  # garbage only the cyclic collector frees


class GcProbe(nn.Module):
    """Returns ``x * scale`` and its worker's collector: enabled, how many objects are
    frozen, whether this model is one of them, and whether the cyclic garbage its
    builds made was collected."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = 1.0
        _CYCLES.append(weakref.ref(_Cycle()))

    def forward(self, x: torch.Tensor) -> Any:
        frozen = not any(o is self for o in gc.get_objects())  # the collector's generations skip it
        return x * self.scale, gc.isenabled(), gc.get_freeze_count(), frozen, all(r() is None for r in _CYCLES)


def build_gc_probe() -> GcProbe:
    return GcProbe()


class Completer(nn.Module):
    """A user's own method around a language model's ``generate``; it has no ``generate``."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    @dpmethods.parallel_method(gather="generate")
    def complete(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs: Any) -> Any:
        return self.lm.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)


def gone(pid: int, seconds: float = 30.0) -> bool:
    """Whether process ``pid`` is gone (exited and reaped) within ``seconds``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def wait_for(path: str, seconds: float) -> bool:
    """A worker's job that waits until ``path`` exists; whether it appeared in ``seconds``."""
    end = time.monotonic() + seconds
    while not os.path.exists(path):
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True
