"""The broker: frontend, registry, scheduling and worker supervision."""
