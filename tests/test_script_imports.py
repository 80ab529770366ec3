"""Tests run in one process, and absl refuses a flag defined twice: the
script modules the tests import (and the script modules those import) must
not define the same flag. Helpers that tests need live in flag-free modules
such as `scripts.benchmarking`."""

import ast
import collections
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFINE = re.compile(r"flags\.DEFINE_\w+\(\s*\"(\w+)\"")


def script_imports(path: pathlib.Path) -> set[str]:
  """The `scripts.<name>` modules one file imports."""
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("scripts."):
      names.add(node.module.split(".")[1])
    elif isinstance(node, ast.Import):
      names.update(a.name.split(".")[1] for a in node.names if a.name.startswith("scripts."))
  return names


def test_script_modules_imported_by_tests_define_each_flag_once():
  todo = set().union(*(script_imports(p) for p in (ROOT / "tests").rglob("*.py")))
  assert {"benchmarking", "decode"} <= todo
  seen = set()
  while todo:
    module = todo.pop()
    seen.add(module)
    todo |= script_imports(ROOT / "scripts" / f"{module}.py") - seen
  owners = collections.defaultdict(list)
  for module in sorted(seen):
    for name in DEFINE.findall((ROOT / "scripts" / f"{module}.py").read_text()):
      owners[name].append(module)
  clashes = {name: mods for name, mods in owners.items() if len(mods) > 1}
  assert not clashes, f"flags defined by more than one script the tests import: {clashes}"
