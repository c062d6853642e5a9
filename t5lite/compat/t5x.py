"""t5x's names for t5lite's models and optimizer, so t5x code and gin files port with few edits.

Each alias takes every field of the t5lite class it builds, plus t5x's spelling of the same
settings, and returns the plain t5lite object (nothing here is a second implementation):

- `EncoderDecoderModel` / `DecoderOnlyModel`: `module` -> `network_config`, `optimizer_def` ->
  `optimizer`, `loss_normalizing_factor` -> `loss_normalization`, `decode_fn=beam_search /
  temperature_sample` -> `decoding_method='beam' / 'sample'`, `feature_converter_cls` ->
  `feature_converter`; `input_vocabulary`, `output_vocabulary`, `vocabulary` are accepted and
  unused (the task's vocabulary is used).
- `network.T5Config`: `mlp_activations=('gelu', 'linear') / ('relu',)` -> `variant='t5.1.1' /
  't5.1.0'`, `logits_via_embedding` -> `tie_logits`.
- `network.Transformer(config)`, `network.DecoderWrapper(config)`: the config itself.
- `adafactor.Adafactor`: `logical_factor_rules` -> `factor_rules`, `factored=False` ->
  `factor_rules={}`, `global_norm_clip_threshold` -> `clip_norm`.

A t5x argument t5lite has no equivalent for (`default_decoder_params`, t5x's Adafactor
`factor_map`, `max_parameter_scale`, ...) is not in the signature, so gin rejects it by name.
Defaults are t5lite's (e.g. `z_loss=1e-4`, `loss_normalization='per_real_token'`), not the t5x
classes' (0.0 and `None`, i.e. sum): t5x's gin files set these explicitly, and then they agree.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable, Mapping
from typing import Any

from t5lite.model import config, losses, models, optimizers

_UNSET: Any = object()  # a t5x argument that was not given (None is a meaningful t5x value)
_P = inspect.Parameter


def Transformer(config: Any) -> Any:
    """t5x's `network.Transformer(config)`: t5lite models take the config itself."""
    return config


def DecoderWrapper(config: Any) -> Any:
    """t5x's decoder-only `network.DecoderWrapper(config)`: the config itself."""
    return config


def standard_logical_factor_rules(
    rules: Mapping[str, optimizers.FactorDim | str] | None = None,
) -> dict[str, optimizers.FactorDim]:
    """t5x's `adafactor.standard_logical_factor_rules`: the standard table, updated by `rules`
    (values are `FactorDim`s or their names: 'row', 'column', 'batch', 'none')."""
    out = dict(optimizers.STANDARD_FACTOR_RULES)
    for name, dim in (rules or {}).items():
        out[name] = dim if isinstance(dim, optimizers.FactorDim) else optimizers.FactorDim(dim)
    return out


def _decoding_method(decode_fn: Any) -> str:
    name = getattr(decode_fn, "__name__", str(decode_fn))
    methods = {"beam_search": "beam", "temperature_sample": "sample", "greedy": "greedy"}
    if name not in methods:
        raise ValueError(f"decode_fn {name!r}: t5lite decodes with one of {sorted(methods)}")
    return methods[name]


def _feature_converter(cls: Any) -> str:
    name = getattr(cls, "__name__", str(cls))
    names = {"LMFeatureConverter": "lm", "PrefixLMFeatureConverter": "prefix_lm"}
    if name not in names:
        raise ValueError(
            f"feature_converter_cls {name!r}: a t5lite decoder-only model reads one of "
            f"{sorted(names)} (t5x's DecoderFeatureConverter picks one by the task's features; "
            "name it)"
        )
    return names[name]


def _model_aliases(t5x: dict[str, Any]) -> dict[str, Any]:
    """t5x model arguments -> t5lite fields."""
    out: dict[str, Any] = {}
    for t5x_name, field, convert in (
        ("module", "network_config", lambda v: v),
        ("optimizer_def", "optimizer", lambda v: v),
        ("loss_normalizing_factor", "loss_normalization", losses.canonical_normalization),
        ("decode_fn", "decoding_method", _decoding_method),
        ("feature_converter_cls", "feature_converter", _feature_converter),
    ):
        if t5x.get(t5x_name, _UNSET) is not _UNSET:
            out[field] = convert(t5x[t5x_name])
    return out


def _adafactor_aliases(t5x: dict[str, Any]) -> dict[str, Any]:
    """t5x Adafactor arguments -> t5lite fields."""
    out: dict[str, Any] = {}
    if t5x.get("logical_factor_rules", _UNSET) is not _UNSET:
        out["factor_rules"] = t5x["logical_factor_rules"]
    if t5x.get("factored", _UNSET) is False:
        out["factor_rules"] = {}  # no ROW/COLUMN dimension: every statistic is kept whole
    if t5x.get("global_norm_clip_threshold", _UNSET) is not _UNSET:
        out["clip_norm"] = t5x["global_norm_clip_threshold"]
    return out


