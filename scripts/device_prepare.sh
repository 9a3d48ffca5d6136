#!/usr/bin/env bash
# What the GPU machine needs that the repository does not hold, made here (with network access to PyPI):
#   .whl/            x86-64 CPython 3.12 wheels of hivemind and what that machine's python3 lacks (~20 MiB)
#   .devdata/code32k a BPE-32768 dataset of Python source for the >= 100M-parameter quality check (~29 MiB)
# Both are git-ignored (.git/info/exclude) and travel with the device tool's `carry: [".whl", ".devdata"]`;
# scripts/device_check.sh (through device_setup.sh) uses them there. Run from the repository root with .venv built.
#   bash scripts/device_prepare.sh
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >>.git/info/exclude
grep -qx '/.devdata/' .git/info/exclude 2>/dev/null || echo /.devdata/ >>.git/info/exclude

# The closure a daemon imports there (traced from a real swarm), at the versions .venv tests; typing_extensions is
# carried because pydantic_core needs a newer one than that machine has.
WHEELS="hivemind==1.1.12 multiaddr==0.2.0 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 pydantic==2.14.4
 pydantic_core==2.50.5 annotated_types==0.8.0 typing_inspection==0.4.5 typing_extensions==4.16.0
 py-multihash==3.0.0 py-cid==0.5.0 py-multibase==2.0.0 py-multicodec==1.0.0 morphys==1.0 base58==2.1.1
 blake3==1.0.11 mmh3==5.3.1 netaddr==1.3.0 configargparse==1.9.0"
SDISTS="varint==1.0.2 python-baseconv==1.2.2 prefetch_generator==1.0.3"  # no wheels on PyPI: built here
mkdir -p .whl
for w in $WHEELS; do
    $py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 -d .whl "$w"
done
for s in $SDISTS; do $py -m pip wheel -q --no-deps -w .whl "$s"; done

if [ ! -f .devdata/code32k/manifest.json ]; then
    # The standard library's text sources and transformers' (present here in .venv), about 56 MB.
    src=$(mktemp -d)
    $py - "$src" <<'PY'
import shutil, sys, sysconfig
from pathlib import Path
import transformers
out, total = Path(sys.argv[1]), 0
roots = [Path(sysconfig.get_paths()["stdlib"]), Path(transformers.__file__).parent]
for i, root in enumerate(roots):
    for p in sorted(root.rglob("*.py")):
        if "site-packages" in p.relative_to(root).parts or total > 56e6:
            continue
        try:
            p.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        dst = out / str(i) / p.relative_to(root)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(p, dst)
        total += p.stat().st_size
PY
    $py -m atoll.node.cli data prepare "$src" --out .devdata/code32k --vocab-size 32768 --force
    rm -rf "$src"
fi
du -sh .whl .devdata
