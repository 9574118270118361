"""Griffe extension for the API pages: reStructuredText roles in docstrings become Markdown code.

The package's docstrings cross-reference with Sphinx roles (``:class:`MemoryParts```, ``:func:`train```);
the site renders Markdown, so ``:role:`~a.b.Name``` is shown as ``Name`` in code (``a.b.Name`` without ``~``).
"""
import re

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|obj|exc|const):`(~?)([^`]+)`")


def _code(m: "re.Match") -> str:
    target = m.group(2)
    if m.group(1):
        target = target.rsplit(".", 1)[-1]
    return f"`{target}`"


class RstRoles(griffe.Extension):
    def on_instance(self, *, obj, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(_code, obj.docstring.value)
