#!/usr/bin/env python3
"""The crate's import graph, by wing, from its `crate::` and `super::` paths.

Every file of crates/outbox-relay/src belongs to one wing:

    composition  main.rs lib.rs relay.rs cli/
    sink         sink/        (destinations, the registry, the shared AWS layer)
    pipeline     pipeline/    (the sink contract, the stream, publish, ack, ...)
    postgres     postgres/    (every conversation with the database)
    ground       everything else (config/, event, metrics, http, report, ...)

An import may run to its own wing or to a lower one. The one climb allowed is
config/ naming the destinations' settings sections through the registry
(`crate::sink::Sections`, `crate::sink::Kind`), since the configuration
tree holds every section.

Prints the wing-to-wing import counts, every climb, and every cycle between
files (Tarjan's strongly connected components). Code of `#[cfg(test)]`
modules and comments are left out: tests may reach anywhere, and a doc link
is not an import. Exits 1 on a climb that is not allowed or a cycle.

    python3 scripts/wings.py            # summary
    python3 scripts/wings.py --edges    # every file-to-file import too
"""

import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "crates", "outbox-relay", "src")
LEVEL = {"ground": 0, "postgres": 1, "pipeline": 2, "sink": 3, "composition": 4}


def wing(path):
    top = path.split("/")[0]
    if path in ("main.rs", "lib.rs", "relay.rs") or top == "cli":
        return "composition"
    if top in ("sink", "pipeline", "postgres"):
        return top
    return "ground"


def module_of(path):
    """`pipeline/stream.rs` -> ["pipeline", "stream"]; `sink/mod.rs` -> ["sink"]."""
    parts = path[:-3].split("/")
    if parts[-1] == "mod" or parts == ["lib"] or parts == ["main"]:
        parts = parts[:-1]
    return parts


def code_lines(text):
    """The file's lines outside `#[cfg(test)]` modules, without comments."""
    lines = text.split("\n")
    out = []
    skip_depth = None
    pending_test = False
    depth = 0
    for line in lines:
        stripped = line.strip()
        if skip_depth is None and stripped == "#[cfg(test)]":
            pending_test = True
            continue
        opens, closes = line.count("{"), line.count("}")
        if pending_test:
            pending_test = False
            if re.match(r"(pub(\([a-z]+\))? )?mod \w+ \{", stripped):
                skip_depth = depth
                depth += opens - closes
                continue
        depth += opens - closes
        if skip_depth is not None:
            if depth <= skip_depth:
                skip_depth = None
            continue
        if stripped.startswith("//"):
            continue
        out.append(line.split("//")[0] if "://" not in line else line)
    return out


def main():
    files = {}
    for base, _, names in os.walk(ROOT):
        for name in names:
            if name.endswith(".rs"):
                path = os.path.relpath(os.path.join(base, name), ROOT).replace(os.sep, "/")
                files[path] = open(os.path.join(base, name), encoding="utf-8").read()
    by_module = {tuple(module_of(p)): p for p in files}

    def resolve(parts):
        for n in range(len(parts), 0, -1):
            hit = by_module.get(tuple(parts[:n]))
            if hit:
                return hit, parts[n:]
        return None, parts

    edges = {p: {} for p in files}
    path_re = re.compile(r"\b(crate|super)((?:::[A-Za-z_][A-Za-z0-9_]*)+|::\{)")
    for path, text in files.items():
        here = module_of(path)
        for line in code_lines(text):
            for m in path_re.finditer(line):
                segs = [s for s in m.group(2).split("::") if s and s != "{"]
                if m.group(1) == "crate":
                    parts = segs
                else:
                    ups = 1 + segs.count("super")
                    parts = here[: len(here) - ups] + [s for s in segs if s != "super"]
                # Only the module part of a path; the item name is dropped.
                parts = [s for s in parts if s[:1].islower() or s[:1] == "_"]
                target, _ = resolve(parts)
                if target and target != path:
                    edges[path][target] = edges[path].get(target, 0) + 1
                # `use crate::{a, b::c}` groups
            for m in re.finditer(r"\buse crate::\{([^}]*)\}", line):
                for item in m.group(1).split(","):
                    parts = [s for s in item.strip().split("::") if s and (s[:1].islower() or s[:1] == "_")]
                    target, _ = resolve(parts)
                    if target and target != path:
                        edges[path][target] = edges[path].get(target, 0) + 1

    wings = {}
    climbs = []
    for a, targets in edges.items():
        for b, n in targets.items():
            wa, wb = wing(a), wing(b)
            wings[(wa, wb)] = wings.get((wa, wb), 0) + n
            if LEVEL[wb] > LEVEL[wa]:
                allowed = a.startswith("config/") and b == "sink/mod.rs"
                climbs.append((a, b, n, allowed))

    # Tarjan's strongly connected components over the file graph.
    index, low, on, stack, comps = {}, {}, set(), [], []
    counter = [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            strong(v)

    print(f"{len(files)} files, {sum(len(t) for t in edges.values())} file-to-file imports")
    print("\nimports by wing (from -> to: paths):")
    for (wa, wb), n in sorted(wings.items(), key=lambda kv: (-LEVEL[kv[0][0]], -LEVEL[kv[0][1]])):
        print(f"  {wa:>11} -> {wb:<11} {n}")
    print("\nclimbs (to a higher wing):")
    for a, b, n, allowed in sorted(climbs):
        print(f"  {a} -> {b} ({n}){'  allowed: config holds the sections' if allowed else ''}")
    if not climbs:
        print("  none")
    print("\ncycles between files:")
    for comp in comps:
        print("  " + " <-> ".join(comp))
    if not comps:
        print("  none")
    if "--edges" in sys.argv:
        print("\nedges:")
        for a in sorted(edges):
            for b in sorted(edges[a]):
                print(f"  {a} -> {b}")
    bad = [c for c in climbs if not c[3]]
    return 1 if bad or comps else 0


if __name__ == "__main__":
    sys.exit(main())
