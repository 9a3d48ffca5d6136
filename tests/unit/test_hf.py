"""Hugging Face ``transformers`` models (``models/hf.py``, ``--model hf:PATH``): a tiny ``LlamaForCausalLM`` built
from a dict and from a local config.json, its loss against a naive reference from the HF logits, the same Θ₀ from
the same seed, digests, tied embeddings, local weights as Θ₀, and one-line errors. Nothing is downloaded."""

import json
import sys

import pytest
import torch

pytest.importorskip("transformers")

from safetensors.torch import save_model

from atoll.models import hf
from atoll.models.fragments import make_fragments
from atoll.models.registry import ModelError, build_model, check_name, embedding_of, model_digest

TINY = dict(model_type="llama", vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)


def write_config(folder, **changes):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(dict(TINY, **changes)))
    return folder / "config.json"


def values(model):
    return [p.detach().clone() for p in model.parameters()]


def same(a, b):
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def naive_loss(logits, targets):
    """Mean over positions of -log softmax(logits)[target], position by position."""
    total, n = 0.0, 0
    for row, want in zip(logits.double(), targets):
        for position, token in enumerate(want.tolist()):
            z = row[position]
            total += float(torch.logsumexp(z, 0) - z[token])
            n += 1
    return total / n


@pytest.mark.parametrize("tie", [False, True])
def test_the_loss_is_the_cross_entropy_of_the_hf_logits_at_the_same_positions(tie):
    torch.manual_seed(0)
    model = hf.from_config(dict(TINY, tie_word_embeddings=tie))
    batch = torch.randint(0, 256, (2, 33))
    idx, targets = batch[:, :-1], batch[:, 1:]  # what the daemon gives it: targets already shifted
    with torch.no_grad():
        got = model(idx, targets)
        logits = model.lm(input_ids=idx).logits
        assert got.dim() == 0 and got.dtype == torch.float32
        assert abs(float(got) - naive_loss(logits, targets)) < 1e-5
        # Not shifted again: HF's own loss shifts its labels, so on the unshifted batch it is the same number ...
        assert abs(float(got) - float(model.lm(input_ids=batch, labels=batch).loss)) < 1e-5
        # ... and handing it atoll's (shifted) targets as labels would be another one.
        assert abs(float(got) - float(model.lm(input_ids=idx, labels=targets).loss)) > 1e-3
    loss = model(idx, targets)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_a_config_dict_a_config_json_and_its_directory_build_the_same_model(tmp_path):
    file = write_config(tmp_path / "tiny")
    torch.manual_seed(7)
    from_dict = hf.from_config(TINY)
    for name in (f"hf:{file}", f"hf:{file.parent}"):
        model, shape = build_model(name, seed=7)
        assert isinstance(model, hf.HFCausalLM) and type(model.lm).__name__ == "LlamaForCausalLM"
        assert (shape.vocab_size, shape.seq_len) == (256, 32)  # seq_len: the config's max_position_embeddings
        assert same(values(model), values(from_dict))
        assert [n for n, _ in model.named_parameters()] == [n for n, _ in from_dict.named_parameters()]
        assert model_digest(model) == model_digest(from_dict)
    assert hf.from_config(TINY, seq_len=16).seq_len == 16
    with pytest.raises(ModelError, match="exceeds the config's 32 positions"):
        hf.from_config(TINY, seq_len=64)


def test_the_same_seed_gives_the_same_initial_model_bit_for_bit(tmp_path):
    name = f"hf:{write_config(tmp_path)}"
    a, b, c = build_model(name, 3)[0], build_model(name, 3)[0], build_model(name, 4)[0]
    assert same(values(a), values(b))
    assert not same(values(a), values(c))
    assert model_digest(a) == model_digest(c)  # the digest names parameters, not values
    assert {p.dtype for p in a.parameters()} == {torch.float32}


def test_weights_stay_fp32_whatever_the_config_says(tmp_path):
    model, _ = build_model(f"hf:{write_config(tmp_path, dtype='bfloat16')}", 0)
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_the_digest_differs_for_different_configs():
    base = model_digest(hf.from_config(TINY))
    others = [dict(TINY, hidden_size=48), dict(TINY, num_hidden_layers=1), dict(TINY, num_key_value_heads=2),
              dict(TINY, vocab_size=300), dict(TINY, tie_word_embeddings=True)]
    digests = {model_digest(hf.from_config(c)) for c in others}
    assert base not in digests and len(digests) == len(others)
    assert base != model_digest(build_model("llama-nano", 0)[0])
    assert next(iter(hf.from_config(TINY).state_dict())) == "lm.model.embed_tokens.weight"  # stable names


@pytest.mark.parametrize("tie", [False, True])
def test_the_embedding_is_found_by_identity_and_a_tied_head_is_seen_once(tie):
    model = hf.from_config(dict(TINY, tie_word_embeddings=tie))
    emb = embedding_of(model)
    assert emb is model.lm.model.embed_tokens.weight
    assert (model.lm.lm_head.weight is emb) == tie
    params = list(model.parameters())
    assert len(params) == len({id(p) for p in params})
    assert sum(p is emb for p in params) == 1
    assert len(params) == len(list(hf.from_config(dict(TINY, tie_word_embeddings=False)).parameters())) - tie
    fragments = make_fragments(params, 2, 10, embedding=emb)
    assert sum(f.has_embedding for f in fragments) == 1


