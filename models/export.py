"""The model in the layouts other tools read: a Llama preset as a Hugging Face ``LlamaForCausalLM``, and a
byte-level tokenizer as a ``tokenizers`` JSON. Pure functions on tensors and dicts; files are ``node/home/export.py``'s.

atoll's ``Llama`` and Hugging Face's differ in three ways, all undone here exactly (no arithmetic on the values):

- names (``blocks.0.attn.q.weight`` is ``model.layers.0.self_attn.q_proj.weight``);
- keys and values are one matrix in atoll (``attn.kv``: the key rows, then the value rows), two in HF;
- rotary pairs: atoll rotates the interleaved pairs (0, 1), (2, 3), … of each head, HF the split halves (0, d/2),
  (1, d/2 + 1), … with the same frequency per pair. Permuting the rows of each head of ``q`` and ``k`` from
  interleaved to split order (``rotary_to_halves``) gives the same attention scores: a dot product does not change
  when both vectors' coordinates are permuted alike.

The byte-level tokenizer maps each byte to the token id of its value, as atoll's byte-level data does
(``models/data.py``), through GPT-2's byte-to-character table so that ``tokenizers``' ``ByteLevel`` decoder turns
ids back into the bytes.
"""

from __future__ import annotations

import torch

from .llama import LlamaConfig

HF_NORM_EPS = 1e-6  # atoll's RMSNorm eps (models/gpt.py)


def hf_llama_config(cfg: LlamaConfig, dtype: str) -> dict:
    """The ``config.json`` of ``cfg`` as a ``LlamaForCausalLM`` (``dtype``: "float32" or "bfloat16"). Both ways
    of naming the rotary base are written: transformers 5 reads ``rope_parameters``, 4.x ``rope_theta``. No
    bos/eos ids: atoll's data has none."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.hidden,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": HF_NORM_EPS, "tie_word_embeddings": cfg.tie_embeddings,
        "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "initializer_range": 0.02,
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, "use_cache": True,
        "torch_dtype": dtype, "dtype": dtype,
    }


def rotary_to_halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The rows of a q or k projection (``heads`` × head_dim rows) reordered within each head from interleaved
    rotary pairs to split halves: row 2j goes to j, row 2j+1 to head_dim/2 + j."""
    d = w.shape[0] // heads
    return w.reshape(heads, d // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def rotary_to_pairs(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of ``rotary_to_halves``."""
    d = w.shape[0] // heads
    return w.reshape(heads, 2, d // 2, -1).transpose(1, 2).reshape(w.shape)


_LAYER = (  # (atoll's name in a block, HF's in a layer), for the tensors that only change names
    ("attn_norm.weight", "input_layernorm.weight"), ("attn.o.weight", "self_attn.o_proj.weight"),
    ("mlp_norm.weight", "post_attention_layernorm.weight"), ("mlp.gate.weight", "mlp.gate_proj.weight"),
    ("mlp.up.weight", "mlp.up_proj.weight"), ("mlp.down.weight", "mlp.down_proj.weight"),
)


def llama_to_hf(state: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """atoll's ``Llama`` state dict as ``LlamaForCausalLM``'s (a tied head is left out: HF ties it itself)."""
    kv_rows = cfg.n_kv_heads * cfg.head_dim
    out = {"model.embed_tokens.weight": state["embed.weight"], "model.norm.weight": state["norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = state["head.weight"]
    for i in range(cfg.n_layers):
        a, h = f"blocks.{i}.", f"model.layers.{i}."
        for ours, theirs in _LAYER:
            out[h + theirs] = state[a + ours]
        kv = state[a + "attn.kv.weight"]
        out[h + "self_attn.q_proj.weight"] = rotary_to_halves(state[a + "attn.q.weight"], cfg.n_heads)
        out[h + "self_attn.k_proj.weight"] = rotary_to_halves(kv[:kv_rows], cfg.n_kv_heads)
        out[h + "self_attn.v_proj.weight"] = kv[kv_rows:]
    return {k: v.contiguous() for k, v in out.items()}


def hf_to_llama(state: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """The inverse of ``llama_to_hf``. ``KeyError`` names a tensor the state lacks."""
    out = {"embed.weight": state["model.embed_tokens.weight"], "norm.weight": state["model.norm.weight"]}
    if not cfg.tie_embeddings:
        out["head.weight"] = state["lm_head.weight"]
    for i in range(cfg.n_layers):
        a, h = f"blocks.{i}.", f"model.layers.{i}."
        for ours, theirs in _LAYER:
            out[a + ours] = state[h + theirs]
        out[a + "attn.q.weight"] = rotary_to_pairs(state[h + "self_attn.q_proj.weight"], cfg.n_heads)
        k = rotary_to_pairs(state[h + "self_attn.k_proj.weight"], cfg.n_kv_heads)
        out[a + "attn.kv.weight"] = torch.cat([k, state[h + "self_attn.v_proj.weight"]])
    return {k: v.contiguous() for k, v in out.items()}


def byte_to_char() -> dict[int, str]:
    """GPT-2's table from a byte to a printable character (what ``tokenizers``' ``ByteLevel`` uses): printable
    Latin-1 bytes are themselves, the others are shifted past 255 in order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_tokenizer():
    """A ``tokenizers.Tokenizer`` whose ids are the bytes of the text (id = byte value, 256 ids), decoding back to
    the same text: atoll's byte-level data (the built-in corpus, text files) as a tokenizer other tools load."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: b for b, c in byte_to_char().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok
