"""The package's import graph has no cycles, counting imports inside functions too.

A module of `vision_mlp_bwd` that imports another (at the top or lazily) is an
edge; `from package import name` is an edge to `package.name` where that is a
module. Importing a submodule runs its parent package first, which is not
counted: a parent that imports its children is the usual layout.
"""

from __future__ import annotations

import ast
import pathlib

import vision_mlp_bwd

PACKAGE_DIR = pathlib.Path(vision_mlp_bwd.__file__).parent
PACKAGE = "vision_mlp_bwd"


def _modules():
  """Module name -> source path for every module of the package."""
  modules = {}
  for path in PACKAGE_DIR.rglob("*.py"):
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts = parts[:-1]
    modules[".".join(parts)] = path
  return modules


def _imports(name, source, modules, is_package=False):
  here = name if is_package else name.rpartition(".")[0]
  targets = set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      targets |= {alias.name for alias in node.names}
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        anchor = here.split(".")[: len(here.split(".")) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
      for alias in node.names:
        full = f"{base}.{alias.name}"
        targets.add(full if full in modules else base)
  return {t for t in targets if t in modules and t != name}


def _cycles(graph):
  state, cycles = {}, []

  def visit(node, stack):
    state[node] = "open"
    for child in sorted(graph[node]):
      if state.get(child) == "open":
        cycles.append(stack[stack.index(child):] + [child])
      elif child not in state:
        visit(child, stack + [child])
    state[node] = "done"

  for name in sorted(graph):
    if name not in state:
      visit(name, [name])
  return cycles


def _graph():
  modules = _modules()
  return {name: _imports(name, path.read_text(), modules, path.name == "__init__.py")
          for name, path in modules.items()}


def test_no_import_cycles():
  graph = _graph()
  assert f"{PACKAGE}.backends.shared" in graph[f"{PACKAGE}.backends.triton"]
  cycles = _cycles(graph)
  assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_a_lazy_import_back_into_sharding_would_be_found():
  """The former cycle: the Triton backend importing `sharding` inside a function."""
  graph = _graph()
  modules = _modules()
  lazy = "def backward():\n  from vision_mlp_bwd.sharding import in_shard_map\n"
  name = f"{PACKAGE}.backends.triton"
  graph[name] = graph[name] | _imports(name, lazy, modules, is_package=True)
  assert any(f"{PACKAGE}.sharding" in cycle for cycle in _cycles(graph))
