#!/usr/bin/env python
"""Benchmark atoll's delta codecs against hivemind's on one CPU core.

For one fp32 tensor (64 MiB by default, N(0,1), fixed seed) and each codec
(atoll's none/bf16/int8/int4/fp4/int2, hivemind's Uniform8BitQuantization and
Float16Compression), measures in one process, interleaved round-robin so
that background load hits every codec alike:

* encode, decode and encode+decode wall time (median of ``--reps``), and the
  same in process CPU time (user+sys, ``time.process_time``), which is less
  sensitive to other processes competing for the core;
* throughput = fp32 input size / median(encode+decode) time, in MiB/s;
* compression ratio = input bytes / payload bytes (hivemind: serialized
  protobuf size);
* relative RMS error ||x - x̂|| / ||x||.

Writes ``<out>/bench_codecs.json`` and ``<out>/bench_codecs.png``.

    python -m scripts.bench_codecs            # defaults: --mib 64 --reps 15 --block 256 --out docs/results/codecs
    python -m scripts.bench_codecs --replot   # redraw the PNG from the JSON
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import pathlib
import platform
import statistics
import time
import warnings

import torch

from atoll.protocols import codecs
from scripts.results import pyplot, save_figure, write_result

ROOT = pathlib.Path(__file__).resolve().parents[1]



def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _atoll(codec: str, block: int):
    def enc(x):
        return codecs.encode(x, codec, block)

    def dec(p):
        return codecs.decode(p)

    return enc, dec, len


def _hivemind(cls_name: str):
    import hivemind.compression as hc

    comp = getattr(hc, cls_name)()

    def enc(x):
        return comp.compress(x, hc.CompressionInfo.from_tensor(x))

    def dec(msg):
        return comp.extract(msg)

    return enc, dec, lambda msg: msg.ByteSize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=64, help="fp32 tensor size in MiB")
    ap.add_argument("--reps", type=int, default=15, help="timed repetitions per codec (median reported)")
    ap.add_argument("--block", type=int, default=256, help="block size of the atoll block codecs")
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "docs" / "results" / "codecs")
    ap.add_argument("--no-hivemind", action="store_true", help="skip the hivemind baselines")
    ap.add_argument("--replot", action="store_true", help="only redraw the PNG from an existing <out>/bench_codecs.json")
    args = ap.parse_args()
    if args.replot:
        report = json.loads((args.out / "bench_codecs.json").read_text())
        _plot(report["codecs"], report, args.out / "bench_codecs.png")
        return

    torch.set_num_threads(1)  # one core: the figure of merit is per-core throughput
    warnings.filterwarnings("ignore", category=UserWarning)  # hivemind's 8-bit path warns about deprecated torch.quantize_*
    numel = args.mib * (1 << 20) // 4
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    nbytes = x.numel() * 4
    x64 = x.double()
    x_norm = float(x64.norm())

    entries = {f"atoll:{c}": _atoll(c, args.block) for c in codecs.CODECS}
    if not args.no_hivemind:
        import hivemind

        entries["hivemind:Uniform8BitQuantization"] = _hivemind("Uniform8BitQuantization")
        entries["hivemind:Float16Compression"] = _hivemind("Float16Compression")

    results = {}
    for name, (enc, dec, size_of) in entries.items():  # warm-up + size + accuracy (untimed)
        payload = enc(x)
        y = dec(payload).reshape(-1)
        assert y.shape == x.shape, name
        results[name] = {
            "payload_bytes": int(size_of(payload)),
            "compression_ratio": nbytes / size_of(payload),
            "rel_rms_error": float((y.double() - x64).norm()) / x_norm,
            "enc_s": [],
            "dec_s": [],
            "pair_s": [],
            "pair_cpu_s": [],
        }
        del payload, y

    load_before = os.getloadavg()
    for _ in range(args.reps):
        for name, (enc, dec, _) in entries.items():
            c0 = time.process_time()
            t0 = time.perf_counter()
            payload = enc(x)
            t1 = time.perf_counter()
            y = dec(payload)
            t2 = time.perf_counter()
            c2 = time.process_time()
            r = results[name]
            r["enc_s"].append(t1 - t0)
            r["dec_s"].append(t2 - t1)
            r["pair_s"].append(t2 - t0)
            r["pair_cpu_s"].append(c2 - c0)
            del payload, y
    load_after = os.getloadavg()

    mib = nbytes / (1 << 20)
    for r in results.values():
        for k in ("enc", "dec", "pair", "pair_cpu"):
            r[f"{k}_median_s"] = statistics.median(r[f"{k}_s"])
        r["enc_mib_s"] = mib / r["enc_median_s"]
        r["dec_mib_s"] = mib / r["dec_median_s"]
        r["enc_dec_mib_s"] = mib / r["pair_median_s"]
        r["enc_dec_cpu_mib_s"] = mib / r["pair_cpu_median_s"]

    ratios = {}
    if not args.no_hivemind:
        for key in ("enc_dec_mib_s", "enc_dec_cpu_mib_s"):
            h8 = results["hivemind:Uniform8BitQuantization"][key]
            h16 = results["hivemind:Float16Compression"][key]
            rr = ratios[key] = {}
            for c in codecs.CODECS:
                rr[f"atoll:{c} / hivemind:Uniform8BitQuantization"] = results[f"atoll:{c}"][key] / h8
            rr["atoll:bf16 / hivemind:Float16Compression"] = results["atoll:bf16"][key] / h16

    report = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "tensor": {"numel": numel, "bytes": nbytes, "dtype": "float32", "distribution": "N(0,1), seed 0"},
        "threads": torch.get_num_threads(),
        "reps": args.reps,
        "block_size": args.block,
        "throughput_unit": "MiB of fp32 input per second (median encode+decode time; *_cpu_*: process CPU time)",
        "host": {
            "cpu": _cpu_model(),
            "logical_cpus": os.cpu_count(),
            "loadavg_before": load_before,
            "loadavg_after": load_after,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "hivemind": None if args.no_hivemind else hivemind.__version__,
        },
        "ratios_enc_dec_throughput": ratios,
        "codecs": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    write_result(args.out / "bench_codecs.json", report)
    _plot(results, report, args.out / "bench_codecs.png")

    print(f"{'codec (MiB/s)':36s} {'enc':>6s} {'dec':>6s} {'enc+dec':>8s} {'(cpu)':>7s} {'compr.':>7s} {'rel RMS':>9s}")
    for name, r in results.items():
        print(f"{name:36s} {r['enc_mib_s']:6.0f} {r['dec_mib_s']:6.0f} {r['enc_dec_mib_s']:8.0f} "
              f"{r['enc_dec_cpu_mib_s']:7.0f} {r['compression_ratio']:7.2f} {r['rel_rms_error']:9.2e}")
    for key, rr in ratios.items():
        for k, v in rr.items():
            print(f"[{key}] {k}: {v:.2f}x")
    print(f"load average before/after: {load_before} / {load_after}")


def _plot(results: dict, report: dict, path: pathlib.Path) -> None:
    plt = pyplot()

    names = list(results)
    labels = [n.replace("hivemind:Uniform8BitQuantization", "hivemind\n8-bit").replace(
        "hivemind:Float16Compression", "hivemind\nfp16").replace("atoll:", "atoll\n") for n in names]
    colors = ["tab:blue" if n.startswith("atoll") else "tab:gray" for n in names]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(17, 4.8))
    pos = list(range(len(names)))
    thr = [results[n]["enc_dec_mib_s"] for n in names]
    thr_cpu = [results[n]["enc_dec_cpu_mib_s"] for n in names]
    bars = ax1.bar([p - 0.2 for p in pos], thr, width=0.4, color=colors, label="wall time")
    ax1.bar_label(bars, fmt="%.0f", fontsize=7)
    bars = ax1.bar([p + 0.2 for p in pos], thr_cpu, width=0.4, color=colors, alpha=0.45, hatch="//", label="process CPU time")
    ax1.bar_label(bars, fmt="%.0f", fontsize=7)
    ax1.set_ylim(0, 1.2 * max(thr + thr_cpu))  # head room for the legend
    ax1.legend(fontsize=8, loc="upper center", ncol=2)
    ax1.set_xticks(pos, labels, fontsize=8)
    ax1.set_ylabel("encode+decode throughput (MiB/s, 1 thread)")
    ax1.set_title(f"{report['tensor']['bytes'] >> 20} MiB fp32, median of {report['reps']}")
    cr = [results[n]["compression_ratio"] for n in names]
    bars = ax2.bar(range(len(names)), cr, color=colors)
    ax2.bar_label(bars, fmt="%.2f", fontsize=8)
    ax2.set_xticks(range(len(names)), labels, fontsize=8)
    ax2.set_ylabel("compression ratio (fp32 bytes / payload bytes)")
    ax2.set_title(f"atoll block size {report['block_size']}")
    lossy = [i for i, n in enumerate(names) if results[n]["rel_rms_error"] > 0]  # log axis: leave out exact codecs
    err = [results[names[i]]["rel_rms_error"] for i in lossy]
    bars = ax3.bar(range(len(lossy)), err, color=[colors[i] for i in lossy])
    ax3.bar_label(bars, fmt="%.1e", fontsize=8)
    ax3.set_yscale("log")
    ax3.set_xticks(range(len(lossy)), [labels[i] for i in lossy], fontsize=8)
    ax3.set_ylabel("relative RMS error ||x - x̂|| / ||x||")
    ax3.set_title("N(0,1) input")
    fig.suptitle(f"{report['host']['cpu']} — torch {report['host']['torch']}", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)


if __name__ == "__main__":
    main()
