#!/usr/bin/env python3
"""Import circles between a crate's top-level modules (issue 31).

For each crate source directory given (default: crates/meshd/src and
crates/meshd-proto/src), every .rs file is read as the top-level module it belongs to
(`tunnel.rs`, `tunnel/near.rs` -> `tunnel`); its `crate::X`, `super::...` and `self::...`
paths are resolved to the top-level module they name, and each reference to another
top-level module is an edge. Test code is left out: files named tests.rs or *_tests.rs,
files under a tests/ folder, and `#[cfg(test)] mod ... { ... }` blocks. Comments are left
out too. Names the crate root re-exports (`pub use id::NodeId;`) count for their module.

Prints the edges' strongly connected components that hold more than one module (each an
import circle), every edge inside them with the places that make it, and the shortest
circle through each edge. Exit status 1 when there is a circle, else 0.

    python3 scripts/import-graph.py [SRC_DIR ...] [--all-edges]
"""

import os
import re
import sys
from collections import defaultdict, deque

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


def strip_comments(text):
    """Blanks // and /* */ comments and string literals, keeping line numbers."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append("\n" * text.count("\n", i, j))
            i = j
        elif c == '"' and not re.match(r"[A-Za-z0-9_']", text[i - 1] if i else " "):
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j + 1
        elif c == "'" and re.match(r"'(\\.|[^\\'])'", text[i : i + 4]):
            # a char literal (not a lifetime)
            m = re.match(r"'(\\.|[^\\'])'", text[i:])
            out.append("' '")
            i += m.end()
        else:
            out.append(c)
            i += 1
    return "".join(out)


def strip_test_mods(text):
    """Blanks `#[cfg(test)]` items that are inline blocks (`mod x { ... }`) or declarations."""
    out = list(text)
    for m in re.finditer(r"#\[cfg\(test\)\]", text):
        j = m.end()
        k = text.find("{", j)
        semi = text.find(";", j)
        if semi >= 0 and (k < 0 or semi < k):
            end = semi + 1
        else:
            depth, end = 0, k
            while end < len(text):
                if text[end] == "{":
                    depth += 1
                elif text[end] == "}":
                    depth -= 1
                    if depth == 0:
                        end += 1
                        break
                end += 1
        for p in range(m.start(), end):
            if out[p] != "\n":
                out[p] = " "
    return "".join(out)


def module_path(rel):
    """`tunnel/near.rs` -> ['tunnel', 'near']; `foo/mod.rs` -> ['foo']; lib.rs -> []."""
    parts = rel[:-3].split(os.sep)
    if parts[-1] in ("mod", "lib", "main"):
        parts = parts[:-1]
    return parts


def path_heads(text):
    """Every path that starts with crate/super/self, as (line, [segments])."""
    found = []
    for m in re.finditer(r"(?<![A-Za-z0-9_:$])(\$?crate|super|self)((?:::(?:super|" + IDENT + r"))*)::(\{)?", text):
        line = text.count("\n", 0, m.start()) + 1
        base = [m.group(1).lstrip("$")] + [s for s in m.group(2).split("::") if s]
        if m.group(3):
            # a brace group: the first segment of each item at depth 0
            depth, j, item = 1, m.end(), ""
            items = []
            while j < len(text) and depth:
                ch = text[j]
                if ch == "{":
                    depth += 1
                elif ch == "}":
                    depth -= 1
                if depth == 1 and ch == ",":
                    items.append(item)
                    item = ""
                elif depth >= 1 and not (depth == 1 and ch == "{" and not item.strip()):
                    item += ch
                j += 1
            items.append(item)
            for it in items:
                first = re.match(r"\s*(" + IDENT + r")", it)
                if first:
                    found.append((line, base + [first.group(1)]))
        else:
            nxt = re.match(IDENT, text[m.end() :])
            found.append((line, base + ([nxt.group(0)] if nxt else [])))
    return found


def resolve(segs, here):
    """The absolute module path a `crate::`/`super::`/`self::` path starts from, plus the rest."""
    cur = list(here)
    i = 0
    if segs[0] == "crate":
        cur, i = [], 1
    while i < len(segs) and segs[i] in ("super", "self"):
        if segs[i] == "super":
            cur = cur[:-1]
        i += 1
    return cur + segs[i:]


def root_reexports(src, top):
    """Names the crate root re-exports from one of its modules: name -> module."""
    names = {}
    for root in ("lib.rs", "main.rs"):
        p = os.path.join(src, root)
        if not os.path.exists(p):
            continue
        text = strip_comments(open(p, encoding="utf-8").read())
        for m in re.finditer(r"pub use (" + IDENT + r")::([^;]*);", text):
            if m.group(1) not in top:
                continue
            for name in re.findall(IDENT + r"(?=\s*(?:,|\}|$))", m.group(2)):
                names[name] = m.group(1)
    return names


def is_test_file(rel):
    parts = rel.split(os.sep)
    name = parts[-1]
    return name == "tests.rs" or name.endswith("_tests.rs") or "tests" in parts[:-1]


def graph(src):
    files = []
    for d, _, fs in os.walk(src):
        for f in fs:
            if f.endswith(".rs"):
                rel = os.path.relpath(os.path.join(d, f), src)
                if not is_test_file(rel):
                    files.append(rel)
    top = {module_path(r)[0] for r in files if module_path(r)}
    reexp = root_reexports(src, top)
    edges = defaultdict(list)  # (a, b) -> [file:line]
    for rel in sorted(files):
        here = module_path(rel)
        if not here:
            continue
        text = strip_test_mods(strip_comments(open(os.path.join(src, rel), encoding="utf-8").read()))
        for line, segs in path_heads(text):
            target = resolve(segs, here)
            if not target:
                continue
            t = target[0] if target[0] in top else reexp.get(target[0])
            if t and t != here[0]:
                edges[(here[0], t)].append(f"{rel}:{line}")
    return top, edges


def sccs(nodes, adj):
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(adj[v]):
            if w not in index:
                visit(w)
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
            out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def shortest_back(adj, start, goal, allowed):
    """Shortest path start -> goal inside `allowed` (BFS), as a list of modules."""
    prev, q = {start: None}, deque([start])
    while q:
        v = q.popleft()
        if v == goal:
            path = []
            while v is not None:
                path.append(v)
                v = prev[v]
            return path[::-1]
        for w in sorted(adj[v]):
            if w in allowed and w not in prev:
                prev[w] = v
                q.append(w)
    return None


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    all_edges = "--all-edges" in sys.argv
    srcs = args or ["crates/meshd/src", "crates/meshd-proto/src"]
    circles = 0
    for src in srcs:
        top, edges = graph(src)
        adj = defaultdict(set)
        for a, b in edges:
            adj[a].add(b)
        print(f"== {src}: {len(top)} top-level modules, {len(edges)} edges between them")
        if all_edges:
            for (a, b), where in sorted(edges.items()):
                print(f"  {a} -> {b}  ({len(where)}: {', '.join(where[:3])}{' ...' if len(where) > 3 else ''})")
        for comp in sccs(top, adj):
            if len(comp) < 2:
                continue
            circles += 1
            members = set(comp)
            print(f"circle: {' '.join(comp)}")
            for (a, b), where in sorted(edges.items()):
                if a in members and b in members:
                    back = shortest_back(adj, b, a, members)
                    loop = " -> ".join([a] + back) if back else "?"
                    shown = ", ".join(where[:4]) + (f" (+{len(where) - 4})" if len(where) > 4 else "")
                    print(f"  {a} -> {b}: {shown}")
                    print(f"      closes {loop}")
        if not any(len(c) > 1 for c in sccs(top, adj)):
            print("no circles")
    sys.exit(1 if circles else 0)


if __name__ == "__main__":
    main()
