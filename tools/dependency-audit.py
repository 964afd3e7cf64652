#!/usr/bin/env python3
"""For each direct dependency (normal and build): the crates that only it brings, i.e. what removing it
would remove from the graph. Usage: python3 tools/dependency-audit.py [PROJECT_DIR]"""
import json
import subprocess
import sys

project = sys.argv[1] if len(sys.argv) > 1 else "."
meta = json.loads(subprocess.check_output(
    ["cargo", "metadata", "--format-version", "1", "--filter-platform", "x86_64-unknown-linux-gnu"],
    cwd=project))
nodes = {node["id"]: node for node in meta["resolve"]["nodes"]}
names = {package["id"]: package["name"] for package in meta["packages"]}


def linked(node_id):
    """Normal and build dependencies of a package (dev-dependencies never reach the binary)."""
    return [dep["pkg"] for dep in nodes[node_id]["deps"]
            if any(kind["kind"] in (None, "build") for kind in dep["dep_kinds"])]


def reachable(starts):
    seen, stack = set(), list(starts)
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(linked(node))
    return seen


direct = linked(meta["resolve"]["root"])
everything = reachable(direct)
print(f"crates (normal and build): {len(everything)}")
rows = []
for dependency in direct:
    only = everything - reachable([d for d in direct if d != dependency]) - {dependency}
    rows.append((len(only), names[dependency], sorted(names[c] for c in only)))
for count, name, only in sorted(rows, key=lambda row: (-row[0], row[1])):
    print(f"{count:4} {name}: {' '.join(only)}")
