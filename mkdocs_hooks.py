"""MkDocs hook for `make docs`: the nav in mkdocs.yml names every page the site may have.

Entries whose file is not in docs/ yet are dropped (pages written in parallel
appear once they land), and pages in docs/ that the nav does not name are
listed under "More", so adding a page never breaks the strict build.
"""
from __future__ import annotations

import os


def _filter(items, docs_dir, named):
    out = []
    for item in items:
        if isinstance(item, dict):
            (title, value), = item.items()
            if isinstance(value, list):
                children = _filter(value, docs_dir, named)
                if children:
                    out.append({title: children})
                continue
            item_path = value
        else:
            title, item_path = None, item
        if item_path.startswith(("http://", "https://")) or os.path.exists(os.path.join(docs_dir, item_path)):
            named.add(item_path)
            out.append(item if title is None else {title: item_path})
    return out


def on_config(config, **kwargs):
    docs_dir = config["docs_dir"]
    named: set[str] = set()
    nav = _filter(config["nav"] or [], docs_dir, named)
    extra = []
    for directory, _, files in os.walk(docs_dir):
        for name in sorted(files):
            if name.endswith(".md"):
                path = os.path.relpath(os.path.join(directory, name), docs_dir).replace(os.sep, "/")
                if path not in named:
                    extra.append(path)
    if extra:
        nav.append({"More": sorted(extra)})
    config["nav"] = nav
    return config
