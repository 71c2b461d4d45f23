"""MkDocs hook: the Sphinx roles in docstrings (``:func:`x```, ``:mod:`x```, ...) as links.

The docstrings are numpydoc with Sphinx roles, which read well in ``help()`` and in the source;
mkdocstrings renders the role's name as text (``:func:<code>x</code>``). Here each one becomes
the code alone, linked to the object's entry when this page documents it (mkdocstrings gives
each entry its dotted path as id). ``~`` shows the last component only, as in Sphinx.
"""

import re

_ROLE = re.compile(r":(?:func|mod|class|meth|attr|data|obj|exc):<code>(~?)([\w.]+)</code>")


def on_page_content(content, page, **kwargs):
    ids = set(re.findall(r'id="([\w.]+)"', content))

    def sub(m):
        short, path = m.groups()
        text = path.rsplit(".", 1)[-1] if short else path
        full = next((c for c in (path, "sdpa_numba." + path) if c in ids), None)
        code = f"<code>{text}</code>"
        return f'<a href="#{full}">{code}</a>' if full else code

    return _ROLE.sub(sub, content)
