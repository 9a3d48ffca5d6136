# Source at the start of every command on the lent GPU machine (python3 3.12 with CUDA torch, no network):
#
#     source scripts/device_setup.sh && python3 -m scripts.device_check ...
#
# It (1) installs the wheels carried in .whl/ (hivemind and the part of its and atoll's dependencies that the
# machine lacks; run the device tool with carry: [".whl"] and, for the BPE data, ".devdata") into /tmp/site,
# (2) makes `import atoll` work from this checkout: /tmp/atoll-path/atoll/{node,protocols,models} are links to the
# checkout's node/, protocols/, models/ (as `make test-xla` does under build/xla-path), (3) exports PYTHONPATH with
# both, and (4) puts an `atoll` command (python3 -m atoll.node.cli, the [project.scripts] entry point) on PATH.
# Daemons that scripts start as `sys.executable -m atoll.node.cli` inherit PYTHONPATH and find everything too.
#
# A missing or doubled wheel, a failed install or a failed import: one line on stderr starting with
# "device_setup:", and the shell exits 1 (an interactive shell only returns 1). Sourcing it again is cheap: the
# install is skipped while /tmp/site holds the same wheels for the same python3.
#
# Variables: ATOLL_SITE (default /tmp/site), ATOLL_PATH_DIR (default /tmp/atoll-path), ATOLL_SETUP_NO_WHEELS=1 (skip
# the wheels: for a python3 that already has the dependencies, such as .venv on a CPU machine).

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    echo "device_setup: source it (source scripts/device_setup.sh), running it changes nothing" >&2
    exit 1
fi

_atoll_setup() {
    local root site pathdir bindir py wheels missing name n key w
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)" || return 1
    site="${ATOLL_SITE:-/tmp/site}"
    pathdir="${ATOLL_PATH_DIR:-/tmp/atoll-path}"
    bindir="$pathdir/bin"
    py="$(command -v python3)" || { echo "device_setup: no python3 on PATH" >&2; return 1; }

    if [ "${ATOLL_SETUP_NO_WHEELS:-0}" != 1 ]; then
        # One of each, as saved by `pip download` (names with '_'); the machine has the rest (numpy, torch, scipy,
        # msgpack, uvloop, protobuf, grpcio, psutil, six, rich, safetensors, tokenizers, prometheus-client, ...).
        wheels="hivemind multiaddr cryptography cffi pycparser pydantic pydantic_core annotated_types
                typing_inspection typing_extensions py_multihash py_cid py_multibase py_multicodec python_baseconv
                varint morphys base58 blake3 mmh3 netaddr prefetch_generator configargparse"
        if ! compgen -G "$root/.whl/*.whl" >/dev/null; then
            echo "device_setup: no wheels in $root/.whl (carry the folder: run(carry=[\".whl\", ...]))" >&2
            return 1
        fi
        missing=""
        for name in $wheels; do
            n=$(compgen -G "$root/.whl/$name-[0-9]*.whl" | wc -l)
            if [ "$n" -eq 0 ]; then
                missing="$missing $name"
            elif [ "$n" -gt 1 ]; then
                echo "device_setup: $n versions of $name in $root/.whl (keep one)" >&2
                return 1
            fi
        done
        if [ -n "$missing" ]; then
            echo "device_setup: missing wheels in $root/.whl:$missing (carry=[\".whl\", ...]?)" >&2
            return 1
        fi
        key="$("$py" -c 'import sys; print(sys.version)' 2>&1; for w in "$root"/.whl/*.whl; do
            printf '%s %s\n' "${w##*/}" "$(stat -c %s "$w")"; done)"
        if [ ! -f "$site/.atoll-wheels" ] || [ "$(cat "$site/.atoll-wheels")" != "$key" ]; then
            if ! PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1 "$py" -m pip install -q --no-index \
                    --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$root"/.whl/*.whl; then
                echo "device_setup: pip could not install $root/.whl/*.whl into $site with $py" >&2
                return 1
            fi
            printf '%s' "$key" >"$site/.atoll-wheels"
        fi
        # hivemind's bundled libp2p daemon (a static x86-64 Go binary): every DHT and round needs it.
        "$site/hivemind/hivemind_cli/p2pd" -h >/dev/null 2>&1
        case $? in
            126|127) echo "device_setup: $site/hivemind/hivemind_cli/p2pd cannot run (not executable, or $site" \
                          "is on a noexec mount: set ATOLL_SITE to another folder)" >&2
                     return 1 ;;
        esac
    fi

    # atoll from this checkout, laid out as the installed package (pyproject.toml's package-dir).
    mkdir -p "$pathdir/atoll" "$bindir" || { echo "device_setup: cannot create $pathdir" >&2; return 1; }
    for name in node protocols models; do
        ln -sfn "$root/$name" "$pathdir/atoll/$name"
    done
    for w in "$root"/atoll/*; do
        [ "${w##*/}" = __pycache__ ] || ln -sfn "$w" "$pathdir/atoll/${w##*/}"
    done
    printf '#!/bin/sh\nexec "%s" -m atoll.node.cli "$@"\n' "$py" >"$bindir/atoll"
    chmod +x "$bindir/atoll"

    if [ "${ATOLL_SETUP_NO_WHEELS:-0}" != 1 ]; then
        export PYTHONPATH="$pathdir:$site${PYTHONPATH:+:$PYTHONPATH}"
    else
        export PYTHONPATH="$pathdir${PYTHONPATH:+:$PYTHONPATH}"
    fi
    case ":$PATH:" in *":$bindir:"*) ;; *) export PATH="$bindir:$PATH" ;; esac

    # The imports a daemon needs (hivemind imports torch: a few seconds), from the links, not from the checkout.
    if ! (cd / && "$py" -c 'import atoll, hivemind, multiaddr, pydantic.v1, atoll.node.cli, atoll.node.rounds.join
assert atoll.__file__.startswith("'"$pathdir"'"), atoll.__file__' >/dev/null 2>"$pathdir/import-error.txt"); then
        echo "device_setup: import check failed with $py: $(grep -v '^ ' "$pathdir/import-error.txt" | tail -1)" >&2
        return 1
    fi
    [ "${ATOLL_SETUP_NO_WHEELS:-0}" != 1 ] || site="python3's own site-packages"
    echo "device_setup: python3 $("$py" -c 'import platform; print(platform.python_version())') ($py)," \
         "dependencies from $site, atoll from $root through $pathdir, \`atoll\` = $bindir/atoll" >&2
}

if ! _atoll_setup; then
    unset -f _atoll_setup
    case $- in
        *i*) return 1 ;;
        *) exit 1 ;;
    esac
fi
unset -f _atoll_setup
