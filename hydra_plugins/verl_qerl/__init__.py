"""Hydra discovers plugins in the ``hydra_plugins`` namespace package; see verl_qerl_searchpath.py."""
