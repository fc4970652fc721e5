"""workloads: what a run replays (traces, synthetic workloads, length replay on real engines)"""
