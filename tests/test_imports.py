"""The import graph of `dustin_jax/` and `kernels/`, read from the source.

Every import counts, at module level or inside a function: an import
deferred into a function body still ties the two modules together, it only
hides the cycle until the function runs. The rules:

* the graph of modules is acyclic;
* no module takes a private name (`_x`) of another one, by `from m import
  _x` or as `m._x`;
* `kernels/` stands alone: it never imports `dustin_jax` or `scripts`;
* the core package never imports `scripts`, `tests` or a measurement module
  of the package (benchmarks, profiling, evaluation); those sit on top of
  the core and may import it.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("dustin_jax", "kernels")
OUTSIDE = ("scripts", "tests")  # top-level packages that sit on top of everything
# a module of dustin_jax with a dotted-name part starting with one of these
# measures the package rather than being part of it
MEASUREMENT_PREFIXES = ("bench", "profil", "eval", "measur")


@dataclasses.dataclass(frozen=True)
class Edge:
  src: str
  dst: str
  name: str | None  # the name taken from `dst` (None: the module itself)
  line: int

  def where(self) -> str:
    return f"{module_path(self.src)}:{self.line}"


def find_modules() -> dict[str, pathlib.Path]:
  """Dotted module name -> file, for every module of PACKAGES."""
  mods = {}
  for pkg in PACKAGES:
    for path in sorted((ROOT / pkg).rglob("*.py")):
      parts = path.relative_to(ROOT).with_suffix("").parts
      if parts[-1] == "__init__":
        parts = parts[:-1]
      mods[".".join(parts)] = path
  return mods


MODULES = find_modules()


def module_path(name: str) -> str:
  return str(MODULES[name].relative_to(ROOT))


def _absolute(module: str, node: ast.ImportFrom) -> str:
  """The absolute name `from ... import` reads from (relative imports resolved)."""
  if not node.level:
    return node.module or ""
  pkg = module.split(".")
  if MODULES[module].name != "__init__.py":
    pkg = pkg[:-1]
  pkg = pkg[:len(pkg) - (node.level - 1)]
  return ".".join(pkg + ([node.module] if node.module else []))


def _known(name: str) -> str | None:
  """The longest prefix of `name` that is a module of PACKAGES."""
  parts = name.split(".")
  for i in range(len(parts), 0, -1):
    if ".".join(parts[:i]) in MODULES:
      return ".".join(parts[:i])
  return None


def _dotted(node: ast.AST) -> str | None:
  if isinstance(node, ast.Name):
    return node.id
  if isinstance(node, ast.Attribute):
    base = _dotted(node.value)
    return None if base is None else f"{base}.{node.attr}"
  return None


def scan(module: str) -> tuple[list[Edge], list[str]]:
  """(edges to modules of PACKAGES, imports of OUTSIDE packages as
  'where: name') of one module."""
  tree = ast.parse(MODULES[module].read_text(), str(MODULES[module]))
  edges, outside = [], []
  bound: dict[str, str] = {}  # local name -> module it refers to
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        if a.name.split(".")[0] in OUTSIDE:
          outside.append(f"{module_path(module)}:{node.lineno}: import {a.name}")
        dst = _known(a.name)
        if dst is not None:
          edges.append(Edge(module, dst, None, node.lineno))
          if a.asname:
            bound[a.asname] = a.name
          else:
            bound[a.name.split(".")[0]] = a.name.split(".")[0]
    elif isinstance(node, ast.ImportFrom):
      base = _absolute(module, node)
      if base.split(".")[0] in OUTSIDE:
        outside.append(f"{module_path(module)}:{node.lineno}: from {base} import ...")
      for a in node.names:
        sub = f"{base}.{a.name}"
        if sub in MODULES:
          edges.append(Edge(module, sub, None, node.lineno))
          bound[a.asname or a.name] = sub
        elif _known(base) is not None:
          edges.append(Edge(module, _known(base), a.name, node.lineno))
  for node in ast.walk(tree):  # `m._x` where m names another module
    if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
        and not node.attr.startswith("__"):
      base = _dotted(node.value)
      if base is None or base.split(".")[0] not in bound:
        continue
      first, *rest = base.split(".")
      dst = ".".join([bound[first]] + rest)
      if dst in MODULES:
        edges.append(Edge(module, dst, node.attr, node.lineno))
  return [e for e in edges if e.dst != module], outside


SCANS = {m: scan(m) for m in MODULES}
EDGES = [e for m in MODULES for e in SCANS[m][0]]


def is_measurement(module: str) -> bool:
  return any(p.startswith(MEASUREMENT_PREFIXES) for p in module.split(".")[1:])


def strongly_connected(nodes, succ) -> list[list[str]]:
  """Tarjan's strongly connected components (iterative)."""
  index, low, on_stack, stack, out = {}, {}, set(), [], []
  for root in nodes:
    if root in index:
      continue
    work = [(root, iter(succ[root]))]
    index[root] = low[root] = len(index)
    stack.append(root)
    on_stack.add(root)
    while work:
      v, it = work[-1]
      w = next(it, None)
      if w is not None:
        if w not in index:
          index[w] = low[w] = len(index)
          stack.append(w)
          on_stack.add(w)
          work.append((w, iter(succ[w])))
        elif w in on_stack:
          low[v] = min(low[v], index[w])
        continue
      work.pop()
      if work:
        low[work[-1][0]] = min(low[work[-1][0]], low[v])
      if low[v] == index[v]:
        comp = []
        while True:
          w = stack.pop()
          on_stack.discard(w)
          comp.append(w)
          if w == v:
            break
        out.append(sorted(comp))
  return out


