"""``atoll start``'s flags, help and TOML keys come from the config dataclasses (no sockets: parsing only)."""

import argparse
import dataclasses
import json

import pytest

from atoll.node.cli import build_parser, config_fields, config_overrides, show_default
from atoll.node.config import NODE_FIELDS, RUN_FIELDS, NodeConfig, RunConfig, load_config

PEER = "/ip4/127.0.0.1/tcp/31337/p2p/QmTt18CRK6oG1T7ZZcNcypAuQXGM92vRXWthaDYPaUFgh7"


def _subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _start(*argv: str) -> dict:
    return config_overrides(build_parser().parse_args(["start", *argv]))


def test_every_field_but_run_has_exactly_one_flag():
    names = {f.name for f in config_fields()}
    assert names == set(RUN_FIELDS) | NODE_FIELDS and "run" not in names
    actions = [a for a in _subparser("start")._actions if a.option_strings]
    by_dest: dict[str, list[argparse.Action]] = {}
    for action in actions:
        by_dest.setdefault(action.dest, []).append(action)
    assert set(by_dest) == names | {"help", "config"}
    for name in names:
        (action,) = by_dest[name]
        expected = "--fault" if name == "faults" else "--" + name.replace("_", "-")
        assert action.option_strings == [expected], name
        assert action.default is None, name  # unset stays None so load_config can tell explicit from default


def test_help_shows_each_dataclass_default():
    defaults = {f.name: f.default for f in config_fields()}
    text = " ".join(_subparser("start").format_help().split())  # undo argparse's line wrapping
    for action in _subparser("start")._actions:
        if action.dest not in defaults:
            continue
        if action.dest in ("faults", "harness", "model_digest", "tokenizer"):  # the hidden ones
            assert action.help == argparse.SUPPRESS and action.option_strings[0] + " " not in text
            continue
        shown = f"default: {show_default(defaults[action.dest])})"
        assert shown in action.help, action.dest
        assert shown in " ".join((action.help % {}).split()) and action.option_strings[0] in text
    for snippet in ("--outer-lr LR outer step size (the papers': 0.7) (default: 1.0)", "(default: /ip4/0.0.0.0/tcp/0)",
                    "--error-feedback {true,false}", "(one of decoupled, streaming, diloco, ddp; default: decoupled)",
                    "(one of auto, cpu, cuda, xla; default: auto)", "int4, fp4, int2; default: int4)",
                    f"(default: {RunConfig().sync_every})", f"(default: {NodeConfig().peer_cooldown})"):
        assert snippet in text, snippet


