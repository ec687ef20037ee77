"""What SGLang's receiving rank (``rank.py``) and the probes (``wire_schema.py``,
``launch_args.py``) import when they run with one version's source first on the path,
imported once by that version's session fork server (``forks.py``). A module the version
cannot import here (0.5.10's ``srt/utils/common.py`` needs torchvision) is left out: the
forked process tries it and fails as a fresh one would, and goes on as it does then."""

from __future__ import annotations

from tests.session_forks import preload

preload(("torch", "pydantic", "msgspec", "tests.engines.rollout.sglang.rank"))
preload(("tests.engines.rollout.sglang.launch_args", "tests.engines.rollout.sglang.wire_schema"))
preload(
    (
        "sglang",
        "sglang.srt.utils.common",
        "sglang.srt.weight_sync.tensor_bucket",
        "sglang.srt.server_args",
        "sglang.srt.sampling.sampling_params",
        "sglang.cli.main",
        "sglang.cli.serve",
    ),
    optional=True,
)
