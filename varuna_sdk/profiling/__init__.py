"""Calibration: measures compute, memory and network primitives once into a versioned Profile (paper §4.3)."""
