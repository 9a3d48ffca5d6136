"""Models other than the built-in GPT: the Llama-style preset against a naive reference, user factories and the
clear errors they give, embeddings found by identity, and the digest daemons of one run must agree on."""

import math
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from atoll.models.configs import MODELS, instantiate
from atoll.models.fragments import make_fragments
from atoll.models.llama import Llama, LlamaConfig
from atoll.models.registry import ModelError, build_model, check_name, embedding_of, model_digest, shape_of


def naive_llama_loss(model: Llama, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The same computation written out head by head, position by position (no SDPA, no repeat_interleave)."""
    cfg = model.cfg
    b, t = idx.shape
    hd = cfg.head_dim

    def rms(x, w):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w

    def rope(x):  # x: (t, hd), pairs (2i, 2i+1) rotated by position * theta^(-2i/hd)
        out = torch.empty_like(x)
        for pos in range(x.shape[0]):
            for i in range(hd // 2):
                angle = pos * cfg.rope_theta ** (-2 * i / hd)
                c, s = math.cos(angle), math.sin(angle)
                a, bb = x[pos, 2 * i], x[pos, 2 * i + 1]
                out[pos, 2 * i], out[pos, 2 * i + 1] = a * c - bb * s, a * s + bb * c
        return out

    x = model.embed.weight[idx]
    for block in model.blocks:
        h = rms(x, block.attn_norm.weight)
        q = h @ block.attn.q.weight.T
        kv = h @ block.attn.kv.weight.T
        k, v = kv[..., : cfg.n_kv_heads * hd], kv[..., cfg.n_kv_heads * hd:]
        heads = []
        for n in range(b):
            per = []
            for head in range(cfg.n_heads):
                g = head // (cfg.n_heads // cfg.n_kv_heads)  # the key/value head serving this query head
                qh = rope(q[n, :, head * hd:(head + 1) * hd])
                kh = rope(k[n, :, g * hd:(g + 1) * hd])
                vh = v[n, :, g * hd:(g + 1) * hd]
                scores = qh @ kh.T / math.sqrt(hd)
                scores = scores.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf"))
                per.append(torch.softmax(scores, -1) @ vh)
            heads.append(torch.cat(per, -1))
        x = x + torch.stack(heads) @ block.attn.o.weight.T
        h = rms(x, block.mlp_norm.weight)
        x = x + (F.silu(h @ block.mlp.gate.weight.T) * (h @ block.mlp.up.weight.T)) @ block.mlp.down.weight.T
    x = rms(x, model.norm.weight)
    logits = x @ (model.embed.weight if model.head is None else model.head.weight).T
    return F.cross_entropy(logits.reshape(-1, cfg.vocab_size), targets.reshape(-1))


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("kv", [1, 2, 4])
def test_llama_matches_a_naive_reference(tie, kv):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=2, n_heads=4, n_kv_heads=kv, tie_embeddings=tie)
    model = Llama(cfg).double()
    idx, targets = torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))
    with torch.no_grad():  # the model's loss is taken in fp32 (as on a device with bf16 matmuls): compare at that
        got, want = model(idx, targets), naive_llama_loss(model, idx, targets)
        assert got.dtype == torch.float32 and abs(float(got) - float(want)) < 1e-5 * float(want)
        assert not abs(float(Llama.forward(model, idx, (targets + 1) % 32)) - float(want)) < 1e-3  # it can fail
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params


def test_llama_config_refuses_bad_shapes():
    with pytest.raises(ValueError, match="n_kv_heads"):
        LlamaConfig(n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="positive"):
        LlamaConfig(n_layers=0)


def test_presets_build_the_same_initial_model_from_a_seed():
    for name in ("nano", "llama-nano"):
        a, shape = build_model(name, seed=3)
        b, _ = build_model(name, seed=3)
        c, _ = build_model(name, seed=4)
        assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
        assert not all(torch.equal(x, y) for x, y in zip(a.parameters(), c.parameters()))
        assert (shape.vocab_size, shape.seq_len) == (MODELS[name].vocab_size, MODELS[name].seq_len)
        assert model_digest(a) == model_digest(c)  # the digest names shapes, not values
    assert model_digest(build_model("nano", 0)[0]) != model_digest(build_model("llama-nano", 0)[0])


def test_the_gpt_preset_is_unchanged_by_the_registry():
    torch.manual_seed(0)
    old = instantiate(MODELS["nano"])
    new, _ = build_model("nano", 0)
    assert all(torch.equal(x, y) for x, y in zip(old.parameters(), new.parameters()))


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "usermodels.py").write_text(textwrap.dedent('''
        import torch, torch.nn as nn
        from atoll.models.llama import Llama, LlamaConfig

        def good():
            return Llama(LlamaConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=1, n_heads=4, n_kv_heads=1))

        class Bare(nn.Module):
            def __init__(self):
                super().__init__()
                self.vocab_size, self.seq_len = 64, 16
                self.emb = nn.Embedding(64, 8)
                self.out = nn.Linear(8, 64)
                self.out.weight = self.emb.weight  # tied by assignment: one tensor
            def forward(self, idx, targets):
                return nn.functional.cross_entropy(self.out(self.emb(idx)).flatten(0, 1), targets.flatten())

        def bare():
            return Bare()

        def no_shape():
            return nn.Linear(2, 2)

        def not_a_module():
            return 42

        def raises():
            raise RuntimeError("no GPU here")

        value = 3
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "usermodels"
    sys.modules.pop("usermodels", None)


def test_a_factory_builds_the_users_model(user_module):
    model, shape = build_model(f"{user_module}:good", seed=0)
    assert isinstance(model, Llama) and (shape.vocab_size, shape.seq_len) == (64, 16)
    bare, shape = build_model(f"{user_module}:bare", seed=0)
    assert (shape.vocab_size, shape.seq_len) == (64, 16)
    params = list(bare.parameters())
    assert len(params) == 2  # the tied weight once, and the bias
    emb = embedding_of(bare)
    assert emb is bare.emb.weight
    fragments = make_fragments(params, 2, 10, embedding=emb)
    assert sum(f.has_embedding for f in fragments) == 1


@pytest.mark.parametrize("attr, message", [
    ("missing", "no callable 'missing'"), ("value", "no callable 'value'"), ("no_shape", "vocab_size"),
    ("not_a_module", "returned a int"), ("raises", "RuntimeError: no GPU here"),
])
def test_bad_factories_are_one_line_errors(user_module, attr, message):
    with pytest.raises(ModelError, match=message) as e:
        build_model(f"{user_module}:{attr}", seed=0)
    assert "\n" not in str(e.value)


def test_bad_names_are_one_line_errors():
    with pytest.raises(ModelError, match="cannot import"):
        build_model("no_such_package_anywhere.models:factory", seed=0)
    for name in ("gpt-9000", "a:b:c", "pkg.mod:", ":factory", "pkg mod:f"):
        with pytest.raises(ModelError, match="unknown "):
            check_name(name)
    check_name("pkg.mod:factory")  # well formed: imported only when built


def test_shape_of_reads_the_module_or_its_config():
    class WithConfig(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = type("C", (), {"vocab_size": 10, "seq_len": 4})()
            self.w = nn.Parameter(torch.zeros(2))
    assert shape_of(WithConfig()).vocab_size == 10
    frozen = WithConfig()
    frozen.w.requires_grad_(False)
    with pytest.raises(ModelError, match="no trainable"):
        shape_of(frozen)


def test_the_digest_sees_names_shapes_and_dtypes():
    a, _ = build_model("llama-nano", 0)
    base = model_digest(a)
    b, _ = build_model("llama-nano", 0)
    b.norm.weight.data = b.norm.weight.data.double()
    assert model_digest(b) != base
    c, _ = build_model("llama-nano", 0)
    c.blocks[0].mlp.up = nn.Linear(64, 172, bias=False)
    assert model_digest(c) != base
