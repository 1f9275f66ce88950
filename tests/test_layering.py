"""No module of tokenmill imports itself back, through any chain of imports.

The layers and the loops between sibling packages are import-linter's contracts
(pyproject.toml, run by `lint-imports` in scripts/test.sh). They do not see a loop between
a package and one of its own modules (loader/__init__.py's dispatch importing the readers
that import its types), nor one through the package root (tokenmill/__init__.py re-exports
tokenmill.llm): this test walks the whole module graph for those. grimp (import-linter's
graph) counts every import: at module level, inside a function, or under TYPE_CHECKING.
"""

from __future__ import annotations

import grimp


def test_no_module_imports_itself_back():
    graph = grimp.build_graph("tokenmill", cache_dir=None)
    loops = []
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back:  # (imported, ..., importer)
                loops.append(" -> ".join((importer, *back)))
    assert not loops, "import loops:\n" + "\n".join(loops)