def test_start_help_renders(capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["start", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "--sync-every H" in out and "--initial-peers MADDR [MADDR ...]" in out and "--config TOML" in out


def test_flags_parse_to_typed_overrides():
    overrides = _start("--sync-every", "7", "--error-feedback", "false", "--initial-peers", "a", "b")
    assert overrides["sync_every"] == 7 and type(overrides["sync_every"]) is int
    assert overrides["error_feedback"] is False
    assert overrides["initial_peers"] == ("a", "b")
    set_ = {"sync_every", "error_feedback", "initial_peers"}
    assert all(v is None for k, v in overrides.items() if k not in set_)
    more = _start("--outer-lr", "1", "--rda", "true", "--open", "--harness", "step_delay=0.5", "--fault",
                  "kill_in_round=3", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--seed", "4", "--device", "cpu",
                  "--client-mode", "--initial-peers", PEER)
    assert more["outer_lr"] == 1.0 and type(more["outer_lr"]) is float and more["rda"] is True
    assert more["open"] is True and more["faults"] == ("kill_in_round=3",) and more["harness"] == ("step_delay=0.5",)
    assert more["host_maddrs"] == ("/ip4/127.0.0.1/tcp/0",) and more["seed"] == 4 and more["device"] == "cpu"
    assert more["client_mode"] is True
    cfg, explicit = load_config(more)
    assert cfg.run.outer_lr == 1.0 and cfg.run.rda and cfg.open and cfg.parsed_faults()["kill_in_round"] == 3
    assert cfg.client_mode
    assert explicit == {"outer_lr", "rda", "seed"}


def test_unset_flags_are_none():
    overrides = _start()
    assert set(overrides) == set(RUN_FIELDS) | NODE_FIELDS
    assert all(v is None for v in overrides.values())
    cfg, explicit = load_config(overrides)
    assert cfg == NodeConfig() and explicit == set()


@pytest.mark.parametrize("argv", [["--error-feedback", "maybe"], ["--open", "true"], ["--sync-every", "x"],
                                  ["--initial-peers"]])
def test_bad_flags_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["start", *argv])
    assert info.value.code == 2


def test_status_and_token_default_run_id():
    default = NodeConfig().run_id
    assert build_parser().parse_args(["status", "--initial-peers", PEER]).run_id == default
    assert build_parser().parse_args(["token", "--run-key", "k", "--out", "t"]).run_id == default


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(value)  # a TOML basic string


@pytest.mark.parametrize("access", ["join_token", "run_key"])  # mutually exclusive, so one file each
def test_toml_file_with_every_key(tmp_path, access):
    token = tmp_path / "join.token"
    token.write_bytes(b"x")
    run = dict(model="nano", algorithm="streaming", data="builtin", sync_every=25, outer_lr=0.5, outer_momentum=0.8,
               outer_period=2, inner_lr=2e-3, weight_decay=0.05, warmup_steps=10, seed=3, num_shards=8, gather_timeout=10.0,
               round_timeout=12.5, fragments=2, overlap=1, local_merge="mix", alpha=0.25, quorum=2,
               max_group=8, grace_gamma=0.25,
               join_window=False, stale_contributions=True, rda=False, compression="int8", error_feedback=False,
               codec_block=128, clip_factor=3.0, robust_merge="trimmed", model_digest="0123456789abcdef",
               tokenizer="bytes", global_batch=32, max_step_tokens=4096)
    node = dict(run_id="exp-1", initial_peers=(PEER,), host_maddrs=("/ip4/127.0.0.1/tcp/0",),
                announce_maddrs=("/ip4/127.0.0.1/tcp/4001",), client_mode=True, dht_in_process=True,
                identity=str(tmp_path / "identity.key"),
                checkpoint_dir=str(tmp_path / "ckpt"), device="cpu", precision="bf16", batch_size=4, threads=2, codec_threads=2,
                snapshot_at="due", max_steps=100,
                heartbeat=1.5, eval_batches=4, eval_budget=0.05, bootstrap_retries=5, config_wait=12.0, new_run=True,
                state_wait=60.0, restart_run=True, log_level="DEBUG", log_format="json", metrics_port=9400, metrics_host="0.0.0.0",
                grad_accum=2, nproc_per_node=2, nnodes="1:2",
                rdzv_endpoint="10.0.0.1:29400", max_restarts=1, spmd_devices=0, fsdp=True,
                peer_cooldown=30.0, state_vouchers=3, open=False, join_token=str(token),
                run_key=str(tmp_path / "run.key"),
                # The pause policies are refused on an island of several ranks (nproc_per_node=2): empty here.
                pause_when=(), schedule="", resume_after=30.0, pause_to="checkpoint",
                control_socket=str(tmp_path / "c.sock"), max_hours=8.0, until="06:00",
                tensorboard=str(tmp_path / "tb"), wandb="my-project", wandb_name="island-7",
                faults=("byzantine=nan",), harness=("step_delay=0.1", "start_together=3"))
    assert set(run) == set(RUN_FIELDS) and set(node) == NODE_FIELDS  # a new field needs a value here
    node.pop("run_key" if access == "join_token" else "join_token")
    path = tmp_path / "all.toml"
    path.write_text("".join(f"{k} = {_toml_value(v)}\n" for k, v in node.items()) + "[run]\n"
                    + "".join(f"{k} = {_toml_value(v)}\n" for k, v in run.items()))
    cfg, explicit = load_config(_start(), str(path))
    assert explicit == set(RUN_FIELDS)
    assert dataclasses.asdict(cfg.run) == run
    got = {k: v for k, v in dataclasses.asdict(cfg).items() if k in node}
    assert got == node
    # Flat run keys work too, and a flag beats the file.
    path.write_text("".join(f"{k} = {_toml_value(v)}\n" for k, v in {**node, **run}.items()))
    cfg, _ = load_config(_start("--sync-every", "30", "--batch-size", "2"), str(path))
    assert cfg.run.sync_every == 30 and cfg.batch_size == 2 and cfg.run.codec_block == 128
