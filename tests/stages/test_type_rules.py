"""Types beyond containers: dpmethods.register_type, torch pytree types, and the shipped
rules for transformers caches (DynamicCache is in tests/integrations/transformers/test_models.py)."""

from __future__ import annotations

import inspect
from collections import deque
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn

import dpmethods
from dpmethods import DataParallel, parallel_method
from dpmethods.core.gather import gather
from dpmethods.testing import assert_close_to_reference
from dpmethods.vocab import warn_once as warn_once
from tests.helpers.models import tiny_qwen3_next
from tests.helpers.terms import mlp_terms, transformer_terms


@pytest.fixture(autouse=True)
def _fresh_warnings() -> None:
    warn_once.reset()


class Gaussian:
    """A user type holding batch tensors and a flag."""

    def __init__(self, mean: torch.Tensor, logvar: torch.Tensor, tag: str) -> None:
        self.mean, self.logvar, self.tag = mean, logvar, tag

    def sample(self, g: torch.Generator) -> torch.Tensor:
        return self.mean + (0.5 * self.logvar).exp() * torch.randn(self.mean.shape, generator=g)


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)

    @parallel_method
    def encode(self, x: torch.Tensor) -> dict[str, Any]:
        h = self.lin(x)
        return {"dist": Gaussian(h[:, :3], h[:, 3:], "g"), "h": h}

    @parallel_method
    def decode(self, dist: Gaussian) -> torch.Tensor:
        return dist.mean * 2


def test_register_type_splits_and_joins_without_touching_torch_registry() -> None:
    before = set(pytree.SUPPORTED_NODES)
    dpmethods.register_type(
        Gaussian,
        lambda d: ([d.mean, d.logvar], d.tag),
        lambda children, tag: Gaussian(*children, tag),
    )
    assert set(pytree.SUPPORTED_NODES) == before
    model, x = Encoder(), torch.randn(7, 4)
    dp = DataParallel(model, device_ids=["cpu"] * 3)
    got, ref = dp.encode(x), model.encode(x)
    assert type(got["dist"]) is Gaussian and got["dist"].tag == "g"
    assert_close_to_reference(
        got["dist"].sample(torch.Generator().manual_seed(1)),
        ref["dist"].sample(torch.Generator().manual_seed(1)),
        terms=2 * mlp_terms(4),  # Linear(4, 6), then exp(logvar / 2) times the noise
    )
    # ... and as an input: the tensors inside are split per replica.
    assert_close_to_reference(dp.decode(ref["dist"]), model.decode(ref["dist"]), terms=1)


def test_register_type_checks_its_arguments() -> None:
    with pytest.raises(TypeError, match=r"register_type: cls: expected a class, got int 3"):
        dpmethods.register_type(3, lambda o: ([], None), lambda c, x: None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"register_type: unflatten: expected a callable, got str 'x'"):
        dpmethods.register_type(Gaussian, lambda o: ([], None), "x")  # type: ignore[arg-type]


