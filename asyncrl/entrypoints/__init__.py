"""One entry module per process of a run.

- :mod:`asyncrl.entrypoints.run`: the controller process (``asyncrl run``; no torch).
- :mod:`asyncrl.entrypoints.engine`: an embedded rollout engine (``asyncrl serve``;
  ``python -m asyncrl.entrypoints.engine``). SGLang servers are SGLang's own processes.
- :mod:`asyncrl.entrypoints.trainer`: one trainer rank (``python -m
  asyncrl.entrypoints.trainer``), started by the run's launcher.

Code reachable from an entry module runs in that process only; the import check in
``tests/test_layout.py`` keeps the sides apart.
"""
