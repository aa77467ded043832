#!/usr/bin/env bash
# Runs the whole test suite (scripts/test.sh) on each PostgreSQL major in turn
# and prints a table: the major, the server's exact version, passed / failed /
# skipped counts, the failed tests and how long the run took. The workspace is
# built once (the first run builds, the others find it built).
#
#   bash scripts/matrix.sh                          # 14 15 16 17 18
#   bash scripts/matrix.sh 15 18                    # those majors (what CI runs)
#   bash scripts/matrix.sh 16 17 -- -E 'test(/tls/)'   # after --: test.sh's arguments
#
# Each run's output is shown as it goes and kept in target/matrix/<major>.log;
# the table is also written to target/matrix/table.md. The last line sums the
# runs up ("matrix: N passed, N failed, N skipped"). Exits 0 only if every run
# passed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/pg-versions.sh

majors=()
while [ $# -gt 0 ]; do
    case $1 in
    --) shift; break ;;
    *) majors+=("$1"); shift ;;
    esac
done
[ ${#majors[@]} -gt 0 ] || read -r -a majors <<<"$PG_MAJORS"
for major in "${majors[@]}"; do
    PG_VERSION=$major pg_major >/dev/null || exit 2
done
if [ -n "${PG_BIN:-}" ]; then
    echo "matrix.sh: PG_BIN is set ($PG_BIN); unset it: each run takes its major's binaries" >&2
    exit 2
fi

out=target/matrix
mkdir -p "$out"
rows=$out/rows.tsv
: >"$rows"
status=0
for major in "${majors[@]}"; do
    echo "=== matrix.sh: PostgreSQL $major ==="
    started=$(date +%s)
    set +e
    PG_VERSION=$major bash scripts/test.sh "$@" 2>&1 | tee "$out/$major.log"
    rc=${PIPESTATUS[0]}
    set -e
    [ "$rc" = 0 ] || status=1
    python3 - "$out/$major.log" "$major" "$rc" "$(($(date +%s) - started))" >>"$rows" <<'PY'
import re, sys

log, major, rc, secs = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
text = open(log, encoding="utf-8", errors="replace").read()
text = re.sub(r"\x1b\[[0-9;]*m", "", text)
server = re.findall(r"^pg-cluster\.sh: PostgreSQL (.+?) \(", text, re.M)
server = server[-1] if server else "?"
summary = list(re.finditer(r"^\s*Summary \[.*?\] (.*)$", text, re.M))
counts = {"passed": "-", "failed": "-", "skipped": "-"}
failed = []
if summary:
    line = summary[-1].group(1)
    for key in counts:
        m = re.search(r"(\d+) " + key, line)
        counts[key] = int(m.group(1)) if m else 0
    # "N timed out" counts as failed here.
    m = re.search(r"(\d+) timed out", line)
    if m:
        counts["failed"] += int(m.group(1))
    for row in text[summary[-1].end():].splitlines():
        m = re.match(r"^\s*(?:TRY \d+ )?([A-Z][A-Z-]*)\s+\[[^\]]*\]\s+(?:\(\s*\d+/\d+\)\s+)?(\S+)\s+(\S+)\s*$", row)
        if m and m.group(1) not in ("PASS", "SKIP", "FLAKY", "SLOW"):
            failed.append(m.group(3))
    failed = sorted(set(failed))
    names = ", ".join(failed) if failed else ("-" if rc == 0 else f"(exit {rc})")
else:
    tail = [l for l in text.splitlines() if l.strip()][-1:] or ["no output"]
    names = f"did not run the tests (exit {rc}): {tail[0].strip()[:120]}"
print("\t".join(map(str, [major, server, counts["passed"], counts["failed"], counts["skipped"], names, f"{secs // 60}m{secs % 60:02d}s"])))
PY
done

python3 - "$rows" "$out/table.md" <<'PY'
import sys

rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
head = ["PG_VERSION", "server", "passed", "failed", "skipped", "failed tests", "duration"]
table = [head] + rows
widths = [max(len(r[i]) for r in table) for i in range(len(head))]
def fmt(r):
    return "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"
lines = [fmt(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [fmt(r) for r in rows]
text = "\n".join(lines)
open(sys.argv[2], "w").write(text + "\n")
print()
print(text)
total = {k: sum(int(r[i]) for r in rows if r[i].isdigit()) for k, i in (("passed", 2), ("failed", 3), ("skipped", 4))}
print()
print(f"matrix: {total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped")
PY
exit $status
