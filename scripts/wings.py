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
files (Tarjan's strongly connected components). A parent naming its own child
module (`mod.rs` re-exporting or calling into a file it declares) is the
module tree, not an import: every child is reached through its parent, so
those are counted apart and left out of the cycles; a child using its parent
(`super::`) is an import. Code of `#[cfg(test)]`
modules and comments are left out: tests may reach anywhere, and a doc link
is not an import. Exits 1 on a climb that is not allowed or a cycle.

    python3 scripts/wings.py            # summary
    python3 scripts/wings.py --edges    # every file-to-file import too
    python3 scripts/wings.py --tree     # cycles counting a parent's uses of its children too
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

    # What each file hands on from elsewhere (`pub use x::Name;`, `pub use x::{A, b::C}`,
    # `pub use x::*`): a path through the re-export is an import of the file that defines it.
    reexports = {p: {} for p in files}
    globs = {p: [] for p in files}
    for path, text in files.items():
        here = module_of(path)
        for line in code_lines(text):
            m = re.match(r"\s*pub(?:\([a-z]+\))? use (.*);", line)
            if not m:
                continue
            spec = m.group(1)
            if "{" in spec:
                base, inner = spec.split("{", 1)
                names = [x.strip() for x in inner.rstrip("}").split(",") if x.strip()]
            else:
                base, _, last = spec.rpartition("::")
                names = [last]
            segs = [x for x in base.strip(":").split("::") if x]
            if segs[:1] == ["crate"]:
                mod = segs[1:]
            elif segs[:1] == ["super"]:
                mod = here[: len(here) - segs.count("super")] + [x for x in segs if x != "super"]
            else:
                mod = here + [x for x in segs if x != "self"]
            for name in names:
                if name == "*":
                    globs[path].append(mod)
                elif name != "self":
                    orig, _, alias = name.partition(" as ")
                    reexports[path][(alias or orig).strip()] = mod + orig.strip().split("::")

    def defines(path, name):
        pattern = r"\b(fn|struct|enum|trait|type|const|static|mod)\s+" + re.escape(name) + r"\b"
        return re.search(pattern, files[path]) is not None

    def resolve_item(parts, depth=0):
        target, rest = resolve(parts)
        if target is None or not rest or depth > 8:
            return target
        if rest[0] in reexports[target]:
            return resolve_item(reexports[target][rest[0]] + rest[1:], depth + 1) or target
        for mod in globs[target]:
            inner, _ = resolve(mod)
            if inner and defines(inner, rest[0]):
                return resolve_item(mod + rest, depth + 1) or target
        return target

    edges = {p: {} for p in files}
    children = {p: set() for p in files}
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
                target = resolve_item(parts)
                if target and target != path:
                    if module_of(target)[:-1] == here:
                        children[path].add(target)
                    else:
                        edges[path][target] = edges[path].get(target, 0) + 1
                # `use crate::{a, b::c}` groups
            # A parent naming its child's items by a relative path (`use sns::SnsSink`,
            # `sqs::SqsSink::new(..)` in the registry) imports that child too.
            # Kept apart from the imports: a parent reaches every child it declares, so
            # counting those would make each child that uses its parent a "cycle".
            for m in re.finditer(r"(?<![:\w])(?:self::)?([a-z_][a-z0-9_]*)::", line):
                target = by_module.get(tuple(here + [m.group(1)]))
                if target and target != path:
                    children[path].add(target)
            for m in re.finditer(r"\buse crate::\{([^}]*)\}", line):
                for item in m.group(1).split(","):
                    parts = [s for s in item.strip().split("::") if s and s != "self"]
                    target = resolve_item(parts)
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
        for w in list(edges[v]) + (sorted(children[v]) if "--tree" in sys.argv else []):
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

    print(
        f"{len(files)} files, {sum(len(t) for t in edges.values())} file-to-file imports "
        f"(besides {sum(len(c) for c in children.values())} uses of a module by its own parent)"
    )
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