class Pair:
    """A type its own library registered with torch's pytree."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor) -> None:
        self.a, self.b = a, b


pytree.register_pytree_node(Pair, lambda p: ([p.a, p.b], None), lambda c, _: Pair(*c))


def test_torch_pytree_types_are_walked() -> None:
    class M(nn.Module):
        @parallel_method
        def f(self, p: Pair) -> Any:
            return Pair(p.a + 1, p.b * 2), deque([p.a])

    a, b = torch.randn(7, 2), torch.randn(7)
    got, dq = DataParallel(M(), device_ids=["cpu"] * 3).f(Pair(a, b))
    assert type(got) is Pair and type(dq) is deque
    assert_close_to_reference((got.a, got.b, dq[0]), (a + 1, b * 2, a), terms=1)


def test_mismatching_rule_contexts_are_a_structure_error() -> None:
    dpmethods.register_type(Gaussian, lambda d: ([d.mean], d.tag), lambda c, tag: Gaussian(c[0], c[0], tag))
    outs = [Gaussian(torch.ones(1), torch.ones(1), "a"), Gaussian(torch.ones(1), torch.ones(1), "b")]
    with pytest.raises(ValueError, match=r"replica outputs differ in structure.*Gaussian"):
        gather(outs, "cpu")


# --- transformers caches besides DynamicCache --------------------------------------


def _cache_arg(model: nn.Module) -> str:
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _cache_of(out: Any, name: str) -> Any:
    return out[name] if name in out else out.past_key_values


@pytest.mark.parametrize("batch,devices", [(7, 3), (8, 4)])
def test_t5_encoder_decoder_cache_joined_and_used_for_the_next_step(batch: int, devices: int) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(vocab_size=99, d_model=32, d_kv=8, d_ff=37, num_layers=2,
                                   num_heads=4, decoder_start_token_id=0, pad_token_id=0,
                                   eos_token_id=1)
    t5 = transformers.T5ForConditionalGeneration(config).eval()
    ids, dec, nxt = (torch.randint(2, 99, (batch, n)) for n in (6, 3, 1))
    name = _cache_arg(t5)
    dp = DataParallel(t5, device_ids=["cpu"] * devices)
    with torch.no_grad():
        ref1 = t5(input_ids=ids, decoder_input_ids=dec, use_cache=True)
        ref2 = t5(encoder_outputs=(ref1.encoder_last_hidden_state,), decoder_input_ids=nxt,
                  use_cache=True, **{name: _cache_of(ref1, name)})
        got1 = dp(input_ids=ids, decoder_input_ids=dec, use_cache=True)
        cache = _cache_of(got1, name)
        assert type(cache) is transformers.EncoderDecoderCache
        got2 = dp(encoder_outputs=(got1.encoder_last_hidden_state,), decoder_input_ids=nxt,
                  use_cache=True, **{name: cache})
    # 2 encoder and 2 decoder blocks (each decoder block's cross-attention counted as a block).
    terms = transformer_terms(width=32, ff=37, seq=6, layers=6)
    assert_close_to_reference((got1.logits, got2.logits), (ref1.logits, ref2.logits), terms=terms)


def test_a_linear_attention_cache_joined_and_used_for_the_next_step() -> None:
    """Qwen3-Next's linear-attention layer keeps its conv and recurrent states in dicts (by
    state index): each replica's are joined, so the cache holds every row's state."""
    pytest.importorskip("transformers")
    model = tiny_qwen3_next()
    ids, nxt = torch.randint(2, 64, (5, 6)), torch.randint(2, 64, (5, 1))
    name = _cache_arg(model)
    dp = DataParallel(model, device_ids=["cpu"] * 2)
    with torch.no_grad():
        ref1 = model(input_ids=ids, use_cache=True)
        ref2 = model(input_ids=nxt, use_cache=True, **{name: _cache_of(ref1, name)})
        got1 = dp(input_ids=ids, use_cache=True)
        cache = _cache_of(got1, name)
        states = [t for layer in cache.layers for d in (getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {}))
                  for t in d.values() if t is not None]
        assert states and all(t.shape[0] == 5 for t in states)
        got2 = dp(input_ids=nxt, use_cache=True, **{name: cache})
    terms = transformer_terms(width=16, ff=32, seq=7, layers=2)
    assert_close_to_reference((got1.logits, got2.logits), (ref1.logits, ref2.logits), terms=terms)


class _Rows:
    """A state of one value per pair of items in the share: [share, share], as a similarity matrix."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class _RowsModel(nn.Module):
    @parallel_method(gather="pad")
    def state(self, x: torch.Tensor) -> _Rows:
        return _Rows(x[:, : len(x)] * 2)  # [4, 4] and [3, 3] on 7-on-2


@pytest.mark.parametrize("per_item", [False, True])
def test_per_item_rule_children_are_not_reported_as_batch_coupled(per_item: bool, recwarn: Any) -> None:
    dpmethods.register_type(_Rows, lambda r: ([r.t], None), lambda c, _: _Rows(c[0]), per_item=per_item)
    x = torch.randn(7, 5)
    got = DataParallel(_RowsModel(), device_ids=["cpu"] * 2).state(x)
    # Trusted rows are joined padded; a coupled leaf comes back as the replicas' pieces.
    pieces = [got.t[:4, :4], got.t[4:, :3]] if per_item else got.t
    assert_close_to_reference((pieces[0], pieces[1]), (x[:4, :4] * 2, x[4:, :3] * 2), terms=1)
    coupled = [w for w in recwarn if "in more than one dim" in str(w.message)]
    assert len(coupled) == (0 if per_item else 1)
    if not per_item:
        assert "output[0]" in str(coupled[0].message)  # the rule's first child


