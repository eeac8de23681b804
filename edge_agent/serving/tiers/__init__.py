"""The tier machinery both workloads share, below them: the ladder (``ladder.py``: the active tier, one
switch at a time, the first tier that loads), the pure decision and the policy from config (``policy.py``),
the controller thread that applies it (``control.py``), admission's prediction and verdict
(``admission.py``) and an engine swapped in place (``engine_swap.py``). Nothing here imports a workload
(``serving.llm``, ``serving.asr``) or a door."""
