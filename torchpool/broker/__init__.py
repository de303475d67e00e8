"""The broker: frontend, registry, scheduling and worker supervision.

The map of which module owns what, and how a request flows through them, is
at the top of `server.py`.
"""