@pytest.mark.parametrize("tie", [False, True])
def test_local_weights_are_the_initial_model(tmp_path, tie):
    torch.manual_seed(0)
    source = hf.from_config(dict(TINY, tie_word_embeddings=tie))
    with torch.no_grad():
        for p in source.parameters():
            p.add_(0.5)  # not any seed's initialisation
    want = values(source)
    saved = tmp_path / "saved"
    source.lm.save_pretrained(saved)  # config.json and model.safetensors (a tied head is not written)
    model, shape = build_model(f"hf:{saved}", seed=1)
    assert same(values(model), want) and shape.seq_len == 32
    # Sharded: model.safetensors.index.json and its files.
    source.lm.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert len(list((tmp_path / "sharded").glob("model-*-of-*.safetensors"))) > 1
    assert same(values(build_model(f"hf:{tmp_path / 'sharded'}", seed=1)[0]), want)
    # A single .safetensors file: HF's names, or the adapter's own state (names under "lm.").
    save_model(source, str(tmp_path / "adapter.safetensors"))
    for file in (saved / "model.safetensors", tmp_path / "adapter.safetensors"):
        torch.manual_seed(1)
        assert same(values(hf.from_config(dict(TINY, tie_word_embeddings=tie), weights=file)), want)
    # A config file next to the weights is only a config: the seed's initial model.
    assert not same(values(build_model(f"hf:{saved / 'config.json'}", seed=1)[0]), want)
    # bf16 weights load into the fp32 parameters.
    source.lm.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    model, _ = build_model(f"hf:{tmp_path / 'bf16'}", seed=1)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert same(values(model), [w.to(torch.bfloat16).float() for w in want])


def test_on_the_meta_device_weights_are_checked_not_read(tmp_path):
    hf.from_config(TINY).lm.save_pretrained(tmp_path / "saved")
    with torch.device("meta"):
        model, _ = build_model(f"hf:{tmp_path / 'saved'}", 0)
    assert all(p.is_meta for p in model.parameters())
    assert model_digest(model) == model_digest(build_model(f"hf:{tmp_path / 'saved'}", 0)[0])
    with torch.device("meta"), pytest.raises(ModelError, match="do not fit"):
        hf.from_config(dict(TINY, hidden_size=48), weights=tmp_path / "saved")


def one_line_error(call, match):
    with pytest.raises(ModelError, match=match) as e:
        call()
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


def test_errors_are_one_line(tmp_path, monkeypatch):
    missing = tmp_path / "nowhere" / "config.json"
    message = one_line_error(lambda: build_model(f"hf:{missing}", 0), "no such file or directory")
    assert message.startswith(f"'hf:{missing}': ")
    (tmp_path / "empty").mkdir()
    one_line_error(lambda: build_model(f"hf:{tmp_path / 'empty'}", 0), "holds no config.json")
    (tmp_path / "bad.json").write_text('{"model_type": "llama",\n "vocab_size": ')
    one_line_error(lambda: build_model(f"hf:{tmp_path / 'bad.json'}", 0), "is not JSON")
    (tmp_path / "plain.json").write_text('{"vocab_size": 256}')
    one_line_error(lambda: build_model(f"hf:{tmp_path / 'plain.json'}", 0), "no 'model_type'")
    (tmp_path / "odd.json").write_text('{"model_type": "no-such-architecture"}')
    one_line_error(lambda: build_model(f"hf:{tmp_path / 'odd.json'}", 0), "knows no model_type")
    one_line_error(lambda: hf.from_config(dict(TINY, num_attention_heads=3)), "cannot build|config")
    one_line_error(lambda: check_name("hf:"), "needs the PATH")
    check_name(f"hf:{missing}")  # well formed: read only when built

    # Weights that do not fit: another shape, another architecture's names, not a safetensors file, none at all.
    hf.from_config(TINY).lm.save_pretrained(tmp_path / "saved")
    one_line_error(lambda: hf.from_config(dict(TINY, hidden_size=48), weights=tmp_path / "saved"),
                   r"do not fit the LlamaForCausalLM: .*wrong shape \(model.embed_tokens.weight \(256, 32\) != "
                   r"\(256, 48\)")
    one_line_error(lambda: hf.from_config(dict(TINY, num_hidden_layers=1), weights=tmp_path / "saved"),
                   r"9 unexpected \(model.layers.1.")
    one_line_error(lambda: hf.from_config(dict(TINY, num_hidden_layers=3), weights=tmp_path / "saved"),
                   r"9 missing \(model.layers.2.")
    (tmp_path / "junk.safetensors").write_bytes(b"not a tensor file")
    one_line_error(lambda: hf.from_config(TINY, weights=tmp_path / "junk.safetensors"), "not a safetensors file")
    one_line_error(lambda: hf.from_config(TINY, weights=tmp_path / "empty"), "holds no model.safetensors")
    one_line_error(lambda: hf.from_config(TINY, weights=tmp_path / "none.safetensors"), "no weights")

    monkeypatch.setitem(sys.modules, "transformers", None)  # as if it were not installed
    message = one_line_error(lambda: build_model(f"hf:{tmp_path / 'nowhere'}", 0), "transformers")
    assert "pip install 'atoll[hf]'" in message


def test_under_autocast_the_weights_stay_fp32_and_the_loss_is_fp32():
    torch.manual_seed(0)
    model = hf.from_config(TINY)
    batch = torch.randint(0, 256, (2, 33))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model.logits(batch[:, :-1]).dtype == torch.bfloat16
        loss = model(batch[:, :-1], batch[:, 1:])
    assert loss.dtype == torch.float32 and abs(loss.detach().item() - 5.55) < 0.1  # about ln 256 at Θ₀
    loss.backward()
    assert {p.dtype for p in model.parameters()} == {p.grad.dtype for p in model.parameters()} == {torch.float32}
