"""InfiniGen and its baselines over one transformers adapter. From Python (infinigen/api.py, README "Use it from
Python"): `load_model`, `load_method`, `apply`, `generate`; imported on first use, so `import infinigen` stays cheap."""

from infinigen import selected  # noqa: F401  -- registers the config resolver conf/method/infinigen.yaml reads

API = ("load_model", "load_method", "apply", "generate", "Generation", "method_names", "model_names")


def __getattr__(name: str):
    if name in API:
        from infinigen import api

        return getattr(api, name)
    raise AttributeError(f"module 'infinigen' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(API))
