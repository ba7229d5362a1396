"""One way to name a model's configuration in Python, for every config class
of the binding (MoEModelConfig, MLAConfig): a preset name, a Hugging Face
config (a dict, a transformers PretrainedConfig, or a config.json path) or
an instance, with keyword overrides."""

from __future__ import annotations

import json
from typing import Any


def resolve_config(cls, model: Any, overrides: dict, unknown_field: str):
    """An instance of `cls` (a binding config class with preset(),
    from_hf_config_json() and validate()) from `model`, fields overridden by
    `overrides`; TypeError "moelink: <unknown_field> <name>" for a field the
    class lacks."""
    if isinstance(model, cls):
        cfg = model
    elif isinstance(model, str) and model.endswith(".json"):
        with open(model) as f:
            cfg = cls.from_hf_config_json(f.read())
    elif isinstance(model, str):
        cfg = cls.preset(model)
    else:
        d = model if isinstance(model, dict) else model.to_dict()
        cfg = cls.from_hf_config_json(json.dumps(d, default=str))
    for k, v in overrides.items():
        if not hasattr(cfg, k):
            raise TypeError(f"moelink: {unknown_field} {k!r}")
        setattr(cfg, k, v)
    cfg.validate()
    return cfg
