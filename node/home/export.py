"""Taking the model home: the run's global model Θ out of a checkpoint directory or a live run, into files other tools
read (``atoll export``), and back into a model for ``atoll sample`` and ``atoll eval`` (``node/home/evaluate.py``).

Θ is every fragment's replica (what the run's rounds merged), not a daemon's local θ: a checkpoint holds both
(``node/home/persist.py``), and ``local=True`` takes θ instead (the model a daemon's own held-out figure measures). A
live run is read as a joiner would: a DHT node with the member's credentials adopts the run's config, publishes a
``joining`` record (donors of a private run serve members only) and downloads the newest vouched replica of every
fragment (``CatchUp.join``), each checked against the claim it was chosen for; then it leaves.

An export is a directory:

- ``atoll.json``: the run, the model's name, shape and digest, the (version, weight, digest) of every fragment it
  took, the dtype and the tokenizer (``EXPORT_FORMAT``);
- a Llama preset: ``config.json`` and ``model.safetensors`` of a Hugging Face ``LlamaForCausalLM``
  (``models/export.py``); an ``hf:`` model: its own ``save_pretrained`` files; a GPT preset or a
  ``module:factory`` model: ``model.safetensors`` of the module's own state dict;
- ``tokenizer.json`` and ``tokenizer_config.json``: the prepared dataset's tokenizer, or a byte-level one for
  byte-level data (the built-in corpus, text files), so that ``transformers.AutoTokenizer`` loads either.

Everything a user gets wrong (a path that is neither a checkpoint directory nor an export, a digest that does not
match, a run that cannot be reached, a tokenizer of other data) is an ``ExportError`` with one line: exit 2.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from atoll.models.configs import MODELS, instantiate
from atoll.models.data import BYTES, tokenizer_of
from atoll.models.dataset import TOKENIZER, is_prepared
from atoll.models.export import byte_tokenizer, hf_llama_config, hf_to_llama, llama_to_hf
from atoll.models.fragments import make_fragments
from atoll.models.gpt import GPTConfig
from atoll.models.llama import LlamaConfig
from atoll.models.registry import ModelError, build_model, embedding_of, is_hf, model_digest

from ..config import NodeConfig, reconcile_run_config
from ..run_config import LOCAL_DATA, OWN_MODEL, ConfigError, RunConfig

logger = logging.getLogger("atoll")
EXPORT_FORMAT = "atoll-export/1"
EXPORT_META = "atoll.json"
WEIGHTS = "model.safetensors"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class ExportError(ValueError):
    """Input the user must fix (one line; the CLI exits 2)."""


class Kind:
    """How an export holds the model (``atoll.json``'s ``kind``)."""

    HF_LLAMA = "hf-llama"  # a Llama preset as LlamaForCausalLM
    HF = "hf"  # an hf: model, its own save_pretrained
    STATE_DICT = "state-dict"  # the module's own state dict (GPT presets, factories)


@dataclass
class Global:
    """A run's model loaded on the CPU in fp32: Θ (or one daemon's θ), with where it came from."""

    model: nn.Module
    run: RunConfig
    run_id: str
    identities: list[tuple[int, float, str]]  # (version, weight, digest) of each fragment taken; [] for θ
    source: str
    export_dir: Path | None = None  # set when loaded from an export

    def versions(self) -> str:
        return " ".join(f"v{v}" for v, _, _ in self.identities) if self.identities else "local θ"


# ---- the run's model ----------------------------------------------------------------------------------------------
def run_config(published: Any, model: str | None = None) -> RunConfig:
    """The run's config from a checkpoint's or an export's record; ``model`` names the model where the run's record
    does not (a run of an ``atoll.Island`` model). A run on files of its own publishes no data path: its ``data``
    stays ``LOCAL_DATA`` (only a tokenizer needs the data, and the caller names it)."""
    if not isinstance(published, dict):
        raise ExportError("the checkpoint holds no run config")
    own_data = published.get("data") == LOCAL_DATA
    if own_data:
        published = {**published, "data": "builtin"}
    local, explicit = RunConfig(), set()
    if published.get("model") == OWN_MODEL and model is not None:
        local, explicit = dataclasses.replace(local, model=model), {"model"}
    try:
        run = reconcile_run_config(local, explicit, published)
    except ConfigError as e:
        raise ExportError(str(e)) from None
    return dataclasses.replace(run, data=LOCAL_DATA) if own_data else run


def build(run: RunConfig, model: str | None = None) -> nn.Module:
    """The run's model (``model`` names it where the run's name does not: an ``atoll.Island`` model, or an ``hf:``
    path that is elsewhere on this machine), checked against the run's digest."""
    name = model or run.model
    if name == OWN_MODEL:
        raise ExportError("the run trains a model of its own (atoll.Island): name its factory with --model "
                          "package.module:factory")
    try:
        module, _ = build_model(name, run.seed)
    except ModelError as e:
        raise ExportError(f"model: {e}") from None
    digest = model_digest(module)
    if run.model_digest and digest != run.model_digest:
        raise ExportError(f"model: {name!r} has parameters (digest {digest}) other than the run's (digest "
                          f"{run.model_digest})")
    return module.eval()


def fragments_of(model: nn.Module, run: RunConfig) -> tuple[list[torch.Tensor], list]:
    """The model's trainable parameters and the run's fragments of them (as every daemon splits them)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return params, make_fragments(params, run.num_fragments, run.sync_every, embedding=embedding_of(model))


# ---- out of a checkpoint --------------------------------------------------------------------------------------------
def is_checkpoint_dir(path: Path) -> bool:
    return path.is_dir() and any(path.glob("ckpt-*.json"))


def from_checkpoint(directory: str | os.PathLike, model: str | None = None, local: bool = False) -> Global:
    """Θ (``local``: the daemon's own θ) of the newest intact checkpoint in ``directory``."""
    from ..rounds.replica import Replica
    from .checkpoint import load_checkpoint

    path = Path(directory)
    if not is_checkpoint_dir(path):
        raise ExportError(f"{str(path)!r} is not a checkpoint directory (no ckpt-*.json in it)")
    loaded = load_checkpoint(path)
    if loaded is None:
        raise ExportError(f"{str(path)!r} holds no intact checkpoint (every one failed its hash or holds NaN)")
    tensors, meta = loaded
    run = run_config(meta.get("run"), model)
    module = build(run, model)
    params, fragments = fragments_of(module, run)
    try:
        if local:
            with torch.no_grad():
                for i, p in enumerate(params):
                    p.copy_(tensors[f"model.{i}"].reshape(p.shape))
            identities = []
        else:
            thetas = [tensors[f"replica.{p}.params"] for p in range(len(fragments))]
            replica = Replica(thetas, [tensors[f"replica.{p}.momentum"] for p in range(len(fragments))],
                              meta["versions"], meta["weights"])
            identities = replica.identities()
            for fragment, theta in zip(fragments, thetas):
                fragment.scatter(theta, params)
    except (KeyError, IndexError, ValueError, RuntimeError) as e:
        raise ExportError(f"{str(path)!r}: the checkpoint does not fit model {run.model!r} ({type(e).__name__}: "
                          f"{e})") from None
    if identities and [d for _, _, d in identities] != list(meta["digests"]):
        raise ExportError(f"{str(path)!r}: the checkpoint's replica does not match its recorded digests")
    source = f"checkpoint {str(path)!r} (step {meta.get('step')})"
    return Global(module, run, str(meta.get("run_id", "")), identities, source)


# ---- out of a live run ----------------------------------------------------------------------------------------------
def from_live(cfg: NodeConfig, model: str | None = None, timeout: float | None = None) -> Global:
    """The newest vouched Θ of a live run, downloaded as a joiner downloads it (see the module's docstring);
    ``model`` names the run's model where its record does not, as for ``from_checkpoint``."""
    from ..faults import Faults
    from ..metrics import Counters
    from ..rounds.join import read_run_config, start_member_dht
    from ..rounds.replica import Replica
    from ..rounds.syncer import Syncer

    try:
        dht, token, revocation, validators = start_member_dht(cfg)
    except ConfigError as e:
        raise ExportError(str(e)) from None
    syncer = None
    try:
        try:
            published = read_run_config(dht, dataclasses.replace(cfg, new_run=False), token)
        except ConfigError as e:
            raise ExportError(str(e)) from None
        assert published is not None
        run = run_config(published.fields, model)
        cfg = dataclasses.replace(cfg, run=run)
        module = build(run, model)
        params, fragments = fragments_of(module, run)
        replica = Replica([f.gather(params) for f in fragments])
        syncer = Syncer(cfg, dht, validators[0].local_public_key, replica, fragments, Counters(), Faults(()),
                        private=token is not None, config_record=published.dict(),
                        run_public_key=token.run_public_key if token is not None else None, revocation=revocation)
        syncer.start()
        states = _download(syncer, len(fragments), timeout or max(60.0, 4 * run.round_timeout), cfg.heartbeat)
        if not states:
            raise ExportError(f"no live peer of run {cfg.run_id!r} holds its model (none is training, or none "
                              f"answered)")
        if len(states) < len(fragments):
            raise ExportError(f"run {cfg.run_id!r}: fragment {len(states)} of {len(fragments)} could not be "
                              f"downloaded from its holders (none vouched for, or none answered); try again")
        identities = replica.identities()
        for fragment, (theta, _) in zip(fragments, (replica.params_and_id(p) for p in range(len(fragments)))):
            fragment.scatter(theta, params)
        donors = sorted({d[-8:] for s in states for d in s.donors})
        return Global(module, run, cfg.run_id, identities, f"live run {cfg.run_id!r} (from {', '.join(donors)})")
    finally:
        if syncer is not None:
            syncer.shutdown()
        dht.shutdown()


def _download(syncer: Any, fragments: int, timeout: float, every: float) -> list:
    """Every fragment's newest vouched replica, as a joiner takes it, tried again every ``every`` seconds until
    ``timeout``: in a live run the members' records of a fragment differ for a moment after each round (one has
    merged, the other not yet), and a replica only some hold is not vouched for. A fragment taken already is not
    downloaded again (its holders' claim is the replica we hold) unless the run moved on."""
    deadline = time.monotonic() + timeout
    while True:
        states = syncer.download_initial_state(max(1.0, deadline - time.monotonic()))
        if len(states) == fragments or time.monotonic() + every > deadline:
            return states
        logger.info("%d of %d fragments taken; reading the run again", len(states), fragments)
        time.sleep(every)


# ---- into an export -------------------------------------------------------------------------------------------------
def preset_config(run: RunConfig) -> GPTConfig | LlamaConfig | None:
    return MODELS.get(run.model)


def write(g: Global, out: str | os.PathLike, dtype: str = "fp32", data: str | None = None) -> str:
    """Write ``g`` as an export into ``out`` (created; an existing export there is replaced, any other non-empty
    directory refused). Returns what ``tokenizer.json`` holds: "bytes", a prepared dataset's tokenizer sha256, or
    "none" where the run's tokenizer could not be found (pass ``data``)."""
    from safetensors.torch import save_file

    if dtype not in DTYPES:
        raise ExportError(f"--dtype: one of {', '.join(DTYPES)}, got {dtype!r}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / EXPORT_META).is_file())):
        raise ExportError(f"--out: {str(out)!r} exists and is not an export directory; name a new or empty one")
    out.mkdir(parents=True, exist_ok=True)
    cast = DTYPES[dtype]
    state = {k: v.detach().to("cpu", cast).contiguous() for k, v in g.model.state_dict().items()}
    preset = preset_config(g.run)
    if isinstance(preset, LlamaConfig):
        kind = Kind.HF_LLAMA
        save_file(llama_to_hf(state, preset), str(out / WEIGHTS), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(hf_llama_config(preset, _hf_dtype(dtype)), indent=1))
    elif is_hf(g.run.model):
        kind = Kind.HF
        lm = g.model.lm.to(cast)
        try:
            lm.save_pretrained(str(out))
        finally:
            g.model.float()
    else:
        kind = Kind.STATE_DICT
        save_file(_untied(state), str(out / WEIGHTS), metadata={"format": "pt"})
    tokenizer = _write_tokenizer(g, out, data)
    meta = {
        "format": EXPORT_FORMAT, "run_id": g.run_id, "model": g.run.model, "kind": kind,
        "preset": dataclasses.asdict(preset) if preset is not None else None,
        "preset_type": type(preset).__name__ if preset is not None else None,
        "model_digest": model_digest(g.model), "seed": g.run.seed, "dtype": dtype, "tokenizer": tokenizer,
        "seq_len": _seq_len(g.model), "source": g.source,
        "fragments": [{"version": v, "weight": w, "digest": d} for v, w, d in g.identities],
        "run": g.run.published(),
    }
    (out / EXPORT_META).write_text(json.dumps(meta, indent=1))
    return tokenizer


def _hf_dtype(dtype: str) -> str:
    return {"fp32": "float32", "bf16": "bfloat16"}[dtype]


def _untied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict with every tensor once (safetensors refuses shared storage; ``load_state_dict`` with
    ``strict=False`` fills a tied alias from the tensor it shares)."""
    seen: dict[int, str] = {}
    out = {}
    for k, v in state.items():
        ptr = v.data_ptr()
        if ptr in seen:
            continue
        seen[ptr] = k
        out[k] = v
    return out


def _seq_len(model: nn.Module) -> int:
    from atoll.models.registry import shape_of

    return shape_of(model).seq_len


def _write_tokenizer(g: Global, out: Path, data: str | None) -> str:
    """``tokenizer.json`` (and its config) for the run's data: "bytes", the dataset tokenizer's sha256, or "none"."""
    want = g.run.tokenizer
    source = data if data is not None else ("builtin" if g.run.data == "builtin" else None)
    if want in ("", BYTES) and (source is None or _tokenizer_kind(source) == BYTES):
        if want == "" and source is None:
            logger.warning("the run does not say how its data was tokenized; writing a byte-level tokenizer")
        byte_tokenizer().save(str(out / TOKENIZER))
        found = BYTES
    else:
        if source is None:
            logger.warning("no tokenizer written: the run's data is a prepared dataset (tokenizer %s); pass --data "
                           "with the run's dataset", want[:12])
            return "none"
        kind = _tokenizer_kind(source)
        if kind in (BYTES, "") or not is_prepared(Path(source)):
            raise ExportError(f"--data: {source!r} is not a prepared dataset; the run's data was tokenized by "
                              f"{want[:12]}")
        if want and kind != want:
            raise ExportError(f"--data: {source!r} was tokenized by {kind[:12]}, the run's data by {want[:12]}")
        (out / TOKENIZER).write_bytes((Path(source) / TOKENIZER).read_bytes())
        found = kind
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": _seq_len(g.model),
              "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return found


def _tokenizer_kind(spec: str) -> str:
    try:
        return tokenizer_of(spec)
    except ValueError as e:
        raise ExportError(f"--data: {e}") from None


# ---- back from an export ----------------------------------------------------------------------------------------------
def is_export_dir(path: Path) -> bool:
    return (path / EXPORT_META).is_file()


def from_export(directory: str | os.PathLike, model: str | None = None) -> Global:
    """The model of an export written by ``write``, in fp32 on the CPU, checked against its recorded digest."""
    from safetensors.torch import load_file

    path = Path(directory)
    try:
        meta = json.loads((path / EXPORT_META).read_text())
        if meta.get("format") != EXPORT_FORMAT:
            raise ValueError(f"format {meta.get('format')!r}, not {EXPORT_FORMAT!r}")
        run = run_config(meta["run"], model)
        kind = meta["kind"]
        if kind == Kind.HF:
            from atoll.models.hf import from_path

            module = from_path(path, seq_len=meta["seq_len"])
        else:
            module = build(run, model) if kind == Kind.STATE_DICT and meta["preset"] is None else None
            if module is None:
                preset = meta["preset"]
                cfg = LlamaConfig(**preset) if meta["preset_type"] == "LlamaConfig" else GPTConfig(**preset)
                module = instantiate(cfg)
            state = load_file(str(path / WEIGHTS))
            if kind == Kind.HF_LLAMA:
                state = hf_to_llama(state, module.cfg)
            missing, unexpected = module.load_state_dict(state, strict=False)
            tied = {k for k in missing if _is_alias(module, k, state)}
            if set(missing) - tied or unexpected:
                raise ValueError(f"missing {sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]}")
    except ExportError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure to read the files (safetensors' own errors too) is one line
        raise ExportError(f"{str(path)!r} is not a readable atoll export ({type(e).__name__}: {e})") from None
    module.float().eval()
    digest = model_digest(module)
    if digest != meta.get("model_digest"):
        raise ExportError(f"{str(path)!r}: its model's digest {digest} is not the one it records "
                          f"({meta.get('model_digest')})")
    identities = [(f["version"], f["weight"], f["digest"]) for f in meta.get("fragments", [])]
    return Global(module, run, meta.get("run_id", ""), identities, f"export {str(path)!r}", path)


def _is_alias(module: nn.Module, key: str, state: dict[str, torch.Tensor]) -> bool:
    """Whether ``key`` is a tied tensor of ``module`` whose twin is in ``state`` (loaded already)."""
    own = module.state_dict(keep_vars=True)
    return any(other in state and own[other] is own[key] for other in own if other != key)


def load(path: str | os.PathLike, model: str | None = None, local: bool = False) -> Global:
    """A checkpoint directory's Θ (or θ with ``local``), or an export's model."""
    p = Path(path)
    if is_export_dir(p):
        if local:
            raise ExportError(f"{str(p)!r} is an export: it holds Θ only (--local reads a checkpoint directory)")
        return from_export(p, model)
    if is_checkpoint_dir(p):
        return from_checkpoint(p, model, local)
    raise ExportError(f"{str(p)!r} is neither a checkpoint directory (ckpt-*.json) nor an export ({EXPORT_META})")
