"""engine/env.py: a METRALE_ variable outside its documented set stands in as its default at import and is named
by env.check(), which every engine's creation calls (the command line calls it before anything else)."""
from __future__ import annotations

import importlib

import pytest

from engine import env
from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.runtime import Runtime


@pytest.fixture()
def reloaded_env(monkeypatch):
    """env re-read under the test's variables, then restored as the process had it."""
    def reload(**variables):
        for name, value in variables.items():
            monkeypatch.setenv(name, value)
        return importlib.reload(env)
    yield reload
    monkeypatch.undo()
    importlib.reload(env)


def test_values_in_their_sets_are_taken(reloaded_env):
    e = reloaded_env(METRALE_GEMM="cublas", METRALE_LOG_LEVEL="warning", METRALE_PDL="0", METRALE_DECODE_WARP="1",
                     METRALE_W8A8_SKINNY_ROWS="0", METRALE_PREFILL_GRAPH_TOKENS="2048", METRALE_GEMM_SILU_ROWS="128")
    assert (e.GEMM, e.LOG_LEVEL, e.PDL, e.DECODE_WARP, e.W8A8_SKINNY_ROWS, e.PREFILL_GRAPH_TOKENS, e.GEMM_SILU_ROWS) == (
        "cublas", "WARNING", False, True, 0, 2048, 128)
    assert e.PROBLEMS == []
    e.check()


def test_values_outside_their_sets_fall_back_and_are_named(reloaded_env):
    e = reloaded_env(METRALE_GEMM="sm100", METRALE_PDL="false", METRALE_CUDNN_MIN_KEYS="4k")
    assert (e.GEMM, e.PDL, e.CUDNN_MIN_KEYS) == ("sm90", True, 4096)  # the defaults, until check() refuses them
    with pytest.raises(ConfigError) as info:
        e.check()
    message = str(info.value)
    for part in ("METRALE_GEMM='sm100'", "METRALE_PDL='false'", "METRALE_CUDNN_MIN_KEYS='4k'", "sm90, cublas, sm90-all"):
        assert part in message, message


def test_an_engine_is_not_created_under_a_bad_variable(reloaded_env, tiny_model):
    reloaded_env(METRALE_STEP_WAIT="busy")
    with pytest.raises(ConfigError, match="METRALE_STEP_WAIT='busy' is not one of poll, thread"):
        Runtime.create(EngineConfig(model=str(tiny_model), device="cpu"))
