"""MkDocs hook: render the TeX that ``pymdownx.arithmatex`` (``generic: true``) leaves in the
page as MathML, at build time, with latex2mathml (in the ``docs`` extra).

arithmatex protects the TeX from Markdown and wraps it as ``<span class="arithmatex">\\(..\\)
</span>`` (inline) or ``<div class="arithmatex">\\[..\\]</div>`` (display); every modern
browser draws MathML natively, so the pages need no JavaScript and no network connection.
A formula that latex2mathml cannot convert stops the build with its text in the message.
"""

import html
import re

from latex2mathml.converter import convert

_INLINE = re.compile(r'<span class="arithmatex">\\\((.+?)\\\)</span>', re.S)
_BLOCK = re.compile(r'<div class="arithmatex">\\\[(.+?)\\\]</div>', re.S)


def _render(tex, display, page):
    tex = html.unescape(tex).strip()
    try:
        return convert(tex, display=display)
    except Exception as exc:
        raise ValueError(f"{page.file.src_path}: cannot render TeX {tex!r}: {exc}") from exc


def on_page_content(content, page, **kwargs):
    content = _BLOCK.sub(lambda m: '<div class="math-display">'
                         + _render(m.group(1), "block", page) + "</div>", content)
    return _INLINE.sub(lambda m: _render(m.group(1), "inline", page), content)
