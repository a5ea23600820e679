"""varuna-sdk: pipeline x data parallel training on pre-emptible VMs (after Varuna, arXiv 2111.04007).

Owns nothing itself; re-exports the public face of the sub-packages. Layering (DESIGN.md):
``notebook/cli -> manager -> cluster, planner, checkpoint -> pipeline -> model``.
"""

__version__ = "0.1.0"
