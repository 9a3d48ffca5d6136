"""Taking the model home, without sockets: the layout conversions against naive references and against
``transformers`` itself, exports of checkpoints (Llama preset as ``LlamaForCausalLM``, GPT presets, ``hf:`` and
factory models) read back, ``atoll sample`` and ``atoll eval`` on them, and every bad input as one line, exit 2."""

import json
import math
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from atoll.models.data import Corpus, load_corpus, load_held_out
from atoll.models.export import (byte_tokenizer, hf_to_llama, llama_to_hf, rotary_to_halves, rotary_to_pairs)
from atoll.models.configs import MODELS
from atoll.models.generate import generate, next_token
from atoll.models.registry import build_model, model_digest
from atoll.node.home import export
from atoll.node.home.checkpoint import save_checkpoint
from atoll.node.config import NodeConfig, RunConfig
from atoll.node.device import resolve_device
from atoll.node.home.evaluate import Tokenizer, evaluate, held_out_batches, tokenizer_for
from atoll.node.island.learner import Learner
from atoll.node.rounds.replica import Replica

transformers = pytest.importorskip("transformers")

LOGITS_TOL = 1e-5  # fp32, one model against the other: the same products summed in another order


def atoll(*args):
    return subprocess.run([sys.executable, "-m", "atoll.node.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def in_process(*args):
    """``atoll ARGS`` in this process (no interpreter start: a second each), as a ``CompletedProcess``."""
    import contextlib
    import io

    from atoll.node.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def one_line_exit_2(out, pattern):
    import re

    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert re.search(pattern, lines[0]), lines[0]


# ---- the math ----------------------------------------------------------------------------------------------------
def test_rotary_permutation_moves_interleaved_pairs_to_halves_and_back():
    heads, d, cols = 3, 8, 5
    w = torch.randn(heads * d, cols)
    halves = rotary_to_halves(w, heads)
    for h in range(heads):  # the naive reference: row 2j of a head goes to j, row 2j+1 to d/2 + j
        for j in range(d // 2):
            assert torch.equal(halves[h * d + j], w[h * d + 2 * j])
            assert torch.equal(halves[h * d + d // 2 + j], w[h * d + 2 * j + 1])
    assert torch.equal(rotary_to_pairs(halves, heads), w)


@pytest.mark.parametrize("tie", [False, True])
def test_a_llama_preset_is_the_same_function_as_transformers_llama(tie):
    import dataclasses

    from atoll.models.configs import instantiate
    from atoll.models.export import hf_llama_config

    cfg = dataclasses.replace(MODELS["llama-nano"], tie_embeddings=tie)
    torch.manual_seed(0)
    ours = instantiate(cfg).eval()
    state = llama_to_hf(ours.state_dict(), cfg)
    back = hf_to_llama(state, cfg)
    assert set(back) == set(ours.state_dict()) and all(torch.equal(back[k], v) for k, v in ours.state_dict().items())
    values = {k: v for k, v in hf_llama_config(cfg, "float32").items() if k not in ("architectures", "model_type")}
    theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(**values)).eval()
    missing, unexpected = theirs.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if tie else set())
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    with torch.no_grad():
        assert (ours.logits(idx) - theirs(input_ids=idx).logits).abs().max() < LOGITS_TOL


@settings(max_examples=50, deadline=None)
@given(st.text(max_size=200))
def test_the_byte_tokenizer_is_the_utf8_bytes(text):
    tok = byte_tokenizer()
    ids = tok.encode(text).ids
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_next_token_against_a_naive_reference():
    gen = torch.Generator().manual_seed(0)
    logits = torch.tensor([0.1, 2.0, -1.0, 1.5, 0.0])
    assert next_token(logits, 0.0, 0, gen) == 1  # temperature 0: the arg-max
    assert {next_token(logits, 5.0, 1, gen) for _ in range(50)} == {1}  # top-1: the arg-max at any temperature
    draws = [next_token(logits, 1.0, 2, gen) for _ in range(4000)]
    assert set(draws) <= {1, 3}  # top-2: only the two largest
    p1 = math.exp(2.0) / (math.exp(2.0) + math.exp(1.5))  # the softmax over those two
    assert abs(draws.count(1) / len(draws) - p1) < 0.03
    draws = [next_token(logits, 0.5, 0, gen) for _ in range(4000)]
    ref = torch.softmax(logits / 0.5, 0)
    for i in range(5):
        assert abs(draws.count(i) / len(draws) - float(ref[i])) < 0.03


def test_generate_is_deterministic_for_a_seed_and_slides_its_window():
    torch.manual_seed(0)
    model, shape = build_model("nano", 0)
    seen = []

    def logits(idx):
        seen.append(idx.shape[1])
        return model.logits(idx)

    a = generate(logits, [10, 20], 80, shape.seq_len, 1.0, 0, seed=3)
    b = generate(model.logits, [10, 20], 80, shape.seq_len, 1.0, 0, seed=3)
    c = generate(model.logits, [10, 20], 80, shape.seq_len, 1.0, 0, seed=4)
    assert a == b and a != c and len(a) == 80
    assert max(seen) == shape.seq_len  # 82 tokens of context: cut to the model's window


# ---- checkpoints and exports ----------------------------------------------------------------------------------------
def make_checkpoint(directory, model="llama-nano", **run_fields):
    """A daemon's checkpoint as ``persist.capture`` writes it, with Θ and θ moved away from Θ₀ (and apart)."""
    run = RunConfig(model=model, **run_fields)
    module, _ = build_model(model, run.seed)
    run = RunConfig(model=model, model_digest=model_digest(module), tokenizer=run_fields.get("tokenizer", "bytes"),
                    **{k: v for k, v in run_fields.items() if k != "tokenizer"})
    params, fragments = export.fragments_of(module, run)
    gen = torch.Generator().manual_seed(1)
    thetas = [f.gather(params) + 0.05 * torch.randn(f.numel, generator=gen) for f in fragments]
    momenta = [0.01 * torch.randn(f.numel, generator=gen) for f in fragments]
    replica = Replica(thetas, momenta, [3 + p for p in range(len(fragments))], [100.0 * (p + 1) for p in
                                                                              range(len(fragments))])
    tensors = {f"model.{i}": p.detach() + 0.02 * torch.randn(p.shape, generator=gen) for i, p in enumerate(params)}
    for p in range(len(fragments)):
        tensors[f"replica.{p}.params"], tensors[f"replica.{p}.momentum"] = thetas[p], momenta[p]
    ids = replica.identities()
    meta = {"run_id": "atoll", "peer_id": "QmTest", "run": run.published(), "version": sum(v for v, _, _ in ids),
            "versions": [v for v, _, _ in ids], "weights": [w for _, w, _ in ids], "digests": [d for _, _, d in ids],
            "step": 42, "tokens": 0, "position": 0}
    save_checkpoint(directory, tensors, meta)
    return run, fragments, thetas, tensors


def theta_of(model, run):
    params, fragments = export.fragments_of(model, run)
    return [f.gather(params) for f in fragments]


def test_a_llama_export_loads_offline_in_transformers_with_the_same_logits(tmp_path, monkeypatch):
    run, _, thetas, _ = make_checkpoint(tmp_path / "ckpt")
    out = in_process("export", tmp_path / "ckpt", "--out", tmp_path / "hf")
    assert out.returncode == 0, out.stderr
    assert "f0 v3" in out.stdout and "f1 v4" in out.stdout and "tokenizer bytes" in out.stdout, out.stdout
    g = export.load(tmp_path / "ckpt")
    assert all(torch.equal(a, b) for a, b in zip(theta_of(g.model, run), thetas))  # Θ, not θ
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lm = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert type(lm).__name__ == "LlamaForCausalLM"
    text = "def f(x):\n    return x * 2  # é ✓"
    ids = tok(text, return_tensors="pt").input_ids
    assert ids[0].tolist() == list(text.encode()) and tok.decode(ids[0]) == text
    with torch.no_grad():
        assert (lm(input_ids=ids).logits - g.model.logits(ids)).abs().max() < LOGITS_TOL
    meta = json.loads((tmp_path / "hf" / "atoll.json").read_text())
    assert [f["version"] for f in meta["fragments"]] == [3, 4, 5, 6][:len(thetas)]
    assert meta["model_digest"] == run.model_digest and meta["kind"] == "hf-llama"
    back = export.load(tmp_path / "hf")  # atoll reads its export back into its own Llama
    assert all(torch.equal(a, b) for a, b in zip(theta_of(back.model, run), thetas))


def test_a_gpt_export_round_trips_into_the_preset_and_bf16_rounds_it(tmp_path):
    run, _, thetas, tensors = make_checkpoint(tmp_path / "ckpt", model="nano")
    for dtype in ("fp32", "bf16"):
        out = in_process("export", tmp_path / "ckpt", "--out", tmp_path / dtype, "--dtype", dtype)
        assert out.returncode == 0, out.stderr
    fp32, bf16 = export.load(tmp_path / "fp32"), export.load(tmp_path / "bf16")
    assert all(torch.equal(a, b) for a, b in zip(theta_of(fp32.model, run), thetas))
    assert all(torch.equal(a, b.bfloat16().float()) for a, b in zip(theta_of(bf16.model, run), thetas))
    from safetensors import safe_open

    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
        assert set(f.keys()) == set(fp32.model.state_dict())  # the module's own names
    local = export.load(tmp_path / "ckpt", local=True)  # --local: the daemon's θ
    assert all(torch.equal(p, tensors[f"model.{i}"]) for i, p in enumerate(local.model.parameters()))


def test_hf_and_factory_models_export_through_their_own_layouts(tmp_path, monkeypatch):
    (tmp_path / "hfcfg").mkdir()
    (tmp_path / "hfcfg" / "config.json").write_text(json.dumps(dict(
        model_type="llama", vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)))
    run, _, thetas, _ = make_checkpoint(tmp_path / "ckpt-hf", model=f"hf:{tmp_path / 'hfcfg'}")
    assert atoll("export", tmp_path / "ckpt-hf", "--out", tmp_path / "out-hf").returncode == 0
    g = export.load(tmp_path / "out-hf")
    assert all(torch.equal(a, b) for a, b in zip(theta_of(g.model, run), thetas))
    lm = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out-hf", local_files_only=True)
    assert sum(p.numel() for p in lm.parameters()) == sum(t.numel() for t in thetas)

    (tmp_path / "mine.py").write_text(textwrap.dedent('''
        import torch.nn as nn

        class Bare(nn.Module):
            def __init__(self):
                super().__init__()
                self.vocab_size, self.seq_len = 256, 16
                self.emb = nn.Embedding(256, 8)
                self.out = nn.Linear(8, 256)
                self.out.weight = self.emb.weight  # tied: one tensor under two names

            def forward(self, idx, targets):
                return nn.functional.cross_entropy(self.out(self.emb(idx)).flatten(0, 1), targets.flatten())

        def bare():
            return Bare()
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    run, _, thetas, _ = make_checkpoint(tmp_path / "ckpt-own", model="mine:bare", fragments=2)
    out = atoll("export", tmp_path / "ckpt-own", "--out", tmp_path / "out-own")
    assert out.returncode == 0, out.stderr
    g = export.load(tmp_path / "out-own")
    assert all(torch.equal(a, b) for a, b in zip(theta_of(g.model, run), thetas))
    assert g.model.out.weight is g.model.emb.weight
    one_line_exit_2(atoll("sample", tmp_path / "out-own"), "has no logits")


def test_sample_is_deterministic_for_a_seed(tmp_path):
    make_checkpoint(tmp_path / "ckpt")
    assert in_process("export", tmp_path / "ckpt", "--out", tmp_path / "hf").returncode == 0
    runs = [in_process("sample", path, "--prompt", "def ", "--max-tokens", "40", "--seed", seed)
            for path, seed in ((tmp_path / "ckpt", 1), (tmp_path / "hf", 1), (tmp_path / "ckpt", 2))]
    assert all(r.returncode == 0 for r in runs), [r.stderr for r in runs]
    assert runs[0].stdout == runs[1].stdout != runs[2].stdout  # the checkpoint's Θ and its export write alike
    assert runs[0].stdout.startswith("def ")
    greedy = [in_process("sample", tmp_path / "hf", "--temperature", "0", "--max-tokens", "20", "--seed", s).stdout
              for s in (1, 2)]
    assert greedy[0] == greedy[1]


def test_eval_agrees_with_the_daemons_own_held_out_figure(tmp_path):
    """The daemon's figure: its ``Learner`` built as ``Daemon._prepare`` builds it (the corpus, the held-out
    batches of ``eval_batches`` × ``batch_size``), θ loaded from the checkpoint as a restart loads it."""
    run, _, _, tensors = make_checkpoint(tmp_path / "ckpt")
    node = NodeConfig()
    tokens, _ = load_corpus("builtin")
    corpus = Corpus(tokens, MODELS[run.model].seq_len, run.num_shards, held_out=load_held_out("builtin"))
    learner = Learner(run, resolve_device("cpu"), corpus, 0, node.batch_size,
                      held_out=corpus.held_out(node.eval_batches, node.batch_size))
    learner.load_state_tensors(tensors)
    daemons = learner.held_out_loss()
    out = in_process("eval", tmp_path / "ckpt", "--local", "--json")
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout)
    assert abs(figures["loss"] - daemons) < 1e-5, (figures, daemons)
    assert figures["perplexity"] == pytest.approx(math.exp(figures["loss"]))
    assert figures["tokens"] == figures["bytes"] == node.eval_batches * node.batch_size * MODELS[run.model].seq_len
    glob = json.loads(in_process("eval", tmp_path / "ckpt", "--json").stdout)
    assert glob["loss"] != figures["loss"] and glob["versions"] == [3, 4, 5, 6]


def test_a_prepared_datasets_tokenizer_goes_with_the_export(tmp_path):
    docs = tmp_path / "docs.txt"
    docs.write_text("".join(f"document {i}: the quick brown fox jumps over the lazy dog {i * i}\n"
                            for i in range(3000)))
    prep = atoll("data", "prepare", docs, "--out", tmp_path / "ds", "--vocab-size", "300", "--held-out", "0.05")
    assert prep.returncode == 0, prep.stderr
    from atoll.models.data import tokenizer_of

    sha = tokenizer_of(str(tmp_path / "ds"))
    import dataclasses

    cfg = dataclasses.replace(MODELS["llama-nano"], vocab_size=300)
    from atoll.models import configs

    configs.MODELS["llama-test-300"] = cfg  # in this process only: nothing below runs the CLI
    try:
        run, _, _, _ = make_checkpoint(tmp_path / "ckpt", model="llama-test-300", tokenizer=sha,
                                        data=str(tmp_path / "ds"))
        g = export.load(tmp_path / "ckpt")
        assert export.write(g, tmp_path / "none") == "none"  # no --data: no tokenizer, said in a warning
        assert export.write(g, tmp_path / "hf", data=str(tmp_path / "ds")) == sha
        assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (tmp_path / "ds" / "tokenizer.json").read_bytes()
        tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
        text = "document 7: the quick brown fox"
        assert tok.decode(tok(text).input_ids) == text
        with pytest.raises(export.ExportError, match="not a prepared dataset"):
            export.write(g, tmp_path / "bytes", data=str(docs))
        ours = tokenizer_for(export.load(tmp_path / "hf"), None)
        batches = held_out_batches(str(tmp_path / "ds"), cfg.seq_len, cfg.vocab_size, 2, 4, sha)
        result = evaluate(export.load(tmp_path / "hf"), ours, batches)
        assert result.bytes > result.tokens  # BPE tokens stand for several bytes each
        assert result.loss_per_byte == pytest.approx(result.loss * result.tokens / result.bytes, rel=1e-6)
        with pytest.raises(export.ExportError, match="tokenized"):
            held_out_batches("builtin", cfg.seq_len, cfg.vocab_size, 2, 4, sha)
    finally:
        del configs.MODELS["llama-test-300"]


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    """Two through the real command (a new interpreter: nothing but one line on its stderr), the rest in process."""
    one_line_exit_2(atoll("export", tmp_path, "--out", tmp_path / "x"), "is not a checkpoint directory")
    one_line_exit_2(in_process("export", "--out", tmp_path / "x"), "name a CHECKPOINT_DIR")
    one_line_exit_2(in_process("sample", tmp_path / "nowhere"), r"neither a checkpoint directory \(ckpt-\*.json\) nor an export")
    one_line_exit_2(in_process("eval", tmp_path), r"neither a checkpoint directory \(ckpt-\*.json\) nor an export")
    run, _, _, _ = make_checkpoint(tmp_path / "ckpt")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "precious.txt").write_text("keep")
    one_line_exit_2(in_process("export", tmp_path / "ckpt", "--out", tmp_path / "full"), "not an export directory")
    one_line_exit_2(in_process("export", tmp_path / "ckpt", "--out", tmp_path / "x", "--model", "nano"),
                    r"digest .* other than the run's")
    assert in_process("export", tmp_path / "ckpt", "--out", tmp_path / "hf").returncode == 0
    meta = json.loads((tmp_path / "hf" / "atoll.json").read_text())
    (tmp_path / "hf" / "atoll.json").write_text(json.dumps({**meta, "model_digest": "0" * 16}))
    one_line_exit_2(atoll("sample", tmp_path / "hf"), "digest .* is not the one it records")
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"not safetensors")
    one_line_exit_2(in_process("eval", tmp_path / "hf"), "is not a readable atoll export")
    one_line_exit_2(in_process("eval", tmp_path / "ckpt", "--data", tmp_path / "nowhere"), "does not exist")
    one_line_exit_2(in_process("sample", tmp_path / "ckpt", "--temperature", "-1"), "temperature")
    # A checkpoint whose replica is not what its metadata records: the digests do not match.
    ckpt = sorted((tmp_path / "ckpt").glob("ckpt-*.json"))[-1]
    meta = json.loads(ckpt.read_text())
    meta["digests"][0] = "f" * 16
    ckpt.write_text(json.dumps(meta))
    one_line_exit_2(in_process("export", tmp_path / "ckpt", "--out", tmp_path / "y"), "does not match its recorded")


def test_tokenizer_of_byte_level_runs_needs_no_data():
    tok = Tokenizer("bytes")
    assert tok.encode("é") == [0xC3, 0xA9] and tok.decode([0xC3, 0xA9]) == "é" and tok.byte_count([1, 2]) == 2
