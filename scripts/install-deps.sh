#!/usr/bin/env bash
# Installs what the tests need when it is missing; prints one line per install
# and nothing when everything is there. Idempotent.
#   - PostgreSQL 15 server and client tools (initdb, pg_ctl, postgres, psql,
#     pg_recvlogical) in $PG_BIN, plus the `postgres` user
#   - cargo-nextest
#   - moto's server mode (AWS mock): python3 -m moto.server / moto_server
#   - the official SQS Extended Client for Python (amazon-sqs-extended-client)
set -euo pipefail

PG_BIN=${PG_BIN:-/usr/lib/postgresql/15/bin}
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

# PostgreSQL 15. The package would create and start a default cluster (15/main
# on port 5432): keep services from starting while installing, then drop it.
missing_pg=false
for tool in initdb pg_ctl postgres; do [ -x "$PG_BIN/$tool" ] || missing_pg=true; done
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
        [ -x "$PG_BIN/$tool" ] || { echo "install-deps: no $PG_BIN/$tool after installing postgresql-15 (is PG_BIN right?)" >&2; exit 1; }
    done
    echo "install-deps: installed postgresql-15 ($("$PG_BIN/postgres" --version))"
fi
for tool in psql pg_recvlogical; do
    if [ ! -x "$PG_BIN/$tool" ]; then
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

# The compose validation test (scripts/validate-compose.py).
if ! python3 -c 'import yaml, jsonschema' >/dev/null 2>&1; then
    python3 -m pip install --quiet --disable-pip-version-check pyyaml jsonschema
    echo "install-deps: installed pyyaml and jsonschema"
fi
