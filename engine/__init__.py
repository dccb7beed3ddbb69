"""The model on one device: weights, paged KV cache, sequences, sampling, speculative verify."""
from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine

__all__ = ["Engine", "EngineConfig", "ModelConfig"]