def _alias(
    cls: type,
    t5x_params: Mapping[str, Any],
    translate: Callable[[dict[str, Any]], dict[str, Any]],
    doc: str,
) -> Callable[..., Any]:
    """A factory for `cls` taking its fields and `t5x_params` (name -> type), keyword-only.

    Its signature and annotations are explicit, so gin still rejects a misspelt parameter and
    the CLI's type checks still see every field.
    """
    # Init-only fields too (`T5Config.dtype`, an InitVar folded into `precision`); dataclasses
    # lists those only among its private pseudo-fields.
    initvars = [
        f
        for f in cls.__dataclass_fields__.values()  # type: ignore[attr-defined]
        if f._field_type is dataclasses._FIELD_INITVAR  # type: ignore[attr-defined]
    ]
    fields = [f for f in dataclasses.fields(cls) if f.init] + initvars
    hints = {
        n: t.type if isinstance(t, dataclasses.InitVar) else t
        for n, t in typing.get_type_hints(cls).items()
    }
    t5x_only = [n for n in t5x_params if n not in {f.name for f in fields}]

    def factory(**kwargs: Any) -> Any:
        t5x = {n: kwargs.pop(n) for n in t5x_only if n in kwargs}
        renamed = translate(t5x)
        both = sorted(set(renamed) & set(kwargs))
        if both:
            raise ValueError(
                f"{cls.__name__}: {both} given under both the t5lite and the t5x name "
                f"({sorted(t5x)}); give one"
            )
        return cls(**kwargs, **renamed)

    params = [_P(f.name, _P.KEYWORD_ONLY, default=_default(f)) for f in fields]
    params += [_P(n, _P.KEYWORD_ONLY, default=_UNSET) for n in t5x_only]
    factory.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    factory.__annotations__ = {**hints, **{n: t5x_params[n] for n in t5x_only}}
    factory.__name__ = factory.__qualname__ = cls.__name__
    factory.__doc__ = doc
    return factory


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return _P.empty


_MODEL_T5X = {
    "module": Any,
    "optimizer_def": Any,
    "loss_normalizing_factor": Any,
    "decode_fn": Any,
    "input_vocabulary": Any,
    "output_vocabulary": Any,
}
EncoderDecoderModel = _alias(
    models.EncoderDecoderModel,
    _MODEL_T5X,
    _model_aliases,
    "`models.EncoderDecoderModel` with t5x's argument names too (see the module docstring).",
)
DecoderOnlyModel = _alias(
    models.DecoderOnlyModel,
    {**_MODEL_T5X, "vocabulary": Any, "feature_converter_cls": Any},
    _model_aliases,
    "`models.DecoderOnlyModel` with t5x's argument names too. NOTE: t5x's default for "
    "`inputs_bidirectional_attention` is False, t5lite's True (prefix-LM prompts).",
)
Adafactor = _alias(
    optimizers.Adafactor,
    {"logical_factor_rules": Any, "factored": bool, "global_norm_clip_threshold": Any},
    _adafactor_aliases,
    "`optimizers.Adafactor` with t5x's argument names too. The learning rate is the optimizer's "
    "(t5x takes it from the trainer's `learning_rate_fn`).",
)


_T5_MLPS = {("gelu", "linear"): "t5.1.1", ("relu",): "t5.1.0"}


def _t5_config_aliases(t5x: dict[str, Any]) -> dict[str, Any]:
    """t5x T5Config arguments -> t5lite fields."""
    out: dict[str, Any] = {}
    if t5x.get("mlp_activations", _UNSET) is not _UNSET:
        acts = tuple(t5x["mlp_activations"])
        if acts not in _T5_MLPS:
            raise ValueError(
                f"T5Config.mlp_activations={acts!r}: t5lite's T5 is one of {list(_T5_MLPS)} "
                "(variant 't5.1.1' or 't5.1.0')"
            )
        out["variant"] = _T5_MLPS[acts]
    if t5x.get("logits_via_embedding", _UNSET) is not _UNSET:
        out["tie_logits"] = t5x["logits_via_embedding"]
    return out


T5Config = _alias(
    config.T5Config,
    {"mlp_activations": tuple, "logits_via_embedding": bool},
    _t5_config_aliases,
    "`network.T5Config` with t5x's `mlp_activations` and `logits_via_embedding` too.",
)
