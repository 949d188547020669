"""Shared pytest setup. Area fixtures live in tests/fx_*.py, each owned by one area."""

pytest_plugins = [
    "tests.fx_images",
    "tests.fx_agent",
    "tests.fx_network",
    "tests.fx_inject",
    "tests.fx_runtime",
    "tests.fx_ray",
    "tests.fx_hostile",
    "tests.fx_service",
    "tests.fx_durations",
]
