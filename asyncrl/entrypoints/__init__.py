"""One entry module per process of a run.

- :mod:`asyncrl.entrypoints.run`: the controller process (``asyncrl run``; no torch).
- :mod:`asyncrl.entrypoints.engine`: an embedded rollout engine (``asyncrl serve``;
  ``python -m asyncrl.entrypoints.engine``). SGLang servers are SGLang's own processes.
- :mod:`asyncrl.entrypoints.trainer`: one trainer rank (``python -m
  asyncrl.entrypoints.trainer``), started by the run's launcher.
- :mod:`asyncrl.entrypoints.keyed`: the front of an SGLang or vLLM server the run
  launches: gives it the run secret as ``--api-key`` in memory, then runs the server's
  own module in the same process (docs/security.md).
- :mod:`asyncrl.entrypoints.forkserver`: the fork server (:mod:`asyncrl.forkserver`):
  imports the trainer's and engine's modules once and forks them; its children run
  their own entry module and become that process.

Code reachable from an entry module runs in that process only; the import check in
``tests/test_layout.py`` keeps the sides apart.
"""
