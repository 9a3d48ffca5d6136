"""``--spmd-devices``: bad combinations are one ConfigError line (exit 2) before anything starts. The SPMD learner
itself runs in tests/xla (``make test-xla``)."""

import pytest

from atoll.node.config import ConfigError, NodeConfig
from atoll.node.device import resolve_device


@pytest.mark.parametrize("kwargs, message", [
    (dict(device="cpu", spmd_devices=4), "spmd_devices: SPMD shards the learner over XLA devices; it needs --device xla, not cpu"),
    (dict(device="auto", spmd_devices=2), "it needs --device xla, not auto"),
    (dict(device="xla", spmd_devices=2, nproc_per_node=2), "spmd_devices: an SPMD island is one process"),
    (dict(device="xla", spmd_devices=-1), "spmd_devices: must be a non-negative number"),
])
def test_bad_spmd_configuration_is_one_config_error(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        NodeConfig(**kwargs).validate()


def test_spmd_on_xla_validates():
    NodeConfig(device="xla", spmd_devices=4).validate()
    NodeConfig(device="cpu", spmd_devices=0).validate()


def test_resolve_device_refuses_spmd_off_xla():
    with pytest.raises(ConfigError, match="needs --device xla, not cpu"):
        resolve_device("cpu", spmd_devices=2)
    assert resolve_device("cpu").devices == 1
