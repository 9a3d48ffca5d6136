"""Device resolution and the device helpers. These run in both environments; the xla path itself is tested in
tests/xla (run by ``make test-xla``, in the xla venv)."""

import os

import pytest
import torch

import atoll.node.device as device_mod
from atoll.node.config import ConfigError
from atoll.node.device import Device, resolve_device, xla_available


def test_xla_without_torch_xla_is_one_config_error(monkeypatch):
    monkeypatch.setattr(device_mod, "xla_available", lambda: False)
    with pytest.raises(ConfigError, match=r"torch_xla is not installed \(pip install 'atoll\[xla\]'\)"):
        resolve_device("xla")


def test_unknown_xla_precision_is_one_config_error(monkeypatch):
    monkeypatch.setattr(device_mod, "xla_available", lambda: True)
    monkeypatch.setenv("ATOLL_XLA_PRECISION", "fp8")
    with pytest.raises(ConfigError, match="ATOLL_XLA_PRECISION: unknown 'fp8'"):
        resolve_device("xla")


def test_unknown_device_is_one_config_error():
    with pytest.raises(ConfigError, match="device: unknown 'tpu'"):
        resolve_device("tpu")


def test_cpu_device_helpers():
    cpu = resolve_device("cpu")
    assert cpu == Device("cpu", torch.device("cpu"), "fp32") and cpu.describe() == "cpu"
    assert cpu.compilations() == 0
    cpu.sync()
    t = torch.arange(4.0)
    (h,) = cpu.to_host([t])
    assert torch.equal(h, t) and h.data_ptr() != t.data_ptr()  # a copy
    with cpu.autocast():
        assert not torch.is_autocast_enabled("cpu")
    with Device("cpu", torch.device("cpu"), "bf16").autocast():
        assert torch.is_autocast_enabled("cpu")
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16


@pytest.mark.skipif(not xla_available() and os.environ.get("ATOLL_REQUIRE_XLA") != "1",
                    reason="torch_xla is not installed in this environment; `make test-xla` runs this in the xla venv")
def test_xla_resolves_with_bf16_and_an_fp32_override(monkeypatch):
    monkeypatch.setenv("PJRT_DEVICE", os.environ.get("PJRT_DEVICE", "CPU"))
    xla = resolve_device("xla")
    assert xla.kind == "xla" and xla.torch_device.type == "xla" and xla.precision == "bf16"
    monkeypatch.setenv("ATOLL_XLA_PRECISION", "fp32")
    assert resolve_device("xla").precision == "fp32"
    (h,) = xla.to_host([torch.arange(3.0, device=xla.torch_device) * 2])
    assert h.device.type == "cpu" and h.tolist() == [0.0, 2.0, 4.0]