def test_register_type_per_item_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match=r"register_type: per_item: expected True or False, got str 'yes'"):
        dpmethods.register_type(_Rows, lambda r: ([r.t], None), lambda c, _: _Rows(c[0]), per_item="yes")  # type: ignore[arg-type]


class _Pair:
    """A user type for wrong rules: each test registers its own rule on its own subclass."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class _PairModel(nn.Module):
    @parallel_method
    def make(self, x: torch.Tensor) -> Any:
        return self.kind(x * 2)

    kind: type = _Pair


def _run_rule(flatten: Any, unflatten: Any) -> Any:
    kind = type("Box", (_Pair,), {})  # a fresh class: no other test's rule applies
    dpmethods.register_type(kind, flatten, unflatten)
    model = _PairModel()
    model.kind = kind
    return DataParallel(model, device_ids=["cpu"] * 3).make(torch.randn(6, 3))


def test_wrong_flatten_result_names_the_class_and_the_expected_pair() -> None:
    with pytest.raises(TypeError, match=r"the type rule of Box: flatten\(obj\) must return a pair "
                       r"\(children, context\), got a list of length 1 \(see dpmethods.register_type\)"):
        _run_rule(lambda b: [b.t], lambda c, _: _Pair(c[0]))
    with pytest.raises(TypeError, match=r"got int 3 \(see"):
        _run_rule(lambda b: 3, lambda c, _: _Pair(c[0]))


def test_flatten_returning_a_bare_tensor_as_children_is_refused() -> None:
    # Iterated, a [2, 3] tensor is 2 rows: the object was silently rebuilt from rows.
    with pytest.raises(TypeError, match=r"the type rule of Box: flatten\(obj\) returned a tensor of "
                       r"shape \[2, 3\] as its children, expected a list of children; to split the "
                       r"tensor along the batch, return \(\[tensor\], context\)"):
        _run_rule(lambda b: (b.t, None), lambda c, _: _Pair(torch.stack(list(c))))
    with pytest.raises(TypeError, match=r"returned a dict with keys \['t'\] as its children, expected "
                       r"a list of children; return \(list\(d.values\(\)\), keys\)"):
        _run_rule(lambda b: ({"t": b.t}, None), lambda c, _: _Pair(c[0]))
    with pytest.raises(TypeError, match=r"returned int 3 as its children, expected a list of children$"):
        _run_rule(lambda b: (3, None), lambda c, _: _Pair(c[0]))


def test_right_rules_in_other_shapes_still_work() -> None:
    x = torch.randn(6, 3)
    for flatten in (lambda b: [[b.t], None], lambda b: ((b.t,), None), lambda b: (iter([b.t]), None)):
        kind = type("Box", (_Pair,), {})
        dpmethods.register_type(kind, flatten, lambda c, _, kind=kind: kind(c[0]))
        model = _PairModel()
        model.kind = kind
        got = DataParallel(model, device_ids=["cpu"] * 3).make(x)
        assert type(got) is kind
        assert_close_to_reference(got.t, x * 2, terms=1)


def test_register_type_checks_the_arity_of_flatten_and_unflatten() -> None:
    with pytest.raises(TypeError, match=r"register_type: unflatten \(of _Pair\): expected a function "
                       r"called as unflatten\(children, context\), got <lambda>\(c\)$"):
        dpmethods.register_type(_Pair, lambda b: ([b.t], None), lambda c: _Pair(c[0]))
    with pytest.raises(TypeError, match=r"register_type: flatten \(of _Pair\): expected a function "
                       r"called as flatten\(obj\), got <lambda>\(b, extra\)$"):
        dpmethods.register_type(_Pair, lambda b, extra: ([b.t], None), lambda c, x: _Pair(c[0]))
    # Defaults, *args and callables without a signature are accepted.
    dpmethods.register_type(_Pair, lambda b, extra=1: ([b.t], None), lambda *a: _Pair(a[0][0]))
    dpmethods.register_type(_Pair, lambda b: ([b.t], None), lambda c, x: _Pair(c[0]))


def test_gpt2_cache_with_as_many_heads_as_rows_per_replica_is_not_warned(recwarn: Any) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=99,
                                     n_positions=64, bos_token_id=0, eos_token_id=0)
    gpt = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 99, (8, 5))
    with torch.no_grad():
        got = DataParallel(gpt, device_ids=["cpu"] * 4)(ids, use_cache=True)  # keys [2, 2, 5, 16]
        ref = gpt(ids, use_cache=True)
    assert_close_to_reference(got.logits, ref.logits, terms=transformer_terms(width=32, ff=128, seq=5, layers=2))
    assert not [str(w.message) for w in recwarn if "in more than one dim" in str(w.message)]


def test_gpt2_static_cache() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=99,
                                     n_positions=64, bos_token_id=0, eos_token_id=0)
    gpt = transformers.GPT2LMHeadModel(config).eval()
    name = _cache_arg(gpt)
    ids, nxt = torch.randint(0, 99, (7, 5)), torch.randint(0, 99, (7, 1))
    dp = DataParallel(gpt, device_ids=["cpu"] * 3)
    with torch.no_grad():
        ref1 = gpt(ids, use_cache=True, **{name: transformers.StaticCache(config=config, max_cache_len=16)})
        ref2 = gpt(nxt, use_cache=True, **{name: _cache_of(ref1, name)})
        got1 = dp(ids, use_cache=True, **{name: transformers.StaticCache(config=config, max_cache_len=16)})
        cache = _cache_of(got1, name)
        assert type(cache) is transformers.StaticCache and cache.layers[0].keys.shape[0] == 7
        got2 = dp(nxt, use_cache=True, **{name: cache})
    terms = transformer_terms(width=32, ff=128, seq=16, layers=2)  # attends over the 16 cache slots
    assert_close_to_reference((got1.logits, got2.logits), (ref1.logits, ref2.logits), terms=terms)


class _PackedGRU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(3, 5, batch_first=True, num_layers=2)

    @parallel_method(gather_dim={"h": 1})  # h is [layers, batch, hidden]
    def run(self, packed: Any) -> dict[str, Any]:
        out, h = self.rnn(packed)
        return {"out": out, "h": h}

    @parallel_method
    def packed_only(self, packed: Any) -> Any:
        return self.rnn(packed)[0]  # every leaf a tensor: gather's fast path


@pytest.mark.parametrize("batch,devices", [pytest.param(7, 3, id="7-on-3"), pytest.param(8, 4, id="8-on-4")])
def test_packed_sequences_are_split_and_joined_item_by_item(batch: int, devices: int) -> None:
    from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

    torch.manual_seed(0)
    model = _PackedGRU()
    x = torch.randn(batch, 6, 3, requires_grad=True)
    lengths = torch.randint(1, 7, (batch,))
    packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
    got = DataParallel(model, device_ids=["cpu"] * devices).run(packed)
    assert isinstance(got["out"], PackedSequence)
    out, out_lengths = pad_packed_sequence(got["out"], batch_first=True)
    grad = torch.autograd.grad(out.sum() + got["h"].sum(), x, retain_graph=True)[0]
    ref = model.run(packed)
    ref_out, ref_lengths = pad_packed_sequence(ref["out"], batch_first=True)
    ref_grad = torch.autograd.grad(ref_out.sum() + ref["h"].sum(), x)[0]
    assert torch.equal(out_lengths, ref_lengths)
    # 6 steps through 2 GRU layers, each step's gates summing 3 + 5 (then 5 + 5) inputs
    # and a bias each; the gradient runs the same path back.
    terms = 6 * mlp_terms(3, 5, 5, 5)
    assert_close_to_reference((out, got["h"]), (ref_out, ref["h"]), terms=terms)
    assert_close_to_reference(grad, ref_grad, terms=2 * terms)
    with torch.no_grad():
        alone = DataParallel(model, device_ids=["cpu"] * devices).packed_only(packed)
        assert_close_to_reference(
            pad_packed_sequence(alone, batch_first=True)[0],
            pad_packed_sequence(model.packed_only(packed), batch_first=True)[0], terms=terms,
        )


class _Policy(nn.Module):
    """A VAE encoder / RL policy head returning torch distributions."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)

    @parallel_method
    def dist(self, x: torch.Tensor, kind: str) -> Any:
        import torch.distributions as D

        h = self.lin(x)
        loc, scale = h[:, :3], h[:, 3:].exp()
        return {
            "normal": lambda: D.Normal(loc, scale),
            "independent": lambda: D.Independent(D.Normal(loc, scale), 1),
            "categorical": lambda: D.Categorical(logits=h),
            "bernoulli": lambda: D.Bernoulli(probs=h.sigmoid()),
            "mvn": lambda: D.MultivariateNormal(loc, covariance_matrix=torch.diag_embed(scale)),
            "beta": lambda: D.Beta(loc.exp(), scale),
        }[kind]()

    @parallel_method
    def log_prob(self, dist: Any, value: torch.Tensor) -> torch.Tensor:
        return dist.log_prob(value) + 0 * self.lin.bias.sum()


