"""Pieces that run inside other programs (a gateway), never inside the daemon.

Each one is an optional extra (`pip install 'vacancyd[litellm]'`) and imports its host's
library; no module of the daemon imports this package (pyproject.toml's contracts).
"""
