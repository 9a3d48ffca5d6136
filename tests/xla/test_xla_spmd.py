"""The SPMD learner (``--spmd-devices 4``) on torch_xla's CPU runtime with four devices: it trains exactly as the
CPU learner does on the same data, each device holds a quarter of θ and of the AdamW state, writes of merged and
restored values keep the sharding, and nothing compiles after warm-up.

torch_xla fixes the device count and SPMD mode when its runtime starts, so the learner runs in a process of its own
(``spmd_probe.py``, started with ``PJRT_DEVICE=CPU``; ``Spmd.start`` sets ``CPU_NUM_DEVICES``) that reports what it
saw; the assertions are here."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from xla_helpers import xla_only

pytestmark = xla_only
DEVICES = 4
QUARTER = f"{{devices=[{DEVICES},1]0,1,2,3}}"  # a matrix split in 4 along dim 0
QUARTER_1D = f"{{devices=[{DEVICES}]0,1,2,3}}"


@pytest.fixture(scope="module")
def probe():
    env = {k: v for k, v in os.environ.items() if k != "CPU_NUM_DEVICES"}
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("spmd_probe.py")), str(DEVICES)],
                         capture_output=True, text=True, timeout=400, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def split(specs):
    return all(s in (QUARTER, QUARTER_1D) for s in specs)


def test_spmd_learner_trains_as_the_cpu_learner(probe):
    assert probe["devices"] == DEVICES and probe["describe"].endswith("/spmd4")
    assert probe["island_batch"] == probe["cpu_island_batch"] == 2 * DEVICES  # --batch-size is per device
    assert probe["same_theta0"]
    for spmd, cpu in probe["losses"]:
        assert spmd == pytest.approx(cpu, abs=1e-4)
    assert probe["param_gap"] < 1e-4
    after_spmd, after_cpu = probe["held_out_after"]
    assert after_spmd == pytest.approx(after_cpu, abs=1e-4) and after_spmd < probe["held_out_before"]


def test_parameters_optimizer_state_and_batch_are_split_over_the_devices(probe):
    # Every nano parameter has a dim 0 that 4 divides: all are split, none replicated.
    assert split(probe["param_specs"]) and split(probe["opt_specs"])
    for shape, pieces in zip(probe["shapes"], probe["param_local_shapes"]):
        assert pieces == [[shape[0] // DEVICES, *shape[1:]]] * DEVICES
    assert probe["batch_spec"] == QUARTER
    # Each device holds a quarter of θ's bytes, and of AdamW's two moments (twice θ).
    assert probe["param_bytes_per_device"] == [probe["param_bytes"] // DEVICES] * DEVICES
    assert probe["opt_bytes_per_device"] == [2 * probe["param_bytes"] // DEVICES] * DEVICES


def test_writes_into_theta_keep_the_sharding(probe):
    # Right after each write, before any step could re-mark anything.
    assert split(probe["after_scatter_specs"]) and probe["scatter_exact"]
    assert all(len(pieces) == DEVICES and len({tuple(p) for p in pieces}) == 1
               and pieces[0][0] * DEVICES in (256, 192, 64) for pieces in probe["after_scatter_local_shapes"])
    assert split(probe["after_load_flat_specs"]) and probe["load_flat_exact"]
    assert split(probe["after_restore_specs"]) and split(probe["after_restore_opt_specs"]) and probe["restore_exact"]
    assert split(probe["after_step_specs"]) and split(probe["after_step_opt_specs"])
    assert split(probe["final_specs"])
    assert probe["remarked"] == 0  # the step's guard never had to mark a parameter again


def test_nothing_compiles_after_warm_up(probe):
    warm, later = probe["compilations"]
    assert 0 < warm <= 16 and later == warm
