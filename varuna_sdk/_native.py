"""The compiled C++ core (``csrc/``, built by ``pip install``), imported in one place with an
error that says how to build it. Schedules (``pipeline.schedule``), the simulator and the search
(``planner``) all reach it through here."""

try:
    from varuna_sdk import _core as core
except ImportError as exc:  # pragma: no cover - only without a built extension
    raise ImportError(
        "varuna_sdk._core (the C++ core: schedules, simulator, search) is not built; build it with "
        "`pip install --no-build-isolation -e .` from the repository root (or run `make setup`)"
    ) from exc

__all__ = ["core"]