def shortest_cycle(start: str, comp: set[str], succ) -> list[str]:
  """The shortest path start -> ... -> start inside `comp` (breadth first)."""
  prev, frontier = {}, [start]
  while frontier:
    nxt = []
    for v in frontier:
      for w in sorted(succ[v]):
        if w not in comp:
          continue
        if w == start:
          path = [v]
          while path[-1] != start:
            path.append(prev[path[-1]])
          return [start] + path[::-1][1:] + [start]
        if w not in prev:
          prev[w] = v
          nxt.append(w)
    frontier = nxt
  return [start]


def test_import_graph_is_acyclic():
  succ = {m: sorted({e.dst for e in EDGES if e.src == m}) for m in MODULES}
  report = []
  for comp in strongly_connected(sorted(MODULES), succ):
    if len(comp) < 2:
      continue
    cycle = shortest_cycle(comp[0], set(comp), succ)
    lines = [" -> ".join(cycle)]
    for a, b in zip(cycle, cycle[1:]):
      lines.append(f"  {a} -> {b}: " + ", ".join(sorted({e.where() for e in EDGES
                                                         if e.src == a and e.dst == b})))
    inner = sorted({f"    {e.src} -> {e.dst} ({e.where()})" for e in EDGES
                    if e.src in comp and e.dst in comp})
    lines.append(f"  all {len(inner)} imports among these {len(comp)} modules:")
    lines += inner
    report.append("\n".join(lines))
  if report:
    pytest.fail("import cycles:\n" + "\n".join(report), pytrace=False)


def test_no_private_names_across_modules():
  bad = [f"{e.where()}: {e.src} takes {e.dst}.{e.name}" for e in EDGES
         if e.name and e.name.startswith("_") and not e.name.startswith("__")]
  if bad:
    pytest.fail("private names used across modules:\n" + "\n".join(sorted(set(bad))),
                pytrace=False)


def test_kernels_stand_alone():
  bad = [f"{e.where()}: {e.src} imports {e.dst}" for e in EDGES
         if e.src.split(".")[0] == "kernels" and e.dst.split(".")[0] != "kernels"]
  bad += [o for m in MODULES if m.split(".")[0] == "kernels" for o in SCANS[m][1]]
  if bad:
    pytest.fail("kernels/ must not import the package or scripts:\n" + "\n".join(bad),
                pytrace=False)


def test_core_does_not_import_measurement_or_scripts():
  core = [m for m in MODULES if m.split(".")[0] == "dustin_jax" and not is_measurement(m)]
  bad = [f"{e.where()}: {e.src} imports {e.dst}" for e in EDGES
         if e.src in core and is_measurement(e.dst)]
  bad += [o for m in core for o in SCANS[m][1]]
  if bad:
    pytest.fail("the core package must not import measurement modules, scripts or tests:\n"
                + "\n".join(bad), pytrace=False)


def test_the_scan_sees_the_package():
  # guards the rules above against passing on an empty or misread graph
  assert "dustin_jax.config" in MODULES and "kernels.common" in MODULES
  assert any(e.src == "dustin_jax.cache" and e.dst == "dustin_jax.config" for e in EDGES)
  assert not is_measurement("dustin_jax.cache") and is_measurement("dustin_jax.profiling.search")
