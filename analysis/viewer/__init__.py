"""``rtrees view``: a local, read-only web page over a store (issue 26).

``server.serve(store, port)`` serves the page on 127.0.0.1 to its owner only: every
route needs the access token of the URL it prints (``server.py`` says why the standard
library's ``http.server`` and how the server stays local, private and read-only);
``data.ViewerData`` answers its questions from the store's locked-down DuckDB views
(``data.ViewerStores``: several stores at once, issue 48);
the page itself is ``static/index.html`` with ``static/viewer.js`` (plain DOM and SVG
drawn by our own script: no library, no CDN, works offline) and ``static/viewer.css``.
"""

from analysis.viewer.data import FilterError, ViewerData, ViewerStores, checked_where
from analysis.viewer.server import HOST, ViewerServer, serve, start

__all__ = ["HOST", "FilterError", "ViewerData", "ViewerServer", "ViewerStores",
           "checked_where", "serve", "start"]
