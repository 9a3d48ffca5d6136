"""scripts/bench_codec_device.py: its on-device codec prototype gives ``codecs.encode``'s bytes and
``codecs.decode``'s values exactly (run here on host tensors, the same torch operations), the CPU dry run writes its
JSON, the extrapolation and budget paths, and bad arguments refused in one line with exit status 2."""

from __future__ import annotations

import json

import pytest
import torch

from atoll.protocols import codecs



@pytest.fixture(scope="module")
def bench():
    from scripts import bench_codec_device

    return bench_codec_device


def _tensors():
    g = torch.Generator().manual_seed(3)
    out = [torch.randn(n, generator=g) for n in (1, 5, 255, 256, 257, 70001)]
    x = torch.randn(4096, generator=g)
    x[:256] *= 1e-40  # a block whose scale is an fp32 subnormal (the codec's float64 path)
    x[256:512] = 0.0
    x[512:768] = -0.0
    x[768], x[1024] = 3.4e38, -3.4028234e38  # scales nudged down an ulp
    return out + [x, torch.randn(3000, generator=g).to(torch.bfloat16)]


@pytest.mark.parametrize("codec", ["int4", "int8", "fp4", "int2"])
@pytest.mark.parametrize("block", [4, 256])
def test_the_prototype_gives_the_codecs_bytes_and_values(bench, codec, block):
    for x in _tensors():
        payload = codecs.encode(x, codec, block)
        assert bench.device_encode(x, codec, block) == payload, (codec, block, x.numel())
        got = bench.device_decode(payload, torch.device("cpu"), expected_numel=x.numel())
        assert torch.equal(got, codecs.decode(payload)), (codec, block, x.numel())


def test_the_prototype_refuses_what_decode_refuses(bench):
    payload = bytearray(codecs.encode(torch.randn(512), "int4", 256))
    with pytest.raises(codecs.ShapeError):
        bench.device_decode(bytes(payload), torch.device("cpu"), expected_numel=511)
    payload[codecs.HEADER_SIZE:codecs.HEADER_SIZE + 4] = b"\x00\x00\xc0\x7f"  # a NaN scale
    with pytest.raises(codecs.NonFiniteError):
        bench.device_decode(bytes(payload), torch.device("cpu"))
    with pytest.raises(ValueError):
        bench.device_encode(torch.tensor([1.0, float("nan")]), "int4", 256)


def test_the_cpu_dry_run_writes_its_json(bench, tmp_path):
    out = tmp_path / "codec.json"
    assert bench.main(["--device", "cpu", "--numel", "1e5", "--repeats", "2", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert (r["device"], r["gpu"], r["numel_measured"], r["extrapolated"], r["repeats_done"]) == \
        ("cpu", None, 100_000, False, 2)
    assert r["checks"] == {"prototype_bytes_equal": True, "prototype_decode_equal": True}
    assert r["payload_bytes"] == codecs.encoded_size(100_000, "int4", 256)
    assert set(r["measured"]) == {"host_encode", "host_decode", "host_encode_1t", "host_decode_1t",
                                  "prototype_encode", "prototype_decode"}
    for k, m in r["measured"].items():
        assert len(m["seconds"]) == 2 and m["median_seconds_per_1b"] > 0
    s = r["summary_seconds_per_1b"]
    assert s["encode_cuda_tensor_as_is"] is None and s["encode_host_tensor"] > 0
    assert r["peak_host_rss_gib"] > 0 and r["codec_threads"] == 1


def test_a_pass_too_long_is_measured_smaller_and_repetitions_keep_to_the_budget(bench, tmp_path):
    r = bench.run(bench.parse(["--device", "cpu", "--numel", "2e6", "--fallback-numel", "1e5",
                               "--max-pass-seconds", "1e-9", "--budget-seconds", "1e-9", "--repeats", "3",
                               "--no-prototype"]))
    assert (r["numel_asked"], r["numel_measured"], r["extrapolated"]) == (2_000_000, 100_000, True)
    assert r["repeats_done"] == 1 and r["checks"] == {}
    assert r["measured"]["host_encode"]["numel"] == 100_000


def test_bad_arguments_are_refused_in_one_line(bench, capsys):
    cases = [(["--device", "tpu"], "cpu or cuda"), (["--codec", "none"], "a block codec"),
             (["--block-size", "6"], "multiple of 4"), (["--numel", "0"], "at least 1"),
             (["--numel", "1.5"], "whole number"), (["--repeats", "0"], "at least 1"), (["--bogus"], "unrecognized")]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "sees no CUDA device"))
    for argv, message in cases:
        assert bench.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("bench_codec_device: ") and message in err, (argv, err)
