"""Partitioning: measure the layers (``profile``), cut them optimally (``solve``), say what was found (``report``).

Used by both public classes before anything runs; it knows nothing of threads or processes.
"""
