"""The fleet simulator: request traces replayed over simulated replicas, routed by the router's own policies.

`replay.py` replays a trace request by request (`prefixserve simulate`); `pd_replay.py` step by step, with
prefill and decode roles (`simulate --pd`); `replica.py`, `steps.py` and `tier_model.py` are the simulated
replica, its decode steps and the tiers below its pool; `report.py` and `pd_report.py` print and plot. No torch:
it runs where the router runs.
"""