@pytest.mark.parametrize("kind", ["normal", "independent", "categorical", "bernoulli", "mvn", "beta"])
@pytest.mark.parametrize("batch,devices", [pytest.param(7, 3, id="7-on-3"), pytest.param(8, 4, id="8-on-4")])
def test_torch_distributions_joined_and_split_through_their_parameters(kind: str, batch: int, devices: int) -> None:
    torch.manual_seed(0)
    model = _Policy()
    x = torch.randn(batch, 4)
    dp = DataParallel(model, device_ids=["cpu"] * devices)
    got, ref = dp.dist(x, kind), model.dist(x, kind)
    assert type(got) is type(ref) and got.batch_shape == ref.batch_shape
    value = ref.sample()
    # Linear(4, 6): 5 terms. The densities square (value - loc) / exp(h) and take lgamma
    # of exp(h): that multiplies h's error by up to about 2 |log_prob| |h|, here < 16.
    terms = 16 * mlp_terms(4)
    assert_close_to_reference(got.log_prob(value), ref.log_prob(value), terms=terms)
    assert_close_to_reference(got.entropy(), ref.entropy(), terms=terms)
    torch.manual_seed(1)
    drawn = got.sample()
    torch.manual_seed(1)
    assert_close_to_reference(drawn, ref.sample(), terms=terms)
    # Gradients reach the parameters through the joined distribution (a sum over the rows).
    grad = torch.autograd.grad(got.log_prob(value).sum(), model.lin.weight)[0]
    want = torch.autograd.grad(ref.log_prob(value).sum(), model.lin.weight)[0]
    assert_close_to_reference(grad, want, terms=terms + batch)
    # As an input: each replica gets its items' distribution.
    with torch.no_grad():
        assert_close_to_reference(dp.log_prob(ref, value), model.log_prob(ref, value), terms=terms)


def test_a_subclass_of_a_torch_distribution_without_a_rule_is_a_list_with_a_warning(recwarn: Any) -> None:
    import torch.distributions as D

    class Tanh(D.Normal):  # its own constructor: the Normal rule must not rebuild it
        def __init__(self, loc: torch.Tensor, scale: torch.Tensor, bound: float) -> None:
            super().__init__(loc, scale)
            self.bound = bound

    class M(nn.Module):
        @parallel_method
        def f(self, x: torch.Tensor) -> Any:
            return Tanh(x, x.exp(), 2.0)

    got = DataParallel(M(), device_ids=["cpu"] * 2).f(torch.randn(4, 3))
    assert isinstance(got, list) and len(got) == 2 and all(type(d) is Tanh for d in got)
    assert any("register_type" in str(w.message) and "Tanh" in str(w.message) for w in recwarn)
