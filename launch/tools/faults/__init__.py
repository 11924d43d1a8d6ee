"""Faults on purpose: ``fault_sweep`` (bad inputs and faults, each answer tabulated:
``python -m launch.tools.fault_sweep``), ``fault_injection`` (``python -m pretrain`` with a fault injected)
and ``chaos`` (a job under random faults against an uninterrupted one: ``python -m launch.chaos``)."""
