"""Calibration: measures compute, memory and network primitives once into a versioned Profile (paper §4.3).

``profile`` — the ``Profile`` type (JSON, versioned); ``calibrate`` — one model's segments and
the engine's own costs; ``network`` — the host probes (p2p, all-reduce, shared cores) in spawned
processes; ``job`` — a ``JobConfig``'s calibration, cached (``calibrate_job``, ``profile_key``).
Never imports ``planner``, ``trainer``, ``cluster`` or ``manager``.
"""
