"""Configuration: validation errors are one clear line and exit code 2."""

import pytest

from atoll.node.cli import main
from atoll.node.config import ConfigError, RunConfig, load_config, reconcile_run_config
from atoll.node.device import resolve_device, xla_available

PEER = "/ip4/127.0.0.1/tcp/31337/p2p/QmTt18CRK6oG1T7ZZcNcypAuQXGM92vRXWthaDYPaUFgh7"


def test_defaults_are_valid():
    cfg, explicit = load_config({})
    assert cfg.run.algorithm == "decoupled" and cfg.run.sync_every > 0 and explicit == set()


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"device": "tpu"}, "device: unknown"),
        ({"initial_peers": ["not-a-maddr"]}, "initial_peers: malformed multiaddr"),
        ({"initial_peers": ["/ip4/127.0.0.1/tcp/1"]}, "lacks the /p2p/"),
        ({"host_maddrs": ["/ip4/999.0.0.1/tcp/1"]}, "host_maddrs: malformed"),
        ({"model": "huge"}, "model: unknown"),
        ({"algorithm": "magic"}, "algorithm: unknown"),
        ({"sync_every": 0}, "sync_every: must be a positive"),
        ({"outer_momentum": 1.5}, "outer_momentum"),
        ({"batch_size": "many"}, "batch_size: expected a int"),
        ({"data": "/nonexistent/corpus"}, "data:"),
        ({"faults": ["explode=1"]}, "faults: unknown fault"),
        ({"run_id": "bad id!"}, "run_id"),
        ({"clip_factor": 0.5}, "clip_factor: must be 0"),
        ({"clip_factor": -1.0}, "clip_factor: must be 0"),
        ({"clip_factor": "inf"}, "clip_factor: must be 0"),
        ({"peer_cooldown": -1.0}, "peer_cooldown: must be a non-negative"),
        ({"eval_budget": 0.0}, "eval_budget: 0.0 must be in"),
        ({"eval_budget": 1.5}, "eval_budget: 1.5 must be in"),
        ({"faults": ["byzantine=evil"]}, "faults: unknown byzantine kind"),
        ({"faults": ["byzantine_from=x"]}, "faults: bad value"),
        ({"client_mode": True}, "client_mode: a daemon nobody can dial cannot start a run"),
    ],
)
def test_bad_values_raise_one_line_errors(overrides, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_config(overrides)
    assert "\n" not in str(info.value)


def test_toml_file_and_precedence(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('run_id = "exp1"\nbatch_size = 4\n[run]\nsync_every = 25\nmodel = "nano"\n')
    cfg, explicit = load_config({"batch_size": 16}, str(path))
    assert cfg.run_id == "exp1" and cfg.batch_size == 16 and cfg.run.sync_every == 25 and cfg.run.model == "nano"
    assert explicit == {"sync_every", "model"}
    path.write_text("bogus_key = 1\n")
    with pytest.raises(ConfigError, match="unknown key"):
        load_config({}, str(path))
    path.write_text("this is not toml [")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config({}, str(path))
    with pytest.raises(ConfigError, match="not found"):
        load_config({}, str(tmp_path / "missing.toml"))


def test_joiner_adopts_run_config_and_refuses_conflicts():
    published = RunConfig(model="nano", sync_every=10).published()
    adopted = reconcile_run_config(RunConfig(), set(), published)
    assert adopted.model == "nano" and adopted.sync_every == 10
    same = reconcile_run_config(RunConfig(model="nano"), {"model"}, published)
    assert same.model == "nano"
    with pytest.raises(ConfigError, match="disagrees.*sync_every=50"):
        reconcile_run_config(RunConfig(sync_every=50), {"sync_every"}, published)
    with pytest.raises(ConfigError, match="does not know"):
        reconcile_run_config(RunConfig(), set(), {**published, "future_field": 1})


def test_a_data_path_is_not_published_and_each_joiner_names_its_own(tmp_path):
    """Anyone who reaches the DHT reads the run's config record: it says that the run has data of its own, not
    where it lies on the machine that started the run."""
    published = RunConfig(data="/srv/secret/corpus.bin").published()
    assert published["data"] == "<local>" and "/srv" not in repr(published)
    assert RunConfig().published()["data"] == "builtin"
    with pytest.raises(ConfigError, match="pass --data PATH"):
        reconcile_run_config(RunConfig(), set(), published)
    copy = str(tmp_path)
    assert reconcile_run_config(RunConfig(data=copy), {"data"}, published).data == copy


@pytest.mark.skipif(xla_available(), reason="torch_xla is installed here")
def test_xla_without_torch_xla_is_a_config_error():
    with pytest.raises(ConfigError, match="torch_xla is not installed"):
        resolve_device("xla")


def test_cpu_device_resolves():
    assert resolve_device("cpu").kind == "cpu"
    assert resolve_device("auto").kind in ("cpu", "cuda")


def test_cli_prints_one_line_and_exits_2(capsys):
    assert main(["start", "--device", "tpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["atoll: error: device: unknown 'tpu'; use one of auto, cpu, cuda, xla"]
    assert main(["start", "--initial-peers", "garbage"]) == 2
    assert "malformed multiaddr" in capsys.readouterr().err
    assert main(["start", "--client-mode"]) == 2  # behind NAT with nobody to dial: refused before anything starts
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("atoll: error: client_mode: a daemon nobody can dial")


def test_hostile_peer_settings_parse():
    cfg, explicit = load_config({"clip_factor": "0", "peer_cooldown": "5", "faults": ["byzantine=scale",
                                                                                     "byzantine_from=3"]})
    assert cfg.run.clip_factor == 0.0 and cfg.peer_cooldown == 5.0 and "clip_factor" in explicit
    assert cfg.parsed_faults() == {"byzantine": "scale", "byzantine_from": 3}
    assert load_config({})[0].run.clip_factor >= 1


def test_optimizer_flags_reach_the_run_config():
    from atoll.node.cli import build_parser

    args = build_parser().parse_args(["start", "--outer-lr", "1", "--outer-momentum", "0", "--inner-lr", "2e-3"])
    overrides = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    cfg, explicit = load_config(overrides)
    assert (cfg.run.outer_lr, cfg.run.outer_momentum, cfg.run.inner_lr) == (1.0, 0.0, 2e-3)
    assert {"outer_lr", "outer_momentum", "inner_lr"} <= explicit
    assert main(["start", "--outer-momentum", "1"]) == 2  # a momentum of 1 never forgets: refused


def test_a_checkpoint_of_an_older_version_is_the_same_run_when_its_missing_fields_are_at_their_defaults():
    run = RunConfig(sync_every=40)
    saved = run.published()
    assert run.same_run(saved)
    older = {k: v for k, v in saved.items() if k != "outer_period"}  # recorded before --outer-period existed
    assert run.same_run(older)
    assert not RunConfig(sync_every=40, outer_period=2).same_run(older)
    assert not run.same_run({**saved, "sync_every": 50}) and not run.same_run(None)
